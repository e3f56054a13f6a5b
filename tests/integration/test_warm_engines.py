"""Warm engines on a real local Ray: jobs that name a keeper take its engines, the next job of the same model does
not start them again, a plan they cannot serve rebuilds them, a stopped job leaves nothing running, idle engines
stop."""

from __future__ import annotations

import datetime as dt
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.config import JobConfig
from pipeline.runtime.engines.warm_keeper import start_keeper
from pipeline.runtime.job import run_job
from tests.lines import chat_line, read_jsonl

pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.timeout(300)]

START_SECONDS = 3.0  # the fake engine's start: what a warm engine saves


def _job(tmp_path, name: str, rows: int, keeper: str | None, **fake) -> JobConfig:
    path = tmp_path / f"{name}.jsonl"
    path.write_text(
        "".join(chat_line(f"{name}-{i:04d}", f"question {i} of {name}") + "\n" for i in range(rows))
    )
    return JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / f"{name}-out"),
            "model": None,
            "job_id": name,
            "engine": {
                "backend": "fake",
                "fake": {"output_tokens": 4, "start_seconds": START_SECONDS, **fake},
                "warm_engines": keeper,
            },
            # The engines take every CPU of the cluster, as a CPU pool does by default: what a job does after its
            # engine phase (finalize) must not wait for CPUs its warm engines keep.
            "resources": {"num_engines": 2, "cpus_per_engine": 1.0, "rows_per_task": 16},
        }
    )


def _manifest(config: JobConfig) -> dict:
    return json.loads((Path(config.output) / "manifest.json").read_text())


def _done_ids(config: JobConfig) -> list[str]:
    return sorted(r["custom_id"] for r in read_jsonl(Path(config.output).glob("results-*.jsonl")))


@pytest.fixture()
def keeper(request):
    import ray

    name = f"keeper-{request.node.name}"[:60]
    handle = start_keeper(name, idle_seconds=120)
    ray.get(handle.describe.remote())
    yield name, handle
    ray.kill(handle)


def test_the_second_job_takes_the_first_jobs_engines_warm(tmp_path, keeper):
    import ray

    name, handle = keeper
    first = _job(tmp_path, "first", 300, name)
    second = _job(tmp_path, "second", 300, name)
    run_job(first, show_progress=False)
    run_job(second, show_progress=False)

    assert _manifest(first)["engine"]["reused"] == 0
    assert _manifest(second)["engine"]["reused"] == 2
    assert all(e["reused"] for e in _manifest(second)["engine"]["per_engine"].values())
    state = ray.get(handle.describe.remote())
    assert state["started"] == 2 and state["reused"] == 2
    assert [e["job"] for e in state["engines"]] == [None, None]  # back, warm, for the next job
    for config, rows in ((first, 300), (second, 300)):
        m = _manifest(config)
        assert m["counts"]["succeeded"] == rows and m["counts"]["failed"] == 0
        assert len(set(_done_ids(config))) == rows
    # The second job did not wait for an engine to start: its engines were ready before it began. (Not timed: a
    # wall-time comparison of the two jobs fails on a loaded box, and speed belongs in bench/.)
    ready = dt.datetime.fromisoformat(_manifest(second)["engine"]["first_ready_at"])
    began = dt.datetime.fromisoformat(_manifest(second)["created_at"])
    first_began = dt.datetime.fromisoformat(_manifest(first)["created_at"])
    assert first_began < ready < began


def test_an_engine_that_cannot_serve_the_next_plan_is_rebuilt_in_its_actor(tmp_path, keeper):
    import ray

    name, handle = keeper
    run_job(_job(tmp_path, "small", 100, name, max_concurrency=8), show_progress=False)
    bigger = _job(tmp_path, "bigger", 100, name, max_concurrency=16)
    run_job(bigger, show_progress=False)
    m = _manifest(bigger)
    # The same two actors (no new ones placed), each with an engine built for the new args.
    assert ray.get(handle.describe.remote())["started"] == 2
    assert m["engine"]["reused"] == 0
    assert m["engine"]["args"]["max_concurrency"] == 16
    assert m["counts"]["succeeded"] == 100


def test_idle_engines_stop_after_the_idle_time(tmp_path):
    import ray

    handle = start_keeper("keeper-idle", idle_seconds=2)
    try:
        run_job(_job(tmp_path, "once", 50, "keeper-idle", start_seconds=0), show_progress=False)
        assert ray.get(handle.describe.remote())["started"] == 2
        deadline = time.monotonic() + 30
        while ray.get(handle.describe.remote())["engines"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray.get(handle.describe.remote())["engines"] == []
    finally:
        ray.kill(handle)


def test_a_job_without_its_keeper_starts_its_own_engines(tmp_path):
    config = _job(tmp_path, "alone", 50, "no-such-keeper", start_seconds=0)
    run_job(config, show_progress=False)
    m = _manifest(config)
    assert m["counts"]["succeeded"] == 50 and m["engine"]["reused"] == 0


def test_a_dropped_job_leaves_nothing_running_and_its_engines_serve_the_next(tmp_path, keeper):
    """A driver stopped mid-job (what a cancel or a closed window does): after drop_job returns, no part of it is
    written any more, and the engines take the next job."""
    import threading

    import ray

    from pipeline.io.staging import StagingArea

    name, handle = keeper
    slow = _job(
        tmp_path, "slow", 400, name, start_seconds=0, decode_seconds_per_token=0.05, max_concurrency=4
    )
    failure: list[BaseException] = []

    def drive() -> None:
        try:
            run_job(slow, show_progress=False)
        except BaseException as exc:  # noqa: BLE001 - the job is stopped under it on purpose
            failure.append(exc)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    staging = StagingArea(Path(slow.output))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if staging.count("results") > 0:
                break
        except Exception:  # noqa: BLE001 - not there yet
            pass
        time.sleep(0.2)
    ray.get(handle.drop_job.remote("slow"))
    staged = staging.count("results")
    time.sleep(2.0)
    assert (
        staging.count("results") == staged
    )  # nothing of the dropped job was written after drop_job returned
    assert 0 < staged < 400
    driver.join(timeout=120)
    assert failure and "engines were taken back" in str(failure[0])  # the job fails; its checkpoint stays
    nxt = _job(tmp_path, "next", 60, name, start_seconds=0)
    run_job(nxt, show_progress=False)
    assert _manifest(nxt)["counts"]["succeeded"] == 60


def test_a_warm_engine_that_dies_is_restarted_and_its_ticket_sent_again(tmp_path, keeper):
    """A request that kills its engine every time, on warm engines: Ray restarts the actor, the job sends its
    ticket again, the request ends isolated as an engine_error and every other row is answered once."""
    name, handle = keeper
    config = _job(tmp_path, "poison", 60, name, start_seconds=0, crash_on=["0017"])
    run_job(config, show_progress=False)
    m = _manifest(config)
    assert m["counts"]["succeeded"] == 59 and m["counts"]["by_error_code"] == {"engine_error": 1}
    assert len(set(_done_ids(config))) == 59 and "poison-0017" not in _done_ids(config)
    # The keeper's engines are the same two actors, restarted in place and back for the next job.
    nxt = _job(tmp_path, "after", 30, name, start_seconds=0)
    run_job(nxt, show_progress=False)
    assert _manifest(nxt)["counts"]["succeeded"] == 30
    import ray

    assert ray.get(handle.describe.remote())["started"] == 2


def test_a_job_of_two_pools_takes_both_pools_engines_warm(tmp_path, keeper):
    """Engines of different kinds (here: two pools placed with different CPUs) are all kept for the next job of the
    same pools; only kinds no pool of the job runs are stopped to free their resources."""
    name, handle = keeper

    def two_pools(job: str) -> JobConfig:
        config = _job(tmp_path, job, 80, name, start_seconds=0).model_dump()
        config["resources"] = {"rows_per_task": 16}
        config["pools"] = [
            {"name": "big", "min_engines": 1, "cpus_per_engine": 1.0},
            {"name": "small", "min_engines": 1, "cpus_per_engine": 0.5},
        ]
        return JobConfig.model_validate(config)

    run_job(two_pools("pools-1"), show_progress=False)
    second = two_pools("pools-2")
    run_job(second, show_progress=False)
    m = _manifest(second)
    assert m["counts"]["succeeded"] == 80
    # Both pools' actors were handed back to the second job: none was stopped and started again. (Whether each
    # had built its engine depends on whether it got a chunk of the first job's 80 rows.)
    import ray

    state = ray.get(handle.describe.remote())
    assert state["started"] == 2 and state["reused"] == 2 and len(state["engines"]) == 2


def test_a_ticket_is_sent_again_only_once_its_engine_is_restarted(tmp_path):
    """A send while Ray is still restarting the engine actor fails without reaching it; the job waits for the
    restarted actor instead of spending the ticket's attempts on it."""
    import ray

    from pipeline.runtime.engines.warm_keeper import _until_restarted
    from tests.gated_restart import GatedRestart

    gate, started = tmp_path / "gate", tmp_path / "started"
    actor = ray.remote(num_cpus=0, max_restarts=-1)(GatedRestart).remote(str(gate), str(started))
    first = ray.get(actor.pid.remote())
    ray.kill(actor, no_restart=False)
    with pytest.raises(ray.exceptions.ActorUnavailableError):
        while (
            True
        ):  # until the kill is seen: then each call fails at once while the restart waits at the gate
            ray.get(actor.ready.remote())
    waiter = ThreadPoolExecutor(1).submit(_until_restarted, actor)
    with pytest.raises(ray.exceptions.ActorUnavailableError):
        ray.get(actor.ready.remote())  # still restarting: the condition _until_restarted waits out
    assert not waiter.done()
    gate.write_text("open")
    waiter.result(timeout=120)
    assert ray.get(actor.pid.remote()) != first
    ray.kill(actor, no_restart=True)
