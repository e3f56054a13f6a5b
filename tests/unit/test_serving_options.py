"""Serving options with vLLM's names, the tasks models are run for, and what a job with one model per pool needs
from its pieces (pool specs, per-model work lists, per-model totals) — all without an engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import ConfigError, JobConfig, PoolConfig, VllmEngineArgs, merge_overrides
from pipeline.engines.base import EngineSpec
from pipeline.fit_record import FitDecision
from pipeline.io.staging import StagingArea
from pipeline.max_tokens import generation_max_tokens
from pipeline.models import ResolvedModel, model_task, served_name
from pipeline.runtime.engines.launch import models_summary, pool_spec
from pipeline.tokens import load_chat_template
from tests.lines import chat_line, write_lines


def test_serving_options_keep_vllms_names_and_defaults():
    args = VllmEngineArgs()
    assert (args.chat_template, args.tool_call_parser, args.reasoning_parser) == (None, None, None)
    assert (args.enable_auto_tool_choice, args.response_role, args.generation_config) == (
        False,
        "assistant",
        "auto",
    )
    assert args.override_generation_config == {} and args.runner == "auto"
    with pytest.raises(ValueError, match="tool_call_parser"):
        VllmEngineArgs(enable_auto_tool_choice=True)


def test_flags_reach_the_config_and_a_bad_one_names_itself(tmp_path):
    from pipeline.config_flags import flag_labels

    FLAG_FOR_KEY = flag_labels(JobConfig)  # noqa: N806 - the labels the CLI names errors by
    job = merge_overrides(
        JobConfig(),
        {"engine.vllm.tool_call_parser": "hermes", "engine.vllm.enable_auto_tool_choice": True},
        FLAG_FOR_KEY,
    )
    assert job.engine.vllm.tool_call_parser == "hermes"
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice|tool_call_parser"):
        merge_overrides(JobConfig(), {"engine.vllm.enable_auto_tool_choice": True}, FLAG_FOR_KEY)
    batch = write_lines(tmp_path / "in.jsonl", [chat_line("a", "hi")])
    result = CliRunner().invoke(
        app, ["run", str(batch), str(tmp_path / "out"), "--override-generation-config", "{not json"]
    )
    assert result.exit_code == 2 and "--override-generation-config" in result.output


def test_chat_template_is_found_as_vllm_finds_it(tmp_path):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_generation_config_decides_the_default_output_limit(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 300}))
    other = tmp_path / "g"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 40}))
    assert generation_max_tokens(model) == 300
    assert generation_max_tokens(model, "vllm") is None
    assert generation_max_tokens(model, str(other)) == 40
    assert generation_max_tokens(model, "auto", {"max_new_tokens": 7}) == 7


def _model_dir(tmp_path: Path, name: str, architectures: list[str], modules: bool = False) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": architectures}))
    if modules:
        pooling = [{"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        (directory / "modules.json").write_text(json.dumps(pooling))
    return directory


def test_model_task_follows_vllms_rules(tmp_path):
    assert model_task(_model_dir(tmp_path, "a", ["LlamaForCausalLM"])) == "generate"
    assert model_task(_model_dir(tmp_path, "b", ["BertModel"])) == "embed"
    assert model_task(_model_dir(tmp_path, "c", ["XLMRobertaForSequenceClassification"])) == "classify"
    # A Sentence Transformers model pools, whatever its architecture says.
    assert model_task(_model_dir(tmp_path, "d", ["Qwen3ForCausalLM"], modules=True)) == "embed"
    assert model_task(_model_dir(tmp_path, "e", ["LlamaForCausalLM"]), runner="pooling") == "embed"
    assert model_task(tmp_path / "nothing") is None
    assert (
        served_name("embedded:minilm") == "all-minilm-l6-v2" and served_name(None) == "smollm2-135m-instruct"
    )


def _resolved(name: str, path: str, task: str) -> ResolvedModel:
    return ResolvedModel(name=name, path=path, revision=None, source="local-dir", task=task)


def test_a_pool_of_another_model_drops_the_job_models_fitted_args():
    spec = EngineSpec("vllm", "/chat", "chat", {"max_model_len": 512, "max_num_seqs": 40, "dtype": "auto"})
    fit = FitDecision(
        enabled=True,
        counted_by="words",
        max_model_len={"source": "fitted", "value": 512, "model_limit": 8192, "block_size": 16},
        max_num_seqs={
            "chat": {"source": "fitted", "value": 40, "why": ""},
            "embed": {"source": "fitted", "value": 40, "why": ""},
        },
    )
    chat = PoolConfig(name="chat")
    assert pool_spec(spec, _resolved("chat", "/chat", "generate"), fit, chat) is spec
    embed = pool_spec(spec, _resolved("minilm", "/minilm", "embed"), fit, PoolConfig(name="embed"))
    assert (embed.model_path, embed.served_model_name) == ("/minilm", "minilm")
    assert (
        embed.args["max_model_len"] is None
        and embed.args["max_num_seqs"] == 64
        and embed.args["dtype"] == "auto"
    )
    given = PoolConfig(name="embed", engine_overrides={"max_model_len": 128, "max_num_seqs": 16})
    kept = pool_spec(spec, _resolved("minilm", "/minilm", "embed"), fit, given)
    assert kept.args["max_model_len"] == 512 and kept.args["max_num_seqs"] == 16  # overrides apply over these


def test_models_summary_adds_up_pools_per_model():
    models = {"a": _resolved("chat", "/c", "generate"), "b": _resolved("chat", "/c", "generate")}
    models["e"] = _resolved("emb", "/e", "embed")
    pools = {
        "a": {"rows": 2, "prompt_tokens": 10, "completion_tokens": 4},
        "e": {"rows": 3, "prompt_tokens": 9},
    }
    summary = models_summary(models, pools)
    assert summary["chat"] == {
        "path": "/c",
        "task": "generate",
        "pools": ["a", "b"],
        "rows": 2,
        "prompt_tokens": 10,
        "completion_tokens": 4,
    }
    assert summary["emb"]["rows"] == 3 and summary["emb"]["completion_tokens"] == 0


def test_requests_are_split_by_model(tmp_path):
    staging = StagingArea(tmp_path)
    staging.create()
    rows = [
        {"custom_id": f"r{i}", "url": "/v1/embeddings", "body": "{}", "line": i, "source": "f", "model": m}
        for i, m in enumerate(["chat", "emb", "emb", "chat", "emb"])
    ]
    staging.write_requests(rows)
    files = staging.request_files()
    emb = staging.requests_for_model(files, ["emb"])
    assert staging.num_rows(emb) == 3 and staging.num_rows(staging.requests_for_model(files, ["chat"])) == 2
    assert staging.requests_for_model(files, ["other"]) == []


def test_structured_outputs_backend_is_vllms_and_reaches_its_namespace():
    from pipeline.config_flags import flag_labels

    assert VllmEngineArgs().structured_outputs_backend == "auto"
    job = merge_overrides(
        JobConfig(), {"engine.vllm.structured_outputs_backend": "xgrammar"}, flag_labels(JobConfig)
    )
    assert job.engine.vllm.structured_outputs_backend == "xgrammar"
    with pytest.raises(ConfigError, match="--structured-outputs-backend"):
        merge_overrides(
            JobConfig(), {"engine.vllm.structured_outputs_backend": "regexp"}, flag_labels(JobConfig)
        )

    pytest.importorskip("vllm")
    from pipeline.engines.vllm_engine import build_vllm_namespace

    args = {**job.engine.vllm.model_dump(), "cpu_kvcache_space_gib": None}
    spec = EngineSpec(backend="vllm", model_path="m", served_model_name="m", args=args)
    ns = build_vllm_namespace(spec)
    # Where vLLM's --structured-outputs-config.backend puts it; not an attribute of its own.
    assert ns.structured_outputs_config.backend == "xgrammar"
    assert not hasattr(ns, "structured_outputs_backend")


def test_speech_to_text_only_models_run_the_transcription_task(tmp_path):
    assert model_task(_model_dir(tmp_path, "w", ["WhisperForConditionalGeneration"])) == "transcription"
    # A model that also transcribes but generates text as well stays a generating one.
    assert model_task(_model_dir(tmp_path, "v", ["VoxtralForConditionalGeneration"])) == "generate"


def test_the_transcription_only_list_is_the_installed_vllms():
    """Every architecture whose vLLM class sets `supports_transcription_only`, read from vLLM's registry and its
    model modules' source (importing each model would take minutes)."""
    pytest.importorskip("vllm")
    import re
    from pathlib import Path

    from vllm.model_executor.models import registry

    from pipeline.models import TRANSCRIPTION_ONLY

    source = Path(registry.__file__).parent
    only = set()
    for arch, (module, cls) in registry._VLLM_MODELS.items():
        path = source / f"{module.rsplit('.', 1)[-1]}.py"
        text = path.read_text() if path.exists() else ""
        body = re.search(rf"^class {cls}\b.*?(?=^class |\Z)", text, re.S | re.M)
        if body and "supports_transcription_only = True" in body.group(0):
            only.add(arch)
    assert only == TRANSCRIPTION_ONLY
