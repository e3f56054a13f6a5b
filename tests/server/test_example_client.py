"""examples/batch_api_client.py, as a user runs it against `nightshift serve` (the shared server, fake engine): it
prints the batch's `model` and `usage` and each file's `expires_at`, as the API holds them, and writes the result
and error lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.failure_figures import note
from tests.server.harness import KEY_A

pytestmark = pytest.mark.timeout(180)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_example_client_prints_usage_model_and_expiry_and_downloads_results(server, client_a, tmp_path):
    results = tmp_path / "results.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script needs nothing of the repo
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "batch_api_client.py"), "--base-url", server.base_url,
         "--output", "results.jsonl", "--poll-seconds", "0.5", "--expires-after", "7200"],
        env={**env, "NIGHTSHIFT_API_KEY": KEY_A}, capture_output=True, text=True, timeout=150, cwd=tmp_path,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    note(f"$ python examples/batch_api_client.py\n{out.rstrip()}")

    batch_id = re.search(r"^batch (batch_\w+): validating$", out, re.M).group(1)
    batch = client_a.batches.retrieve(batch_id)
    assert batch.status == "completed"
    # The usage and model it printed are the batch's own.
    usage = batch.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert (
        f"usage: input_tokens={usage.input_tokens} (cached 0), output_tokens={usage.output_tokens} (reasoning 0), "
        f"total_tokens={usage.total_tokens}"
    ) in out
    assert f"model: {batch.model}\n" in out and batch.model == "smollm2-135m-instruct"
    # Each file's expires_at: the input's from --expires-after, the outputs' from --output-expires-after (7 days).
    input_file = client_a.files.retrieve(batch.input_file_id)
    expiries = [int(x) for x in re.findall(r"^  expires_at: (\d+) \(", out, re.M)]
    assert input_file.expires_at == input_file.created_at + 7200 and expiries[0] == input_file.expires_at
    output_file = client_a.files.retrieve(batch.output_file_id)
    assert (
        output_file.expires_at == output_file.created_at + 7 * 86400
        and output_file.expires_at in expiries[1:]
    )
    # examples/chat.jsonl: 16 chat requests, a completion (another endpoint), a duplicate and an unknown model.
    counts = batch.request_counts
    assert f"{counts.completed} completed, {counts.failed} failed of {counts.total}" in out
    assert (counts.completed, counts.failed, counts.total) == (16, 3, 19)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    errors = [json.loads(line) for line in (tmp_path / "results.errors.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and len(errors) == 3
    assert results.read_bytes() == client_a.files.content(batch.output_file_id).content
