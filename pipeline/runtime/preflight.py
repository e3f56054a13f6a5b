"""Checks that run before any engine starts: a bad input or output location fails in seconds, with a message that
says what to change — not after a 30-second engine start (or an hour of work).

Input: the location resolves to at least one readable file (local path, directory, glob; S3 bucket and key or
prefix, with working credentials; an HTTP URL that answers), and Parquet inputs have the request columns.
Output: local — a directory we can write; S3 — the bucket exists and takes a probe object (put + delete);
HTTP — the server answers (writability cannot be known before the first PUT). In every case OUTPUT must not hold a
completed job (manifest.json) unless --overwrite, nor an unfinished one (its staging). Transient errors (connection
refused, timeouts, 5xx, throttling) are retried with backoff first; each retry is logged.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import StorageConfig
from pipeline.io.locations import LocationError, parse_location
from pipeline.io.readers import InputSource, check_parquet_schemas, input_source
from pipeline.io.rows import TableRead
from pipeline.io.writers import MANIFEST_NAME, HttpTarget, OutputTarget, S3Target, output_target


class PreflightError(ValueError):
    """The job cannot start; the message says what to change."""


def check_input_source(
    location: str | None, storage: StorageConfig | None = None, table: TableRead | None = None
) -> InputSource:
    """The input, resolved to its files and checked to be readable (as request lines, or as a dataset job's
    table: `table`)."""
    if not location:
        raise PreflightError(
            "no INPUT given: pass an OpenAI Batch JSONL or Parquet file, a directory or glob of shards, "
            "s3://bucket/prefix or an http(s):// URL"
        )
    try:
        source = input_source(location, storage)
        source.table = table
        check_parquet_schemas(source)
    except LocationError as exc:
        raise PreflightError(str(exc)) from exc
    return source


def check_input(
    location: str | None, storage: StorageConfig | None = None, table: TableRead | None = None
) -> Path:
    """A local input (file, or directory of shards), as a Path. Remote inputs: use check_input_source."""
    if not location:
        raise PreflightError("no INPUT given: pass the path of an OpenAI Batch JSONL file")
    try:
        loc = parse_location(location)
    except LocationError as exc:
        raise PreflightError(str(exc)) from exc
    if loc.kind != "local" or loc.has_glob():
        raise PreflightError(f"input {location}: a local file or directory is expected here")
    check_input_source(location, storage, table)
    return Path(loc.path)


def _check_no_job(target: OutputTarget, location: str, overwrite: bool, resume: bool) -> None:
    staging = target.staging_area()
    if not resume and staging.exists():
        where = "" if target.stages_in_output else f" (staged locally in {staging.describe()})"
        raise PreflightError(
            f"output {location} holds an unfinished job (_staging/){where}: continue it with "
            f"`nightshift resume {location}` (or `run ... --resume`), or remove {staging.describe()} to start over"
        )
    if not overwrite and target.exists(MANIFEST_NAME):
        raise PreflightError(
            f"output {location} already holds a completed job (manifest.json); pass --overwrite to replace it, "
            "or choose another OUTPUT"
        )


def check_output_target(
    location: str | None, overwrite: bool, storage: StorageConfig | None = None, resume: bool = False
) -> OutputTarget:
    """OUTPUT must be a place we can write, not holding another job (unless --overwrite for a finished one, or
    resume=True for an unfinished one)."""
    if not location:
        raise PreflightError(
            "no OUTPUT given: pass a directory for the results, s3://bucket/prefix or an http(s):// URL"
        )
    try:
        target = output_target(location, storage)
        if target.is_local:
            path = Path(target.location.path)
            if path.exists() and not path.is_dir():
                raise PreflightError(
                    f"output {location} is a file: pass a directory (it is created if missing)"
                )
            _check_no_job(target, location, overwrite, resume)
            target.check_writable()
        elif isinstance(target, S3Target):
            target.check_bucket()
            _check_no_job(target, location, overwrite, resume)
            target.check_writable()
        elif isinstance(target, HttpTarget):
            target.check_reachable()
            _check_no_job(target, location, overwrite, resume)
            target.check_writable()
    except LocationError as exc:
        raise PreflightError(str(exc)) from (exc.__cause__ or exc)
    except PreflightError:
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. S3 HEAD of manifest.json denied: still a location problem
        raise PreflightError(output_problem(exc, location, storage, "write output to")) from exc
    return target


def output_problem(exc: BaseException, location: str, storage: StorageConfig | None, action: str) -> str:
    """What went wrong reaching OUTPUT, and what to change."""
    from pipeline.io.locations import http_problem, s3_problem

    kind = parse_location(location).kind
    if kind == "s3":
        return s3_problem(exc, location, storage, action)
    if kind == "http":
        return http_problem(exc, location, action)
    return f"output {location}: {exc}"
