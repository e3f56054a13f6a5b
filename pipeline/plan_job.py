"""What `nightshift plan --config JOB.yaml` plans: every pool of a job file, as the job would run it.

Runs on the driver (the CLI process), with no Ray and no vLLM: it reads the job file and resolves each pool's
model the way `run` does (`pipeline.job_plan.JobPlan`, resolved), so a plan and a job never disagree on which model
a pool serves. The arithmetic and the printing stay in `pipeline.planner` and `pipeline.plan_cli`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pipeline.model_shape import PlanError
from pipeline.topology import Topology

if TYPE_CHECKING:
    from pipeline.config import VllmEngineArgs
    from pipeline.models import ResolvedModel

# The `nightshift plan` options that go with --config: what the job file does not say (the GPU a pool runs on, the
# input to fit to, the output's form). Every other one (--model, --tensor-parallel-size, --block-size, ...) the
# job file sets, for each pool on its own: given beside it, it would say neither which pool it means nor which wins.
COMBINE_WITH_CONFIG = frozenset({"config", "input", "gpu_memory", "gpus_per_node", "json_output"})


@dataclass(frozen=True)
class PoolTarget:
    """One pool of the job, as the plan needs it: its model, its engine args and where its engines run."""

    name: str
    model: ResolvedModel
    args: VllmEngineArgs
    device: Literal["cpu", "gpu"]
    default_max_tokens: (
        int  # the job's engine.fit.default_max_tokens: output budgeted for chat requests without
    )

    @property
    def topology(self) -> Topology:
        return Topology.of(self.args.model_dump())

    # vLLM args without a field of their own are in `extra`, as the engine passes them on (and fitting reads them).
    @property
    def kv_cache_dtype(self) -> str:
        return self.args.extra.get("kv_cache_dtype", "auto")

    @property
    def block_size(self) -> int | None:
        return self.args.extra.get("block_size")


def job_pool_targets(config_path: str, gpu_memory_given: bool) -> list[PoolTarget]:
    """Every pool of the job file at `config_path`, in its order, with the model and engine args it runs with.

    A GPU pool is planned on a GPU of the size `--gpu-memory` gives; without it, the pools on GPUs are named before
    any model is resolved (the embedded model's first use converts it)."""
    from pipeline.config import ConfigError, load_job_config
    from pipeline.job_plan import JobPlan, JobPlanError
    from pipeline.models import MissingDependencyError, ModelNotFoundError

    try:
        config = load_job_config(config_path)
        if config.engine.backend != "vllm":
            raise PlanError(
                f"{config_path}: nightshift plan sizes vLLM engines, and this job's engine backend is "
                f"{config.engine.backend!r}"
            )
        plan = JobPlan.of(config)
        on_gpus = [pool.name for pool in plan.pools if pool.device == "gpu"]
        if on_gpus and not gpu_memory_given:
            one = len(on_gpus) == 1
            raise PlanError(
                f"{_pools(on_gpus)} of {config_path} {'runs' if one else 'run'} on GPUs (gpus_per_engine > 0): "
                f"pass --gpu-memory, the memory of one of {'its' if one else 'their'} GPUs (e.g. --gpu-memory "
                f"80GiB), to plan {'it' if one else 'them'}"
            )
        plan = plan.resolve()
    except (ConfigError, JobPlanError, ModelNotFoundError, MissingDependencyError) as exc:
        raise PlanError(str(exc)) from None
    return [
        PoolTarget(
            name=pool.name,
            model=pool.model,
            args=pool.args,
            device=pool.device,
            default_max_tokens=config.engine.fit.default_max_tokens,
        )
        for pool in plan.pools
    ]


def _pools(names: list[str]) -> str:
    return ("pool " if len(names) == 1 else "pools ") + ", ".join(repr(name) for name in names)
