"""The job resolved once (pipeline/job_plan.py): its pools, served names, adapters, topology and engine spec, from the
config alone (the pure plan) or with its models; the one place a job's pools are derived; flags named after vLLM's
that another backend takes applied to it, or refused by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import ConfigError, JobConfig
from pipeline.job_plan import JobPlan, JobPlanError
from pipeline.models import ResolvedModel
from pipeline.topology import Topology

ROOT = Path(__file__).resolve().parents[2]


def model(name: str, task: str | None = "generate") -> ResolvedModel:
    return ResolvedModel(name=name, path=f"/m/{name}", revision="r", source="local-dir", task=task)


TWO_POOLS_WITH_ADAPTERS = {
    "model": "/models/base",
    "engine": {"vllm": {"lora_modules": {"sql": "/adapters/sql"}}},
    "pools": [
        {"name": "chat", "min_engines": 2},
        {
            "name": "embed",
            "model": "/models/emb",
            "served_model_name": "emb",
            "engine_overrides": {"lora_modules": {}},
        },
    ],
}


def test_the_pure_plan_names_every_pool_model_and_adapter_without_loading_anything():
    plan = JobPlan.of(JobConfig.model_validate(TWO_POOLS_WITH_ADAPTERS))
    assert [(p.name, p.served_name, p.adapters) for p in plan.pools] == [
        ("chat", "/models/base", {"sql": "/adapters/sql"}),
        ("embed", "emb", {}),
    ]
    assert not plan.resolved
    assert plan.validation_map() == {"/models/base": None, "emb": None, "sql": None}
    assert plan.served.names_of("/models/base") == ["/models/base", "sql"]


def test_a_resolved_plan_carries_each_pools_model_and_task_and_refit_keeps_them():
    config = JobConfig.model_validate(TWO_POOLS_WITH_ADAPTERS)
    plan = JobPlan.of(config, {"chat": model("/models/base"), "embed": model("emb", "embed")})
    assert plan.resolved and plan.model.name == "/models/base"
    assert plan.validation_map() == {"/models/base": "generate", "emb": "embed", "sql": "generate"}
    fitted = plan.refit(config.model_copy(update={"overwrite": True}))
    assert fitted.pool_models == plan.pool_models and fitted.config.overwrite


def test_without_pools_the_job_runs_one_default_pool_of_its_resources():
    plan = JobPlan.of(JobConfig.model_validate({"resources": {"num_engines": 3, "cpus_per_engine": 2}}))
    (pool,) = plan.pools
    assert (pool.name, pool.config.min_engines, pool.config.cpus_per_engine) == ("default", 3, 2)
    assert pool.served_name == "smollm2-135m-instruct"  # the embedded default model's name


def test_pools_that_cannot_be_are_refused_before_any_work():
    with pytest.raises(ConfigError, match="unique"):
        JobPlan.of(JobConfig.model_validate({"pools": [{"name": "a"}, {"name": "a"}]}))
    bad = {"pools": [{"name": "a", "engine_overrides": {"max_num_seq": 4}}]}
    with pytest.raises(ConfigError, match=r"pools\[a\].engine_overrides"):
        JobPlan.of(JobConfig.model_validate(bad))


def test_adapters_that_clash_or_sit_on_a_pooling_model_are_refused():
    clash = {
        "pools": [
            {"name": "a", "model": "/m/a", "engine_overrides": {"lora_modules": {"x": "/one"}}},
            {"name": "b", "model": "/m/b", "engine_overrides": {"lora_modules": {"x": "/two"}}},
        ]
    }
    with pytest.raises(JobPlanError, match="one name must mean one adapter"):
        JobPlan.of(JobConfig.model_validate(clash))
    on_embedder = JobConfig.model_validate({"engine": {"vllm": {"lora_modules": {"x": "/x"}}}})
    with pytest.raises(JobPlanError, match="generating models only"):
        JobPlan.of(on_embedder, {"default": model("emb", "embed")})


def test_an_http_job_is_a_pool_per_server_and_names_its_model_only_when_given():
    servers = {"backend": "http", "http": {"endpoints": ["http://a:1", "http://b:2/v1"]}}
    plan = JobPlan.of(JobConfig.model_validate({"engine": servers}))
    assert [p.name for p in plan.pools] == ["endpoint-0", "endpoint-1"]
    assert plan.served is None
    with pytest.raises(JobPlanError, match="give --model"):
        plan.validation_map()
    named = JobPlan.of(JobConfig.model_validate({"engine": servers, "model": "llama"}))
    assert named.validation_map() == {"llama": None}


def test_a_topology_flag_is_the_fake_engines_too_and_the_manifest_args_say_so():
    config = JobConfig.model_validate({"engine": {"backend": "fake", "vllm": {"pipeline_parallel_size": 2}}})
    plan = JobPlan.of(config)
    assert plan.pools[0].topology == Topology(tensor_parallel_size=1, pipeline_parallel_size=2)
    assert plan.engine_spec(None).args["pipeline_parallel_size"] == 2
    # --lora-modules, vLLM's flag, is the fake engine's adapters too.
    with_adapters = JobConfig.model_validate(
        {"engine": {"backend": "fake", "vllm": {"lora_modules": {"a": "/a"}}}}
    )
    assert JobPlan.of(with_adapters).pools[0].adapters == {"a": "/a"}


def test_a_flag_the_backend_does_not_read_is_refused_by_name():
    http = {"backend": "http", "http": {"endpoints": ["http://a:1"]}, "vllm": {"tensor_parallel_size": 2}}
    with pytest.raises(ValidationError, match=r"--tensor-parallel-size .* not read by the http backend"):
        JobConfig.model_validate({"engine": http})
    both = {"backend": "fake", "vllm": {"pipeline_parallel_size": 2}, "fake": {"pipeline_parallel_size": 3}}
    with pytest.raises(ValidationError, match="give one of them"):
        JobConfig.model_validate({"engine": both})


def test_the_command_line_refuses_a_flag_its_backend_does_not_read(tmp_path):
    (tmp_path / "in.jsonl").write_text("{}\n")
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(tmp_path / "in.jsonl"),
            str(tmp_path / "out"),
            "--engine",
            "http",
            "--endpoint",
            "http://127.0.0.1:9",
            "--pipeline-parallel-size",
            "2",
        ],
    )
    assert result.exit_code == 2 and "--pipeline-parallel-size" in result.output
    assert not (tmp_path / "out").exists()  # refused before any work


def test_the_pools_are_derived_in_one_place():
    """Nothing but pipeline/job_plan.py works a job's pools out from its config; everything else reads the plan."""
    derivers = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            name = (
                node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else None
            )
            if name in ("_derive_pools", "effective_pools", "_endpoint_pools"):
                derivers.append(str(path.relative_to(ROOT)))
    assert set(derivers) == {"pipeline/job_plan.py"}, derivers


def test_an_http_pool_takes_the_jobs_model_name_not_its_own():
    servers = {"backend": "http", "http": {"endpoints": ["http://a:1"]}}
    config = {
        "engine": servers,
        "pools": [{"name": "p", "model": "y", "engine_overrides": {"endpoints": ["http://a:1"]}}],
    }
    with pytest.raises(ConfigError, match=r"pools\[p\].*--model"):
        JobPlan.of(JobConfig.model_validate(config))


def test_a_shared_flag_given_twice_differently_is_refused_even_where_one_is_the_default():
    both = {"backend": "fake", "vllm": {"max_loras": 3}, "fake": {"max_loras": 1}}
    with pytest.raises(ValidationError, match="give one of them"):
        JobConfig.model_validate({"engine": both})
    same = JobConfig.model_validate(
        {"engine": {"backend": "fake", "vllm": {"max_loras": 3}, "fake": {"max_loras": 3}}}
    )
    assert same.engine.args().max_loras == 3


def test_each_pool_runs_its_own_fitted_max_num_seqs_over_its_placement():
    """Fitting writes a named pool's max_num_seqs into its engine_overrides; the engines of that pool start with it,
    on the CPUs placed at launch."""
    from pipeline.fit_record import FitDecision
    from pipeline.runtime.engines.launch import feed_spec, settled_pool
    from pipeline.runtime.ingest.fit import apply_fit

    config = JobConfig.model_validate({"pools": [{"name": "a"}, {"name": "b"}]})
    planned = JobPlan.of(config, {"a": model("m"), "b": model("m")})
    record = FitDecision.model_validate(
        {
            "enabled": True,
            "counted_by": "words",
            "max_model_len": {"value": 512, "source": "fitted", "model_limit": 8192, "block_size": 16},
            "max_num_seqs": {
                "a": {"value": 7, "source": "fitted", "why": ""},
                "b": {"value": 9, "source": "fitted", "why": ""},
            },
        }
    )
    settled = apply_fit(planned, record)
    placed = [pool.model_copy(update={"cpus_per_engine": 2.0}) for pool in planned.pool_configs]
    pools = [settled_pool(pool, settled) for pool in placed]
    started = [feed_spec(settled.engine_spec(), pool) for pool in pools]
    assert [(s.args["max_num_seqs"], s.cpus) for s in started] == [(7, 2.0), (9, 2.0)]


def test_a_dataset_job_is_resolved_once_in_its_plan_and_request_lines_have_no_table():
    lines = JobPlan.of(JobConfig(input="in.jsonl", output="out"))
    assert (lines.table_read, lines.dataset_spec, lines.table_output, lines.dataset_summary) == (None,) * 4
    assert lines.output_format(lambda: {"parquet"}) == "jsonl"  # request lines come back as lines

    config = JobConfig.model_validate(
        {
            "input": "t.parquet",
            "output": "out",
            "dataset": {
                "template": "{{ title }}: {{ text }}",
                "system": "Answer in {{ lang }}.",
                "id_column": "id",
                "keep_columns": ["id", "stars"],
            },
        }
    )
    plan = JobPlan.of(config)
    assert plan.table_read.rendered == ("id", "lang", "text", "title")
    assert plan.table_read.columns == ("id", "lang", "stars", "text", "title")
    assert plan.dataset_spec is config.dataset
    assert plan.table_output.answer_names() == plan.dataset.output.answer_names()
    assert plan.output_format(lambda: {"parquet"}) == "parquet"
    assert plan.output_format(lambda: {"parquet", "jsonl"}) == "jsonl"
    assert JobPlan.of(config.model_copy(update={"output_options": config.output_options.model_copy(
        update={"format": "jsonl"})})).output_format(lambda: {"parquet"}) == "jsonl"  # fmt: skip
    summary = plan.dataset_summary
    assert summary.templates == {"template": "{{ title }}: {{ text }}", "system": "Answer in {{ lang }}."}
    assert (summary.route, summary.id_column) == ("chat", "id")
    assert summary.answer_columns == plan.table_output.answer_names()


def test_below_the_command_line_nothing_reads_the_dataset_section_but_the_plan():
    """The table is read, rendered and written as the plan says: the steps take its renderer, its spec and its
    TableOutput, never a config's `dataset` again. Building a config (the Python call, the server's settings) is
    above the plan."""
    readers = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        if path.name in ("job_plan.py", "config.py", "api.py", "settings.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "dataset":
                owner = node.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
                if name in ("config", "job", "fitted_config", "job_config"):
                    readers.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert readers == [], "\n".join(readers)
