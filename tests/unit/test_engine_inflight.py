"""An engine is fed by the rows it has yet to run, not by the rows it holds: a chunk is staged only when its slowest
request ends, and the finished rows waiting for it must not keep the engine's batch short of work (runtime/engines/inflight.py).
Rows held keep a ceiling of their own, so one request that never ends cannot pull the whole work list in."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.engines.base import Engine, EngineRequest, EngineResult, EngineSpec
from pipeline.runtime.engines.engine_actor import HOLD_FACTOR, EngineWorker
from pipeline.runtime.engines.inflight import EngineWindow
from pipeline.runtime.engines.work_queue import WorkQueue
from tests.actor_handles import as_actor

CHUNK = 8


def test_slots_count_finished_requests_and_settle_counts_the_rest():
    async def go():
        window = EngineWindow(2)
        window.leased(5)
        slots = window.for_chunk()
        for _ in range(3):
            async with slots:
                pass
        assert window.to_run == 2
        woke = asyncio.ensure_future(window.drops_below(1))
        await asyncio.sleep(0)
        assert not woke.done()
        slots.settle(5)  # two requests of the chunk ran without a slot (alone, or isolated)
        await asyncio.wait_for(woke, 1)
        return window.to_run

    assert asyncio.run(go()) == 0


class _GatedEngine(Engine):
    """Answers at once, except each chunk's first request (a long generation), which waits until the test lets it
    finish."""

    def __init__(self) -> None:
        super().__init__(EngineSpec("fake", "m", "m", {}))
        self.release = asyncio.Event()
        self.answered = 0
        self.waiting = 0

    async def start(self) -> None:
        pass

    async def generate(self, request: EngineRequest) -> EngineResult:
        if int(request.custom_id.removeprefix("r-")) % CHUNK == 0:
            self.waiting += 1
            await self.release.wait()
        else:
            await asyncio.sleep(0)
        self.answered += 1
        return EngineResult(request.custom_id, 200, {"ok": True}, None, 1, 1)


class _Sink:
    def __init__(self) -> None:
        self.staged: list[str] = []

    def stage(self, name: str, table: pa.Table) -> dict:
        self.staged.append(name)
        return {"rows": table.num_rows, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0}


def _work_list(tmp_path, n: int) -> list[str]:
    ids = [f"r-{i:05d}" for i in range(n)]
    table = pa.table(
        {
            "custom_id": ids,
            "url": ["/v1/chat/completions"] * n,
            "body": ['{"messages": []}'] * n,
            "line": list(range(1, n + 1)),
            "source": ["in.jsonl"] * n,
            "prefix_key": pa.array([None] * n, pa.string()),
        }
    )
    path = tmp_path / "work.parquet"
    pq.write_table(table, path)
    return [str(path)]


def test_finished_rows_waiting_for_their_chunks_straggler_do_not_starve_the_engine(tmp_path):
    # Every chunk has one long request. Counting its finished chunk-mates as work to do would hold window + chunk
    # rows: two chunks, two requests inside an engine with room for eight.
    window, n = 8, 1000
    hold_cap = HOLD_FACTOR * (window + CHUNK)
    queue = WorkQueue(_work_list(tmp_path, n), shrink_tail=False)
    sink = _Sink()
    worker = EngineWorker(
        EngineSpec("fake", "m", "m", {}),
        queue=as_actor(queue),
        sink=sink,
        chunk_rows=CHUNK,
        max_in_flight=window,
    )
    engine = worker.engine = _GatedEngine()
    worker._built_spec = worker.spec  # the engine serves the plan the queue hands out

    async def go():
        serving = asyncio.ensure_future(worker.serve("default/0"))
        for _ in range(2000):  # everything that can run without the long requests ending, runs
            await asyncio.sleep(0)
        seen = queue.served_rows, engine.waiting, engine.answered, len(sink.staged)
        engine.release.set()
        chunks = await asyncio.wait_for(serving, 10)
        return seen, chunks

    (held, inside, answered, staged), chunks = asyncio.run(go())
    assert inside == window, "the engine's window was not kept full"
    # ... and the rows held stop at their own ceiling.
    assert held == hold_cap and staged == 0 and answered < held
    assert chunks == n // CHUNK and len(set(sink.staged)) == n // CHUNK and queue.served_rows == n
