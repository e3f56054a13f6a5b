"""Finalize: staging → sorted result shards, error shards, then `manifest.json` (the commit marker), then drop
`_staging/`. Reads only staging, so it can be re-run after a crash at any point."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.io.files import atomic_write_json
from pipeline.io.staging import StagedRow, StagingArea
from pipeline.stages.finalize import ShardInfo, write_shards

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


class AccountingError(RuntimeError):
    """Staged rows do not add up to the input: the job is not committed."""


def _unique_ids(rows: Iterator[StagedRow]) -> Iterator[tuple[str | None, str]]:
    previous: str | None = None
    for row in rows:
        if previous is not None and row.custom_id == previous:
            raise AccountingError(f"custom_id {row.custom_id!r} staged twice as a result")
        previous = row.custom_id
        yield row.custom_id, row.record


def remove_previous_outputs(output: Path) -> None:
    """A re-run finalize (or --overwrite) must not leave shards of another shard count behind."""
    (output / MANIFEST_NAME).unlink(missing_ok=True)
    for pattern in ("results-*-of-*.*", "errors-*-of-*.*"):
        for stale in output.glob(pattern):
            stale.unlink()


def write_outputs(
    output: Path, staging: StagingArea, rows_per_shard: int, expected_rows: int
) -> dict[str, Any]:
    """Write the shards; returns counts and shard descriptions for the manifest."""
    n_results = staging.count("results")
    n_errors = staging.count("errors")
    if n_results + n_errors != expected_rows:
        raise AccountingError(
            f"staging holds {n_results} results + {n_errors} errors = {n_results + n_errors} rows, "
            f"but the input has {expected_rows}; output not committed"
        )
    by_code = Counter(code for code in staging.iter_column("errors", "error_code"))

    def open_shard(name: str):
        return open(output / name, "wb")

    remove_previous_outputs(output)
    result_shards: list[ShardInfo] = write_shards(
        _unique_ids(staging.merged("results")), n_results, rows_per_shard, "results", open_shard
    )
    error_shards: list[ShardInfo] = write_shards(
        ((r.custom_id, r.record) for r in staging.merged("errors")),
        n_errors,
        rows_per_shard,
        "errors",
        open_shard,
    )
    return {
        "counts": {
            "total": expected_rows,
            "succeeded": n_results,
            "failed": n_errors,
            "by_error_code": dict(sorted(by_code.items())),
        },
        "shards": {
            "results": [s.as_manifest() for s in result_shards],
            "errors": [s.as_manifest() for s in error_shards],
        },
    }


def commit(output: Path, staging: StagingArea, manifest: dict[str, Any]) -> None:
    """The manifest is written last and atomically: its presence means every shard is complete."""
    atomic_write_json(output / MANIFEST_NAME, manifest)
    shutil.rmtree(staging.root, ignore_errors=True)
