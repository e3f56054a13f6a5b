"""The `nightshift` command line (typer). Heavy imports (Ray, vLLM, torch) happen inside commands, so
`nightshift --help` is instant."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from pipeline.config import ConfigError, JobConfig, UnreadableConfigFile, load_job_config, merge_overrides
from pipeline.config_flags import FlagValues, with_config_flags
from pipeline.server.settings import ServerConfig, load_server_config, serve_flags

app = typer.Typer(
    name="nightshift",
    help="Self-hosted batch LLM inference: OpenAI Batch files in, sorted sharded results out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _mount_node_commands() -> None:
    try:
        from cluster.cli import node_app
    except ImportError:  # cluster/ is part of the distribution; tolerate a partial checkout
        return
    app.add_typer(node_app, name="node")


_mount_node_commands()


_DEBUG = False


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback of an error instead of its one-line message.")
    ] = False,
) -> None:
    global _DEBUG
    _DEBUG = debug


def _fail(message: str, code: int = 2) -> None:
    """One line that says what to change, and exit. Called while handling an exception under --debug, re-raise it
    instead, so its traceback shows: for a config file that could not be read, the read error behind the message
    (none for a directory, which is only a wrong path)."""
    handling = sys.exc_info()[1]
    if isinstance(handling, UnreadableConfigFile):
        handling = handling.__cause__
    if _DEBUG and handling is not None and not isinstance(handling, typer.Exit):
        raise handling
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


# The night window, as `run` and `resume` take it.
HoursOption = Annotated[
    str | None,
    typer.Option(
        help="Work only inside this daily window, HH:MM-HH:MM (may wrap midnight, e.g. 22:00-06:00): wait "
        "for it to open; when it closes, stop as Ctrl-C does (finished rows kept) and resume at the next opening."
    ),
]
TimezoneOption = Annotated[
    str | None,
    typer.Option(help="--hours: the window's IANA timezone (default: this machine's local time)."),
]
WarmOption = Annotated[
    bool,
    typer.Option(
        "--warm/--no-warm",
        envvar="NIGHTSHIFT_WARM",
        help="Without --address: run on `nightshift up`'s Ray and warm engines when it is up and can serve the "
        "job as a private Ray would (default); --no-warm (or NIGHTSHIFT_WARM=0) starts a private Ray. Each shift "
        "of --hours starts a private Ray.",
    ),
]


@app.command()
@with_config_flags(JobConfig)
def run(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Job config YAML; flags win over it.")
    ] = None,
    hours: HoursOption = None,
    timezone: TimezoneOption = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="With --address: file holding the cluster's Ray token. Default: RAY_AUTH_TOKEN, "
            "RAY_AUTH_TOKEN_PATH, then $NIGHTSHIFT_HOME/ray/auth_token (the head's own)."
        ),
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the unfinished job in OUTPUT.")] = False,
    warm: WarmOption = True,
    log_format: Annotated[str, typer.Option(help="Logs: console or json.")] = "console",
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Live progress display.")] = True,
    *,
    flags: FlagValues,
) -> None:
    """Run a batch: INPUT (OpenAI Batch JSONL/Parquet) → OUTPUT/ (sorted result shards, error shards, manifest.json)."""
    from pipeline.observe.logs import configure_logging

    if log_format not in ("console", "json"):
        _fail(f"--log-format must be console or json, got {log_format!r}")
    configure_logging(log_format)
    try:
        # Every config field's flag, given or not (None); flags win over the job file.
        job = merge_overrides(load_job_config(config), flags.overrides(), flags.labels)
    except ConfigError as exc:
        _fail(str(exc))
    _run(job, progress, resume, token_file, _hours(hours, timezone), warm=warm)


@app.command("resume")
@with_config_flags(
    JobConfig,
    "storage.s3_endpoint_url",
    "storage.s3_region",
    "resources.address",
    help={
        "storage.s3_endpoint_url": "S3-compatible endpoint, as for `run` (default: AWS_ENDPOINT_URL_S3 / "
        "AWS_ENDPOINT_URL); given, it replaces the interrupted job's.",
        "storage.s3_region": "S3 region (default: AWS_REGION); given, it replaces the job's.",
        "resources.address": "Ray cluster to continue on; given, it replaces the job's (e.g. a restarted cluster).",
    },
)
def resume_command(
    output: Annotated[
        str,
        typer.Argument(help="OUTPUT of the interrupted job: a directory, s3://bucket/prefix or http(s)://."),
    ],
    hours: HoursOption = None,
    timezone: TimezoneOption = None,
    token_file: Annotated[
        Path | None,
        typer.Option(help="File holding the Ray token of the job's cluster (as for `run --token-file`)."),
    ] = None,
    warm: WarmOption = True,
    log_format: Annotated[str, typer.Option(help="Logs: console or json.")] = "console",
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Live progress display.")] = True,
    *,
    flags: FlagValues,
) -> None:
    """Continue an interrupted job from OUTPUT/_staging/: same spec, same input (checked), finished rows kept.

    An s3:// OUTPUT keeps its checkpoint in the bucket, so any machine that reaches it can resume the job; an
    http(s):// OUTPUT keeps it on the disk of the machine that started the job.
    """
    from pipeline.observe.logs import configure_logging
    from pipeline.runtime.job import load_resumable
    from pipeline.runtime.preflight import PreflightError

    configure_logging(log_format)
    try:
        # The storage flags are needed to read the checkpoint at all; the rest go over the job it holds.
        job = load_resumable(output, flags.section("storage"))
        job = merge_overrides(job, {"resources.address": flags["resources.address"]}, flags.labels)
    except (PreflightError, ConfigError) as exc:
        _fail(str(exc))
    _run(job, progress, resume=True, token_file=token_file, hours=_hours(hours, timezone), warm=warm)


@app.command("status")
@with_config_flags(JobConfig, "storage.s3_endpoint_url", "storage.s3_region")
def status_command(
    output: Annotated[
        str,
        typer.Argument(
            help="OUTPUT of a running, interrupted or finished job: a directory or s3://bucket/prefix."
        ),
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="The status as one JSON object, for scripts.")
    ] = False,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch", help="Redraw in place every few seconds until the job ends (Ctrl-C to leave)."
        ),
    ] = False,
    every: Annotated[float, typer.Option(help="--watch: seconds between refreshes.", min=0.5)] = 2.0,
    *,
    flags: FlagValues,
) -> None:
    """Where a job stands, from its OUTPUT alone: state, rows, throughput, ETA, pools, errors by code."""
    from pipeline.config import StorageConfig
    from pipeline.io.staging import JobStateError
    from pipeline.observe.status import NoJobError, job_status, render

    if as_json and watch:
        _fail("--json and --watch do not go together: --json prints once, for scripts")
    storage = StorageConfig.model_validate(flags.section("storage"))

    def read() -> dict:
        try:
            return job_status(output, storage)
        except (NoJobError, JobStateError, FileNotFoundError) as exc:
            _fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - an unreachable OUTPUT: say what failed in one line
            _fail(f"cannot read {output}: {type(exc).__name__}: {exc}")

    if as_json:
        sys.stdout.write(json.dumps(read(), indent=2) + "\n")
        return
    from rich.console import Console

    console = Console()
    if not watch:
        console.print(render(read()))
        return
    import time

    from rich.live import Live

    status = read()
    try:
        with Live(render(status), console=console, auto_refresh=False) as live:
            while status["state"] == "running":
                time.sleep(every)
                status = read()
                live.update(render(status), refresh=True)
    except KeyboardInterrupt:
        pass


@app.command()
@with_config_flags(ServerConfig, *serve_flags())
def serve(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="Server config YAML (limits, auth, the job every batch runs as)."
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="With --address: file holding the cluster's Ray token (as for `run --token-file`). Default: "
            "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, then $NIGHTSHIFT_HOME/ray/auth_token."
        ),
    ] = None,
    log_format: Annotated[str, typer.Option(help="Logs: console or json.")] = "console",
    *,
    flags: FlagValues,
) -> None:
    """The OpenAI Files + Batches API on Ray Serve: point the `openai` client's base_url at http://HOST:PORT/v1."""
    from cluster.auth import AuthError
    from pipeline.observe.logs import configure_logging
    from pipeline.server.auth import Keyring
    from pipeline.server.datadir import prepare_data_dir
    from pipeline.server.quotas import Quotas

    configure_logging(log_format)
    try:
        settings = load_server_config(config, flags.overrides(), flags.labels)
        # Keys, and the labels quotas.keys names, are checked here, before Ray starts.
        keyring = Keyring.load(settings.auth)
        Quotas(settings.quotas, keyring.labels)
        prepare_data_dir(settings.data_dir)  # private from here on, and refused if another server holds it
    except ConfigError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(
            f"--data-dir {settings.data_dir}: cannot be created ({exc.strerror or exc}); choose a writable directory"
        )
    from pipeline.server.serving import serve_forever

    if not keyring.disabled:
        # The server gets the keys' digests, and no process of the Ray started below inherits a key: every Ray
        # worker, engines reading tenants' lines included, would otherwise hold them in its environment.
        settings = settings.model_copy(
            update={
                "auth": settings.auth.model_copy(
                    update={"key_digests": keyring.as_digests(), "keys_file": None}
                )
            }
        )
        os.environ.pop(settings.auth.keys_env, None)
    try:
        serve_forever(settings.model_copy(update={"data_dir": settings.data_dir.resolve()}), token_file)
    except (AuthError, ConfigError) as exc:
        _fail(str(exc))


def _check_environment(job: JobConfig) -> None:
    """The fast checks of `nightshift doctor`, before Ray or an engine starts: a broken install stops here with
    its fix."""
    import structlog

    from pipeline.doctor import describe, failures, job_checks
    from pipeline.engines.base import backend

    if not backend(job.engine.backend).runs_vllm:
        return
    findings = job_checks(job)
    for warning in (f for f in findings if f.status == "warn"):
        structlog.get_logger("nightshift").warning(describe(warning))
    problems = failures(findings)
    for problem in problems[:-1]:
        typer.secho(f"error: {describe(problem)}", fg=typer.colors.RED, err=True)
    if problems:
        _fail(describe(problems[-1]))


def _hours(hours: str | None, timezone: str | None):  # noqa: ANN202 - pipeline.hours.Hours | None
    from pipeline.hours import HoursError, window

    try:
        return window(hours, timezone)
    except HoursError as exc:
        _fail(str(exc))


def _run_in_hours(job: JobConfig, progress: bool, resume: bool, hours, token_file: Path | None) -> None:  # noqa: ANN001
    """The job inside the window (runtime/hosting/shifts.py), each shift a child `run`/`resume` that prints its own
    errors and summary; this process waits, stops and resumes them, and exits as the last one did."""
    from pipeline.clock import clock_from_environment
    from pipeline.runtime.hosting.shifts import ShiftJob, run_in_hours

    flags = ["--no-warm"] + ([] if progress else ["--no-progress"])
    if token_file is not None:
        flags += ["--token-file", str(token_file)]
    try:
        code = run_in_hours(hours, ShiftJob(job, resume, flags), clock_from_environment())
    except KeyboardInterrupt:
        _fail("interrupted; finished rows are kept in OUTPUT/_staging/", code=130)
    if code != 0:
        raise typer.Exit(code)


def _run(
    job: JobConfig,
    progress: bool,
    resume: bool = False,
    token_file: Path | None = None,
    hours=None,  # noqa: ANN001 - pipeline.hours.Hours | None
    warm: bool = True,
) -> None:
    import structlog

    from cluster.auth import AuthError, driver_environment
    from pipeline.io.full_disk import disk_full_cause
    from pipeline.io.locations import LocationError
    from pipeline.models import MissingDependencyError, ModelNotFoundError
    from pipeline.observe.summary import print_summary
    from pipeline.runtime.job import run_job
    from pipeline.runtime.preflight import PreflightError

    _check_environment(job)
    if hours is not None:
        # Each shift is a private Ray: when the window closes, the engines must be gone until it opens again.
        _run_in_hours(job, progress, resume, hours, token_file)
        return
    from pipeline.api import on_warm_runtime

    job = on_warm_runtime(job, warm)
    try:
        # The cluster's token (or none) is checked here, in milliseconds, and handed to Ray the way Ray reads it.
        with driver_environment(job.resources.address, token_file) as warnings:
            for warning in warnings:
                structlog.get_logger("nightshift").warning(warning)
            outcome = run_job(job, show_progress=progress, resume=resume)
    except (
        AuthError,
        PreflightError,
        ModelNotFoundError,
        MissingDependencyError,
        LocationError,
        ConfigError,
        ValueError,
    ) as exc:
        if (full := disk_full_cause(exc)) is not None:  # a full disk met while reading or checking
            _stopped_by_a_full_disk(job, full)
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted; finished rows are kept in OUTPUT/_staging/", code=130)
    except Exception as exc:  # noqa: BLE001 - the job failed: say why in one line, keep the traceback in the log
        full = disk_full_cause(exc)
        if full is not None:
            _stopped_by_a_full_disk(job, full)
        structlog.get_logger("nightshift").exception("job failed")
        root = exc
        while root.__cause__ is not None:
            root = root.__cause__
        _fail(
            f"job failed: {type(root).__name__}: {str(root).strip().splitlines()[-1] if str(root).strip() else ''}",
            1,
        )
    print_summary(outcome.manifest, outcome.output)


def _stopped_by_a_full_disk(job: JobConfig, full: OSError) -> None:
    """A full disk stops the job, never its rows: what finished stays staged, and `resume` completes it."""
    import os

    from pipeline.io.full_disk import EXIT_DISK_FULL

    # The errno's own words: a remote error's text also carries Ray's frame of it.
    path = full.filename if isinstance(full.filename, str) and "\n" not in full.filename else None
    where = f" writing {path}" if path else ""
    _fail(
        f"no space left on the disk{where} ({os.strerror(full.errno)}): every row finished so far is staged in "
        f"OUTPUT/_staging/; free space, then `nightshift resume {job.output}` completes the job",
        EXIT_DISK_FULL,
    )


@app.command()
def up(
    idle_timeout: Annotated[
        str,
        typer.Option(
            help="Stop the warm engines, then the runtime, after this long without a run: 900, 90s, 30m, 2h."
        ),
    ] = "30m",
) -> None:
    """Keep a local Ray and warm engines between runs: each `nightshift run` without --address uses them, and a run
    of the same model and engine args skips the engines' start. `nightshift down` ends it."""
    from pipeline.runtime.hosting import warm_runtime

    try:
        seconds = warm_runtime.parse_duration(idle_timeout)
        state, started = warm_runtime.start(seconds)
    except warm_runtime.WarmRuntimeError as exc:
        _fail(str(exc))
    verb = "up" if started else "already up"
    typer.echo(
        f"nightshift {verb}: Ray at {state.address} (daemon pid {state.pid}); engines are kept "
        f"{state.idle_timeout_s:.0f} s after their last run. `nightshift down` stops it."
    )
    if not started:
        kept = warm_runtime.describe(state)
        engines = kept.get("engines") or []
        typer.echo(
            f"warm engines: {len(engines)} kept, {kept.get('started', 0)} started and {kept.get('reused', 0)} "
            "handed to a later run over the runtime's life"
        )
        for engine in engines:
            held = f"running job {engine['job']}" if engine["job"] else f"idle {engine['idle_s']:.0f} s"
            typer.echo(f"  {engine['model']} ({engine['backend']}): {held}")


@app.command()
def down() -> None:
    """End `nightshift up`'s runtime: its warm engines and its Ray."""
    from pipeline.runtime.hosting import warm_runtime

    state = warm_runtime.stop()
    typer.echo("nightshift is not up" if state is None else f"nightshift down (daemon pid {state.pid} ended)")


@app.command()
@with_config_flags(
    JobConfig,
    "model",
    "served_model_name",
    "engine.backend",
    "engine.vllm.lora_modules",
    "engine.vllm.max_model_len",
    "engine.http.endpoints",
    "storage.s3_endpoint_url",
    "dataset.template",
    "dataset.system",
    "dataset.pair_template",
    "dataset.route",
    "dataset.id_column",
    "dataset.keep_columns",
    "dataset.max_tokens",
    "dataset.image_column",
    "dataset.audio_column",
    "dataset.media_root",
    help={"model": "Model the job would serve (its name is checked)."},
)
def validate(
    input: Annotated[
        str,
        typer.Argument(help="OpenAI Batch JSONL or Parquet: a file, directory, glob, s3:// or http(s)://."),
    ],
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="Job config YAML: its pools, models and adapters are what lines may name."
        ),
    ] = None,
    tokens: Annotated[
        bool,
        typer.Option(
            "--tokens/--no-tokens",
            help="Token statistics with each model's tokenizer, and the lines longer than the job's context.",
        ),
    ] = True,
    *,
    flags: FlagValues,
) -> None:
    """Dry run of the job: counts, every error record (JSON lines on stdout), token statistics. No engine is started.

    Lines are checked against every name the job serves — each pool's model and its LoRA adapters — as `run` with the
    same --config and flags would check them. A dataset job (--template, or `dataset:` in the job file) renders each
    row of its table first: rows its templates cannot render are counted by the column to blame, and the token
    statistics are those of the rendered prompts."""
    from pipeline.datasets.render import DatasetError
    from pipeline.engines.base import backend
    from pipeline.job_plan import JobPlan, JobPlanError
    from pipeline.models import MissingDependencyError, ModelNotFoundError
    from pipeline.runtime.preflight import PreflightError, check_input_source
    from pipeline.validate_job import validate_input

    try:
        job = merge_overrides(load_job_config(config), flags.overrides(), flags.labels)
        # A media column's relative paths are under the input's directory, as `run` reads them.
        job = job.model_copy(update={"input": input})
        plan = JobPlan.of(job)
        source = check_input_source(input, job.storage, plan.table_read)
        if plan.dataset is not None:  # a table: its columns are checked against the templates first
            plan.dataset.check_table(source)
        # Tokens are counted with each model's own tokenizer, which needs the models; a backend whose servers
        # count their own (http) has nothing to count with here, and its servers are not contacted.
        tokens = tokens and backend(job.engine.backend).fitting is not None
        report = validate_input(source, plan.resolve() if tokens else plan, tokenize=tokens)
    except (
        ConfigError,
        DatasetError,
        JobPlanError,
        PreflightError,
        ModelNotFoundError,
        MissingDependencyError,
    ) as exc:
        _fail(str(exc))
    for record in report.error_records:
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    typer.echo(report.summary(), err=False)


@app.command()
def doctor(
    locations: Annotated[
        list[str] | None,
        typer.Argument(
            help="INPUT / OUTPUT locations a job would use: s3:// ones get their credentials checked."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Findings as a JSON list.")] = False,
    address: Annotated[
        str | None,
        typer.Option(help="Ray cluster a job would join: check it enforces a token and takes this node's."),
    ] = None,
    token_file: Annotated[
        str | None, typer.Option(help="File holding the cluster's Ray token (as for `run --token-file`).")
    ] = None,
) -> None:
    """Check this node can run a job: engine stack for its accelerators, torch builds, the embedded model, Ray and
    Python versions, /dev/shm, S3 credentials, and with --address the cluster's token authentication. Each finding
    comes with its fix; exit 1 when a job would fail."""
    from pipeline.doctor import check_cluster_auth, failures, run_checks

    findings = run_checks(locations or [])
    if address:
        findings = [*findings, check_cluster_auth(address, token_file)]
    if as_json:
        sys.stdout.write(json.dumps([f.model_dump() for f in findings], indent=2) + "\n")
    else:
        _print_findings(findings)
    if failures(findings):
        raise typer.Exit(1)


def _print_findings(findings) -> None:  # noqa: ANN001 - list[pipeline.doctor.Finding]
    from rich.console import Console
    from rich.table import Table

    colors = {"ok": "green", "warn": "yellow", "fail": "red"}
    table = Table(show_header=True, header_style="bold", show_lines=False)
    with_fix = any(f.fix for f in findings)
    for column in ("check", "status", "finding", "fix")[: 4 if with_fix else 3]:
        table.add_column(column, overflow="fold")
    for f in findings:
        row = [f.name, f"[{colors[f.status]}]{f.status}[/]", f.detail] + ([f.fix or ""] if with_fix else [])
        table.add_row(*row)
    Console(soft_wrap=False).print(table)


def _mount_plan_command() -> None:
    from pipeline.plan_cli import plan_command

    app.command("plan")(plan_command)


_mount_plan_command()


def main() -> None:
    """The console entry point (`nightshift`, `python -m pipeline`): the command, then an exit that waits for nothing
    left to do.

    Ray, when the command started or joined it, is ended here (runtime/hosting/session.py: `end_ray`, a second sooner than
    Ray's own exit hook), and then the process exits without the interpreter tearing its modules down one by one:
    with Ray Data, pyarrow and matplotlib loaded that takes a second after a job that is already committed. Output
    and logs are flushed first. Tests drive `app` itself, which exits as any typer app does."""
    try:
        app(prog_name="nightshift")
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    _exit_now(code)


def _exit_now(code: object) -> None:  # pragma: no cover - ends the process
    import logging
    import os

    from pipeline.runtime.hosting.session import end_ray

    if code is not None and not isinstance(
        code, int
    ):  # SystemExit("message"): printed, status 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    try:
        end_ray()
    except BaseException as exc:  # noqa: BLE001 - the command's own status must not hide that Ray did not end
        print(f"error: Ray did not shut down cleanly: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = code or 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe (`nightshift ... | head`) has nothing more to take
            pass
    os._exit(code or 0)
