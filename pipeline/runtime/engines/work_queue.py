"""Work is pulled, not split up front: one queue of request chunks that every engine of every pool leases from.

A `WorkQueue` actor (pinned to the driver's node) reads the staged work list through the staging area's storage
(local disk, or the bucket of an s3:// OUTPUT) a bounded window at a time and hands it out in chunks. Engines pull
(runtime/engines/engine_actor.py): each leases a chunk when it has room for one, so a faster engine or pool simply leases more and
a slower one never becomes the tail. The chunks travel through Ray's object store, so engines on other nodes never
need the driver's disk.

Leases: a chunk stays on the queue's books until its engine acknowledges that its rows are staged. The engines' pull
loops are Ray Data tasks ("tickets"); when an engine dies, Ray re-runs its ticket on a fresh actor, and the ticket's
first call hands its unacknowledged chunks out again — same id, same staged part name, so a chunk that was staged but
not yet acknowledged is rewritten, never doubled. Only chunks in flight are remembered, never the job's rows.

Prefix-aware routing: with routing on, the queue groups its window by prefix key (stages/prefix_key.py) and gives each
key an owner: the first engine to pull it. An engine's chunk is filled from, in order: keys it owns; keys nobody
owns yet (it claims them); requests without a key; keys it already took over from others; and last, another
engine's keys (it steals, so no engine idles while work remains: the key with the most rows waiting, where one more
prefill of its prompt pays best). Chunks are prefix-homogeneous where the window allows.

Engines start before their work is known: a queue made with `planned=False` holds no work list yet, and each
engine asks it for its pool's plan (`engine_plan`: the engine args fitted to the measured input, the chunk size)
while ingest and fitting still run — the engine's process and imports overlap them. `start_work` hands over the work
list and the plans at once. The work list may also still be growing (`add_files` while ingest stages it, then
`close_input`): an engine that finds the queue empty waits until more arrives or the input is closed.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    """Serves the pending requests in leased chunks, streaming through the staged Parquet parts (bounded memory)."""

    def __init__(
        self,
        files: list[str],
        read_rows: int = 8192,
        files_on: Any = None,
        route: bool = False,
        window_rows: int = 32768,
        run_id: str = "run",
        input_closed: bool = True,
        shrink_tail: bool = True,
        plans: dict[str, Any] | None = None,
        planned: bool = True,
        monitor: Any = None,
        tail_rows: int = 0,
    ) -> None:
        """`files_on`: the staging area's storage (`pipeline.io.staging.PartFiles`); default: local paths.
        `route`: group by prefix key and give each key an owner; `window_rows`: how far ahead the queue reads to
        find rows of a key (bounds its memory). `run_id` makes chunk names unique across runs of one job (a
        resumed job must never overwrite a part an earlier run staged). `input_closed=False`: more files will
        come (`add_files`) until `close_input` — engines start while the input is still being staged. `plans`: per
        pool, what its engines run with (an object with `spec` and `chunk_rows`); a pool without one keeps the spec
        its engines were made with. `planned=False`: not decided yet — engines wait in `engine_plan` until
        `start_work`. `monitor`: the job's JobMonitor, told which engine finished which chunk as each ack lands
        (told here, not by the engine: an engine lost with its node right after its ack would leave the monitor
        counting rows as in flight that never run again). `tail_rows`: once no more than this many rows are left to hand out
        (and the work list is complete), they are handed out longest output budget first (see `_order_the_tail`)."""
        self._open = files_on.parquet if files_on is not None else pq.ParquetFile
        self._files = list(files)
        self._input_closed = input_closed
        self._read_rows = read_rows
        self._reader: Iterator[pa.RecordBatch] = iter(())
        self._route = route
        self._window_rows = window_rows if route else 0  # without routing: read only what a chunk needs
        self._run_id = run_id
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
        # Leases: chunks handed out and not yet acknowledged, by id, with the ticket that holds them. Only chunks
        # in flight are kept (bounded by engines x their windows), never the job's rows.
        self._next_chunk = 0
        # Guided self-scheduling: near the end, chunks shrink to a share of what is left per engine, so the last
        # chunks finish together instead of one engine running a full chunk on alone (the tail of a job).
        self._total_rows = sum(self._rows_in(f) for f in self._files)
        self._new_rows_out = 0
        self._takers: set[str] = set()
        self._shrink_tail = shrink_tail
        self._leases: dict[int, Lease] = {}
        self._reissue: deque[Lease] = deque()
        self.chunks_reissued = 0
        self.rows_reissued = 0
        self.duplicate_acks = 0
        self.served_rows = 0
        self.served_by: dict[str, int] = {}
        self.routing = {"keys": 0, "rows_routed": 0, "rows_stolen": 0, "rows_unkeyed": 0}
        self.progress_totals = Progress()
        self._plans = plans or {}
        self._monitor = monitor
        self._planned = planned
        self._tail_rows = tail_rows
        self._tail_ordered = False

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

    def _order_the_tail(self) -> None:
        """The last rows of the job, longest output budget first (within each prefix key): a long generation
        handed out last would run on alone after every other request has finished, the job's tail. Rows without
        a budget may run to the model's context and go first. Done once, when everything left to hand out fits
        `tail_rows`: it is read into one batch (bounded memory), ordered, and grouped again by key."""
        self._tail_ordered = True
        while self._read_more():
            pass
        if not self._window:
            return
        keys = list(self._segments)
        ranges, pieces = [], []
        for key in keys:
            start = sum(len(rows) for _, rows in pieces)
            pieces.extend(self._segments[key])
            ranges.append((key, start, sum(len(rows) for _, rows in pieces)))
        table = self._chunk(pieces)  # every row left, grouped by key; the read batches are released
        if "output_budget" not in table.schema.names:  # a work list staged before budgets were recorded
            budgets = np.zeros(table.num_rows)
        else:
            budget = table.column("output_budget")
            budgets = pc.fill_null(budget, np.iinfo(np.int64).max).to_numpy().astype(np.float64)
        bid = self._next_batch
        self._next_batch += 1
        self._batches[bid] = [table.combine_chunks().to_batches()[0], table.num_rows]
        for key, start, end in ranges:
            order = start + np.argsort(-budgets[start:end], kind="stable")
            self._segments[key] = deque([(bid, order)])

    def _fill(self, taker: str, rows: int) -> list[tuple[int, np.ndarray]]:
        pieces: list[tuple[int, np.ndarray]] = []
        wanted = rows
        if (
            self._tail_rows
            and not self._tail_ordered
            and self._input_closed
            and self._total_rows - self._new_rows_out <= self._tail_rows
        ):
            self._order_the_tail()
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

    # -- leases -------------------------------------------------------------------------------------------------
    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _rows_in(self, path: str) -> int:
        return self._open(path).metadata.num_rows

    def _chunk_rows(self, rows: int) -> int:
        """`rows`, or less near the end: half an even share per engine of what is left (never under 1/16 of a chunk,
        which bounds the per-chunk overhead). Only once the work list is complete is what is left known."""
        if not self._shrink_tail or not self._input_closed or not self._takers:
            return rows
        left = self._total_rows - self._new_rows_out
        share = -(-left // (2 * len(self._takers)))
        return max(min(rows, share), max(1, rows // 16))

    async def start_work(
        self,
        files: list[str],
        plans: dict[str, Any],
        route: bool = False,
        window_rows: int = 32768,
        rows: int | None = None,
        input_closed: bool = True,
        tail_rows: int = 0,
    ) -> None:
        """The work list (or its first files, with `input_closed=False`) and each pool's plan, decided once ingest
        and fitting are done; engines waiting in `engine_plan` go on. `rows`: the work list's row count when the
        caller knows it (else read from each part's metadata). No files and closed: nothing to do, and every
        engine's ticket ends without building its engine. `tail_rows`: see the constructor."""
        async with self._condition():
            self._plans = plans
            self._tail_rows = tail_rows
            self._planned = True
            self._route = route
            self._window_rows = window_rows if route else 0
            self._total_rows += rows if rows is not None else sum(self._rows_in(f) for f in files)
            self._files.extend(files)
            self._input_closed = input_closed
            self._changed.notify_all()

    async def engine_plan(self, pool: str) -> Any:
        """What `pool`'s engines run with (see `start_work`), once decided; None: keep the spec the engine has."""
        async with self._condition():
            await self._changed.wait_for(lambda: self._planned)
            return self._plans.get(pool)

    async def add_files(self, files: list[str]) -> None:
        """More of the work list was staged (ingest still running)."""
        async with self._condition():
            self._total_rows += sum(self._rows_in(f) for f in files)
            self._files.extend(files)
            self._changed.notify_all()

    async def close_input(self) -> None:
        """The work list is complete: an empty queue now means the job's work is all handed out."""
        async with self._condition():
            self._input_closed = True
            self._changed.notify_all()

    async def ticket_started(self, ticket: str) -> int:
        """A ticket (one engine's pull loop, a Ray Data task) begins. If it ran before, its engine died with the
        chunks it leased: they are handed out again first, to whichever engine asks next. Returns their count."""
        async with self._condition():
            lost = [lease for lease in self._leases.values() if lease.ticket == ticket]
            for lease in lost:
                del self._leases[lease.chunk_id]
                self._reissue.append(lease)
                self.chunks_reissued += 1
                self.rows_reissued += lease.table.num_rows
            if lost:
                self._changed.notify_all()
            return len(lost)

    def _exhausted(self) -> bool:
        return not self._files and self._input_closed and not self._window and not self._batches

    async def lease(self, taker: str, ticket: str, rows: int) -> tuple[int, str, int, pa.Table] | None:
        """The next chunk for engine `taker` (held by `ticket`) of up to `rows` requests: (chunk id, chunk name,
        attempt, rows), or None when every row has been handed out. A chunk handed out again keeps its id and
        name, so staging its rows twice writes the same part twice, never two parts."""
        async with self._condition():
            self._takers.add(taker)
            while True:
                if self._reissue:
                    old = self._reissue.popleft()
                    lease = Lease(old.chunk_id, old.name, old.attempt + 1, ticket, taker, old.table)
                    break
                pieces = self._fill(taker, self._chunk_rows(rows))
                if pieces:
                    chunk_id = self._next_chunk
                    self._next_chunk += 1
                    name = f"chunk-{self._run_id}-{chunk_id:08d}"
                    lease = Lease(chunk_id, name, 1, ticket, taker, self._chunk(pieces))
                    self._new_rows_out += lease.table.num_rows
                    break
                if self._exhausted():
                    return None
                await self._changed.wait()  # more input is being staged, or a lost chunk may come back
            self._leases[lease.chunk_id] = lease
        self.served_rows += lease.table.num_rows
        self.served_by[taker] = self.served_by.get(taker, 0) + lease.table.num_rows
        return lease.chunk_id, lease.name, lease.attempt, lease.table

    async def ack(self, chunk_id: int, pool: str, staged: dict[str, Any]) -> bool:
        """A chunk's rows are staged (`staged`: its rows, failures and tokens). The first acknowledgement counts;
        a second one (a chunk that ran twice) is dropped. Returns whether this one counted."""
        async with self._condition():
            lease = self._leases.pop(chunk_id, None)
            if lease is None:
                self.duplicate_acks += 1
                return False
            self.progress_totals.add(pool, staged)
            if self._monitor is not None:
                self._monitor.finished.remote(lease.taker, lease.table.num_rows, chunk_id)
            self._changed.notify_all()
            return True

    def progress(self) -> dict[str, Any]:
        """Running totals of staged rows (what the driver shows and reports), O(pools) to read."""
        return self.progress_totals.as_dict()

    def stats(self) -> dict[str, Any]:
        return {
            "served_rows": self.served_rows,
            "served_by": dict(self.served_by),
            "routing": dict(self.routing),
            "chunks_issued": self._next_chunk,
            "chunks_reissued": self.chunks_reissued,
            "rows_reissued": self.rows_reissued,
            "duplicate_acks": self.duplicate_acks,
            "leases_open": len(self._leases) + len(self._reissue),
        }


@dataclass
class Lease:
    chunk_id: int
    name: str  # the staged parts' name: the same on every attempt
    attempt: int
    ticket: str
    taker: str
    table: pa.Table


@dataclass
class Progress:
    """Totals of acknowledged chunks, overall and per pool."""

    rows: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    chunks: int = 0
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    _started: float = field(default_factory=time.monotonic)

    def add(self, pool: str, staged: dict[str, Any]) -> None:
        self.rows += staged["rows"]
        self.failed += staged["failed"]
        self.prompt_tokens += staged["prompt_tokens"]
        self.completion_tokens += staged["completion_tokens"]
        self.chunks += 1
        elapsed = round(time.monotonic() - self._started, 3)
        stats = self.pools.setdefault(
            pool, {"rows": 0, "prompt_tokens": 0, "completion_tokens": 0, "first_result_s": elapsed}
        )
        for key in ("rows", "prompt_tokens", "completion_tokens"):
            stats[key] += staged[key]
        stats["last_result_s"] = elapsed

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "failed": self.failed,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "chunks": self.chunks,
            "pools": {name: dict(stats) for name, stats in self.pools.items()},
        }
