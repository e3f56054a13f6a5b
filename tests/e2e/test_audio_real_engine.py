"""Audio on the real engine: transcription and translation lines, written as vLLM's run-batch takes them (`file_url`:
a base64 `data:` URL, or an http URL of the test's loopback server), on a tiny random-weight Whisper
(tests/e2e/tiny_whisper.py), under the policy a server runs with (private networks off; the loopback server's
address listed in `allowed_networks`).

Each answered line's body equals vLLM's own run-batch on the same line (vLLM fetching the URL itself); audio that
cannot be decoded, a URL the policy refuses and a line with the form's `file` field are each that line's error, and
the job goes on; the allowed URL was fetched once."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.cli import run_cli
from tests.e2e.run_batch import run_batch
from tests.lines import read_job_output, write_lines
from tests.media_server import MediaServer

TRANSCRIBE, TRANSLATE = "/v1/audio/transcriptions", "/v1/audio/translations"


def line(custom_id: str, url: str, **body) -> str:
    # A short answer: the model is random, so without a limit it talks to the end of its context.
    body = {"model": "whisper", "temperature": 0, "max_completion_tokens": 12, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def whisper(tmp_path_factory, embedded_model) -> Path:
    from tests.e2e.tiny_whisper import make_tiny_whisper

    return make_tiny_whisper(tmp_path_factory.mktemp("models") / "tiny-whisper", Path(embedded_model.path))


@pytest.fixture(scope="module")
def calls():
    from tests.e2e.tiny_whisper import wav

    server = MediaServer(wav(2.0, 330.0), media_path="/call.wav")
    yield server
    server.close()


@pytest.fixture(scope="module")
def lines(calls) -> dict[str, str]:
    from tests.e2e.tiny_whisper import wav

    tone = "data:audio/wav;base64," + base64.b64encode(wav(1.0)).decode()
    return {
        "transcribe-data": line("transcribe-data", TRANSCRIBE, file_url=tone, language="en"),
        "transcribe-url": line("transcribe-url", TRANSCRIBE, file_url=calls.url("/call.wav"), language="en"),
        "transcribe-verbose": line(
            "transcribe-verbose", TRANSCRIBE, file_url=tone, language="en", response_format="verbose_json"
        ),
        "translate-data": line("translate-data", TRANSLATE, file_url=tone, language="de"),
        "broken-audio": line("broken-audio", TRANSCRIBE, file_url="data:audio/wav;base64,AAAAAAAA"),
        "refused-metadata": line("refused-metadata", TRANSCRIBE, file_url="http://169.254.169.254/call.wav"),
        "refused-file": line("refused-file", TRANSLATE, file_url="file:///etc/passwd"),
        "form-file": line("form-file", TRANSCRIBE, file="call.wav"),
    }


ANSWERED = ("transcribe-data", "transcribe-url", "transcribe-verbose", "translate-data")


@pytest.fixture(scope="module")
def job(e2e_dir, whisper, calls, lines):
    config = e2e_dir / "audio-job.json"
    policy = {"allow_private_networks": False, "allowed_networks": ["127.0.0.1/32"]}  # as a server runs
    config.write_text(json.dumps({"media": policy}))
    path = write_lines(e2e_dir / "audio.jsonl", list(lines.values()))
    output = e2e_dir / "audio-out"
    proc = run_cli(
        "run", str(path), str(output), "-c", str(config), "--model", str(whisper), "--served-model-name", "whisper",
        "--num-engines", "1", "--cpus-per-engine", "1", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits = Counter(path for path, _ in calls.hits)
    calls.hits.clear()
    return (*read_job_output(output), hits)


@pytest.fixture(scope="module")
def oracle(e2e_dir, whisper, lines):
    """vLLM's own run-batch on the lines it answers, the same model (it fetches the URL itself)."""
    return run_batch(
        e2e_dir, "audio", [lines[name] for name in ANSWERED], "--model", str(whisper), "--served-model-name",
        "whisper", kv_cache_gib=1, env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
    )  # fmt: skip


def error_of(record: dict) -> dict:
    return (record["response"]["body"] if record.get("response") else record)["error"]


def test_every_line_is_answered_or_its_own_error_and_the_job_goes_on(job, lines):
    results, errors, manifest = job[:3]
    assert set(results) | set(errors) == set(lines) and not set(results) & set(errors)
    assert set(results) == set(ANSWERED)
    assert manifest["counts"]["total"] == len(lines)
    assert manifest["model"]["task"] == "transcription"
    codes = {custom_id: error_of(record)["code"] for custom_id, record in errors.items()}
    assert codes == {
        "broken-audio": "invalid_request",
        "refused-metadata": "media_refused",
        "refused-file": "media_refused",
        "form-file": "invalid_request",
    }, codes
    assert "link-local" in error_of(errors["refused-metadata"])["message"]
    assert "allowed_local_media_path" in error_of(errors["refused-file"])["message"]
    assert "body.file_url" in error_of(errors["form-file"])["message"]


def test_the_allowed_url_is_fetched_once_and_the_refused_never(job):
    assert job[3] == Counter({"/call.wav": 1})


def test_bodies_equal_vllms_own_run_batch(job, oracle):
    results = job[0]
    assert set(oracle) == set(ANSWERED)
    for custom_id, theirs in oracle.items():
        assert theirs["error"] is None, theirs
        ours = results[custom_id]["response"]["body"]
        assert ours == theirs["response"]["body"], custom_id
    assert results["transcribe-data"]["response"]["body"]["usage"] == {"type": "duration", "seconds": 1}
    assert results["transcribe-verbose"]["response"]["body"]["duration"] == 1.0


@pytest.fixture(scope="module")
def call_table(e2e_dir, whisper):
    """A dataset job with --route transcriptions over a Parquet table whose `call` column holds paths beside the
    table (one that climbs out of its directory, and a null): the table back with each row's text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.e2e.tiny_whisper import wav

    folder = e2e_dir / "archive"
    (folder / "calls").mkdir(parents=True)
    (folder / "calls" / "tone.wav").write_bytes(wav(1.0))
    (e2e_dir / "outside.wav").write_bytes(wav(1.0))
    source = folder / "calls.parquet"
    pq.write_table(
        pa.table({"id": ["a", "b", "c"], "call": ["calls/tone.wav", "../outside.wav", None]}), source
    )
    config = e2e_dir / "call-table.json"
    config.write_text(json.dumps({"dataset": {"route": "transcriptions", "audio_column": "call", "id_column": "id",
                                              "body": {"language": "en", "max_completion_tokens": 12}}}))  # fmt: skip
    output = e2e_dir / "call-table-out"
    proc = run_cli(
        "run", str(source), str(output), "-c", str(config), "--temperature", "0", "--model", str(whisper),
        "--served-model-name", "whisper", "--num-engines", "1", "--cpus-per-engine", "1", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {row["id"]: row for row in pq.read_table(sorted(output.glob("results-*.parquet"))).to_pylist()}


def test_an_audio_column_of_paths_is_transcribed_as_the_same_audio_in_a_line(call_table, job):
    same = job[0]["transcribe-data"]["response"]["body"]  # the same audio, written as a request line
    assert call_table["a"]["error"] is None and call_table["a"]["content"] == same["text"]
    refused = call_table["b"]["error"]  # the media root is the table's directory: nothing above it is read
    assert refused["code"] == "media_refused" and "allowed_local_media_path" in refused["message"], refused
    assert call_table["c"]["error"]["code"] == "template_error"
    assert list(call_table) == ["a", "b", "c"] and call_table["a"]["call"] == "calls/tone.wav"
