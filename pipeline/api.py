"""nightshift as a Python call: a job from a config (or a table in memory, or a Ray Dataset), with the setup the
`nightshift` command does around it, and a typed outcome back.

    import pipeline
    result = pipeline.run("job.yaml")                                 # or a JobConfig, or a dict of one
    result.counts.succeeded, result.results                          # the manifest's counts, the shards' paths
    answered = pipeline.run_table(df, template="Summarise: {{ text }}", max_tokens=64)   # pandas in, pandas out
    answered = pipeline.run_dataset(ds, output="s3://bucket/job/", template="{{ text }}", route="embeddings")

The setup is the command's: the install's fast checks (what `nightshift doctor` refuses), `nightshift up`'s warm
runtime when it is there and can serve the job, the cluster's token handed to Ray, and a Ray this call started shut
down when it returns (a Ray the caller started, with `ray.init`, is the caller's and stays up). A job that cannot
start raises what says why (PreflightError, ConfigError, ModelNotFoundError, ...); a job that fails raises its error.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.config import JobConfig, load_job_config
from pipeline.manifest import Counts, Manifest


class NightshiftSetupError(RuntimeError):
    """The install cannot run the job (what `nightshift doctor` reports as a failure)."""


class RunResult(BaseModel):
    """What a job wrote: where, its manifest (typed), and its shards' paths."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    output: str
    manifest: Manifest
    results: list[str]  # result shards (a dataset job's table), in order
    errors: list[str]  # error shards, in order (none for a dataset job: its errors are in the table)

    @property
    def counts(self) -> Counts:
        return self.manifest.counts


def _as_config(job: JobConfig | Mapping[str, Any] | str | Path, overrides: Mapping[str, Any]) -> JobConfig:
    if isinstance(job, JobConfig):
        config = job
    elif isinstance(job, str | Path):
        config = load_job_config(job)
    else:
        config = JobConfig.model_validate(dict(job))
    if overrides:
        config = JobConfig.model_validate({**config.model_dump(), **overrides})
    return config


def _check_install(config: JobConfig) -> None:
    from pipeline.doctor import describe, failures, job_checks
    from pipeline.engines.base import backend

    if not backend(config.engine.backend).runs_vllm:
        return
    problems = failures(job_checks(config))
    if problems:
        raise NightshiftSetupError("; ".join(describe(problem) for problem in problems))


def on_warm_runtime(config: JobConfig, warm: bool) -> JobConfig:
    """The job on `nightshift up`'s runtime when it is there and can serve it (runtime/hosting/warm_runtime.py); else
    as given. A resumed job that began on the runtime chooses again."""
    import structlog

    from pipeline.runtime.hosting import warm_runtime

    config = warm_runtime.detach(config)
    if not warm or config.resources.address is not None or config.engine.warm_engines is not None:
        return config
    state = warm_runtime.find_runtime()
    if state is None:
        return config
    why_not = warm_runtime.mismatch(state, os.environ, sys.executable)
    log = structlog.get_logger("nightshift")
    if why_not is not None:
        log.warning(
            f"not using the warm runtime of `nightshift up`: {why_not}; this run starts its own Ray "
            "(`nightshift down`, then `nightshift up` from this environment, to share it)"
        )
        return config
    warm_runtime.claim()
    log.info("on the warm runtime of `nightshift up`", address=state.address)
    return warm_runtime.attach(config, state)


def run(
    job: JobConfig | Mapping[str, Any] | str | Path,
    *,
    resume: bool = False,
    show_progress: bool = False,
    warm: bool = True,
    token_file: str | Path | None = None,
    **overrides: Any,
) -> RunResult:
    """Run a job (a JobConfig, a dict of one, or a job file's path) to its committed output, or, with `resume`,
    continue the unfinished job in its OUTPUT. `overrides`: top-level config fields over the job's (e.g.
    `input=`, `output=`, `dataset={...}`). `warm`: use `nightshift up`'s runtime when it can serve the job."""
    import ray
    import structlog

    from cluster.auth import driver_environment
    from pipeline.runtime.job import run_job

    config = _as_config(job, overrides)
    _check_install(config)
    config = on_warm_runtime(config, warm)
    ours = not ray.is_initialized()
    try:
        with driver_environment(
            config.resources.address, Path(token_file) if token_file else None
        ) as warnings:
            for warning in warnings:
                structlog.get_logger("nightshift").warning(warning)
            outcome = run_job(config, show_progress=show_progress, resume=resume)
    finally:
        if ours and ray.is_initialized():
            ray.shutdown()
    manifest = Manifest.model_validate(outcome.manifest)
    where = str(outcome.output).rstrip("/")
    return RunResult(
        output=str(outcome.output),
        manifest=manifest,
        results=[f"{where}/{shard.name}" for shard in manifest.shards.results],
        errors=[f"{where}/{shard.name}" for shard in manifest.shards.errors],
    )


def _dataset_job(
    input_path: str,
    output: str,
    job: JobConfig | Mapping[str, Any] | str | Path | None,
    dataset: dict[str, Any],
) -> JobConfig:
    base = _as_config(job if job is not None else JobConfig(), {})
    merged = {**base.dataset.model_dump(exclude_defaults=True), **dataset}
    return JobConfig.model_validate(
        {**base.model_dump(), "input": input_path, "output": output, "dataset": merged}
    )


def run_table(
    table: Any,
    *,
    job: JobConfig | Mapping[str, Any] | str | Path | None = None,
    output: str | Path | None = None,
    **dataset: Any,
) -> Any:
    """A table in memory (a pyarrow Table or a pandas DataFrame) answered: the same type back, its columns kept,
    the answer columns added (datasets/output.py), one row per input row in input order (or by `id_column`).
    `dataset`: the dataset fields (template, system, route, id_column, keep_columns, max_tokens, temperature,
    body, body_columns); `job`: the rest of the job (model, engine, resources). `output`: where the job's files
    go (default: a temporary directory, removed after); giving one keeps them, and a call with the same table
    and output after an interruption resumes the job there."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    is_pandas = not isinstance(table, pa.Table)
    arrow = pa.Table.from_pandas(table, preserve_index=False) if is_pandas else table
    with tempfile.TemporaryDirectory(prefix="nightshift-table-") as scratch:
        where = Path(output) if output is not None else Path(scratch) / "out"
        input_path = Path(f"{where}.input.parquet") if output is not None else Path(scratch) / "input.parquet"
        config = _dataset_job(str(input_path), str(where), job, {**dataset})
        unfinished = (where / "_staging").exists() and input_path.exists()
        if not unfinished:
            input_path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(arrow, input_path)
        config = config.model_copy(
            update={"output_options": config.output_options.model_copy(update={"format": "parquet"})}
        )
        result = run(config, resume=unfinished)
        answered = pa.concat_tables([pq.read_table(path) for path in result.results])
    return answered.to_pandas() if is_pandas else answered


def run_dataset(
    dataset_in: Any,
    *,
    output: str,
    job: JobConfig | Mapping[str, Any] | str | Path | None = None,
    **dataset: Any,
) -> Any:
    """A Ray Dataset answered: a Ray Dataset of its rows with the answer columns, read from the job's Parquet
    output at `output` (local or s3://). The input is written once as Parquet beside the output
    (`<output>.input/`); a call whose job in `output` was interrupted resumes it over that copy, so the rows
    already answered are not run again (a dataset whose content changed must go to a new output)."""
    import ray

    from pipeline.io.locations import parse_location

    input_dir = f"{output.rstrip('/')}.input"
    location = parse_location(output)
    config = _dataset_job(input_dir, output, job, {**dataset})
    config = config.model_copy(
        update={"output_options": config.output_options.model_copy(update={"format": "parquet"})}
    )
    staged = output.rstrip("/") + "/_staging/job.json"
    unfinished = Path(staged).exists() if location.kind == "local" else _exists(staged, config)
    if not unfinished:  # a copy left by an earlier job in this output is replaced, never added to
        from ray.data import SaveMode

        dataset_in.write_parquet(input_dir, mode=SaveMode.OVERWRITE)
    result = run(config, resume=unfinished)
    return ray.data.read_parquet(result.results)


def _exists(url: str, config: JobConfig) -> bool:
    from pipeline.io.writers import output_target

    target = output_target(url.rsplit("/_staging/", 1)[0], config.storage)
    return target.staging_area().exists()
