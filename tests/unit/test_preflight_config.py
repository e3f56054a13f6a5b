"""Preflight checks on INPUT / OUTPUT, and JobConfig loading / flag merging."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.config import ConfigError, JobConfig, load_job_config, merge_overrides
from pipeline.runtime.preflight import PreflightError, check_input, check_output_target


def check_output(location: str | None, overwrite: bool, resume: bool = False) -> Path:
    """A local OUTPUT through the preflight `run` and `resume` use, as the directory it resolved to."""
    return Path(check_output_target(location, overwrite, resume=resume).location.path)


# -- check_input ----------------------------------------------------------------------------------------------------


def test_input_ok(tmp_path: Path):
    path = tmp_path / "in.jsonl"
    path.write_text("{}\n")
    assert check_input(str(path)) == path


@pytest.mark.parametrize("location", [None, ""])
def test_input_not_given(location):
    with pytest.raises(PreflightError, match="no INPUT given.*JSONL"):
        check_input(location)


def test_input_missing(tmp_path: Path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(PreflightError, match="does not exist: check the path") as info:
        check_input(str(missing))
    assert str(missing) in str(info.value)


def test_input_is_a_directory(tmp_path: Path):
    with pytest.raises(PreflightError, match="is a directory: pass a JSONL file") as info:
        check_input(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_input_expands_user(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "in.jsonl").write_text("{}\n")
    assert check_input("~/in.jsonl") == tmp_path / "in.jsonl"


# -- check_output ---------------------------------------------------------------------------------------------------


def test_output_created_when_missing(tmp_path: Path):
    out = tmp_path / "a" / "b" / "out"
    assert check_output(str(out), overwrite=False) == out
    assert out.is_dir()
    assert list(out.iterdir()) == []  # the write probe is cleaned up


def test_output_existing_empty_dir_ok(tmp_path: Path):
    assert check_output(str(tmp_path), overwrite=False) == tmp_path


@pytest.mark.parametrize("location", [None, ""])
def test_output_not_given(location):
    with pytest.raises(PreflightError, match="no OUTPUT given: pass a directory for the results, s3://"):
        check_output(location, overwrite=False)


def test_output_is_a_file(tmp_path: Path):
    target = tmp_path / "out.jsonl"
    target.write_text("")
    with pytest.raises(PreflightError, match="is a file: pass a directory"):
        check_output(str(target), overwrite=False)


def test_output_holds_a_completed_job(tmp_path: Path):
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(PreflightError, match=r"completed job \(manifest.json\); pass --overwrite"):
        check_output(str(tmp_path), overwrite=False)
    assert check_output(str(tmp_path), overwrite=True) == tmp_path  # --overwrite allows it
    assert (tmp_path / "manifest.json").exists()  # preflight itself removes nothing


@pytest.mark.parametrize("overwrite", [False, True])
def test_output_holds_an_unfinished_job(tmp_path: Path, overwrite: bool):
    (tmp_path / "_staging").mkdir()
    with pytest.raises(PreflightError, match=r"unfinished job \(_staging/\)") as info:
        check_output(str(tmp_path), overwrite=overwrite)
    assert f"nightshift resume {tmp_path}" in str(info.value)  # points at the way to continue
    assert str(tmp_path / "_staging") in str(info.value)  # names what to remove to start over


def test_resume_accepts_an_unfinished_job(tmp_path: Path):
    (tmp_path / "_staging").mkdir()
    assert check_output(str(tmp_path), overwrite=False, resume=True) == tmp_path


def test_output_not_writable(tmp_path: Path):
    # Root ignores permission bits, so make mkdir fail structurally: a path below a regular file.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "out"
    with pytest.raises(PreflightError, match="is not writable .*: choose another OUTPUT") as info:
        check_output(str(target), overwrite=False)
    assert str(target) in str(info.value)
    assert "Not a directory" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)


def test_preflight_error_is_a_value_error():
    assert issubclass(PreflightError, ValueError)


# -- JobConfig ------------------------------------------------------------------------------------------------------


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_config_defaults():
    config = load_job_config(None)
    assert config == JobConfig()
    assert config.engine.vllm.max_num_seqs is None  # not given: fitted to the KV capacity at run time
    assert config.engine.fit.enabled is True


def test_config_loads_yaml(tmp_path: Path):
    path = write_yaml(
        tmp_path,
        "model: /models/m\nengine:\n  backend: fake\n  fake:\n    max_concurrency: 8\n"
        "output_options:\n  rows_per_shard: 10\n",
    )
    config = load_job_config(path)
    assert config.model == "/models/m"
    assert config.engine.backend == "fake"
    assert config.engine.fake.max_concurrency == 8
    assert config.output_options.rows_per_shard == 10


def test_config_empty_file_is_defaults(tmp_path: Path):
    assert load_job_config(write_yaml(tmp_path, "")) == JobConfig()


@pytest.mark.parametrize(
    "text, key",
    [
        ("modle: x\n", "modle"),
        ("engine:\n  vllm:\n    max_num_seq: 4\n", "engine.vllm.max_num_seq"),
        ("output_options:\n  shards: 3\n", "output_options.shards"),
    ],
)
def test_config_unknown_key_names_the_key(tmp_path: Path, text: str, key: str):
    path = write_yaml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_job_config(path)
    message = str(info.value)
    assert key in message
    assert str(path) in message
    assert "Extra inputs are not permitted" in message


@pytest.mark.parametrize(
    "text, where",
    [
        ("engine:\n  vllm:\n    max_num_seqs: 0\n", "engine.vllm.max_num_seqs"),
        ("engine:\n  vllm:\n    gpu_memory_utilization: 1.5\n", "engine.vllm.gpu_memory_utilization"),
        ("engine:\n  backend: tgi\n", "engine.backend"),
        ("output_options:\n  rows_per_shard: 0\n", "output_options.rows_per_shard"),
        ("input: '  '\n", "input"),
    ],
)
def test_config_invalid_value(tmp_path: Path, text: str, where: str):
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        load_job_config(write_yaml(tmp_path, text))


def test_config_file_problems(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_job_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job_config(write_yaml(tmp_path, "engine: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_job_config(write_yaml(tmp_path, "- a\n- b\n"))


def test_config_file_that_cannot_be_read_says_why(tmp_path: Path):
    with pytest.raises(ConfigError, match="is a directory: give the path of a YAML job file"):
        load_job_config(tmp_path)
    binary = tmp_path / "job.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="is not UTF-8 text .*: give a YAML job file"):
        load_job_config(binary)


def test_job_file_and_server_config_are_read_by_one_loader(tmp_path: Path):
    """The server config fails as the job file does, named as what it is."""
    from pipeline.server.settings import load_server_config

    for text, problem in [
        ("engine: [unclosed\n", "is not valid YAML"),
        ("- a\n", "must hold a mapping at the top level"),
    ]:
        path = write_yaml(tmp_path, text)
        with pytest.raises(ConfigError, match=f"^config file {path} {problem}"):
            load_job_config(path)
        with pytest.raises(ConfigError, match=f"^server config {path} {problem}"):
            load_server_config(path, {})
    with pytest.raises(ConfigError, match="^server config .* is a directory: give the path of a YAML server"):
        load_server_config(tmp_path, {})


def test_merge_overrides_flag_wins_over_file(tmp_path: Path):
    config = load_job_config(
        write_yaml(tmp_path, "model: from-file\nengine:\n  vllm:\n    max_num_seqs: 8\n    dtype: float16\n")
    )
    merged = merge_overrides(
        config,
        {
            "model": "from-flag",
            "engine.vllm.max_num_seqs": 32,
            "engine.vllm.dtype": None,  # flag not given: the file's value stays
            "output_options.rows_per_shard": 5,
        },
    )
    assert merged.model == "from-flag"
    assert merged.engine.vllm.max_num_seqs == 32
    assert merged.engine.vllm.dtype == "float16"
    assert merged.output_options.rows_per_shard == 5
    assert config.engine.vllm.max_num_seqs == 8  # the original is not mutated


@pytest.mark.parametrize(
    "overrides, where",
    [
        ({"engine.vllm.max_num_seqs": 0}, "engine.vllm.max_num_seqs"),
        ({"engine.fake.max_concurrency": -1}, "engine.fake.max_concurrency"),
        ({"engine.vllm.max_model_len": 8}, "engine.vllm.max_model_len"),
        ({"engine.vllm.no_such_arg": 1}, "engine.vllm.no_such_arg"),
    ],
)
def test_merge_overrides_invalid(overrides, where):
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        merge_overrides(JobConfig(), overrides)


def test_every_config_field_has_a_description():
    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                walk(annotation, f"{prefix}{name}.")

    walk(JobConfig)


def test_settings_for_a_backend_the_job_does_not_run_are_named():
    from pipeline.config import EngineConfig

    assert EngineConfig().unused_settings() == []
    assert EngineConfig(backend="fake", fake={"output_tokens": 4}).unused_settings() == []
    (unused,) = EngineConfig(fake={"output_tokens": 4}).unused_settings()
    assert "engine.fake" in unused and "--engine fake" in unused


# -- engine placement: CPUs per engine when the job does not say ----------------------------------------------------


@pytest.mark.parametrize(
    "engines, nodes, expected",
    [
        (1, [2.0], 2.0),  # one engine on a CPU box: every core
        (2, [2.0], 1.0),  # two on it: a core each
        (3, [8.0, 8.0, 8.0], 8.0),  # one per node
        (4, [8.0, 8.0, 8.0], 4.0),  # two on some node: half of one each
        (2, [16.0, 4.0], 4.0),  # the smallest node bounds it: more could never be placed there
        (5, [2.0], 1.0),  # never less than one
        (1, [], 1.0),
    ],
)
def test_cpus_per_engine_shares_out_the_nodes_cores(engines, nodes, expected):
    from pipeline.runtime.engines.placement import cpus_per_engine

    assert cpus_per_engine(engines, nodes) == expected


def _spec(backend: str = "vllm"):
    from pipeline.engines.base import EngineSpec

    return EngineSpec(backend, "/nonexistent/model", "m", {"cpu_kvcache_space_gib": 2})


def test_placement_keeps_given_values_and_gives_gpu_and_fake_engines_one_cpu(monkeypatch):
    from pipeline.config import PoolConfig
    from pipeline.runtime.engines import placement

    monkeypatch.setattr(placement, "_nodes", lambda pool: [placement.Node(6.0, 64 * placement.GiB)])
    given = placement.place_pool(PoolConfig(name="a", cpus_per_engine=0.5), _spec())
    assert (given.min_engines, given.cpus_per_engine) == (1, 0.5)
    assert (
        placement.place_pool(PoolConfig(name="g", gpus_per_engine=1), _spec(), False).cpus_per_engine == 1.0
    )
    fake = placement.place_pool(PoolConfig(name="f"), _spec("fake"), False)
    assert (fake.min_engines, fake.cpus_per_engine) == (1, 1.0)
    shared = placement.place_pool(PoolConfig(name="c", min_engines=2), _spec())
    assert (shared.min_engines, shared.cpus_per_engine) == (2, 3.0)  # given count: the cores shared out


def test_cpu_engines_default_to_one_per_core_as_memory_allows(monkeypatch):
    from pipeline.config import PoolConfig
    from pipeline.runtime.engines import placement

    box = [placement.Node(2.0, 16 * placement.GiB)]
    monkeypatch.setattr(placement, "_nodes", lambda pool: box)
    pool = placement.place_pool(PoolConfig(name="default"), _spec(), engines_given=False)
    assert (pool.min_engines, pool.max_engines, pool.cpus_per_engine) == (2, None, 1.0)
    # 4 GiB per engine (2 GiB KV + process): a 64-core node with 20 GiB holds 5 engines, of 12 cores each
    box[:] = [placement.Node(64.0, 20 * placement.GiB)]
    pool = placement.place_pool(PoolConfig(name="default"), _spec(), engines_given=False)
    assert (pool.min_engines, pool.cpus_per_engine) == (5, 12.0)
    small_job = placement.place_pool(PoolConfig(name="default"), _spec(), engines_given=False, chunks=2)
    assert (small_job.min_engines, small_job.cpus_per_engine) == (2, 32.0)  # no engine without a chunk
    box[:] = [placement.Node(8.0, 64 * placement.GiB), placement.Node(4.0, 64 * placement.GiB)]
    assert placement.engines_per_core(box, 4 * placement.GiB) == 12


def test_job_resources_and_pools_share_one_model_of_engine_resources():
    """ResourcesConfig and PoolConfig take the same per-engine Ray resources, declared once; job files keep their
    shape, and a job without pools runs one pool with the job's resources."""
    from pipeline.config import EngineResources, PoolConfig, ResourcesConfig
    from pipeline.job_plan import JobPlan

    shared = set(EngineResources.model_fields)
    assert shared == {"cpus_per_engine", "gpus_per_engine", "resources_per_engine"}
    for model in (ResourcesConfig, PoolConfig):
        assert issubclass(model, EngineResources)
        assert all(
            model.model_fields[n].description == EngineResources.model_fields[n].description for n in shared
        )
    given = {
        "cpus_per_engine": 2.0,
        "gpus_per_engine": 0.5,
        "resources_per_engine": {"accelerator:cuda": 1.0},
    }
    job = JobConfig.model_validate({"resources": {"num_engines": 3, **given}})
    (pool,) = JobPlan.of(job).pool_configs
    assert (pool.name, pool.min_engines) == ("default", 3)
    assert pool.model_dump(include=shared) == given
    with pytest.raises(ValidationError, match="extra_forbidden|Extra inputs"):
        PoolConfig(name="a", num_engines=2)  # the job's count is min_engines in a pool
