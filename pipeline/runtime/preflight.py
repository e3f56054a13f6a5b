"""Checks that run before any engine starts: a bad input or output location fails in a second, not after a
30-second engine start (or an hour of work)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


class PreflightError(ValueError):
    """The job cannot start; the message says what to change."""


def check_input(location: str | None) -> Path:
    if not location:
        raise PreflightError("no INPUT given: pass the path of an OpenAI Batch JSONL file")
    path = Path(location).expanduser()
    if not path.exists():
        raise PreflightError(f"input {location} does not exist: check the path")
    if path.is_dir():
        raise PreflightError(f"input {location} is a directory: pass a JSONL file")
    if not os.access(path, os.R_OK):
        raise PreflightError(f"input {location} is not readable: check its permissions")
    return path


def check_output(location: str | None, overwrite: bool, resume: bool = False) -> Path:
    """OUTPUT must be a directory we can write, not holding another job (unless --overwrite for a finished one,
    or resume=True for an unfinished one)."""
    if not location:
        raise PreflightError("no OUTPUT given: pass a directory for the results")
    path = Path(location).expanduser()
    if path.exists() and not path.is_dir():
        raise PreflightError(f"output {location} is a file: pass a directory (it is created if missing)")
    if (path / "_staging").exists() and not resume:
        raise PreflightError(
            f"output {location} holds an unfinished job (_staging/): continue it with `nightshift resume {location}` "
            f"(or `run ... --resume`), or remove {path / '_staging'} to start over"
        )
    if (path / "manifest.json").exists() and not overwrite:
        raise PreflightError(
            f"output {location} already holds a completed job (manifest.json); pass --overwrite to replace it, "
            "or choose another OUTPUT"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".nightshift-probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise PreflightError(
            f"output {location} is not writable ({exc.strerror}): choose another OUTPUT"
        ) from exc
    return path
