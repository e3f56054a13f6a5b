"""The same requests through the in-process engine (`--engine vllm`) and through `--engine http` against vLLM's own
OpenAI server, at several concurrencies: why requests in flight matter to a server that batches.

    python bench/http_concurrency.py [--requests 512] [--max-tokens 32] [--max-num-seqs 64]

Both paths get the whole box (bench/fair.py): the in-process engine is one engine bound to every core, the server
is started with VLLM_CPU_OMP_THREADS_BIND over the same cores; they never run at the same time. Throughput is output
tokens over the generation span (first request handed to an engine to last result, from the manifest's
per-engine activity), so neither path's engine start is counted — the server is started once, before its runs.
Needs vllm-cpu and the embedded model; takes ~1 min at 64 requests × 16 tokens on a 2-core box.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fair import bind_string, box_cores, free_port  # noqa: E402

MODEL_NAME = "smollm2-135m-instruct"
TOPICS = ["the sea", "a city", "bees", "winter", "a library", "the moon", "trains", "a garden"]


def write_input(path: Path, n: int, max_tokens: int, run: str) -> Path:
    """N chats; `run` in every prompt, so no run finds its prompts in the server's prefix cache from an earlier one."""
    import json

    with path.open("w") as fh:
        for i in range(n):
            body = {
                "model": MODEL_NAME,
                "messages": [
                    {"role": "user", "content": f"Write a short story ({run}-{i}) about {TOPICS[i % 8]}."}
                ],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,  # every request generates max_tokens: the paths do the same work
            }
            fh.write(
                json.dumps({"custom_id": f"r-{i:05d}", "url": "/v1/chat/completions", "body": body}) + "\n"
            )
    return path


def generation_rate(manifest: dict) -> tuple[float, float]:
    """(span seconds, output tokens per second) of a finished job, from its engines' activity."""
    engines = (manifest["engine"].get("per_engine") or {}).values()
    first = min(e["first_request_at"] for e in engines if e.get("first_request_at"))
    last = max(e["last_result_at"] for e in engines if e.get("last_result_at"))
    span = last - first
    return span, manifest["tokens"]["completion"] / span


def run(config: dict) -> dict:
    from pipeline.config import JobConfig
    from pipeline.runtime.job import run_job

    return run_job(JobConfig.model_validate(config), show_progress=False).manifest


def start_server(
    model_path: str, port: int, max_num_seqs: int, cores: list[int], log: Path
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    cmd += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", "512", "--max-num-seqs", str(max_num_seqs), "--enforce-eager"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": bind_string(cores)}
    server = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM's server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    raise RuntimeError("vLLM's server never answered")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()

    import ray

    from pipeline.models import resolve_model

    cores = box_cores()
    model = resolve_model(None)
    work = Path(tempfile.mkdtemp(prefix="bench-http-"))
    # Ray is told of more CPUs than the box has: the engine's reservation of every core must not starve the
    # (tiny) ingest and finalize tasks; the engine binds its threads to the cores itself.
    ray.init(num_cpus=len(cores) + 2, include_dashboard=False, log_to_driver=False)
    base = {"model": None, "overwrite": True}
    rows = []
    manifest = run(
        {
            **base,
            "input": str(write_input(work / "vllm.jsonl", args.requests, args.max_tokens, "vllm")),
            "output": str(work / "vllm"),
            "engine": {"backend": "vllm", "vllm": {"max_num_seqs": args.max_num_seqs, "max_model_len": 512}},
            "resources": {"num_engines": 1, "cpus_per_engine": len(cores)},
        }
    )
    rows.append(("vllm in-process", args.max_num_seqs, *generation_rate(manifest)))

    port = free_port()
    server = start_server(model.path, port, args.max_num_seqs, cores, work / "server.log")
    try:
        for concurrency in dict.fromkeys([1, 8, 64, args.max_num_seqs]):
            manifest = run(
                {
                    **base,
                    "input": str(
                        write_input(
                            work / f"http-{concurrency}.jsonl",
                            args.requests,
                            args.max_tokens,
                            f"c{concurrency}",
                        )
                    ),
                    "output": str(work / f"http-{concurrency}"),
                    "engine": {
                        "backend": "http",
                        "http": {"endpoints": [f"http://127.0.0.1:{port}"], "concurrency": concurrency},
                    },
                }
            )
            rows.append(("http → vllm serve", concurrency, *generation_rate(manifest)))
    finally:
        server.terminate()
        server.wait(timeout=60)
        ray.shutdown()

    reference = rows[0][3]
    print(
        f"\n{args.requests} chats × {args.max_tokens} tokens, {len(cores)} cores, max_num_seqs {args.max_num_seqs}"
    )
    print(f"{'path':<20} {'in flight':>9} {'span s':>8} {'tok/s':>8} {'vs in-process':>14}")
    for path, concurrency, span, rate in rows:
        print(f"{path:<20} {concurrency:>9} {span:>8.1f} {rate:>8.1f} {rate / reference:>13.2f}x")


if __name__ == "__main__":
    main()
