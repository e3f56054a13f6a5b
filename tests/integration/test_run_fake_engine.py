"""The whole job on a real local Ray cluster with the fake engine: sorting, sharding, accounting, the manifest."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from pipeline.config import JobConfig
from pipeline.manifest import Manifest
from pipeline.runtime.job import run_job
from pipeline.runtime.preflight import PreflightError
from tests.lines import chat_line, completion_line, read_jsonl

pytestmark = pytest.mark.usefixtures("local_ray")


def _job(input_path, output, **overrides) -> JobConfig:
    config = {
        "input": str(input_path),
        "output": str(output),
        "model": None,
        "engine": {"backend": "fake", "fake": {"output_tokens": 4}},
        "resources": {"num_engines": 2, "cpus_per_engine": 0.5, "rows_per_task": 16},
        "output_options": {"rows_per_shard": 300, "staging_rows": 250},
    }
    config.update(overrides)
    return JobConfig.model_validate(config)


@pytest.fixture(scope="module")
def mixed_input(tmp_path_factory):
    """2,000 valid requests in shuffled id order, with bad lines sprinkled in."""
    rng = random.Random(7)
    ids = [f"id-{i:05d}" for i in range(2000)]
    rng.shuffle(ids)
    lines = []
    for n, custom_id in enumerate(ids):
        maker = completion_line if n % 5 == 0 else chat_line
        lines.append(maker(custom_id, f"request {custom_id} " + "x " * (n % 7)))
        if n % 400 == 0:
            lines.append("{broken json")
        if n % 500 == 0:
            lines.append(chat_line(custom_id, "a duplicate"))
    path = tmp_path_factory.mktemp("in") / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, len(lines)


@pytest.fixture(scope="module")
def finished(mixed_input, tmp_path_factory):
    path, n_lines = mixed_input
    output = tmp_path_factory.mktemp("out") / "job"
    outcome = run_job(_job(path, output), show_progress=False)
    return output, outcome, n_lines


def test_accounting_holds(finished):
    """README "Failure model", row "a bad line": one error record each, and every good line still has its result."""
    output, outcome, n_lines = finished
    results = read_jsonl(output.glob("results-*.jsonl"))
    errors = read_jsonl(output.glob("errors-*.jsonl"))
    assert len(results) + len(errors) == n_lines
    assert len(results) == 2000
    assert len({r["custom_id"] for r in results}) == 2000
    codes = sorted(e["error"]["code"] for e in errors)
    assert codes == ["duplicate_custom_id"] * 4 + ["invalid_json"] * 5


def test_results_sorted_across_shard_boundaries(finished):
    output, _, _ = finished
    shards = sorted(output.glob("results-*.jsonl"))
    assert [s.name for s in shards] == [f"results-{i:05d}-of-00007.jsonl" for i in range(7)]
    all_ids = []
    previous_last = None
    for shard in shards:
        ids = [json.loads(line)["custom_id"] for line in shard.read_text().splitlines()]
        assert ids == sorted(ids, key=lambda s: s.encode())
        if previous_last is not None:
            assert previous_last.encode() < ids[0].encode()
        previous_last = ids[-1]
        all_ids.extend(ids)
    assert all_ids == sorted(all_ids)


def test_errors_sorted_by_source_line_with_positions(finished):
    output, _, _ = finished
    errors = read_jsonl(output.glob("errors-*.jsonl"))
    lines = [e["error"]["line"] for e in errors]
    assert lines == sorted(lines)
    assert all(e["response"] is None and e["error"]["source"].endswith("mixed.jsonl") for e in errors)


def test_manifest_describes_the_output(finished):
    output, _, n_lines = finished
    manifest = json.loads((output / "manifest.json").read_text())
    assert not (output / "_staging").exists()
    assert manifest["counts"] == {
        "total": n_lines,
        "succeeded": 2000,
        "failed": n_lines - 2000,
        "by_error_code": {"duplicate_custom_id": 4, "invalid_json": 5},
        "structured": {"requested": 0, "parsed_json": 0},
    }
    assert manifest["input"]["lines"] == n_lines
    assert manifest["input"]["fingerprint"].startswith("sha256:")
    assert manifest["engine"]["backend"] == "fake"
    assert manifest["model"]["name"] == "smollm2-135m-instruct"
    for kind in ("results", "errors"):
        for shard in manifest["shards"][kind]:
            data = (output / shard["name"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
            assert data.count(b"\n") == shard["rows"]
    firsts = [s["first_custom_id"] for s in manifest["shards"]["results"]]
    lasts = [s["last_custom_id"] for s in manifest["shards"]["results"]]
    assert all(last < first for last, first in zip(lasts, firsts[1:], strict=False))
    assert manifest["tokens"]["completion"] == 2000 * 4
    assert manifest["pools"]["default"]["rows"] == 2000


def test_manifest_is_a_valid_manifest_model_and_what_the_job_returned(finished):
    """manifest.json is exactly `Manifest.model_dump(mode="json")`: every key is declared in the model, with its
    type, and nothing is lost or added on the way through it."""
    output, outcome, _ = finished
    written = json.loads((output / "manifest.json").read_text())
    manifest = Manifest.model_validate(written)
    assert manifest.model_dump(mode="json") == written == outcome.manifest
    assert manifest.recovery.resumed is False and manifest.engine.engines == 2


def test_completed_output_is_refused_then_overwritten(finished, mixed_input):
    output, _, _ = finished
    path, _ = mixed_input
    with pytest.raises(PreflightError, match="already holds a completed job"):
        run_job(_job(path, output), show_progress=False)


def test_same_input_gives_identical_shards_apart_from_ids(mixed_input, tmp_path):
    path, _ = mixed_input

    def normalized(output):
        rows = read_jsonl(output.glob("results-*.jsonl"))
        for row in rows:
            row.pop("id")
            row["response"].pop("request_id")
            row["response"]["body"].pop("created")
        return rows

    first = tmp_path / "a"
    second = tmp_path / "b"
    run_job(_job(path, first), show_progress=False)
    run_job(
        _job(path, second, resources={"num_engines": 1, "cpus_per_engine": 0.5, "rows_per_task": 7}),
        show_progress=False,
    )
    assert normalized(first) == normalized(second)


def test_fitted_engine_args_and_too_long_rows_reach_the_manifest(tmp_path):
    lines = [chat_line(f"r-{i:02d}", "word " * (5 + i), max_tokens=10) for i in range(20)]
    lines.append(chat_line("too-long", "word " * 9000))  # over the fake's 8192-token limit
    lines.append("{broken json")
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out"
    outcome = run_job(_job(path, output), show_progress=False)

    manifest = json.loads((output / "manifest.json").read_text())
    fitted = manifest["engine"]["fitted"]
    # The fake counts "user: word ...": r-19 has 24 words + 1 for the role = 25 prompt + 10 max_tokens.
    assert fitted["measured"]["prompt_plus_max_tokens"]["max"] == 35
    assert fitted["max_model_len"] == {
        "value": 48,
        "source": "fitted",
        "model_limit": 8192,
        "block_size": 16,
        "needed": 48,
        "why": "longest request 'r-19': 25 prompt + 10 output tokens = 35, rounded up to a 16-token KV block",
    }
    assert manifest["engine"]["args"]["max_model_len"] == 48  # what the engines ran with
    assert fitted["context_length_exceeded"] == 1
    assert manifest["counts"]["by_error_code"] == {"context_length_exceeded": 1, "invalid_json": 1}

    results = read_jsonl(output.glob("results-*.jsonl"))
    errors = read_jsonl(output.glob("errors-*.jsonl"))
    assert len(results) + len(errors) == len(lines) and len(results) == 20
    too_long = next(e for e in errors if e["custom_id"] == "too-long")
    assert too_long["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert outcome.counters.done == len(lines)


def test_given_max_model_len_wins_over_fitting(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(chat_line("a", "hello there", max_tokens=4) + "\n")
    config = _job(path, tmp_path / "out")
    config = config.model_copy(
        update={
            "engine": config.engine.model_copy(
                update={"vllm": config.engine.vllm.model_copy(update={"max_model_len": 1000})}
            )
        }
    )
    run_job(config, show_progress=False)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["engine"]["args"]["max_model_len"] == 1000
    assert manifest["engine"]["fitted"]["max_model_len"]["source"] == "given"


def test_the_in_flight_window_follows_the_engines_own_max_num_seqs(tmp_path):
    """An engine that decides max_num_seqs as it starts (a GPU's vLLM, here the fake engine's KV model: 640 tokens
    of cache at a 64-token context hold 10 sequences) gets 2 x that many requests at once, never a fixed cap."""
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(chat_line(f"r-{i:03d}", f"q {i}") for i in range(240)) + "\n")
    fake = {"output_tokens": 4, "decode_seconds_per_token": 0.01, "kv_cache_tokens": 640}
    config = _job(
        path,
        tmp_path / "out",
        engine={"backend": "fake", "fake": fake, "vllm": {"max_model_len": 64}},
        resources={"num_engines": 1, "cpus_per_engine": 0.5, "rows_per_task": 8},
    )
    outcome = run_job(config, show_progress=False)
    window = outcome.manifest["engine"]["in_flight"]["default"]
    assert window["max_num_seqs"] == 10 and window["window"] == 20
    # The engine saw the window fill (10 running, 10 waiting for a slot) and never more.
    assert window["peak_requests_inside"] == 20
    assert outcome.manifest["counts"]["succeeded"] == 240
    engines = outcome.manifest["engine"]["per_engine"]
    assert sum(e["rows"] for e in engines.values()) == 240 and all(e["node_id"] for e in engines.values())
    # One engine fed from the queue with a window of 20: never waiting for work between its first and last request.
    assert all(e["busy_share"] >= 0.9 for e in engines.values()), engines
