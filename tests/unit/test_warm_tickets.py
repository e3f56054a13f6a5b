"""A warm engine and the runs of a job: a ticket sent before the job was dropped but arriving after it is refused
(else it would stage rows of a stopped job), and the job's next run is served. In-process, no Ray."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.engines.base import EngineSpec
from pipeline.runtime.engines.warm_keeper import TicketDropped, WarmEngine


@pytest.fixture
def engine(monkeypatch) -> WarmEngine:
    warm = WarmEngine(EngineSpec("fake", "m", "m", {"max_model_len": 64}), "default")
    served: list[str] = []

    async def serve(ticket: str) -> int:  # the pull loop itself is the work queue's tests' subject
        served.append(ticket)
        return 1

    monkeypatch.setattr(warm, "serve", serve)
    monkeypatch.setattr(warm, "bind", lambda **_: None)
    monkeypatch.setattr(warm, "_report", lambda force=False: None)
    warm.served = served
    return warm


def test_a_ticket_that_arrives_after_its_job_was_dropped_is_refused(engine):
    async def go():
        await engine.drop_job("job", next_run=1)  # no ticket of it here yet: the drop is remembered
        with pytest.raises(TicketDropped, match="job job was stopped"):
            await engine.serve_job("default/0", "job", 0, "default", {})

    asyncio.run(go())
    assert engine.served == []


def test_the_next_run_of_a_dropped_job_is_served(engine):
    async def go():
        await engine.drop_job("job", next_run=1)
        return await engine.serve_job("default/0", "job", 1, "default", {})

    assert asyncio.run(go()) == 1 and engine.served == ["default/0"]


def test_another_jobs_tickets_are_not_touched_by_a_drop(engine):
    async def go():
        await engine.drop_job("stopped", next_run=3)
        return await engine.serve_job("default/0", "other", 0, "default", {})

    assert asyncio.run(go()) == 1


def test_a_warm_engines_numbers_in_a_jobs_report_are_that_jobs_own():
    """A warm engine's counters run across jobs (and API keys): what a job reports is counted from its own start,
    so a job never shows the prefix-cache traffic or preemptions of the jobs before it."""
    from pipeline.engines.base import EngineStats

    class Counting:
        def __init__(self) -> None:
            self.now = EngineStats(kv_cache_tokens=1000, prefix_cache_queries=500, prefix_cache_hits=400)

        def stats(self) -> EngineStats:
            return self.now

        def effective_args(self) -> dict:
            return {}

        def sampling_defaults(self) -> dict:
            return {}

        def concurrency(self, args: dict) -> int:
            return 4

    reports: list[dict] = []

    class Monitor:
        class report:  # noqa: N801 - called as a Ray actor method is
            @staticmethod
            def remote(actor_id, info):
                reports.append(info["stats"])

    warm = WarmEngine(EngineSpec("fake", "m", "m", {"max_model_len": 64}), "default")
    warm.engine = Counting()  # the engine an earlier job left warm: its counters are the earlier jobs'
    warm.bind("default", Monitor(), "second", None, None, 8, None)
    warm.engine.now = EngineStats(kv_cache_tokens=1000, prefix_cache_queries=530, prefix_cache_hits=410)
    warm._report(force=True)
    assert (reports[-1]["prefix_cache_queries"], reports[-1]["prefix_cache_hits"]) == (30, 10)
    assert reports[-1]["kv_cache_tokens"] == 1000  # a gauge: as it is


def test_a_warm_engine_serves_only_jobs_of_its_own_media_policy():
    """An engine fetches by the policy it started with: a job with another policy gets engines of its own, never a
    permissive job's engine under a strict one's name."""
    from pipeline.media.policy import MediaPolicy
    from pipeline.runtime.engines.warm_keeper import engine_kind

    permissive = EngineSpec("vllm", "m", "m", {}, media=MediaPolicy())
    strict = EngineSpec("vllm", "m", "m", {}, media=MediaPolicy(allow_private_networks=False))
    assert engine_kind(permissive, {}) != engine_kind(strict, {})
    assert engine_kind(strict, {}) == engine_kind(EngineSpec("vllm", "m", "m", {}, media=strict.media), {})
