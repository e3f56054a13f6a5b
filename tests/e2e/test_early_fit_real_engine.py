"""The early fit on the real engine (README "early fit"): vLLM engines start on args fitted to a sample of the input,
measured with the model's own tokenizer and chat template, and take requests while ingest reads the rest; a request
longer than the sample's fit is held back, then answered by an engine started again with the args fitted to the
whole input — vLLM would refuse it (or cut its output) at the early context.

The sample of a real job is 2,048 lines; here it is made 8 (the driver decides how many lines the sample reads of
each piece), so that a 40-line input is larger than its sample. The model is the tiny Llama of
tests/e2e/tiny_llama.py (the embedded tokenizer, random weights): a second engine start costs seconds.
"""

from __future__ import annotations

import json

import pytest

from pipeline.config import JobConfig
from pipeline.runtime.ingest import sample
from pipeline.runtime.job import run_job
from tests.lines import read_jsonl, write_lines

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+2?", "Name a color.", "Who wrote Hamlet?", "What do bees make?", "Say hello.", "Why?"]
LONG_AT = 20  # past the sample's 8 lines


def chat(custom_id: str, model: str, question: str, max_tokens: int = 8) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_a_request_longer_than_the_early_fit_is_held_and_answered_after_the_refit(
    private_ray, tiny_llama, tmp_path, monkeypatch
):
    monkeypatch.setattr(sample, "SAMPLE_ROWS", 8)
    lines = [chat(f"q-{i:02d}", str(tiny_llama), QUESTIONS[i % len(QUESTIONS)]) for i in range(40)]
    long_question = "Summarize this: " + "the quick brown fox jumps over the lazy dog " * 20
    lines[LONG_AT] = chat(f"q-{LONG_AT:02d}", str(tiny_llama), long_question)
    config = JobConfig.model_validate(
        {
            "input": str(write_lines(tmp_path / "in.jsonl", lines)),
            "output": str(tmp_path / "out"),
            "job_id": "early-fit",
            "model": str(tiny_llama),
            "engine": {"backend": "vllm", "fit": {"early_min_bytes": 0}},
            "resources": {"num_engines": 1, "cpus_per_engine": 2, "rows_per_task": 4},
        }
    )
    result = run_job(config, show_progress=False)

    rows = read_jsonl(result.output.glob("results-*.jsonl"))
    errors = read_jsonl(result.output.glob("errors-*.jsonl"))
    assert errors == [] and len(rows) == len(lines) == result.manifest["counts"]["succeeded"]
    assert all(r["response"]["status_code"] == 200 for r in rows)
    manifest = result.manifest
    assert manifest["ingest"]["streamed"] is True
    fitted = manifest["engine"]["fitted"]
    early = fitted["early"]
    assert early["sampled_lines"] == 8 and early["rows_held"] == 1
    # The early context was counted by the model's tokenizer and chat template, and the long prompt passes it.
    held = next(r for r in rows if r["custom_id"] == f"q-{LONG_AT:02d}")
    prompt_tokens = held["response"]["body"]["usage"]["prompt_tokens"]
    assert prompt_tokens + 8 > early["max_model_len"]
    assert fitted["max_model_len"]["value"] >= prompt_tokens + 8
    # Two engines, one after the other: the streamed one (39 rows), then the one the held request ran on.
    per_engine = sorted(e["rows"] for e in manifest["engine"]["per_engine"].values())
    assert per_engine == [1, 39]
    assert manifest["engine"]["args"]["max_model_len"] in (
        early["max_model_len"],
        fitted["max_model_len"]["value"],
    )
