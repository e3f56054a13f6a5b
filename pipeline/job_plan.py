"""The job resolved once: its pools, each with its model, served name, adapters, engine args and topology; the names
a line may give in `model`; what the backend told of itself before any work.

Everything below the command line reads the job through a `JobPlan` instead of working it out again from the config:

    JobPlan.of(config)            pure: pools, served names, adapters, topology — names only, nothing loaded or
                                  contacted (`nightshift validate`, `plan --config`, the Batch API's line check)
    JobPlan.of(config).resolve()  the models resolved (prepared, their tasks read) and an http job's servers probed:
                                  what `run` hands to ingest, fit, launch, finalize, the manifest and the cost
    plan.refit(fitted_config)     the same pools and models with the engine args fitting settled

This is the one place a job's pools are derived (`_derive_pools`): one pool "default" sized by `resources` when the
config names none, one pool per server for the http backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from pipeline.adapters import AdapterError, ServedNames, served_names
from pipeline.config import (
    HTTP_CPUS_PER_ENGINE,
    ConfigError,
    EngineResources,
    JobConfig,
    PoolConfig,
    format_validation_error,
)
from pipeline.datasets.media import input_media_root
from pipeline.datasets.output import TableOutput
from pipeline.datasets.render import RowRenderer
from pipeline.datasets.spec import DatasetConfig
from pipeline.datasets.template import TemplateError
from pipeline.engines.base import EngineSpec, backend, engine_class
from pipeline.io.rows import TableRead
from pipeline.manifest import DatasetJob
from pipeline.media.policy import MediaPolicy
from pipeline.models import ResolvedModel, resolve_models, served_name
from pipeline.topology import Topology


class JobPlanError(ValueError):
    """The job cannot be planned as configured; the message says what to change."""


@dataclass(frozen=True)
class PlannedPool:
    """One pool of the job as its engines will run: its resources, the model it serves and its engine args."""

    config: PoolConfig  # name, resources, engine_overrides, as configured
    backend_name: str  # the job's engine backend
    model_arg: (
        str | None
    )  # the model as given (a directory, hub id or embedded:NAME; None: the embedded default)
    served_name_arg: str | None  # --served-model-name / the pool's served_model_name, as given
    args: BaseModel  # the job's backend block (engine.vllm, ...) under the pool's engine_overrides, validated
    model: ResolvedModel | None = None  # once resolved (`JobPlan.resolve`)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def device(self) -> Literal["cpu", "gpu"]:
        return self.config.device

    @property
    def served_name(self) -> str | None:
        """The name requests use for this pool's model; None for a server's model before it is probed (the http
        backend without --model)."""
        if self.model is not None:
            return self.model.name
        if self.model_arg is None and self.served_name_arg is None and self.model_source == "server":
            return None
        return served_name(self.model_arg, self.served_name_arg)

    @property
    def model_source(self) -> str:
        """Where the model comes from: "local" (the engine loads it) or "server" (the backend's servers name it)."""
        return backend(self.backend_name).model_source

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters its engines serve, {name: path}."""
        return dict(getattr(self.args, "lora_modules", None) or {})

    @property
    def topology(self) -> Topology:
        return Topology.of(self.args.model_dump())


@dataclass(frozen=True)
class JobPlan:
    """The job resolved once, handed down to every step (see the module's docstring)."""

    config: JobConfig
    pools: tuple[PlannedPool, ...]
    probed: dict[str, Any] = field(
        default_factory=dict
    )  # what the backend told before any work (http servers)

    # --- construction ------------------------------------------------------------------------------------------

    @classmethod
    def of(
        cls,
        config: JobConfig,
        models: Mapping[str, ResolvedModel] | None = None,
        probed: dict[str, Any] | None = None,
    ) -> JobPlan:
        """The pure plan of `config` (names only), or, with `models` (pool name -> its model), a resolved one.

        Raises ConfigError for pools that cannot be (duplicate names, engine overrides the backend does not
        take, an http pool without its one server)."""
        planned = []
        for pool in _derive_pools(config):
            planned.append(
                PlannedPool(
                    config=pool,
                    backend_name=config.engine.backend,
                    model_arg=pool.model or config.model,
                    served_name_arg=pool.served_model_name
                    or (None if pool.model else config.served_model_name),
                    args=_pool_args(config, pool),
                    model=(models or {}).get(pool.name),
                )
            )
        plan = cls(config, tuple(planned), dict(probed or {}))
        plan.served  # noqa: B018 - adapter names that clash are refused here, before any work
        plan.dataset  # noqa: B018 - so are templates that do not compile
        return plan

    def resolve(self) -> JobPlan:
        """The models of every pool resolved (the embedded model prepared, hub ids found, tasks read) and, for a
        backend whose servers name the model, its servers probed. Raises what resolving raises (ModelNotFoundError,
        MissingDependencyError) and JobPlanError for servers that cannot serve the job."""
        config = self.config
        if backend(config.engine.backend).model_source == "server":
            probed = engine_class(config.engine.backend).probe(self.engine_spec(None))
            model = _server_model(config, probed.get("servers") or [])
            return JobPlan.of(config, {pool.name: model for pool in self.pools}, probed)
        models = resolve_models(
            [(pool.name, pool.model_arg, pool.served_name_arg) for pool in self.pools],
            config.engine.vllm.runner,
        )
        engine = engine_class(config.engine.backend)
        for name, model in models.items():
            # What one image or audio item costs in a prompt, for fitting and `validate` to count: the backend's
            # own processor knows it ({} for a model that takes no media).
            media = engine.media_tokens(model, config.engine.vllm.model_dump())
            if media:
                models[name] = model.model_copy(update={"media_tokens": media})
        return JobPlan.of(config, models)

    def refit(self, config: JobConfig) -> JobPlan:
        """This plan with the engine args of `config` (the job's config after fitting): same pools and models."""
        return JobPlan.of(config, self.pool_models, self.probed)

    # --- what the steps read -----------------------------------------------------------------------------------

    @property
    def resolved(self) -> bool:
        return all(pool.model is not None for pool in self.pools)

    @property
    def pool_models(self) -> dict[str, ResolvedModel]:
        """The model of each pool, by pool name (a resolved plan)."""
        return {pool.name: pool.model for pool in self.pools if pool.model is not None}

    @property
    def model(self) -> ResolvedModel:
        """The job's own model: the first pool's (the one fitting measures and the manifest names first)."""
        model = self.pools[0].model
        if model is None:
            raise RuntimeError("the job's models are not resolved yet (JobPlan.resolve)")
        return model

    @property
    def pool_configs(self) -> list[PoolConfig]:
        return [pool.config for pool in self.pools]

    def pool(self, name: str) -> PlannedPool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)

    @cached_property
    def dataset(self) -> RowRenderer | None:
        """A dataset job's renderer (its templates compiled, its route and id column), None for request lines.
        A template that does not compile is refused here, before any work."""
        spec = self.config.dataset
        if not spec.enabled:
            return None
        if spec.media_columns and spec.media_root is None:
            spec = spec.model_copy(update={"media_root": input_media_root(self.config.input)})
        try:
            return RowRenderer(spec, self.config.limits.max_json_depth)
        except TemplateError as exc:
            raise JobPlanError(str(exc)) from exc

    @property
    def media_policy(self) -> MediaPolicy:
        """The job's media fetch policy: as configured, and for a dataset job whose media column holds paths, reading
        under the media root (the input's own directory, or dataset.media_root) unless the policy names a directory
        of its own."""
        policy = self.config.media
        root = self.dataset.spec.media_root if self.dataset else None
        if root is None or policy.allowed_local_media_path is not None:
            return policy
        return policy.model_copy(update={"allowed_local_media_path": root})

    @property
    def table_read(self) -> TableRead | None:
        """How the input is read: a dataset job's table (the columns its requests are made of, and the kept ones);
        None for request lines."""
        return self.dataset.table_read() if self.dataset else None

    @property
    def dataset_spec(self) -> DatasetConfig | None:
        """What ingest's tasks rebuild the renderer from, on the nodes that read the rows (compiled templates do not
        travel); None for request lines."""
        return self.dataset.spec if self.dataset else None

    @property
    def table_output(self) -> TableOutput | None:
        """How finalize writes a dataset job's table (its answer columns); None: output lines, as the input's."""
        return self.dataset.output if self.dataset else None

    def output_format(self, input_formats: Callable[[], set[str]]) -> str:
        """The format asked for; else JSONL, or for a dataset job its input's (Parquet when every file is).
        `input_formats` is asked only then: telling a remote file's format may mean reading its first bytes."""
        asked = self.config.output_options.format
        if asked is not None:
            return asked
        if self.dataset is None:
            return "jsonl"
        return "parquet" if input_formats() == {"parquet"} else "jsonl"

    @property
    def dataset_summary(self) -> DatasetJob | None:
        """The manifest's account of a dataset job: its route, id column, templates and answer columns."""
        if self.dataset is None:
            return None
        return DatasetJob(
            route=self.dataset.spec.route,
            id_column=self.dataset.spec.id_column,
            templates={
                name.removeprefix("dataset."): template.text
                for name, template in self.dataset.templates.items()
            },
            answer_columns=self.dataset.output.answer_names(),
            media_columns=self.dataset.spec.media_columns,
            media_root=self.dataset.spec.media_root,
        )

    @cached_property
    def served(self) -> ServedNames | None:
        """Every name a line may give in `model`: each pool's served model (with its task, once resolved) and its
        LoRA adapters. None when a server names the model and it is not probed yet (the http backend without
        --model): then no name can be checked before the job runs."""
        names = [pool.served_name for pool in self.pools]
        if any(name is None for name in names):
            return None
        tasks = {pool.served_name: (pool.model.task if pool.model else None) for pool in self.pools}
        try:
            served = served_names(
                tasks, [(pool.name, pool.served_name, pool.adapters) for pool in self.pools]
            )
        except AdapterError as exc:
            raise JobPlanError(str(exc)) from exc
        for name, base in served.adapters.items():
            task = tasks[base]
            if task not in (None, "generate"):
                raise JobPlanError(
                    f"adapter {name!r}: its model {base!r} runs the {task!r} task; LoRA adapters are served for "
                    "generating models only"
                )
        return served

    def validation_map(self) -> dict[str, str | None]:
        """Every name a line may give, with its task (None: the engine's to check)."""
        if self.served is None:
            raise JobPlanError(
                "the servers name the model this job serves: give --model (or --served-model-name), the name "
                "requests use, to check each line's model before the job runs"
            )
        return self.served.validation_map()

    def engine_spec(self, model: ResolvedModel | None | Literal["job"] = "job") -> EngineSpec:
        """The job's engine spec: its backend's args (engine.<backend>), for `model` (default: the job's own; None:
        before it is known — a server backend's model is the one its servers name)."""
        if model == "job":
            model = self.model
        engine = self.config.engine
        args = engine.args().model_dump()
        # A fitted backend without a context arg of its own (the fake) takes the one fitting sets (--max-model-len).
        if backend(engine.backend).fitting and "max_model_len" not in args and engine.vllm.max_model_len:
            args["max_model_len"] = engine.vllm.max_model_len
        # A token is kept out of the args, which are logged and written to the manifest.
        secret = args.pop("api_key", None)
        key_env = args.get("api_key_env")
        api_key = secret.get_secret_value() if secret else (os.environ.get(key_env) if key_env else None)
        return EngineSpec(
            engine.backend,
            model.path if model else "",
            model.name if model else "",
            args,
            api_key=api_key,
            adapter_storage=self.config.storage,
            media=self.media_policy,
        )


# --- the one derivation of a job's pools ---------------------------------------------------------------------------


def _derive_pools(config: JobConfig) -> list[PoolConfig]:
    """The job's pools, checked: unique names, engine overrides the backend knows."""
    pools = config.pools or [
        PoolConfig(
            name="default",
            min_engines=config.resources.num_engines or 1,
            **config.resources.model_dump(include=set(EngineResources.model_fields)),
        )
    ]
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ConfigError(f"pool names must be unique, got {names}")
    if backend(config.engine.backend).model_source == "server":
        pools = _endpoint_pools(config, pools)
        for pool in pools:
            if pool.model or pool.served_model_name:
                # One name for every server: what requests give is checked against what each server serves.
                raise ConfigError(
                    f"pools[{pool.name}]: a pool of the {config.engine.backend} backend serves its server's model; "
                    "name it for the whole job with --model (or --served-model-name), not per pool"
                )
    return pools


def _pool_args(config: JobConfig, pool: PoolConfig) -> BaseModel:
    """The engine args a pool's engines run with: the job's backend block (engine.vllm, ...) under the pool's
    engine_overrides, validated as that block."""
    base = config.engine.args()
    try:
        return type(base).model_validate({**base.model_dump(), **pool.engine_overrides})
    except ValidationError as exc:
        raise ConfigError(f"pools[{pool.name}].engine_overrides: {format_validation_error(exc)}") from exc


def _endpoint_pools(config: JobConfig, pools: list[PoolConfig]) -> list[PoolConfig]:
    """http jobs: one pool per server, so each server has its own bound of requests in flight and all of them
    pull from the one queue. Pools given in the config each name their server (engine_overrides.endpoints)."""
    endpoints = config.engine.http.endpoints
    if not config.pools:
        cpus = config.resources.cpus_per_engine
        return [
            PoolConfig(
                name=f"endpoint-{i}",
                min_engines=config.resources.num_engines or 1,
                cpus_per_engine=HTTP_CPUS_PER_ENGINE if cpus is None else cpus,
                engine_overrides={"endpoints": [url]},
            )
            for i, url in enumerate(endpoints)
        ]
    for pool in pools:
        own = pool.engine_overrides.get("endpoints", endpoints)
        if not isinstance(own, list) or len(own) != 1:
            raise ConfigError(
                f"pools[{pool.name}]: an http pool sends to one server; give it engine_overrides: "
                f"{{endpoints: [URL]}} (it would send to {own})"
            )
    return pools


def _server_model(config: JobConfig, servers: list[dict[str, Any]]) -> ResolvedModel:
    """A server backend's model: the name every body's `model` must equal — --served-model-name or --model as
    given, else the one model the servers serve — which every server must serve."""
    name = config.served_model_name or config.model
    if name is None:
        served = {m for s in servers for m in s["models"]}
        if len(served) != 1:
            raise JobPlanError(
                f"the servers serve {sorted(served) or 'no model'}: pass --model NAME (the name requests use)"
            )
        name = served.pop()
    for server in servers:
        if name not in server["models"]:
            raise JobPlanError(
                f"endpoint {server['endpoint']} does not serve {name!r} (it serves {server['models']}): pass "
                "--model with one of those, or point --endpoint at a server of that model"
            )
    endpoints = [s["endpoint"] for s in servers]
    versions = sorted({f"{s['kind']} {s['version']}" for s in servers if s.get("version")})
    return ResolvedModel(
        name=name,
        path=" ".join(endpoints),
        revision=", ".join(versions) or None,
        source="server",
        task=None,  # the server answers a route its model cannot serve with its own error
    )
