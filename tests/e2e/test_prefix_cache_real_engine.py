"""Prefix caching pays on the real engine: two engines, two long system prompts — each prompt's rows are routed to
one engine, and the manifest's prefix-cache hit rate (vLLM's own counters) is high. The two CPU engines compute on
cores of their own (vLLM's own binding would put both on the first core). Its own engines, not the session's warm ones
(tests/e2e/warm_cluster.py): which cores they bind, read from its own Ray session's logs, is part of the subject."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.e2e.cli import run_cli
from tests.lines import MODEL_NAME, write_lines

pytestmark = pytest.mark.slow

ROWS_PER_PROMPT = 24
SYSTEM = [
    "You are a museum guide. "
    + "Describe every painting with its artist, its year and one striking detail. " * 30,
    "You are a ship's cook. "
    + "Answer every question about food with a recipe, its time and its cost. " * 30,
]


def test_shared_system_prompts_hit_the_prefix_cache(e2e_dir):
    lines = []
    for i in range(2 * ROWS_PER_PROMPT):
        body = {
            "model": MODEL_NAME,
            "messages": [
                {"role": "system", "content": SYSTEM[i % 2]},
                {"role": "user", "content": f"Question {i}: what should I know?"},
            ],
            "max_tokens": 4,
            "temperature": 0,
        }
        line = {"custom_id": f"p-{i:03d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        lines.append(json.dumps(line))
    path = write_lines(e2e_dir / "shared-prefix.jsonl", lines)
    out = e2e_dir / "shared-prefix-out"
    # Ray's session (and its logs, where vLLM says which cores it bound) in a directory of this test's own; short,
    # because Ray puts Unix sockets under it.
    ray_tmp = Path(tempfile.mkdtemp(prefix="nsr", dir="/tmp"))
    proc = run_cli(
        "run", str(path), str(out),
        "--num-engines", "2", "--cpus-per-engine", "1",
        "--max-model-len", "1024", "--max-num-seqs", "4", "--cpu-kvcache-space", "1",
        "--no-progress",
        env={"RAY_TMPDIR": str(ray_tmp)},
    )  # fmt: skip
    vllm_bindings = sorted(
        {
            match
            for log in ray_tmp.glob("ray/session_2*/logs/*")
            if log.is_file()
            for match in re.findall(r"local_rank=0, core ids=(\[[0-9, ]*\])", log.read_text(errors="replace"))
        }
    )
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["succeeded"] == 2 * ROWS_PER_PROMPT
    assert manifest["engine"]["args"]["enable_prefix_caching"] is True  # on by default, and said so
    assert manifest["engine"]["engines"] == 2
    cores = manifest["engine"]["cpu_cores"]
    assert len(cores) == 2 and not set(cores[0]) & set(cores[1]), cores
    assert vllm_bindings == sorted(str(c) for c in cores), (vllm_bindings, cores)
    routing = manifest["routing"]
    assert routing["used"] and routing["keys"] == 2
    assert routing["rows_routed"] + routing["rows_stolen"] == 2 * ROWS_PER_PROMPT
    # Each prompt is ~600 tokens and the question ~15: once an engine holds a prompt, nearly every prompt token of
    # its next requests is a hit. Only the first few requests per engine (those scheduled before its first
    # prefill is done) miss.
    assert manifest["prefix_cache_hit_rate"] >= 0.6, (manifest["prefix_cache_hit_rate"], routing)
