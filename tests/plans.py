"""Job plans for tests that hand a step a plan without resolving real models: every pool serves `model`."""

from __future__ import annotations

from pipeline.config import JobConfig
from pipeline.job_plan import JobPlan
from pipeline.models import ResolvedModel


def plan_of(config: JobConfig, model: ResolvedModel | None = None) -> JobPlan:
    """The plan of `config`: pure (names only) without `model`, else with `model` as every pool's."""
    if model is None:
        return JobPlan.of(config)
    return JobPlan.of(config, {pool.name: model for pool in JobPlan.of(config).pools})
