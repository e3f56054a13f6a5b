"""The whole job with `--engine http` on a local Ray cluster, against two small loopback OpenAI-compatible servers with
faults: accounting, one result per request, both servers used, the manifest's server identity — and a driver kill
followed by `resume`."""

from __future__ import annotations

import json
import sys

import pytest

from pipeline.config import JobConfig
from pipeline.manifest import Manifest
from pipeline.runtime.job import run_job
from pipeline.runtime.preflight import PreflightError
from tests.lines import chat_line, completion_line, read_jsonl
from tests.openai_stub import OpenAIStub
from tests.runs import kill_driver_half_way, nightshift_ok

pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.timeout(300)]

FAST_RETRIES = {"backoff_s": 0.01, "backoff_max_s": 0.05, "max_retries": 4, "timeout_s": 0.5}


def _lines(n: int) -> list[str]:
    faults = ["", " [429x1]", " [500x2]", " [dropx1]", " [slowx1]"]
    lines = []
    for i in range(n):
        maker = completion_line if i % 7 == 0 else chat_line
        lines.append(maker(f"id-{i:04d}", f"request {i} words here{faults[i % len(faults)]}", max_tokens=3))
    return lines


def test_a_job_through_two_servers_with_faults(tmp_path):
    lines = _lines(60) + [chat_line("bad-request", "[400]"), "{broken json"]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with OpenAIStub(kind="vllm", slow_s=1.0) as one, OpenAIStub(kind="llama.cpp", slots=4, slow_s=1.0) as two:
        config = JobConfig.model_validate(
            {
                "input": str(path),
                "output": str(tmp_path / "out"),
                "engine": {"backend": "http", "http": {"endpoints": [one.url, two.url], **FAST_RETRIES}},
                "resources": {"rows_per_task": 4},
            }
        )
        outcome = run_job(config, show_progress=False)
        answered = one.state.answered + two.state.answered
        used = (sum(one.state.answered.values()), sum(two.state.answered.values()))
    results = read_jsonl((tmp_path / "out").glob("results-*.jsonl"))
    errors = read_jsonl((tmp_path / "out").glob("errors-*.jsonl"))
    assert len(results) + len(errors) == len(lines)
    ids = [r["custom_id"] for r in results]
    assert ids == sorted(ids) and len(set(ids)) == 60
    assert all(count == 1 for count in answered.values()) and len(answered) == 60  # nothing ran twice
    assert all(u > 0 for u in used), used  # both servers pulled from the one queue
    assert sorted(e["custom_id"] or "" for e in errors) == ["", "bad-request"]
    bad = next(e for e in errors if e["custom_id"] == "bad-request")
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["code"] == "invalid_request"

    manifest = outcome.manifest
    assert Manifest.model_validate(manifest).model_dump(mode="json") == manifest
    engine = manifest["engine"]
    assert engine["backend"] == "http"
    servers = {s["endpoint"]: s for s in engine["probed"]["servers"]}
    assert servers[one.url]["kind"] == "vllm" and servers[one.url]["version"] == "0.0-stub"
    assert servers[two.url]["kind"] == "llama.cpp" and servers[two.url]["slots"] == 4
    assert engine["sampling_defaults"]["set_by"] == "server"
    assert engine["fitted"]["enabled"] is False and "servers" in engine["fitted"]["reason"]
    assert manifest["model"]["source"] == "server" and manifest["model"]["name"] == "smollm2-135m-instruct"
    assert set(manifest["pools"]) == {"endpoint-0", "endpoint-1"}


def test_a_model_the_server_does_not_serve_fails_before_any_work(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(chat_line("a", "hi") + "\n")
    with OpenAIStub() as stub:
        config = JobConfig.model_validate(
            {
                "input": str(path),
                "output": str(tmp_path / "out"),
                "model": "gpt-4o",
                "engine": {"backend": "http", "http": {"endpoints": [stub.url]}},
            }
        )
        with pytest.raises(PreflightError, match="does not serve 'gpt-4o'.*--model"):
            run_job(config, show_progress=False)
        assert sum(stub.state.attempts.values()) == 0
    assert not (tmp_path / "out" / "_staging").exists()


def test_driver_killed_half_way_then_resume(tmp_path):
    n = 120
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(chat_line(f"id-{i:04d}", f"q {i}", max_tokens=2) for i in range(n)) + "\n")
    output = tmp_path / "out"
    with OpenAIStub(delay_s=0.05) as stub:
        cmd = [sys.executable, "-m", "pipeline", "run", str(path), str(output), "--engine", "http"]
        cmd += ["--endpoint", stub.url, "--concurrency", "2", "--no-progress"]
        staged_before = kill_driver_half_way(cmd, output, n)
        assert not (output / "manifest.json").exists()
        answered_before = sum(stub.state.answered.values())
        nightshift_ok("resume", str(output), "--no-progress")
        answered_after = sum(stub.state.answered.values()) - answered_before
    results = read_jsonl(output.glob("results-*.jsonl"))
    assert sorted(r["custom_id"] for r in results) == [f"id-{i:04d}" for i in range(n)]
    # finished rows are not sent again: resume asked the server only for what was not staged
    assert answered_after <= n - len(staged_before)
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["recovery"]["resumed"] is True
    assert manifest["recovery"]["rows_from_earlier_runs"] == len(staged_before)
