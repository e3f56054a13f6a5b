"""What one image costs in a prompt is asked of vLLM's processor once per model, engine args and vLLM version, and
remembered; a model that takes no media never asks, and a processor that cannot be built leaves its text counted."""

from __future__ import annotations

import json

import pytest

from pipeline.engines import vllm_engine
from pipeline.models import ResolvedModel


@pytest.fixture
def asked(monkeypatch, tmp_path):
    """Stands in for vLLM's processor: records every ask, answers 7 tokens per image."""
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))
    calls: list[dict] = []

    def from_vllm(model_dir, options):
        calls.append(options)
        return {"image": 7}

    monkeypatch.setattr(vllm_engine, "_media_tokens_from_vllm", from_vllm)
    return calls


def _model_dir(tmp_path, config: dict):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_asked_once_per_model_and_args_then_remembered(tmp_path, asked):
    directory = _model_dir(
        tmp_path, {"architectures": ["Idefics3ForConditionalGeneration"], "vision_config": {}}
    )
    assert vllm_engine.media_tokens(str(directory)) == {"image": 7}
    assert vllm_engine.media_tokens(str(directory)) == {"image": 7}
    assert len(asked) == 1
    args = {"extra": {"mm_processor_kwargs": {"max_pixels": 1024}}, "limit_mm_per_prompt": {"image": 2}}
    vllm_engine.media_tokens(str(directory), args)  # args that change what the processor makes: asked again
    assert asked[-1] == {"mm_processor_kwargs": {"max_pixels": 1024}, "limit_mm_per_prompt": {"image": 2}}
    (directory / "preprocessor_config.json").write_text("{}")  # the model's files changed: asked again
    vllm_engine.media_tokens(str(directory))
    assert len(asked) == 3


def test_a_damaged_memo_is_started_again(tmp_path, asked):
    directory = _model_dir(tmp_path, {"vision_config": {}})
    memo = tmp_path / "home" / "cache" / "media-tokens.json"
    memo.parent.mkdir(parents=True)
    for damaged in ("[1, 2]", "{not json", json.dumps({f"{directory}\u0000{{}}": "x"})):
        memo.write_text(damaged)
        assert vllm_engine.media_tokens(str(directory)) == {"image": 7}
    assert len(asked) == 3
    assert isinstance(json.loads(memo.read_text()), dict)


def test_a_text_model_never_asks(tmp_path, asked):
    directory = _model_dir(tmp_path, {"architectures": ["LlamaForCausalLM"]})
    assert vllm_engine.media_tokens(str(directory)) == {}
    assert asked == []


def test_a_processor_that_cannot_be_built_leaves_the_text_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))
    directory = _model_dir(tmp_path, {"vision_config": {}})

    def fails(model_dir, options):
        raise ValueError("The checkpoint has model type `x` but Transformers does not recognize it")

    monkeypatch.setattr(vllm_engine, "_media_tokens_from_vllm", fails)
    model = ResolvedModel(name="m", path=str(directory), revision="r", source="local-dir")
    assert vllm_engine.VllmEngine.media_tokens(model, {}) == {}
