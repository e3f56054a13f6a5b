"""`nightshift up`, two `nightshift run`s and `nightshift down` on the real vLLM engine: the second run answers every
line on the first run's engine, warm, and `down` leaves no engine behind. (The mechanism with the fake engine, and
the runs that must not use the runtime: tests/integration/test_up_run_down.py; its speed: bench/startup.py.)

Its own runtime and engine (not the session's warm cluster): the engine's start and reuse across processes are the
subject.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cluster.home import nightshift_home
from pipeline.runtime.hosting import warm_runtime
from tests.e2e.cli import run_cli
from tests.lines import MODEL_NAME, chat_line, read_jsonl, write_lines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTIONS = [
    "What is 2+2?",
    "Name a color.",
    "Who wrote Hamlet?",
    "What do bees make?",
    "Say hello.",
    "Name a fish.",
]


@pytest.fixture
def home(tmp_path, embedded_model) -> dict[str, str]:
    """A NIGHTSHIFT_HOME of its own (no other test's run finds this runtime), with the embedded model converted once
    for the session."""
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models").symlink_to(nightshift_home() / "models")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_", "RAY_ADDRESS"))}
    return {**env, "NIGHTSHIFT_HOME": str(tmp_path / "home"), "NIGHTSHIFT_WARM": "1"}


def _run(tmp_path: Path, name: str, env: dict[str, str]) -> tuple[dict, dict[str, dict]]:
    lines = [chat_line(f"{name}-{i}", q, max_tokens=16, temperature=0) for i, q in enumerate(QUESTIONS)]
    source = write_lines(tmp_path / f"{name}.jsonl", lines)
    out = tmp_path / f"{name}-out"
    done = run_cli(
        "run", str(source), str(out), "--num-engines", "1", "--cpus-per-engine", "1", "--max-model-len", "256",
        "--no-progress", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "on the warm runtime" in done.stderr
    records = {r["custom_id"]: r for r in read_jsonl(out.glob("results-*.jsonl"))}
    return json.loads((out / "manifest.json").read_text()), records


def test_the_second_run_answers_on_the_first_runs_engine(tmp_path, home):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    up = run_cli("up", "--idle-timeout", "10m", env=home)
    assert up.returncode == 0, up.stdout + up.stderr
    state = warm_runtime.read_state(Path(home["NIGHTSHIFT_HOME"]) / "up" / "state.json")
    try:
        first, _ = _run(tmp_path, "first", home)
        second, answers = _run(tmp_path, "second", home)
    finally:
        down = run_cli("down", env=home)
    assert down.returncode == 0 and f"daemon pid {state.pid} ended" in down.stdout

    assert first["engine"]["reused"] == 0 and second["engine"]["reused"] == 1
    # The runtime's task hosts measured the first run's rows with the model's tokenizer and kept it loaded: the
    # second run's ingest loaded none (a fresh Ray worker per run would have loaded it again).
    assert first["ingest"]["tokenizer_loads"] >= 1
    assert second["ingest"]["tokenizer_loads"] == 0
    assert second["counts"]["succeeded"] == len(QUESTIONS) and second["counts"]["failed"] == 0
    assert sorted(answers) == sorted(f"second-{i}" for i in range(len(QUESTIONS)))
    for record in answers.values():
        body = ChatCompletionResponse.model_validate(record["response"]["body"])
        assert body.model == MODEL_NAME and body.choices[0].message.content.strip()
    deadline = time.monotonic() + 30
    while warm_runtime.pid_alive(state.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not warm_runtime.pid_alive(state.pid)
