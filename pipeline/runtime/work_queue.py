"""Work is pulled, not split up front: one queue of request chunks that every accelerator pool draws from.

A `WorkQueue` actor (pinned to the driver's node) hands out chunks of requests, reading the staged work list
through the staging area's storage (local disk, or the bucket of an s3:// OUTPUT).
Each pool's Ray Data pipeline starts with a `QueueDatasource` whose read tasks keep pulling chunks until the queue
is empty. Pulling alone is not enough: Ray Data would let a pool's readers run far ahead of its engines and
buffer half the job. So the queue gives each taker credit — at most as many rows outstanding as its engines can
hold at once (plus a batch each) — and engines return the credit as they finish rows. (Credit is counted in rows,
not chunks, because Ray Data may split or bundle blocks on the way.) A pool therefore takes new work
only as fast as it finishes it, and a slower pool never becomes the tail. The chunks travel through Ray's object
store, so pools on other nodes never need the driver's disk. The read tasks themselves run on the driver's node:
a chunk leaves the queue once, so a read task re-run after its node died would pull a different chunk.

Prefix-aware routing: a "taker" is a pool, or one lane of a pool (one engine with its own pipeline, see
runtime/job.py). With routing on, the queue reads a bounded window of the work list ahead, groups it by prefix key
(stages/route.py), and gives each key an owner: the first taker to pull it. A taker's chunk is filled from, in
order: keys it owns; keys nobody owns yet (it claims them); requests without a key; keys it already took over
from others; and last, another taker's keys (it steals, so no engine idles while work remains: the key with the
most rows waiting, where one more prefill of its prompt pays best). Chunks are full (the job sizes its read tasks
by them) and prefix-homogeneous where the window allows.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

# Owners are remembered for this many keys (least recently seen forgotten first): memory stays bounded on jobs with
# millions of distinct prefixes; forgetting only means a key seen again much later may get a new owner.
MAX_REMEMBERED_KEYS = 100_000

_UNKEYED = None  # the window's group of requests without a prefix key


class WorkQueue:
    """Serves the pending requests in chunks, streaming through the staged Parquet parts (bounded memory)."""

    def __init__(
        self,
        files: list[str],
        credit: dict[str, int],
        read_rows: int = 8192,
        files_on: Any = None,
        route: bool = False,
        window_rows: int = 32768,
    ) -> None:
        """`credit`: taker -> rows it may hold at once. `files_on`: the staging area's storage
        (`pipeline.io.staging.PartFiles`); default: local paths. `route`: group by prefix key and give each key an
        owner; `window_rows`: how far ahead the queue reads to find rows of a key (bounds its memory)."""
        self._open = files_on.parquet if files_on is not None else pq.ParquetFile
        self._files = list(files)
        self._read_rows = read_rows
        self._reader: Iterator[pa.RecordBatch] = iter(())
        self._route = route
        self._window_rows = window_rows if route else 0  # without routing: read only what a chunk needs
        self._credit = dict(credit)  # taker -> rows it may hold at once
        self._outstanding: dict[str, int] = {}
        self._changed: asyncio.Condition | None = None  # created in the actor's event loop
        # The window: read batches by id, and per key the row segments (batch id, row indices) not yet served.
        self._batches: dict[int, list] = {}  # id -> [batch, rows not yet served]
        self._next_batch = 0
        self._segments: dict[str | None, deque[tuple[int, np.ndarray]]] = {}
        self._counts: dict[str | None, int] = {}
        self._window = 0
        # Ownership. Ordered sets (dicts) of the keys that have rows in the window, per owner and unowned.
        self._owner: OrderedDict[str, str] = OrderedDict()
        self._owned: dict[str, dict[str, None]] = {}
        self._unowned: dict[str, None] = {}
        self._started: dict[str, set[str]] = {}  # key -> takers that have served it (have it cached)
        self.served_rows = 0
        self.served_by: dict[str, int] = {}
        self.routing = {"keys": 0, "rows_routed": 0, "rows_stolen": 0, "rows_unkeyed": 0}

    # -- the window ------------------------------------------------------------------------------------------------
    def _read_batch(self) -> pa.RecordBatch | None:
        while True:
            batch = next(self._reader, None)
            if batch is not None:
                if batch.num_rows:
                    return batch
                continue
            if not self._files:
                return None
            self._reader = self._open(self._files.pop(0)).iter_batches(batch_size=self._read_rows)

    def _read_more(self) -> bool:
        """Add one read batch to the window, grouped by key; False when the work list is exhausted."""
        batch = self._read_batch()
        if batch is None:
            return False
        bid = self._next_batch
        self._next_batch += 1
        self._batches[bid] = [batch, batch.num_rows]
        self._window += batch.num_rows
        names = batch.schema.names
        keys = batch.column(names.index("prefix_key")) if self._route and "prefix_key" in names else None
        if keys is None or keys.null_count == batch.num_rows:
            self._add(_UNKEYED, bid, np.arange(batch.num_rows))
            return True
        encoded = pc.dictionary_encode(keys)
        values = encoded.dictionary.to_pylist()
        codes = encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False)
        order = np.argsort(codes, kind="stable")  # rows of one key together, in input order
        ordered = codes[order]
        bounds = np.flatnonzero(np.diff(ordered)) + 1
        for rows in np.split(order, bounds):
            code = codes[rows[0]]
            self._add(values[code] if code >= 0 else _UNKEYED, bid, rows)
        return True

    def _add(self, key: str | None, bid: int, rows: np.ndarray) -> None:
        self._segments.setdefault(key, deque()).append((bid, rows))
        self._counts[key] = self._counts.get(key, 0) + len(rows)
        if key is _UNKEYED:
            return
        owner = self._owner.get(key)
        if owner is None:
            self._unowned[key] = None
        else:
            self._owner.move_to_end(key)
            self._owned.setdefault(owner, {})[key] = None

    def _take(self, key: str | None, wanted: int, pieces: list[tuple[int, np.ndarray]]) -> int:
        """Move up to `wanted` of `key`'s rows from the window into `pieces`; returns how many."""
        segments = self._segments[key]
        taken = 0
        while segments and taken < wanted:
            bid, rows = segments[0]
            if len(rows) <= wanted - taken:
                segments.popleft()
            else:
                rows, segments[0] = rows[: wanted - taken], (bid, rows[wanted - taken :])
            pieces.append((bid, rows))
            taken += len(rows)
        self._counts[key] -= taken
        self._window -= taken
        if not self._counts[key]:
            del self._counts[key], self._segments[key]
            if key is not _UNKEYED:
                self._unowned.pop(key, None)
                owner = self._owner.get(key)
                if owner is not None:
                    self._owned.get(owner, {}).pop(key, None)
        return taken

    def _chunk(self, pieces: list[tuple[int, np.ndarray]]) -> pa.Table:
        batches = []
        i = 0
        while i < len(pieces):  # consecutive pieces of one read batch become one take
            bid, j = pieces[i][0], i
            while j < len(pieces) and pieces[j][0] == bid:
                j += 1
            rows = np.concatenate([p[1] for p in pieces[i:j]]) if j - i > 1 else pieces[i][1]
            entry = self._batches[bid]
            batches.append(entry[0].take(pa.array(rows)))
            entry[1] -= len(rows)
            if not entry[1]:
                del self._batches[bid]
            i = j
        return pa.Table.from_batches(batches)

    # -- ownership ---------------------------------------------------------------------------------------------
    def _set_owner(self, key: str, taker: str) -> None:
        old = self._owner.get(key)
        if old is not None:
            self._owned.get(old, {}).pop(key, None)
        self._owner[key] = taker
        self._owner.move_to_end(key)
        self._owned.setdefault(taker, {})[key] = None
        self._unowned.pop(key, None)
        while len(self._owner) > MAX_REMEMBERED_KEYS:
            forgotten, owner = self._owner.popitem(last=False)
            self._started.pop(forgotten, None)
            if forgotten in self._counts:  # still waiting in the window: unowned again
                self._owned.get(owner, {}).pop(forgotten, None)
                self._unowned[forgotten] = None

    def _pick(self, taker: str) -> tuple[str | None, str]:
        """The group `taker` should take rows from next, and how the rows count ("routed", "unkeyed", "stolen")."""
        own = self._owned.get(taker)
        if own:
            return next(iter(own)), "routed"
        if self._unowned:
            key = next(iter(self._unowned))
            self._set_owner(key, taker)
            self.routing["keys"] += 1
            return key, "routed"
        if _UNKEYED in self._counts:
            return _UNKEYED, "unkeyed"
        # Another taker's key: one this taker already ran keeps its cache warm; else the key with the most rows
        # waiting, where one more prefill of its prompt is spread over the most requests.
        for key in self._counts:
            if key is not _UNKEYED and taker in self._started.get(key, ()):
                return key, "stolen"
        return max(self._counts, key=self._counts.__getitem__), "stolen"

    def _fill(self, taker: str, rows: int) -> list[tuple[int, np.ndarray]]:
        pieces: list[tuple[int, np.ndarray]] = []
        wanted = rows
        while wanted > 0:
            # Top the window up (routing looks ahead for rows of the taker's keys); without routing this reads
            # only when the window cannot fill the chunk.
            while self._window < max(self._window_rows, wanted) and self._read_more():
                pass
            if not self._window:
                break
            key, kind = self._pick(taker)
            taken = self._take(key, wanted, pieces)
            wanted -= taken
            if key is not _UNKEYED:
                self._started.setdefault(key, set()).add(taker)
            self.routing[f"rows_{kind}"] += taken
        return pieces

    async def next_chunk(self, taker: str, rows: int) -> pa.Table | None:
        """Up to `rows` requests for `taker`, once it has credit; None when the queue is empty.

        Chunks are full until the work list runs out: the job sizes its read tasks as ceil(rows / chunk size), so
        a short chunk mid-stream would leave rows that nobody pulls."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            limit = self._credit.get(taker, rows)
            await self._changed.wait_for(lambda: self._outstanding.get(taker, 0) + rows <= max(limit, rows))
            pieces = self._fill(taker, rows)
            if not pieces:
                self._changed.notify_all()  # wake the other waiters: they will see the queue is empty too
                return None
            chunk = self._chunk(pieces)
            self._outstanding[taker] = self._outstanding.get(taker, 0) + chunk.num_rows
        self.served_rows += chunk.num_rows
        self.served_by[taker] = self.served_by.get(taker, 0) + chunk.num_rows
        return chunk

    async def done(self, taker: str, rows: int) -> None:
        """An engine of `taker` finished `rows` requests: that much credit comes back."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            self._outstanding[taker] = max(0, self._outstanding.get(taker, 0) - rows)
            self._changed.notify_all()

    def stats(self) -> dict[str, Any]:
        return {
            "served_rows": self.served_rows,
            "served_by": dict(self.served_by),
            "routing": dict(self.routing),
        }


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
