"""The order keys share the engines in (server/scheduling.py), as pure functions: who gets a free slot, who gives
one up, and a whole contended run simulated turn by turn."""

from __future__ import annotations

import pytest

from pipeline.server.scheduling import Running, Waiting, pick, to_yield


def w(batch_id: str, owner: str, arrival: int, expires_at: int | None = 1000) -> Waiting:
    return Waiting(batch_id, owner, expires_at, arrival)


def r(
    batch_id: str, owner: str, started: float = 0.0, can_yield: bool = True, yielding: bool = False
) -> Running:
    return Running(batch_id, owner, started, can_yield, yielding)


def test_a_free_slot_goes_to_the_key_whose_turn_is_longest_ago():
    queue = [w("a1", "A", 0), w("a2", "A", 1), w("b1", "B", 2), w("c1", "C", 3)]
    # A was served last: B, never served, and C, never served, come first — B waited longer.
    assert pick(queue, [], 1, {"A": 10.0}).batch_id == "b1"
    assert pick(queue, [], 1, {"A": 10.0, "B": 20.0}).batch_id == "c1"
    assert pick(queue, [], 1, {"A": 10.0, "B": 20.0, "C": 30.0}).batch_id == "a1"
    # No turn yet for anyone: the key that waited longest.
    assert pick(queue, [], 1, {}).batch_id == "a1"


def test_within_a_key_the_earlier_expires_at_goes_first():
    queue = [w("late", "A", 0, expires_at=5000), w("soon", "A", 1, expires_at=2000), w("never", "A", 2, None)]
    assert pick(queue, [], 1, {}).batch_id == "soon"
    assert pick([queue[0], queue[2]], [], 1, {}).batch_id == "late"
    # Equal windows: the one queued first.
    assert pick([w("x", "A", 3, 100), w("y", "A", 1, 100)], [], 1, {}).batch_id == "y"


def test_fewest_running_first_no_free_slot_no_pick_and_the_running_limit():
    queue = [w("a2", "A", 0), w("b1", "B", 1)]
    assert pick(queue, [r("a1", "A")], 2, {"B": 0.0, "A": 5.0}).batch_id == "b1"
    assert pick(queue, [r("b0", "B")], 2, {"A": 100.0}).batch_id == "a2"  # B runs one, A none
    assert pick(queue, [r("a1", "A"), r("b0", "B")], 2, {}) is None
    # A may run one batch at a time: its second waits though a slot is free, and B's takes it.
    one = {"A": 1}.get
    assert pick(queue, [r("a1", "A")], 3, {"B": 100.0}, one).batch_id == "b1"
    assert pick([w("a2", "A", 0)], [r("a1", "A")], 3, {}, one) is None
    assert pick([], [], 1, {}) is None


def test_a_batch_yields_once_its_keys_turn_is_over_and_another_key_waits():
    queue = [w("b1", "B", 0)]
    running = [r("a1", "A", started=100.0)]
    assert to_yield(queue, running, 1, {"A": 100.0}, lambda _: 10.0, now=105.0) == []  # its turn goes on
    assert to_yield(queue, running, 1, {"A": 100.0}, lambda _: 10.0, now=110.0) == ["a1"]
    # Nobody waits, or only the same key: no reason to stop.
    assert to_yield([], running, 1, {}, lambda _: 10.0, now=500.0) == []
    assert to_yield([w("a2", "A", 0)], running, 1, {}, lambda _: 10.0, now=500.0) == []
    # No rows finished in its turn yet (a job still starting) or finalizing: not before it has done something.
    stuck = [r("a1", "A", started=100.0, can_yield=False)]
    assert to_yield(queue, stuck, 1, {}, lambda _: 10.0, now=500.0) == []
    # Turns off (0 s).
    assert to_yield(queue, running, 1, {}, lambda _: 0.0, now=500.0) == []
    # Weighted: A's turn is twice B's.
    assert to_yield(queue, running, 1, {}, lambda o: {"A": 20.0, "B": 10.0}[o], now=115.0) == []
    assert to_yield(queue, running, 1, {}, lambda o: {"A": 20.0, "B": 10.0}[o], now=120.0) == ["a1"]


def test_only_as_many_yield_as_waiting_keys_need_and_never_to_a_key_running_as_many():
    old = 0.0
    # A holds both slots; B waits with two batches: one of A's yields (the one running longest), not both.
    running = [r("a1", "A", started=old + 5), r("a2", "A", started=old)]
    queue = [w("b1", "B", 0), w("b2", "B", 1)]
    assert to_yield(queue, running, 2, {}, lambda _: 10.0, now=100.0) == ["a2"]
    # One already yielding: its slot is B's, nobody else yields.
    told = [r("a1", "A", started=old + 5), r("a2", "A", started=old, yielding=True)]
    assert to_yield(queue, told, 2, {}, lambda _: 10.0, now=100.0) == []
    # A and B run one each; B's second batch waits: B runs as many as A, so nothing yields to it.
    even = [r("a1", "A", started=old), r("b1", "B", started=old)]
    assert to_yield([w("b2", "B", 0)], even, 2, {}, lambda _: 10.0, now=100.0) == []
    # ...but a third key, running none, gets the slot of the batch that ran longest.
    assert to_yield([w("c1", "C", 0)], even, 2, {}, lambda _: 10.0, now=100.0) in (["a1"], ["b1"])
    # A free slot needs nobody to yield.
    assert to_yield(queue, [r("a1", "A", started=old)], 2, {}, lambda _: 10.0, now=100.0) == []
    # A waiting key at its own running limit takes no slot from anyone.
    assert to_yield(queue, running, 2, {}, lambda _: 10.0, now=100.0, max_running={"B": 0}.get) == []


def simulate(jobs: dict[str, tuple[str, float]], weights: dict[str, float], turn: float, slots: int = 1):
    """A contended server in 1 s steps: `jobs` batch -> (owner, seconds of work), all queued at 0 in that order.
    A start or a resume costs `turn / 10` s of no work. Returns each batch's finish time, the order batches got
    turns in, and each key's seconds of work done when the first batch finished."""
    queue = [w(b, o, i) for i, (b, (o, _)) in enumerate(jobs.items())]
    left = {b: work for b, (_, work) in jobs.items()}
    running: dict[str, Running] = {}
    startup: dict[str, float] = {}
    last_turn: dict[str, float] = {}
    finished: dict[str, float] = {}
    order: list[str] = []
    worked: dict[str, int] = {}
    first_done: dict[str, int] = {}
    arrival = len(queue)
    for now in range(100_000):
        for b in to_yield(queue, list(running.values()), slots, last_turn, lambda o: turn * weights[o], now):
            arrival += 1
            queue.append(w(b, running.pop(b).owner, arrival))
        while (chosen := pick(queue, list(running.values()), slots, last_turn)) is not None:
            queue.remove(chosen)
            running[chosen.batch_id] = r(chosen.batch_id, chosen.owner, now, can_yield=False)
            startup[chosen.batch_id] = turn / 10
            last_turn[chosen.owner] = now
            order.append(chosen.batch_id)
        for b, run in list(running.items()):
            if startup[b] > 0:
                startup[b] -= 1
                continue
            left[b] -= 1
            worked[run.owner] = worked.get(run.owner, 0) + 1
            running[b] = r(b, run.owner, run.started, can_yield=True)
            if left[b] <= 0:
                finished[b] = now + 1
                first_done = first_done or dict(worked)
                del running[b]
        if not queue and not running:
            return finished, order, first_done
    raise AssertionError("never finished")


def test_a_small_batch_finishes_long_before_a_huge_one_that_came_first():
    finished, order, _ = simulate({"huge": ("A", 3600), "small": ("B", 30)}, {"A": 1, "B": 1}, turn=60)
    assert finished["small"] < 200 < finished["huge"]
    assert order[:3] == ["huge", "small", "huge"]
    # Without turns, the small one waits for the whole huge one.
    finished, _, _ = simulate({"huge": ("A", 3600), "small": ("B", 30)}, {"A": 1, "B": 1}, turn=0)
    assert finished["small"] > 3600


@pytest.mark.parametrize("weight", [1, 3])
def test_two_busy_keys_share_the_engines_by_their_weights(weight):
    """Both keys always have work: while both wait, A's share of the engine is weight / (weight + 1)."""
    finished, order, worked = simulate({"a": ("A", 3000), "b": ("B", 3000)}, {"A": weight, "B": 1}, turn=30)
    assert order.count("a") > 10 and order.count("b") > 10  # many turns each, alternating
    assert all(x != y for x, y in zip(order, order[1:], strict=False))
    share = worked["A"] / (worked["A"] + worked["B"])
    assert share == pytest.approx(weight / (weight + 1), abs=0.03)


def test_the_runner_counts_a_turn_from_its_first_rows_and_then_yields_to_another_key(tmp_path):
    """The runner's side (no job started): a batch whose job has staged nothing yet keeps its slot however long
    it has held it; once rows come, its turn runs, then it yields and the other key's batch is next."""
    import time

    from pipeline.server.runner import BatchRunner, DataDir, _Turn
    from pipeline.server.settings import ServerConfig
    from pipeline.server.store import Store

    data = DataDir(tmp_path)
    data.create()
    store = Store(data.database)
    expires = int(time.time()) + 3600
    for batch_id in ("batch_a", "batch_b"):
        store.add_batch(batch_id, batch_id[-1], "/v1/chat/completions", "file-x", "24h", None, 10, expires)
    store.update_batch("batch_a", status="in_progress")
    runner = BatchRunner(ServerConfig(limits={"fair_share_seconds": 0.2}), store, data, None)
    runner._running["batch_a"] = "a"
    runner._turns["batch_a"] = _Turn(rows_then=0)
    runner._last_turn["a"] = time.monotonic()
    runner._queue.append(("batch_b", "b"))

    time.sleep(0.3)
    assert not runner._turn_over("batch_a", store.batch("batch_a"))  # no rows yet: its job is still starting
    store.update_batch("batch_a", completed=3)
    assert not runner._turn_over("batch_a", store.batch("batch_a"))  # its turn starts now
    time.sleep(0.3)
    assert runner._turn_over("batch_a", store.batch("batch_a"))
    assert "batch_a" in runner._yielding and not runner._turn_over("batch_a", store.batch("batch_a"))
    assert runner._next() is None  # its slot is not free until its job has stopped
    del runner._running["batch_a"]
    runner._queue.append(("batch_a", "a"))
    assert runner._next() == ("batch_b", "b")


def test_each_keys_batches_share_the_prefix_cache_with_that_key_only(tmp_path):
    """A batch's job carries its key's cache_salt, and every line of it is sent with that salt, whatever the line
    says: warm engines serve every key, and a prefix-cache hit must not tell one key what another asked."""
    import time

    from pipeline.server.runner import BatchRunner, DataDir, tenant_cache_salt
    from pipeline.server.settings import ServerConfig
    from pipeline.server.store import Store
    from pipeline.stages.validate import LineValidator, ValidRequest

    data = DataDir(tmp_path)
    data.create()
    store = Store(data.database)
    expires = int(time.time()) + 3600
    for batch_id, owner in (("batch_a1", "a"), ("batch_a2", "a"), ("batch_b", "b")):
        store.add_batch(batch_id, owner, "/v1/chat/completions", "file-x", "24h", None, 10, expires)
    runner = BatchRunner(ServerConfig(), store, data, None)
    runner._running.update({"batch_a1": "a", "batch_a2": "a", "batch_b": "b"})
    salts = {batch_id: runner._job(batch_id, resume=False).limits.cache_salt for batch_id in runner._running}
    assert salts["batch_a1"] == salts["batch_a2"] == tenant_cache_salt("a") != salts["batch_b"]
    line = {
        "custom_id": "x",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "cache_salt": tenant_cache_salt("a")},
    }
    job_b = runner._job("batch_b", resume=False)
    outcome = LineValidator("m", None, job_b.limits)(line, 1, "in.jsonl")
    assert isinstance(outcome, ValidRequest) and outcome.body["cache_salt"] == salts["batch_b"]
