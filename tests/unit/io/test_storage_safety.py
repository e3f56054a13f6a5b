"""What reading and writing storage may cost and reveal. The storage's HTTP headers (an Authorization for an
http(s):// input or output) are secrets: never written with the job (its checkpoint, a child job's file), given to a
resumed or child job through the environment, sent only to the origin they were given for, and never from https to
plain http. An http(s):// download is bounded in bytes and time, a .gz input in what it inflates to."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pipeline.config import JobConfig, StorageConfig
from pipeline.io.locations import _SameOriginRedirects, http_open
from pipeline.io.staging import StagingArea
from pipeline.runtime.hosting.launcher import job_environment, write_job_file
from pipeline.state import JobState

TOKEN = "Bearer s3cr3t-token"


@contextmanager
def _server(redirect_to: str | None = None) -> Iterator[tuple[str, list[dict]]]:
    """A local HTTP server recording each request's headers; with `redirect_to`, /start answers 302 there."""
    seen: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
            if self.path == "/start" and redirect_to:
                self.send_response(302)
                self.send_header("Location", redirect_to)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def _storage() -> StorageConfig:
    return StorageConfig(http_headers={"Authorization": TOKEN})


def test_the_headers_are_never_written_with_the_job(tmp_path):
    config = JobConfig.model_validate({"storage": {"http_headers": {"Authorization": TOKEN}}})
    assert TOKEN not in config.model_dump_json() and "s3cr3t" not in repr(config)
    staging = StagingArea(tmp_path / "out")
    staging.create()
    staging.write_job(JobState(job_id="j", config=config))
    assert "s3cr3t" not in (tmp_path / "out" / "_staging" / "job.json").read_text()
    write_job_file(config, tmp_path / "child.yaml")
    assert "s3cr3t" not in (tmp_path / "child.yaml").read_text()


def test_a_resumed_or_child_job_reads_them_from_its_environment(monkeypatch):
    config = JobConfig.model_validate({"storage": {"http_headers": {"Authorization": TOKEN}}})
    env = job_environment(config)
    assert json.loads(env["NIGHTSHIFT_HTTP_HEADERS"]) == {"Authorization": TOKEN}
    monkeypatch.setenv("NIGHTSHIFT_HTTP_HEADERS", env["NIGHTSHIFT_HTTP_HEADERS"])
    stored = JobConfig.model_validate_json(config.model_dump_json())  # what job.json gives back
    assert stored.storage.header_values() == {"Authorization": TOKEN}
    monkeypatch.setenv("NIGHTSHIFT_HTTP_HEADERS", "Bearer not-json")
    with pytest.raises(ValueError, match="NIGHTSHIFT_HTTP_HEADERS is not a JSON object"):
        StorageConfig()


def test_a_redirect_within_the_origin_keeps_them_and_one_elsewhere_drops_them():
    with _server() as (other, elsewhere):
        with _server(redirect_to=f"{other}/landed") as (origin, here):
            with http_open("GET", f"{origin}/start", _storage()) as response:
                assert response.read() == b"ok"
        assert here[0]["authorization"] == TOKEN
        assert elsewhere[0]["path"] == "/landed" and "authorization" not in elsewhere[0]
    with _server(redirect_to="/landed") as (origin, here):  # a relative Location: the same origin
        with http_open("GET", f"{origin}/start", _storage()) as response:
            assert response.read() == b"ok"
        assert [seen["authorization"] for seen in here] == [TOKEN, TOKEN]


def test_a_redirect_from_https_to_http_is_refused():
    request = urllib.request.Request("https://files.example/start", headers={"Authorization": TOKEN})
    with pytest.raises(urllib.error.HTTPError, match="refused a redirect from https to http"):
        _SameOriginRedirects().redirect_request(request, None, 302, "Found", {}, "http://files.example/start")


# --- bounds on what an input may cost ---------------------------------------------------------------------------------


def test_a_download_past_its_byte_bound_stops_and_is_not_retried(tmp_path):
    import io

    from pipeline.io.http_input import DownloadTooLarge, download
    from pipeline.io.locations import RetryPolicy

    with _server() as (origin, seen):
        storage = StorageConfig(http_max_download_bytes=1)
        with pytest.raises(DownloadTooLarge, match="more than 1 bytes"):
            download(f"{origin}/big", storage, RetryPolicy(retries=3), io.BytesIO())
        assert len(seen) == 1  # refused, not retried
        body = io.BytesIO()
        download(f"{origin}/big", StorageConfig(), RetryPolicy(), body)
        assert body.getvalue() == b"ok"


def test_a_gzip_input_that_inflates_past_its_bound_fails_naming_the_file(tmp_path):
    import gzip

    from pipeline.config import InputLimits
    from pipeline.io.input_files import InputFile, iter_rows
    from pipeline.io.rows import InputFormatError

    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wb") as out:
        out.write(b'{"custom_id": "a"}\n' * 100_000)  # 1.9 MB from a few KB
    file = InputFile(str(path), str(path), path.stat().st_size)
    with (
        path.open("rb") as stream,
        pytest.raises(InputFormatError, match=r"bomb.jsonl.gz decompresses to more than"),
    ):
        list(iter_rows(stream, file, "jsonl", InputLimits(max_decompressed_bytes=1 << 20)))
    with path.open("rb") as stream:
        assert len(list(iter_rows(stream, file, "jsonl", InputLimits()))) == 100_000
