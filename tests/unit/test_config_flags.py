"""The command-line flags come from the config models: each flag is declared once, on the field it sets."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import JobConfig
from pipeline.config_flags import Flag, FlagValues, config_flags, flag_labels, with_config_flags
from tests.lines import chat_line, write_lines


def test_each_flag_is_declared_once_on_a_field_with_vllms_names():
    flags = list(config_flags(JobConfig))
    names = [f.flag.param_name for f in flags]
    assert len(set(names)) == len(names)
    labels = flag_labels(JobConfig)
    assert labels["input"] == "INPUT" and labels["output"] == "OUTPUT"
    for key, flag in [
        ("engine.vllm.max_model_len", "--max-model-len"),
        ("engine.vllm.max_num_seqs", "--max-num-seqs"),
        ("engine.vllm.gpu_memory_utilization", "--gpu-memory-utilization"),
        ("engine.vllm.dtype", "--dtype"),
        ("engine.vllm.cpu_kvcache_space_gib", "--cpu-kvcache-space"),
        ("resources.cpus_per_engine", "--cpus-per-engine"),
        ("routing.prefix_aware", "--prefix-routing/--no-prefix-routing"),
    ]:
        assert labels[key] == flag


def test_run_takes_every_declared_flag():
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "240"})
    assert result.exit_code == 0
    for f in config_flags(JobConfig):
        shown = f.flag.param_name if f.flag.is_argument else f.flag.decls.split("/")[0]
        assert shown in result.output, f.key


def _run_job(monkeypatch, args: list[str]) -> JobConfig:
    """The JobConfig `run` would start with these arguments (nothing is started)."""
    import pipeline.cli

    seen = []
    monkeypatch.setattr(pipeline.cli, "_run", lambda job, *rest, **options: seen.append(job))
    result = CliRunner().invoke(app, ["run", *args])
    assert result.exit_code == 0, result.output
    return seen[0]


def test_flags_reach_their_fields_and_win_over_the_job_file(tmp_path, monkeypatch):
    config = tmp_path / "job.yaml"
    config.write_text(
        "engine:\n  vllm:\n    max_num_seqs: 8\n    dtype: float16\n  fit:\n    enabled: true\n"
    )
    job = _run_job(
        monkeypatch,
        [
            *("in.jsonl", "out", "--config", str(config)),
            *("--max-num-seqs", "32", "--no-fit", "--cpus-per-engine", "2", "--format", "parquet"),
            *("--override-generation-config", '{"temperature": 0.5}', "--gpu-hour-price", "cuda=2.5"),
            *("--gpu-hour-price", "1", "--api-key", "sk-test", "--no-prefix-routing"),
        ],
    )
    assert (job.input, job.output) == ("in.jsonl", "out")
    assert (
        job.engine.vllm.max_num_seqs == 32 and job.engine.vllm.dtype == "float16"
    )  # the file's, not flagged
    assert job.engine.fit.enabled is False and job.routing.prefix_aware is False
    assert job.resources.cpus_per_engine == 2.0 and job.output_options.format == "parquet"
    assert job.engine.vllm.override_generation_config == {"temperature": 0.5}
    assert job.observe.gpu_hour_price == {"cuda": 2.5, "*": 1.0}
    assert job.engine.http.api_key.get_secret_value() == "sk-test"


def test_flags_left_out_leave_the_defaults(tmp_path, monkeypatch):
    assert _run_job(monkeypatch, ["in.jsonl", "out"]) == JobConfig(input="in.jsonl", output="out")


@pytest.mark.parametrize(
    "args, named",
    [
        (["--gpu-hour-price", "cuda=lots"], "--gpu-hour-price 'cuda=lots'"),
        (["--override-generation-config", "[1]"], "--override-generation-config: must be a JSON object"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: Input should be less than or equal"),
        (["--max-num-seqs", "many"], "'--max-num-seqs'"),
    ],
)
def test_a_bad_flag_value_fails_before_any_work_naming_the_flag(tmp_path, args, named):
    source = write_lines(tmp_path / "in.jsonl", [chat_line("a", "hi")])
    result = CliRunner().invoke(
        app, ["run", str(source), str(tmp_path / "out"), *args], env={"COLUMNS": "240"}
    )
    assert result.exit_code == 2 and named in result.output
    assert not (tmp_path / "out").exists()


class _Sample(BaseModel):
    count: Annotated[int | None, Flag("--count", "How many.")] = Field(default=None, description="d")
    names: Annotated[list[str], Flag("--name", "A name (repeat).")] = Field(
        default_factory=list, description="d"
    )


def test_a_command_gets_the_flags_it_names_and_its_own_parameters():
    seen = {}

    @with_config_flags(_Sample, "names", help={"names": "Another help."})
    def command(verbose: bool = False, *, flags: FlagValues) -> None:
        seen.update(verbose=verbose, overrides=flags.overrides())

    import inspect

    assert list(inspect.signature(command).parameters) == ["verbose", "name"]
    command(verbose=True, name=[])
    assert seen == {"verbose": True, "overrides": {"names": None}}  # an unrepeated flag is not given


def test_a_flag_must_exist_and_not_shadow_a_parameter():
    with pytest.raises(ValueError, match="no flag declared"):
        with_config_flags(_Sample, "nope")
    with pytest.raises(ValueError, match="also config flags"):

        @with_config_flags(_Sample)
        def command(count: int = 0, *, flags: FlagValues) -> None: ...


def _serve_settings(monkeypatch, args: list[str]):
    """The ServerConfig `serve` would start with these arguments (nothing is started)."""
    import pipeline.server.serving

    seen = []
    monkeypatch.setattr(
        pipeline.server.serving, "serve_forever", lambda config, token_file=None: seen.append(config)
    )
    result = CliRunner().invoke(app, ["serve", *args], env={"COLUMNS": "240"})
    return result, seen


def test_serve_takes_the_servers_declared_flags_and_no_job_flag():
    from pipeline.server.settings import ServerConfig

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "240"})
    assert result.exit_code == 0
    declared = [f for f in config_flags(ServerConfig) if not f.key.startswith("job.")]
    assert {f.key for f in declared} == {
        "host", "port", "address", "data_dir", "auth.keys_file", "auth.disabled", "hours", "timezone",
        "engine_idle_seconds",
    }  # fmt: skip
    for f in declared:
        assert f.flag.decls in result.output, f.key
    assert "--max-num-seqs" not in result.output  # the job every batch runs as is the server config's


def test_serve_flags_reach_their_fields_over_the_config_file(tmp_path, monkeypatch):
    config = tmp_path / "server.yaml"
    config.write_text("port: 9000\nengine_idle_seconds: 5\nauth: {disabled: false}\n")
    result, seen = _serve_settings(
        monkeypatch,
        ["-c", str(config), "--port", "9100", "--no-auth", "--data-dir", str(tmp_path / "data"), "--hours",
         "22:00-06:00", "--timezone", "UTC"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (settings,) = seen
    assert (settings.port, settings.auth.disabled, settings.engine_idle_seconds) == (9100, True, 5.0)
    assert settings.data_dir == (tmp_path / "data").resolve() and settings.hours == "22:00-06:00"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--port", "99999", "--no-auth"], "error: --port: Input should be less than or equal to 65535"),
        (["--no-auth", "--host", "0.0.0.0"], "--no-auth is allowed only on loopback"),
        (["--no-auth", "--hours", "25:00-06:00"], "--hours"),
    ],
)
def test_a_bad_serve_flag_fails_before_anything_starts_naming_it(tmp_path, monkeypatch, args, named):
    result, seen = _serve_settings(monkeypatch, ["--data-dir", str(tmp_path / "data"), *args])
    assert result.exit_code == 2 and named in result.output, result.output
    assert seen == []
