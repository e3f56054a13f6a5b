"""Output targets (a local directory, `s3://bucket/prefix`, an `http(s)://` URL) and the Parquet shard encoder.

    target = output_target("s3://bucket/run-1/", storage)
    area = target.staging_area()          # the checkpoint: OUTPUT/_staging/ (see below for http(s)://)
    with target.open_write("results-00000-of-00001.jsonl") as fh: ...   # published when closed
    target.put_bytes("manifest.json", data)                            # last: the commit marker

Where the checkpoint lives is the target's choice. A local OUTPUT stages in `OUTPUT/_staging/`, an s3:// OUTPUT in
`s3://…/OUTPUT/_staging/` (whole-object PUTs), so `nightshift resume` works from any machine. An http(s):// OUTPUT
cannot be listed, so its staging stays on the driver's disk, under `$NIGHTSHIFT_HOME/jobs/<sha256(url)[:16]>/`, and
such a job can only be resumed on the machine that started it. That per-job local directory is also every remote
target's scratch: upload spools, the final sort's spill files and the S3 read cache — never needed to resume.
Remote shards are spooled to local disk and sent as whole objects — one PUT per shard (s3fs switches to a multipart
upload, which is equally atomic, above ~100 MB), or one HTTP PUT per file to `OUTPUT_URL/<name>` — each retried
with backoff; `manifest.json` goes last.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
import structlog

from pipeline import json_codec
from pipeline.config import StorageConfig
from pipeline.io.encoders import WRITE_BATCH_ROWS, HashingSink
from pipeline.io.locations import (
    HttpStatusError,
    Location,
    LocationError,
    RetryPolicy,
    http_open,
    http_problem,
    is_transient,
    join_url,
    parse_location,
    redact_url,
    s3_filesystem,
    s3_problem,
    with_retries,
)
from pipeline.io.staging import ObjectStoreFiles, StagingArea
from pipeline.local_files import atomic_write_bytes

log = structlog.get_logger(__name__)

MANIFEST_NAME = "manifest.json"
OUTPUT_PATTERNS = ("results-*-of-*.*", "errors-*-of-*.*")


def _is_output_name(name: str) -> bool:
    return name.startswith(("results-", "errors-")) and "-of-" in name


# -- Parquet output --------------------------------------------------------------------------------------------------

PARQUET_OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("custom_id", pa.string()),
        pa.field("status_code", pa.int32()),
        # JSON: {status_code, request_id, body}, null for a line-level error
        pa.field("response", pa.string()),
        pa.field("error", pa.string()),  # JSON: {code, message, line, source}, or null
        # The flattened columns: each route's registry entry fills its own (Endpoint.flatten), the others are null.
        pa.field(
            "route", pa.string()
        ),  # the route that answered: chat, completions, responses, embeddings, ...
        # chat: choices[0].message.content; completions: choices[0].text; responses: the output text
        pa.field("content", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("completion_tokens", pa.int64()),
        # embeddings: one vector per input, in input order (encoding_format float; base64 stays in `response`)
        pa.field("embeddings", pa.list_(pa.list_(pa.float32()))),
        # score: one score per pair, in pair order; rerank: relevance scores, best first (as `ranking`)
        pa.field("scores", pa.list_(pa.float64())),
        pa.field("ranking", pa.list_(pa.int32())),  # rerank: document indexes, best first
        # Per request, measured in the engine actor (null for lines no engine ran): seconds from its chunk's lease
        # until it entered the engine, and seconds inside the engine.
        pa.field("queue_wait_s", pa.float64()),
        pa.field("engine_s", pa.float64()),
    ]
)

_FLATTENED = ("content", "finish_reason", "embeddings", "scores", "ranking")


def _dumps(value: Any, finite: bool) -> str | None:
    return None if value is None else json_codec.redumps(value, finite)


def flatten_records(records: list[str], latency: dict[str, list] | None = None) -> pa.Table:
    """Output lines (JSON strings) → the Parquet output columns."""
    from pipeline.endpoints import endpoint_answering

    cols: dict[str, list] = {name: [] for name in PARQUET_OUTPUT_SCHEMA.names}
    for line in records:
        record, fast = json_codec.loads_finite(line)
        response = record.get("response")
        body = (response or {}).get("body")
        endpoint = endpoint_answering(body)
        flat = endpoint.flatten(body) if endpoint is not None else {}
        counted = endpoint is not None and isinstance(body.get("usage"), dict)
        tokens = endpoint.usage(body) if counted else (None, None)
        cols["id"].append(record.get("id"))
        cols["custom_id"].append(record.get("custom_id"))
        cols["status_code"].append((response or {}).get("status_code"))
        cols["response"].append(_dumps(response, fast))
        cols["error"].append(_dumps(record.get("error"), fast))
        cols["route"].append(endpoint.name if endpoint is not None else None)
        cols["prompt_tokens"].append(tokens[0])
        cols["completion_tokens"].append(tokens[1])
        for name in _FLATTENED:
            value = flat.get(name)
            if name == "content" and value is not None and not isinstance(value, str):
                value = _dumps(value, fast)
            cols[name].append(value)
    for name in ("queue_wait_s", "engine_s"):
        cols[name] = (latency or {}).get(name) or [None] * len(records)
    return pa.table(cols, schema=PARQUET_OUTPUT_SCHEMA)


class ParquetEncoder:
    """Parquet shards: written in row groups of WRITE_BATCH_ROWS, so memory stays one batch per shard."""

    extension = "parquet"

    def __init__(self, sink: HashingSink) -> None:
        self._sink = sink
        self._writer = pq.ParquetWriter(sink, PARQUET_OUTPUT_SCHEMA, compression="zstd")

    def write_table(self, table: pa.Table) -> None:
        for start in range(0, table.num_rows, WRITE_BATCH_ROWS):
            rows = table.slice(start, WRITE_BATCH_ROWS)
            latency = {
                name: rows.column(name).to_pylist()
                for name in ("queue_wait_s", "engine_s")
                if name in rows.column_names
            }
            self._writer.write_table(flatten_records(rows.column("record").to_pylist(), latency))

    def close(self) -> None:
        self._writer.close()
        self._sink.close()


def shard_encoder(fmt: str) -> tuple[Callable[[HashingSink], Any], str]:
    from pipeline.io.encoders import JsonlEncoder

    if fmt == "parquet":
        return ParquetEncoder, "parquet"
    if fmt == "jsonl":
        return JsonlEncoder, "jsonl"
    raise ValueError(f"unknown output format {fmt!r}: use jsonl or parquet")


# -- targets ---------------------------------------------------------------------------------------------------------


def local_job_dir(url: str) -> Path:
    """A remote output's directory on this machine's disk: scratch (and, for http(s)://, the staging)."""
    from pipeline.local_files import nightshift_home

    key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return nightshift_home() / "jobs" / key


class _SpoolUpload(io.RawIOBase):
    """A local spool file that is uploaded (with retries) when closed, then deleted."""

    def __init__(self, path: Path, publish: Callable[[Path], None]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._fh = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._publish = publish

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        return self._fh.write(data)

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._fh.close()
            self._publish(self._path)
        finally:
            self._path.unlink(missing_ok=True)
            super().close()


class _SyncedFile(io.BufferedWriter):
    """A local shard: its bytes are on the disk once it is closed, before the manifest that vouches for it is
    written — so after a power cut a committed output's shards are whole."""

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
            os.fsync(self.fileno())
        finally:
            super().close()


class OutputTarget(ABC):
    """Where a job's shards and manifest go. Names are plain file names inside the target."""

    def __init__(self, location: Location, storage: StorageConfig | None = None) -> None:
        self.location = location
        self.storage = storage or StorageConfig()
        self.policy = RetryPolicy.from_config(self.storage)

    kind: str = ""

    @property
    def is_local(self) -> bool:
        return self.kind == "local"

    @property
    def where(self) -> Path | str:
        """What to show the user: the local directory, or the (redacted) URL."""
        return Path(self.location.path) if self.is_local else self.describe()

    # Whether `_staging/` lives in OUTPUT itself (so any machine that reaches OUTPUT can resume the job).
    stages_in_output: bool = True

    @property
    @abstractmethod
    def scratch_dir(self) -> Path:
        """Local disk for temporary files of this output (upload spools); never needed to resume."""

    @abstractmethod
    def staging_area(self) -> StagingArea:
        """The job's checkpoint (`_staging/`)."""

    @abstractmethod
    def describe(self) -> str: ...

    def __str__(self) -> str:
        return self.describe()

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def put_file(self, local_path: Path, name: str) -> None: ...

    @abstractmethod
    def put_bytes(self, name: str, data: bytes) -> None: ...

    def read_bytes(self, name: str) -> bytes:
        """A file of a committed output (`nightshift status` reads the manifest)."""
        raise NotImplementedError(f"{self.describe()}: reading back is not supported for this kind of output")

    def open_write(self, name: str) -> BinaryIO:
        spool = self.scratch_dir / "upload" / name
        return _SpoolUpload(spool, lambda path: self.put_file(path, name))  # type: ignore[return-value]

    @abstractmethod
    def remove_previous_outputs(self) -> None:
        """Before new shards are written: the old manifest first (it would vouch for a mix), then old shards."""

    @abstractmethod
    def check_writable(self) -> None:
        """Raise LocationError when the target cannot take writes (where that can be known in advance)."""

    def discard_scratch(self) -> None:
        """After the commit: drop this output's local scratch (a local OUTPUT has none outside `_staging/`)."""
        if not self.is_local:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)


class LocalTarget(OutputTarget):
    kind = "local"

    @property
    def path(self) -> Path:
        return Path(self.location.path)

    @property
    def scratch_dir(self) -> Path:
        return self.path / "_staging"

    def staging_area(self) -> StagingArea:
        return StagingArea(self.path)

    def describe(self) -> str:
        return str(self.path)

    def exists(self, name: str) -> bool:
        return (self.path / name).exists()

    def open_write(self, name: str) -> BinaryIO:
        return _SyncedFile(io.FileIO(self.path / name, "wb"))

    def put_file(self, local_path: Path, name: str) -> None:
        shutil.copyfile(local_path, self.path / name)

    def put_bytes(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self.path / name, data)

    def read_bytes(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def remove_previous_outputs(self) -> None:
        (self.path / MANIFEST_NAME).unlink(missing_ok=True)
        for pattern in OUTPUT_PATTERNS:
            for stale in self.path.glob(pattern):
                stale.unlink()

    def check_writable(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".nightshift-probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise LocationError(
                f"output {self.location.raw} is not writable ({exc.strerror}): choose another OUTPUT"
            ) from exc


class S3Target(OutputTarget):
    kind = "s3"

    def __init__(self, location: Location, storage: StorageConfig | None = None) -> None:
        super().__init__(location, storage)
        self.fs = s3_filesystem(self.storage)
        self.prefix = location.path.rstrip("/")

    @property
    def scratch_dir(self) -> Path:
        return local_job_dir(self.describe())

    def staging_area(self) -> StagingArea:
        """`s3://…/OUTPUT/_staging/`: parts are whole-object PUTs, read back through a local cache in scratch."""
        files = ObjectStoreFiles(self.storage, self.scratch_dir / "cache", fs=self.fs)
        return StagingArea(self.prefix, files, scratch=self.scratch_dir)

    def describe(self) -> str:
        return f"s3://{self.prefix}"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        return with_retries(fn, f"{what} {self.describe()}", self.policy)

    def exists(self, name: str) -> bool:
        def probe() -> bool:
            try:
                self.fs.info(self._key(name))
                return True
            except FileNotFoundError as exc:
                from pipeline.io.locations import s3_error_code

                if s3_error_code(exc)[0] == "NoSuchBucket":
                    raise
                return False

        return self._call("HEAD", probe)

    def put_file(self, local_path: Path, name: str) -> None:
        self._call(f"PUT {name} to", lambda: self.fs.put_file(str(local_path), self._key(name)))

    def put_bytes(self, name: str, data: bytes) -> None:
        self._call(f"PUT {name} to", lambda: self.fs.pipe_file(self._key(name), data))

    def read_bytes(self, name: str) -> bytes:
        return self._call(f"GET {name} from", lambda: self.fs.cat_file(self._key(name)))

    def list_names(self) -> list[str]:
        def listing() -> list[str]:
            try:
                return [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.prefix, detail=False)]
            except FileNotFoundError:
                return []

        return self._call("LIST", listing)

    def remove_previous_outputs(self) -> None:
        if self.exists(MANIFEST_NAME):
            self._call("DELETE manifest.json in", lambda: self.fs.rm_file(self._key(MANIFEST_NAME)))
        for name in self.list_names():
            if _is_output_name(name):
                self._call(f"DELETE {name} in", lambda n=name: self.fs.rm_file(self._key(n)))

    def check_bucket(self) -> None:
        try:
            self._call("LIST", lambda: self.fs.ls(self.location.bucket, detail=False))
        except Exception as exc:  # noqa: BLE001
            raise LocationError(s3_problem(exc, self.describe(), self.storage, "write output to")) from exc

    def check_writable(self) -> None:
        probe = self._key(f".nightshift-probe-{uuid.uuid4().hex}")
        try:
            self._call("PUT probe to", lambda: self.fs.pipe_file(probe, b""))
        except Exception as exc:  # noqa: BLE001
            raise LocationError(s3_problem(exc, self.describe(), self.storage, "write output to")) from exc
        try:
            self._call("DELETE probe in", lambda: self.fs.rm_file(probe))
        except Exception as exc:  # noqa: BLE001 - writable is what matters; say what was left behind
            log.warning("could not delete the write probe", object=f"s3://{probe}", error=str(exc))


class HttpTarget(OutputTarget):
    """PUT per file to OUTPUT_URL/<name> (a query string, e.g. a token, is kept on every URL)."""

    kind = "http"
    # Staging needs listing, which plain HTTP does not have: an http(s):// job stages on the driver's disk and can
    # be resumed only on that machine.
    stages_in_output = False

    @property
    def scratch_dir(self) -> Path:
        return local_job_dir(self.location.url)

    def staging_area(self) -> StagingArea:
        return StagingArea(self.scratch_dir)

    def describe(self) -> str:
        return redact_url(self.location.url)

    def url(self, name: str) -> str:
        return join_url(self.location.url, name)

    def exists(self, name: str) -> bool:
        def probe() -> bool:
            try:
                with http_open("HEAD", self.url(name), self.storage):
                    return True
            except HttpStatusError as exc:
                if exc.status in (
                    403,
                    404,
                    405,
                    410,
                    501,
                ):  # a PUT-only endpoint may refuse HEAD: unknown = no
                    return False
                raise

        return with_retries(probe, f"HEAD {redact_url(self.url(name))}", self.policy)

    def _put(self, name: str, open_body: Callable[[], Any], size: int) -> None:
        url = self.url(name)
        content_type = "application/json" if name.endswith(".json") else "application/octet-stream"

        def attempt() -> None:
            with open_body() as body:
                headers = {"Content-Length": str(size), "Content-Type": content_type}
                with http_open("PUT", url, self.storage, data=body, headers=headers) as response:
                    response.read()

        with_retries(attempt, f"PUT {redact_url(url)}", self.policy)

    def put_file(self, local_path: Path, name: str) -> None:
        self._put(name, lambda: open(local_path, "rb"), os.path.getsize(local_path))

    def put_bytes(self, name: str, data: bytes) -> None:
        self._put(name, lambda: io.BytesIO(data), len(data))

    def remove_previous_outputs(self) -> None:
        # Without a listing only the manifest can be withdrawn; new shards replace old ones of the same name, and
        # the new manifest names exactly the shards that belong to it.
        try:
            with_retries(
                lambda: http_open("DELETE", self.url(MANIFEST_NAME), self.storage).close(),
                f"DELETE {redact_url(self.url(MANIFEST_NAME))}",
                self.policy,
            )
        except HttpStatusError as exc:
            if exc.status not in (403, 404, 405, 501):
                raise
            if exc.status != 404:
                log.warning(
                    "the previous manifest.json could not be deleted before the new shards are written",
                    output=self.describe(),
                    status=exc.status,
                )

    def check_writable(self) -> None:
        log.info(
            "an HTTP output cannot be checked for writability before the job; the first PUT will tell",
            output=self.describe(),
        )

    def check_reachable(self) -> None:
        try:
            self.exists(MANIFEST_NAME)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, HttpStatusError) or is_transient(exc):
                raise LocationError(http_problem(exc, self.url(MANIFEST_NAME), "write output to")) from exc
            raise


def output_target(location: str | Path | Location, storage: StorageConfig | None = None) -> OutputTarget:
    """The target for OUTPUT (no checks; see runtime.preflight.check_output_target)."""
    loc = location if isinstance(location, Location) else parse_location(str(location))
    if loc.kind == "s3":
        return S3Target(loc, storage)
    if loc.kind == "http":
        return HttpTarget(loc, storage)
    return LocalTarget(loc, storage)
