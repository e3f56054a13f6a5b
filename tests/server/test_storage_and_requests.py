"""What a tenant's request may cost the server and what it leaves on disk, against the shared `nightshift serve`:
private data, bounded multipart forms and streamed bodies, OpenAI's metadata bounds, one server per data dir."""

from __future__ import annotations

import contextlib
import stat
import time
from pathlib import Path

import httpx
import openai
import pytest

from pipeline.server.datadir import DataDirInUse, check_free
from pipeline.server.routes import MAX_JSON_BODY_BYTES
from pipeline.server.uploads import (
    FORM_OVERHEAD_BYTES,
    MAX_FORM_FIELDS_BYTES,
    MAX_FORM_PARTS,
    MAX_PART_HEADER_BYTES,
)
from tests.server.batches import FINAL, wait_for, write_input
from tests.server.harness import KEY_A, MAX_FILE_BYTES

pytestmark = pytest.mark.timeout(180)

AUTH = {"Authorization": f"Bearer {KEY_A}"}
BOUNDARY = "nightshift-test-boundary"


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


def _form(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def _chunked(body: bytes, piece: int = 16 * 1024):
    """A generator body: httpx sends it with Transfer-Encoding: chunked and no Content-Length."""

    def pieces():
        for start in range(0, len(body), piece):
            yield body[start : start + piece]

    return pieces()


def _post_form(server, content, **headers) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/files",
        content=content,
        headers={**AUTH, "Content-Type": f"multipart/form-data; boundary={BOUNDARY}", **headers},
        timeout=60,
    )


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def _replica_pid(server) -> int:
    """The process that holds the data dir's lock (its pid is in the lock file): the Serve replica."""
    return int((server.root / "data" / "server.lock").read_text().split()[0])


def test_everything_under_the_data_dir_is_private_after_a_batch(server, client_a, tmp_path):
    """0700 directories and 0600 files, whoever wrote them: the server (database, uploads), the job's process
    (job.yaml, job.log, the checkpoint) and its Ray workers (staged parts, shards, manifest)."""
    uploaded = client_a.files.create(file=write_input(tmp_path / "in.jsonl", 6).open("rb"), purpose="batch")
    batch = client_a.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for(client_a, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed", done.errors
    root = server.root / "data"
    batch_dir = root / "batches" / batch.id
    assert (batch_dir / "job.yaml").is_file() and (batch_dir / "job.log").is_file()
    assert (batch_dir / "output" / "manifest.json").is_file() and (root / "state.sqlite").is_file()
    walked = [root, *root.rglob("*")]
    exposed = [
        f"{oct(stat.S_IMODE(p.lstat().st_mode))} {p.relative_to(root)}"
        for p in walked
        if not p.is_symlink() and stat.S_IMODE(p.lstat().st_mode) & 0o077
    ]
    assert exposed == []
    assert len(walked) > 10


def test_a_form_of_many_small_fields_is_refused_early_with_memory_bounded(server):
    """100,000 one-byte fields, chunked (a declared length over the limit is refused before any is read): refused
    with 400 naming the limit, without the replica holding them."""
    pid = _replica_pid(server)
    before = _rss_kib(pid)
    body = _form(*(_part(f"f{i}", b"x") for i in range(100_000)))
    response = _post_form(server, _chunked(body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert str(MAX_FORM_PARTS) in error["message"] and "parts" in error["message"]
    grown_mib = (_rss_kib(pid) - before) / 1024
    assert grown_mib < 30, f"the replica grew by {grown_mib:.0f} MiB"


def test_form_fields_are_bounded_together(server):
    """Each field within its own limit, all of them over the form's."""
    fields = [_part(f"f{i}", b"x" * 1000) for i in range(MAX_FORM_FIELDS_BYTES // 1000 + 1)]
    response = _post_form(server, _form(_part("purpose", b"batch"), *fields))
    assert response.status_code == 400, response.text
    assert f"more than {MAX_FORM_FIELDS_BYTES} bytes" in response.json()["error"]["message"]


def test_a_part_whose_headers_together_pass_the_cap_is_refused(server):
    """Six header lines of 1 KiB each: each within what the multipart parser takes, together over the cap."""
    headers = b"".join(f"X-Padding-{i}: ".encode() + b"p" * 1024 + b"\r\n" for i in range(6))
    part = (
        f"--{BOUNDARY}\r\n".encode()
        + headers
        + b'Content-Disposition: form-data; name="file"; filename="a"\r\n'
    )
    body = part + b'\r\n{"custom_id": "a"}\n\r\n' + _form(_part("purpose", b"batch"))
    response = _post_form(server, body)
    assert response.status_code == 400, response.text
    assert f"headers are longer than {MAX_PART_HEADER_BYTES} bytes" in response.json()["error"]["message"]


def test_a_chunked_upload_is_cut_at_the_body_limit(server, tmp_path):
    """No Content-Length to check up front: the stream is counted. A small file followed by more than the limit
    of bytes after the closing boundary (which a multipart parser skips) would otherwise be read to the end."""
    small = b'{"custom_id": "a"}\n'
    body = _form(_part("purpose", b"batch"), _part("file", small, "in.jsonl"))
    body += b"e" * (MAX_FILE_BYTES + FORM_OVERHEAD_BYTES)
    response = _post_form(server, _chunked(body))
    assert response.status_code == 413, response.text
    assert str(MAX_FILE_BYTES + FORM_OVERHEAD_BYTES) in response.json()["error"]["message"]
    # And a chunked upload within the limit goes through.
    ok = _post_form(server, _chunked(_form(_part("purpose", b"batch"), _part("file", small, "in.jsonl"))))
    assert ok.status_code == 200 and ok.json()["bytes"] == len(small)
    assert not list((server.root / "data" / "tmp").iterdir())  # nothing left behind by the refused one


def test_a_chunked_json_body_is_cut_at_its_limit(server):
    body = b'{"metadata": {"k": "' + b"v" * (MAX_JSON_BODY_BYTES + 1) + b'"}}'
    response = httpx.post(
        f"{server.base_url}/batches",
        content=_chunked(body),
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413
    assert str(MAX_JSON_BODY_BYTES) in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "metadata, says",
    [
        ({"k" * 65: "v"}, "64 characters"),
        ({"k": "v" * 513}, "512 characters"),
        ({f"k{i}": "v" for i in range(17)}, "16 key-value pairs"),
    ],
)
def test_metadata_beyond_openais_bounds_is_refused(client_a, tmp_path, metadata, says):
    uploaded = client_a.files.create(file=write_input(tmp_path / "m.jsonl", 1).open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        client_a.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=metadata,
        )
    assert exc.value.body["param"] == "metadata" and says in exc.value.body["message"]
    # The bounds themselves are allowed.
    at_bounds = {**{f"k{i}": "v" for i in range(15)}, "k" * 64: "v" * 512}
    batch = client_a.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=at_bounds,
    )
    assert batch.metadata == at_bounds
    with contextlib.suppress(openai.ConflictError):  # 409: it finished first
        client_a.batches.cancel(batch.id)
    wait_for(client_a, batch.id, lambda b: b.status in FINAL)


def test_the_running_server_holds_its_data_dir(server):
    """The replica took the lock where it opened the database: another server on this dir is refused, naming
    the dir and the holder's pid."""
    root = server.root / "data"
    started = time.monotonic()
    with pytest.raises(DataDirInUse) as exc:
        check_free(root, wait_seconds=0)
    assert time.monotonic() - started < 5
    assert str(root) in str(exc.value) and f"pid {_replica_pid(server)}" in str(exc.value)
