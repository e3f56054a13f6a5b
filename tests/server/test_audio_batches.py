"""The audio routes through the Batch API, with the unchanged `openai` client: a server whose job serves a
speech-to-text model (a directory whose config names Whisper, so the job knows the model's task; the fake engine
reads nothing else of it and does not hear: its text is derived from the file's URL). The real engine answers these
lines in tests/e2e/test_audio_real_engine.py."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.batches import FINAL, lines_of, wait_for
from tests.server.harness import JOB, KEY_A, Server

pytestmark = pytest.mark.timeout(240)

AUDIO = "data:audio/wav;base64,UklGRiQAAABXQVZFZm10IBAAAAABAAEAgD4AAAB9AAACABAAZGF0YQAAAAA="


@pytest.fixture(scope="module")
def speech_client(tmp_path_factory):
    root = tmp_path_factory.mktemp("speech-server")
    model = root / "whisper"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["WhisperForConditionalGeneration"]}))
    fake = {
        k: v for k, v in JOB["engine"]["fake"].items() if k != "lora_modules"
    }  # adapters need a chat model
    job = {
        **JOB,
        "engine": {"backend": "fake", "fake": fake},
        "model": str(model),
        "served_model_name": "whisper",
    }
    server = Server(root, job)
    server.start()
    yield openai.OpenAI(base_url=server.base_url, api_key=KEY_A, max_retries=0)
    server.stop()


def test_a_transcription_batch_of_run_batch_lines(speech_client, tmp_path):
    lines = [
        {"custom_id": f"call-{i}", "method": "POST", "url": "/v1/audio/transcriptions",
         "body": {"model": "whisper", "file_url": AUDIO, "language": "en", "prompt": f"call {i}"}}
        for i in range(3)
    ]  # fmt: skip
    lines.append({**lines[0], "custom_id": "form-file", "body": {"model": "whisper", "file": "call.wav"}})
    lines.append({**lines[0], "custom_id": "a-chat", "url": "/v1/chat/completions",
                  "body": {"model": "whisper", "messages": [{"role": "user", "content": "hi"}]}})  # fmt: skip
    source = tmp_path / "calls.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    uploaded = speech_client.files.create(file=source.open("rb"), purpose="batch")
    batch = speech_client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/audio/transcriptions", completion_window="24h"
    )
    done = wait_for(speech_client, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed", done.errors
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 3, 2)
    results = {r["custom_id"]: r for r in lines_of(speech_client, done.output_file_id)}
    errors = {r["custom_id"]: r for r in lines_of(speech_client, done.error_file_id)}
    assert set(results) == {"call-0", "call-1", "call-2"} and set(errors) == {"form-file", "a-chat"}
    for record in results.values():
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200 and body["text"]
        assert body["usage"] == {"type": "duration", "seconds": 1}
    assert "body.file_url" in errors["form-file"]["error"]["message"]
    assert errors["a-chat"]["error"]["code"] == "unsupported_url", errors["a-chat"]
