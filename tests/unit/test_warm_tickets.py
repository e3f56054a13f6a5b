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
