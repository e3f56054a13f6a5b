"""Prefix-aware routing on a local Ray cluster with two fake engines: the rows of one system prompt run on one
engine (each engine logs what it ran to its own file), and switching routing off spreads them over both."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.lines import MODEL_NAME, chat_line, read_jsonl, write_lines

pytestmark = pytest.mark.slow

PROMPTS = 4
ROWS_PER_PROMPT = 48


def system_prompt(k: int) -> str:
    return f"You are assistant number {k}. " + "Answer carefully and completely. " * 12


def shared_prefix_lines() -> list[str]:
    lines = []
    for i in range(PROMPTS * ROWS_PER_PROMPT):  # prompts interleaved row by row: the input order is no help
        body = {
            "model": MODEL_NAME,
            "messages": [
                {"role": "system", "content": system_prompt(i % PROMPTS)},
                {"role": "user", "content": f"question {i}"},
            ],
        }
        lines.append(
            json.dumps(
                {"custom_id": f"r-{i:04d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
        )
    return lines


def run(tmp_path, name: str, lines: list[str], prefix_aware: bool, engines: int = 2):
    path = write_lines(tmp_path / f"{name}.jsonl", lines)
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / f"{name}-out"),
            "engine": {
                "backend": "fake",
                "fake": {
                    "output_tokens": 4,
                    "decode_seconds_per_token": 0.01,
                    "max_concurrency": 8,
                    "call_log": str(tmp_path / f"{name}-calls-{{pid}}.log"),
                },
            },
            "resources": {"num_engines": engines, "cpus_per_engine": 0, "rows_per_task": 8},
            "routing": {"prefix_aware": prefix_aware},
        }
    )
    outcome = run_job(config, show_progress=False)
    rows = read_jsonl(outcome.output.glob("results-*.jsonl"))
    assert sorted(r["custom_id"] for r in rows) == sorted(json.loads(x)["custom_id"] for x in lines)
    engines = {}
    for log in sorted(tmp_path.glob(f"{name}-calls-*.log")):
        engines[log.name] = log.read_text().split()
    return outcome.manifest, engines


def engines_per_prompt(engines: dict[str, list[str]]) -> dict[int, Counter]:
    spread: dict[int, Counter] = defaultdict(Counter)
    for engine, ids in engines.items():
        for custom_id in ids:
            spread[int(custom_id.split("-")[1]) % PROMPTS][engine] += 1
    return spread


def test_rows_of_one_prompt_run_on_one_engine(local_ray, tmp_path):
    manifest, engines = run(tmp_path, "routed", shared_prefix_lines(), prefix_aware=True)
    assert len(engines) == 2, "both engines must do work"
    assert sum(len(ids) for ids in engines.values()) == PROMPTS * ROWS_PER_PROMPT  # each row ran once
    spread = engines_per_prompt(engines)
    off_owner = sum(sum(c.values()) - max(c.values()) for c in spread.values())
    routing = manifest["routing"]
    assert routing["used"] and routing["keys"] == PROMPTS
    assert routing["keyed_rows_in_input"] == PROMPTS * ROWS_PER_PROMPT
    assert len(routing["rows_by_engine"]) == 2
    assert sum(routing["rows_by_engine"].values()) == PROMPTS * ROWS_PER_PROMPT
    # Only stolen rows (an engine out of its own prompts taking another's so as not to idle) may run elsewhere.
    assert off_owner <= routing["rows_stolen"] <= PROMPTS * ROWS_PER_PROMPT // 4, (spread, routing)
    assert routing["rows_routed"] + routing["rows_stolen"] == PROMPTS * ROWS_PER_PROMPT
    # Each engine owns whole prompts: every prompt has one engine that ran most of its rows (a steal takes whole
    # chunks of the prompt with the most rows waiting, so an owner may lose up to a few chunks near the end).
    assert all(max(c.values()) > ROWS_PER_PROMPT // 2 for c in spread.values()), spread


def prompt_switches(ids: list[str]) -> int:
    """How often the prompt changes from one row an engine ran to the next."""
    prompts = [int(custom_id.split("-")[1]) % PROMPTS for custom_id in ids]
    return sum(a != b for a, b in zip(prompts, prompts[1:], strict=False))


@pytest.mark.parametrize("prefix_aware", [True, False], ids=["routed", "unrouted"])
def test_one_engine_runs_a_prompts_rows_together(local_ray, tmp_path, prefix_aware):
    """One engine: with routing on, the queue hands it one prompt's rows after another (while that prompt is in its
    prefix cache), not in the input's interleaved order."""
    manifest, engines = run(tmp_path, "one", shared_prefix_lines(), prefix_aware=prefix_aware, engines=1)
    ((_, ids),) = engines.items()
    assert len(ids) == PROMPTS * ROWS_PER_PROMPT
    switches = prompt_switches(ids)
    if prefix_aware:
        assert manifest["routing"]["used"] and manifest["routing"]["keys"] == PROMPTS
        assert switches < 2 * PROMPTS, switches  # each prompt's rows in a few runs (the tail may split one)
    else:
        assert not manifest["routing"]["used"]
        assert switches > len(ids) // 2, switches  # the input's order: the prompt changes at almost every row


def test_without_routing_prompts_spread_over_engines(local_ray, tmp_path):
    manifest, engines = run(tmp_path, "spread", shared_prefix_lines(), prefix_aware=False)
    spread = engines_per_prompt(engines)
    assert manifest["routing"]["used"] is False and manifest["routing"]["enabled"] is False
    # Ray Data hands chunks to whichever actor is free: a prompt's rows land on both engines.
    assert sum(1 for c in spread.values() if len(c) == 2) >= PROMPTS // 2, spread


def test_a_job_without_shared_prompts_runs_as_one_pool(local_ray, tmp_path):
    lines = [chat_line(f"q-{i:03d}", f"question {i}") for i in range(64)]
    manifest, engines = run(tmp_path, "plain", lines, prefix_aware=True)
    routing = manifest["routing"]
    assert routing["enabled"] and not routing["used"] and routing["keyed_rows_in_input"] == 0
    assert routing["rows_unkeyed"] == 64 and sum(len(ids) for ids in engines.values()) == 64
