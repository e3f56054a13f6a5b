"""`nightshift validate --config` on a job of two pools of real models (the embedded chat model with a LoRA adapter,
and all-MiniLM for embeddings): every name the job serves is valid, each line is counted with its own model's
tokenizer, and a line longer than the job's context is the context_length_exceeded record the job would write. No
engine starts: the tokenizers only."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cli import run_cli
from tests.lines import MODEL_NAME, write_lines

pytestmark = pytest.mark.slow

EMBEDDER = "all-minilm-l6-v2"


def line(custom_id: str, model: str, content: str, url: str = "/v1/chat/completions", **body) -> str:
    if url == "/v1/embeddings":
        payload = {"model": model, "input": content}
    else:
        payload = {"model": model, "messages": [{"role": "user", "content": content}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": payload})


def test_a_lora_and_two_pool_job_validates_with_each_models_tokenizer(embedded_model, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "engine:\n  vllm:\n    max_model_len: 64\n    lora_modules: {sql: /adapters/sql}\n"
        "pools:\n"
        "  - name: chat\n"
        "  - name: embed\n    model: embedded:minilm\n    engine_overrides: {lora_modules: {}}\n"
    )
    long_question = "Tell me everything about " + " and ".join(f"topic {i}" for i in range(40))
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            line("chat", MODEL_NAME, "What is 2+2?", max_tokens=8),
            line("adapter", "sql", "SELECT one row", max_tokens=8),
            line("embedding", EMBEDDER, "a sentence to embed", url="/v1/embeddings"),
            line("too-long", MODEL_NAME, long_question, max_tokens=8),
            line("nobody", "gpt-4o", "hi"),
        ],
    )
    result = run_cli("validate", str(path), "--config", str(job), timeout=600)
    assert result.returncode == 0, result.stderr
    records = [json.loads(text) for text in result.stdout.splitlines() if text.startswith("{")]
    codes = {r["custom_id"]: (r["error"] or r["response"]["body"]["error"])["code"] for r in records}
    # No false model_not_found: the pool's model, its adapter and the other pool's model are all served.
    assert codes == {"nobody": "model_not_found", "too-long": "context_length_exceeded"}
    too_long = next(r for r in records if r["custom_id"] == "too-long")
    assert "maximum context length is 64 tokens" in too_long["response"]["body"]["error"]["message"]
    assert "lines      5 (4 valid, 1 invalid)" in result.stdout
    assert "context_length_exceeded 1, model_not_found 1" in result.stdout
    # Counted by each pool's model: the chat model's template and tokenizer, and MiniLM's.
    (tokens,) = [text for text in result.stdout.splitlines() if text.startswith("prompt")]
    assert f"{MODEL_NAME} tokenizer" in tokens and f"{EMBEDDER} tokenizer" in tokens, tokens
