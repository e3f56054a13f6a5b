"""Where a LoRA adapter's files are, and getting them onto the node an engine runs on.

An adapter's PATH (pipeline/adapters.py) is one of:
- a local directory: used where it is (like a model directory, it must be readable on every node that runs an
  engine of its pool: a shared volume on a cluster);
- `s3://BUCKET/PREFIX` (read with the job's storage settings, `storage.s3_endpoint_url` and the like): copied once
  per node into `$NIGHTSHIFT_HOME/adapters/`, under a lock, so the engines of a
  node (and later jobs) share one copy; a copy is complete once its marker is written, so an interrupted copy is
  redone, never used;
- `hf://ORG/NAME[@REVISION]`: a snapshot in the node's local Hugging Face cache (nothing is downloaded).

`read_adapter_config` reads an adapter's adapter_config.json from any of them, for the driver's preflight.
Runs on the driver (preflight) and in engine actors (staging); no Ray, no vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pipeline.adapters import AdapterError
from pipeline.config import StorageConfig
from pipeline.local_files import exclusive_lock, nightshift_home

_MARKER = ".nightshift-staged"
CONFIG_FILE = "adapter_config.json"


def _hf_snapshot(source: str) -> str:
    repo, _, revision = source.removeprefix("hf://").partition("@")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo, revision=revision or None, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the hub's errors vary by version; the cause is "not cached here"
        raise AdapterError(
            f"adapter {source!r} is not in this node's Hugging Face cache ({type(exc).__name__}); download it "
            "there first (huggingface-cli download ORG/NAME), or give a local directory or s3:// path"
        ) from exc


def _s3_fs(storage: StorageConfig | None) -> Any:
    from pipeline.io.locations import s3_filesystem

    return s3_filesystem(storage)


def read_adapter_config(source: str, storage: StorageConfig | None = None) -> dict[str, Any]:
    """The adapter's adapter_config.json, read where it is (the driver's check before any work)."""
    try:
        if source.startswith("s3://"):
            with _s3_fs(storage).open(f"{source.rstrip('/')}/{CONFIG_FILE}", "rb") as fh:
                text = fh.read()
        else:
            directory = _hf_snapshot(source) if source.startswith("hf://") else source
            text = (Path(directory) / CONFIG_FILE).read_bytes()
    except AdapterError:
        raise
    except (OSError, ValueError) as exc:
        raise AdapterError(
            f"adapter {source!r}: cannot read its {CONFIG_FILE} ({type(exc).__name__}: {exc}); a LoRA adapter is "
            "a directory as peft's save_pretrained writes it"
        ) from exc
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise AdapterError(f"adapter {source!r}: its {CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {source!r}: its {CONFIG_FILE} is not a JSON object")
    return config


def local_adapter_dir(source: str, storage: StorageConfig | None = None) -> str:
    """A directory on this node holding the adapter (staged here first if it is remote)."""
    if source.startswith("s3://"):
        return str(_stage_from_s3(source, storage))
    if source.startswith("hf://"):
        return _hf_snapshot(source)
    if not (Path(source) / CONFIG_FILE).is_file():
        raise AdapterError(f"adapter {source!r}: no {CONFIG_FILE} there on this node")
    return source


def _stage_from_s3(source: str, storage: StorageConfig | None) -> Path:
    """Copy s3://... into this node's adapter cache once; later engines (and jobs) of the node reuse it. The copy is
    keyed by the source and its objects' ETags, so an adapter rewritten under the same prefix is staged anew."""
    fs = _s3_fs(storage)
    prefix = source.rstrip("/")
    files = {
        path: info for path, info in fs.find(prefix, detail=True).items() if info.get("type") != "directory"
    }
    if not any(path.endswith(f"/{CONFIG_FILE}") for path in files):
        raise AdapterError(f"adapter {source!r}: no {CONFIG_FILE} under that prefix")
    digest = hashlib.sha256(prefix.encode())
    for path in sorted(files):
        digest.update(f"\n{path}\0{files[path].get('ETag') or files[path].get('size')}".encode())
    target = nightshift_home() / "adapters" / digest.hexdigest()[:16]
    with exclusive_lock(target.with_suffix(".lock")):
        if (target / _MARKER).is_file():
            return target
        shutil.rmtree(target, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            for path in files:
                local = tmp / os.path.relpath(path, prefix.removeprefix("s3://"))
                local.parent.mkdir(parents=True, exist_ok=True)
                fs.get(path, str(local))
            (tmp / _MARKER).write_text(source + "\n")
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def check_adapters(args: dict[str, Any], storage: StorageConfig | None = None) -> None:
    """Each LoRA adapter of these engine args readable where it is, a LoRA adapter, of a rank the engine takes:
    what vLLM would refuse only as an engine starts, refused on the driver before any work."""
    from pipeline.adapters import check_adapter_config

    for name, source in (args.get("lora_modules") or {}).items():
        check_adapter_config(read_adapter_config(source, storage), name, args.get("max_lora_rank"))


def stage_adapters(args: dict[str, Any], storage: StorageConfig | None = None) -> dict[str, str]:
    """The adapters of these engine args as directories on this node (an engine actor, before its engine starts)."""
    return {
        name: local_adapter_dir(source, storage) for name, source in (args.get("lora_modules") or {}).items()
    }
