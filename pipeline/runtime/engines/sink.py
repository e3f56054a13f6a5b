"""Results are staged where they are made: an engine actor writes each finished chunk as one results part and one
errors part under `_staging/`, named after the chunk, and only a small acknowledgement (rows, failures, tokens)
travels on to the work queue. The driver never sees a result row.

Naming a part after its chunk is what makes staging exactly-once: a chunk that runs again (its engine died after
staging it, before the acknowledgement) writes the same part again, atomically, instead of a second copy; the queue
counts the first acknowledgement only.

Where the engines run matters for a local OUTPUT: another host cannot write the driver's disk. Then the parts go
through a `PartWriter` actor on the driver's node (still not the driver process); on one host, and for s3://
staging, every engine writes directly.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.io.staging import StagingArea
from pipeline.runtime.locality import must_pin_to_driver


def stage_chunk(staging: StagingArea, name: str, table: pa.Table) -> dict[str, Any]:
    """Write one chunk's finished rows (io.staging.STAGED_SCHEMA) and return its acknowledgement."""
    failed = pc.is_valid(table.column("error_code"))
    staging.write_table("results", table.filter(pc.invert(failed)), name=f"{name}.parquet")
    staging.write_table("errors", table.filter(failed), name=f"{name}.parquet")
    return {
        "rows": table.num_rows,
        "failed": table.num_rows - table.column("error_code").null_count,
        "prompt_tokens": int(pc.sum(table.column("prompt_tokens")).as_py() or 0),
        "completion_tokens": int(pc.sum(table.column("completion_tokens")).as_py() or 0),
    }


class PartWriter:
    """A Ray actor on the driver's node that stages chunks for engines on other hosts (a local OUTPUT only)."""

    def __init__(self, staging: StagingArea) -> None:
        self.staging = staging

    def stage(self, name: str, table: pa.Table) -> dict[str, Any]:
        return stage_chunk(self.staging, name, table)


class ChunkSink:
    """How an engine actor stages a chunk: directly, or through the driver node's PartWriter. Picklable."""

    def __init__(self, staging: StagingArea, writer: Any = None) -> None:
        self.staging = staging
        self.writer = writer

    def stage(self, name: str, table: pa.Table) -> dict[str, Any]:
        """Blocking (file or object-store I/O): engine actors call it off their event loop."""
        if self.writer is None:
            return stage_chunk(self.staging, name, table)
        import ray

        return ray.get(self.writer.stage.remote(name, table))


def engines_share_disk_with_driver(staging_is_local: bool) -> bool:
    """Whether engines anywhere in the cluster can write the staging area directly: an s3:// one always, a local
    one only when every live node is on the driver's host."""
    import ray

    return not must_pin_to_driver(staging_is_local, ray.nodes(), ray.get_runtime_context().get_node_id())
