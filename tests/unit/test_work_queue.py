"""The work queue leases every request exactly once, in full chunks, across read-batch and file boundaries; a
chunk whose engine died comes back under its own id and name; engines may start while the work list still grows."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.runtime.engines.work_queue import WorkQueue
from tests.actor_handles import as_actor


def _queue(files, **options) -> WorkQueue:
    """A queue handing out full chunks to the end (the tail-shrinking has its own test)."""
    return WorkQueue(files, shrink_tail=False, **options)


def test_every_row_leased_once_in_full_chunks(tmp_path):
    files, n = [], 0
    for i, size in enumerate([50, 50, 20]):  # part sizes that are no multiple of the chunk or read batch
        path = tmp_path / f"part-{i}.parquet"
        pq.write_table(pa.table({"custom_id": [f"r-{n + k:04d}" for k in range(size)]}), path)
        files.append(str(path))
        n += size
    chunk = 16
    queue = _queue(files, read_rows=7)

    async def drain() -> list[pa.Table]:
        chunks = []
        for _ in range(-(-n // chunk)):
            lease = await queue.lease("p", "p/0", chunk)
            assert lease is not None
            chunks.append(lease[3])
            assert await queue.ack(lease[0], "p", _staged(lease[3]))
        assert await queue.lease("p", "p/0", chunk) is None
        return chunks

    chunks = asyncio.run(drain())
    ids = [i for table in chunks for i in table.column("custom_id").to_pylist()]
    assert sorted(ids) == [f"r-{k:04d}" for k in range(n)]
    assert [t.num_rows for t in chunks] == [16] * 7 + [8]


# -- prefix-aware routing: lane assignment ---------------------------------------------------------------------------


def _work_list(tmp_path, keys: list[str | None], name: str = "part") -> list[str]:
    path = tmp_path / f"{name}.parquet"
    ids = [f"r-{i:05d}" for i in range(len(keys))]
    pq.write_table(pa.table({"custom_id": ids, "prefix_key": pa.array(keys, pa.string())}), path)
    return [str(path)]


def _pull(queue: WorkQueue, taker: str, rows: int) -> pa.Table | None:
    async def go():
        return await queue.lease(taker, f"{taker}/ticket", rows)

    lease = asyncio.run(go())
    return None if lease is None else lease[3]


def _staged(table: pa.Table, failed: int = 0) -> dict:
    return {"rows": table.num_rows, "failed": failed, "prompt_tokens": 3, "completion_tokens": 5}


def _keys(table: pa.Table) -> set:
    return set(table.column("prefix_key").to_pylist())


def test_each_key_goes_to_the_lane_that_first_pulled_it(tmp_path):
    # Four prompts interleaved row by row, as an input ordered by anything but the prompt would be.
    keys = [f"k{i % 4}" for i in range(64)]
    queue = _queue(_work_list(tmp_path, keys), route=True, read_rows=10)
    seen: dict[str, set] = {"a": set(), "b": set()}
    ids = []
    for _ in range(4):  # alternate pulls, as two engines of equal speed would
        for lane in ("a", "b"):
            chunk = _pull(queue, lane, 8)
            assert _keys(chunk) and len(_keys(chunk)) == 1  # prefix-homogeneous
            seen[lane] |= _keys(chunk)
            ids += chunk.column("custom_id").to_pylist()
    assert _pull(queue, "a", 8) is None and _pull(queue, "b", 8) is None
    assert sorted(ids) == [f"r-{i:05d}" for i in range(64)]  # every row once
    assert seen == {"a": {"k0", "k2"}, "b": {"k1", "k3"}}
    assert queue.stats()["routing"] == {
        "keys": 4,
        "rows_routed": 64,
        "rows_stolen": 0,
        "rows_unkeyed": 0,
    }


def test_a_lane_prefers_its_own_keys_then_unowned_then_unkeyed(tmp_path):
    keys = ["k0"] * 8 + [None] * 8 + ["k1"] * 8 + ["k0"] * 8
    queue = _queue(_work_list(tmp_path, keys), route=True)
    assert _keys(_pull(queue, "a", 8)) == {"k0"}
    assert _keys(_pull(queue, "a", 8)) == {
        "k0"
    }  # its own key again, though other rows come first in the file
    assert _keys(_pull(queue, "a", 8)) == {"k1"}  # none of its own left: claims an unowned key
    assert _keys(_pull(queue, "a", 8)) == {None}  # then the rows without a key
    assert _pull(queue, "a", 8) is None


def test_an_idle_lane_steals_rather_than_waits_and_chunks_stay_full(tmp_path):
    keys = ["k0"] * 40 + ["k1"] * 4
    queue = _queue(_work_list(tmp_path, keys), route=True)
    assert _keys(_pull(queue, "a", 8)) == {"k0"}
    first_b = _pull(queue, "b", 8)
    # b claims k1 (4 rows) and fills the rest of its chunk from a's key: chunks are full while rows remain,
    # because the job sizes its read tasks as ceil(rows / chunk).
    assert first_b.num_rows == 8 and _keys(first_b) == {"k0", "k1"}
    stolen = _pull(queue, "b", 8)
    assert _keys(stolen) == {"k0"}  # nothing of its own left: it keeps stealing the key it already runs
    total = 16 + 8
    while (chunk := _pull(queue, "a", 8)) is not None:
        total += chunk.num_rows
    assert total == 44
    stats = queue.stats()["routing"]
    assert stats["rows_stolen"] == 12 and stats["rows_routed"] == 32


def test_a_thief_takes_the_key_with_most_rows_waiting(tmp_path):
    keys = ["k0"] * 8 + ["k1"] * 8 + ["k2"] * 20
    queue = _queue(_work_list(tmp_path, keys), route=True)
    assert _keys(_pull(queue, "a", 4)) == {"k0"}
    assert _keys(_pull(queue, "b", 4)) == {"k1"}
    assert _keys(_pull(queue, "c", 4)) == {"k2"}
    assert _keys(_pull(queue, "a", 8)) == {
        "k0",
        "k2",
    }  # a finishes k0, then steals from the biggest other key
    assert queue.stats()["routing"]["rows_stolen"] == 4


def test_without_routing_the_queue_serves_in_file_order(tmp_path):
    keys = [f"k{i % 3}" for i in range(30)]
    queue = _queue(_work_list(tmp_path, keys))
    chunk = _pull(queue, "a", 10)
    assert chunk.column("custom_id").to_pylist() == [f"r-{i:05d}" for i in range(10)]
    assert queue.stats()["routing"]["rows_unkeyed"] == 10


def test_window_is_bounded_and_ownership_memory_too(tmp_path, monkeypatch):
    import pipeline.runtime.engines.work_queue as wq

    monkeypatch.setattr(wq, "MAX_REMEMBERED_KEYS", 10)
    keys = [f"k{i}" for i in range(200)]  # every row its own prompt
    queue = _queue(_work_list(tmp_path, keys), route=True, read_rows=16, window_rows=32)
    served = 0
    while (chunk := _pull(queue, "a", 8)) is not None:
        served += chunk.num_rows
        assert queue._window <= 32 + 16  # never more than the window plus one read batch ahead
        assert len(queue._owner) <= 10 and len(queue._started) <= 10
    assert served == 200


def test_a_work_list_without_keys_still_routes_as_unkeyed(tmp_path):
    path = tmp_path / "old.parquet"  # staged before prefix keys existed: resume must still work
    pq.write_table(pa.table({"custom_id": [f"r-{i}" for i in range(10)]}), path)
    queue = _queue([str(path)], route=True)
    assert _pull(queue, "a", 6).num_rows == 6 and _pull(queue, "b", 6).num_rows == 4


# -- leases -----------------------------------------------------------------------------------------------------------


def test_chunks_of_a_ticket_that_starts_again_come_back_with_their_id_and_name(tmp_path):
    queue = _queue(_work_list(tmp_path, [None] * 30), run_id="run1")

    async def go():
        first = await queue.lease("e1", "pool/0", 10)
        second = await queue.lease("e1", "pool/0", 10)
        other = await queue.lease("e2", "pool/1", 10)
        assert await queue.ack(first[0], "pool", _staged(first[3]))  # staged before the engine died
        assert await queue.ticket_started("pool/0") == 1  # the ticket runs again: its unacknowledged chunk
        again = await queue.lease("e3", "pool/0", 10)
        assert (again[0], again[1], again[2]) == (second[0], second[1], 2)  # same chunk, same part, attempt 2
        assert again[3].equals(second[3])
        assert second[1] == f"chunk-run1-{second[0]:08d}"
        assert await queue.ack(again[0], "pool", _staged(again[3], failed=1))
        assert not await queue.ack(again[0], "pool", _staged(again[3]))  # a second acknowledgement: dropped
        assert await queue.ack(other[0], "pool", _staged(other[3]))
        assert await queue.lease("e3", "pool/0", 10) is None
        return queue.progress(), queue.stats()

    progress, stats = asyncio.run(go())
    assert (progress["rows"], progress["failed"], progress["chunks"]) == (30, 1, 3)
    assert progress["pools"]["pool"]["rows"] == 30 and progress["completion_tokens"] == 15
    assert stats["chunks_reissued"] == 1 and stats["rows_reissued"] == 10 and stats["duplicate_acks"] == 1
    assert stats["leases_open"] == 0


def test_the_monitor_learns_a_chunk_finished_when_its_ack_lands_not_when_the_engine_says_so(tmp_path):
    # An engine lost with its node right after its ack must not leave the monitor counting that chunk as in
    # flight: it never runs again. The queue, which survives, tells the monitor.
    from pipeline.runtime.engines.monitor import JobMonitor

    monitor = JobMonitor()
    queue = _queue(_work_list(tmp_path, [None] * 30), monitor=as_actor(monitor))

    async def go():
        leases = [await queue.lease("e1", "pool/0", 10) for _ in range(3)]
        for chunk, _, attempt, table in leases:
            monitor.begin(chunk, "e1", table.num_rows, attempt)
        assert await queue.ack(leases[0][0], "pool", _staged(leases[0][3]))
        assert await queue.ack(leases[1][0], "pool", _staged(leases[1][3]))
        # e1 is lost now, with the third chunk in flight: it runs again on e2.
        assert await queue.ticket_started("pool/0") == 1
        again = await queue.lease("e2", "pool/1", 10)
        monitor.begin(again[0], "e2", again[3].num_rows, again[2])
        assert await queue.ack(again[0], "pool", _staged(again[3]))

    asyncio.run(go())
    work = monitor.work()
    assert (work["e1"]["begun"], work["e1"]["finished"], work["e1"]["in_flight"]) == (30, 20, 10)
    assert work["e1"]["rerun_on"] == {"e2": 10}
    assert (work["e2"]["finished"], work["e2"]["in_flight"]) == (10, 0)


def test_engines_wait_for_a_work_list_that_is_still_being_staged(tmp_path):
    first = _work_list(tmp_path, [None] * 4, "first")
    later = _work_list(tmp_path, [None] * 6, "later")
    queue = _queue(first, input_closed=False)

    async def go():
        assert (await queue.lease("e1", "p/0", 8))[3].num_rows == 4
        waiting = asyncio.ensure_future(queue.lease("e1", "p/0", 8))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing to lease yet, but more may come: it waits rather than ends
        await queue.add_files(later)
        assert (await waiting)[3].num_rows == 6
        ending = asyncio.ensure_future(queue.lease("e1", "p/0", 8))
        await asyncio.sleep(0.05)
        assert not ending.done()
        await queue.close_input()
        assert await ending is None

    asyncio.run(go())


def test_chunks_shrink_near_the_end_so_engines_finish_together(tmp_path):
    queue = WorkQueue(_work_list(tmp_path, [None] * 1000))

    async def go() -> list[int]:
        sizes = []
        while (lease := await queue.lease(f"e{len(sizes) % 4}", "t", 100)) is not None:
            sizes.append(lease[3].num_rows)
        return sizes

    sizes = asyncio.run(go())
    assert sum(sizes) == 1000
    assert sizes[:3] == [100, 100, 100]  # full chunks while much is left
    assert sizes[-1] < 100 and sizes[-2] < 100  # then half an even share per engine of what is left
    assert (
        min(sizes[:-1]) >= 100 // 16
    )  # never below a sixteenth of a chunk (but for what is left at the end)


def test_engines_wait_for_their_plan_then_take_the_work_handed_over(tmp_path):
    """Engines start before ingest: each waits in `engine_plan` until `start_work` brings the fitted plans and the
    work list; a pool without a plan keeps its own spec (None)."""
    queue = WorkQueue([], input_closed=False, planned=False)

    async def go() -> tuple[object, object, list[str]]:
        asking = asyncio.ensure_future(queue.engine_plan("gpu"))
        other = asyncio.ensure_future(queue.engine_plan("cpu"))
        await asyncio.sleep(0.05)
        assert not asking.done()  # nothing decided yet
        await queue.start_work(_work_list(tmp_path, [None] * 5), {"gpu": "the gpu plan"}, rows=5)
        ids = []
        while (lease := await queue.lease("e", "t", 10)) is not None:
            ids += lease[3].column("custom_id").to_pylist()
        return await asking, await other, ids

    plan, other, ids = asyncio.run(go())
    assert plan == "the gpu plan" and other is None and len(ids) == 5


def test_no_work_ends_every_ticket_before_any_engine_is_built():
    queue = WorkQueue([], input_closed=False, planned=False)

    async def go() -> object:
        await queue.start_work([], {})
        return await queue.lease("e", "t", 10)

    assert asyncio.run(go()) is None


def _budgeted_work_list(tmp_path, budgets: list[int | None], keys: list[str | None]) -> list[str]:
    path = tmp_path / "budgeted.parquet"
    ids = [f"r-{i:05d}" for i in range(len(budgets))]
    table = pa.table(
        {
            "custom_id": ids,
            "prefix_key": pa.array(keys, pa.string()),
            "output_budget": pa.array(budgets, pa.int64()),
        }
    )
    pq.write_table(table, path, row_group_size=7)  # the tail spans several read batches
    return [str(path)]


def _lease_all(queue: WorkQueue, rows: int) -> list[list[str]]:
    async def go():
        chunks = []
        while (lease := await queue.lease(f"e{len(chunks) % 2}", f"t{len(chunks) % 2}", rows)) is not None:
            chunks.append(lease[3].column("custom_id").to_pylist())
        return chunks

    return asyncio.run(go())


def test_the_last_rows_go_out_longest_budget_first_and_none_is_lost(tmp_path):
    # 60 rows; the last 24 handed out are ordered by budget, descending, a request without one (it may run to the
    # model's context) first; before that, input order.
    budgets = [(i * 37) % 500 + 1 for i in range(60)]
    budgets[50] = None
    queue = _queue(_budgeted_work_list(tmp_path, budgets, [None] * 60), read_rows=5, tail_rows=24)
    served = [i for chunk in _lease_all(queue, 6) for i in chunk]
    assert sorted(served) == [f"r-{i:05d}" for i in range(60)]
    head, tail = served[:36], served[36:]
    assert head == [f"r-{i:05d}" for i in range(36)]
    rank = {f"r-{i:05d}": float("inf") if b is None else b for i, b in enumerate(budgets)}
    assert [rank[i] for i in tail] == sorted((rank[i] for i in tail), reverse=True)
    assert tail[0] == "r-00050"


def test_ordering_the_tail_keeps_each_prefix_key_with_its_engine(tmp_path):
    keys = ["a" if i % 2 else "b" for i in range(40)]
    budgets = [(i * 13) % 97 for i in range(40)]
    queue = _queue(_budgeted_work_list(tmp_path, budgets, keys), route=True, window_rows=8, tail_rows=40)
    chunks = _lease_all(queue, 5)
    assert sorted(i for c in chunks for i in c) == [f"r-{i:05d}" for i in range(40)]
    key_of = {f"r-{i:05d}": k for i, k in enumerate(keys)}
    budget_of = {f"r-{i:05d}": b for i, b in enumerate(budgets)}
    for key in "ab":
        rows = [i for c in chunks for i in c if key_of[i] == key]
        assert [budget_of[i] for i in rows] == sorted((budget_of[i] for i in rows), reverse=True)
    assert all(len({key_of[i] for i in c}) == 1 for c in chunks)  # a chunk is still one key's rows
