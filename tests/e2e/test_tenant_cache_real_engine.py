"""Two tenants on one warm engine (the Batch API server's case): key B's prompt repeats key A's long prefix and gets
no prefix-cache hit, because each key's requests carry its own cache_salt; A's next job hits what A cached; and each
job's numbers are its own, never the engine's totals over earlier jobs."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.e2e.cli import run_cli
from tests.lines import MODEL_NAME, write_lines

pytestmark = pytest.mark.slow

# Longer than two KV blocks, so a cached prefix is whole blocks to hit (or not).
SYSTEM = (
    "You are the archivist of a private company. " + "Every answer cites the ledger page it comes from. " * 30
)


def _job(e2e_dir, shared_engines, name: str, salt: str) -> dict:
    line = {
        "custom_id": f"{name}-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL_NAME,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is on page 4?"},
            ],
            "max_tokens": 2,
            "temperature": 0,
        },
    }
    path = write_lines(e2e_dir / f"tenant-{name}.jsonl", [json.dumps(line)])
    job_file = e2e_dir / f"tenant-{name}.yaml"
    job_file.write_text(
        yaml.safe_dump({"engine": {"warm_engines": shared_engines.keeper}, "limits": {"cache_salt": salt}})
    )
    output = e2e_dir / f"tenant-{name}-out"
    proc = run_cli(
        "run", str(path), str(output), "-c", str(job_file), *shared_engines.job_args(), "--no-progress"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((output / "manifest.json").read_text())


def test_one_keys_cached_prefix_is_never_a_hit_for_another(e2e_dir, shared_engines):
    first = _job(e2e_dir, shared_engines, "a1", "tenant-a")
    other = _job(e2e_dir, shared_engines, "b1", "tenant-b")
    again = _job(e2e_dir, shared_engines, "a2", "tenant-a")
    assert all(m["engine"]["reused"] for m in (other, again))  # one warm engine served all three
    assert other["prefix_cache_hit_rate"] == 0.0  # B's copy of A's prompt found nothing of A's in the cache
    assert again["prefix_cache_hit_rate"] > 0.5  # A's own next job hits what A cached
    # Each job's numbers are its own: the second key's job reports one request's lookups, not the engine's total.
    assert first["counts"]["succeeded"] == other["counts"]["succeeded"] == again["counts"]["succeeded"] == 1
