"""Work is pulled, not split up front: one queue of request chunks that every accelerator pool draws from.

A `WorkQueue` actor (pinned to the driver's node) hands out chunks of requests, reading the staged work list
through the staging area's storage (local disk, or the bucket of an s3:// OUTPUT).
Each pool's Ray Data pipeline starts with a `QueueDatasource` whose read tasks keep pulling chunks until the queue
is empty. Pulling alone is not enough: Ray Data would let a pool's readers run far ahead of its engines and
buffer half the job. So the queue gives each pool credit — at most as many rows outstanding as its engines can
hold at once (plus a batch each) — and engines return the credit as they finish rows. (Credit is counted in rows,
not chunks, because Ray Data may split or bundle blocks on the way.) A pool therefore takes new work
only as fast as it finishes it, and a slower pool never becomes the tail. The chunks travel through Ray's object
store, so pools on other nodes never need the driver's disk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


class WorkQueue:
    """Serves the pending requests in chunks, streaming through the staged Parquet parts (bounded memory)."""

    def __init__(
        self, files: list[str], credit: dict[str, int], read_rows: int = 8192, files_on: Any = None
    ) -> None:
        """`files_on`: the staging area's storage (`pipeline.io.staging.PartFiles`); default: local paths."""
        self._open = files_on.parquet if files_on is not None else pq.ParquetFile
        self._files = list(files)
        self._read_rows = read_rows
        self._batches: Iterator[pa.RecordBatch] = iter(())
        self._current: pa.RecordBatch | None = None
        self._offset = 0
        self._credit = dict(credit)  # pool -> rows it may hold at once
        self._outstanding: dict[str, int] = {}
        self._changed: asyncio.Condition | None = None  # created in the actor's event loop
        self.served_rows = 0
        self.served_by: dict[str, int] = {}

    def _refill(self) -> bool:
        while self._current is None or self._offset >= self._current.num_rows:
            batch = next(self._batches, None)
            if batch is None:
                if not self._files:
                    return False
                self._batches = self._open(self._files.pop(0)).iter_batches(batch_size=self._read_rows)
                continue
            self._current, self._offset = batch, 0
        return True

    async def next_chunk(self, taker: str, rows: int) -> pa.Table | None:
        """Up to `rows` requests for pool `taker`, once it has credit; None when the queue is empty."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            limit = self._credit.get(taker, rows)
            await self._changed.wait_for(lambda: self._outstanding.get(taker, 0) + rows <= max(limit, rows))
            # Fill the chunk across read-batch and file boundaries: the job sizes its read tasks as
            # ceil(rows / chunk size), so a short chunk mid-stream would leave rows that nobody pulls.
            pieces: list[pa.RecordBatch] = []
            wanted = rows
            while wanted > 0 and self._refill():
                piece = self._current.slice(self._offset, wanted)
                self._offset += piece.num_rows
                wanted -= piece.num_rows
                pieces.append(piece)
            if not pieces:
                self._changed.notify_all()  # wake the other waiters: they will see the queue is empty too
                return None
            chunk = pa.Table.from_batches(pieces)
            self._outstanding[taker] = self._outstanding.get(taker, 0) + chunk.num_rows
        self.served_rows += chunk.num_rows
        self.served_by[taker] = self.served_by.get(taker, 0) + chunk.num_rows
        return chunk

    async def done(self, taker: str, rows: int) -> None:
        """An engine of pool `taker` finished `rows` requests: that much credit comes back."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            self._outstanding[taker] = max(0, self._outstanding.get(taker, 0) - rows)
            self._changed.notify_all()

    def stats(self) -> dict[str, Any]:
        return {"served_rows": self.served_rows, "served_by": dict(self.served_by)}


def queue_datasource(queue: Any, pool: str, read_tasks: int, chunk_rows: int):
    """A Ray Data datasource of `read_tasks` tasks that each pull one chunk of up to `chunk_rows` requests.

    One chunk per task, because Ray Data merges a task's yielded blocks and hands them on only when the task ends:
    a long-lived pulling task would sit on its chunks. Tasks that find the queue empty return nothing, so
    `read_tasks` is sized for the whole job going to this pool.
    """
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    def pull_one() -> Iterator[pa.Table]:
        import ray

        chunk = ray.get(queue.next_chunk.remote(pool, chunk_rows))
        if chunk is not None:
            yield chunk

    class QueueDatasource(Datasource):
        def get_name(self) -> str:
            return f"WorkQueue[{pool}]"

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None):
            metadata = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
            return [ReadTask(pull_one, metadata) for _ in range(read_tasks)]

    return QueueDatasource()
