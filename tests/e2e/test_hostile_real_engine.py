"""Hostile lines through a whole job on the real engine: lines taken from other tools' test suites and docs, lines
that reach vLLM and make it refuse them, and a sample of the fuzz corpus. The job completes, each bad line is one
error record, and input lines = result lines + error lines.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.cli import run_cli
from tests.fuzz_lines import hostile_corpus
from tests.lines import MODEL_NAME, chat_line, completion_line, read_jsonl

pytestmark = pytest.mark.slow


def envelope(custom_id: str, body: dict, url: str = "/v1/chat/completions", **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def chat(custom_id: str, **body) -> str:
    return chat_line(custom_id, "Say hi.", **{"max_tokens": 4, **body})


# (line, the error code it must get, or None when it must run). Each is one line; none may fail the job.
CASES = [
    # vLLM's own run-batch tests send "stream": "True"; its request model reads it (and 1, "yes") as true
    (chat("stream-str", stream="True"), "stream_unsupported"),
    (chat("stream-int", stream=1), "stream_unsupported"),
    (chat("stream-yes", stream="yes"), "stream_unsupported"),
    (chat("stream-off", stream="false"), None),
    # fields vLLM coerces run with the coerced value
    (chat_line("coerced", "Say hi.", max_tokens="3", temperature="0", seed="7", n="1"), None),
    # bounds on one line
    ("[" * 2_400 + "]" * 2_400, "invalid_json"),
    (chat("deep", response_format={"type": "text", "x": json.loads("[" * 300 + "]" * 300)}), "invalid_json"),
    (chat("id-" + "x" * 600), "invalid_custom_id"),
    (chat("   "), "invalid_custom_id"),
    (chat("bell\u0007"), "invalid_custom_id"),
    (chat("max-1e30", max_tokens=1e30), "invalid_request"),
    (chat("max-int-huge", max_tokens=10**18), "context_length_exceeded"),
    (chat("max-zero", max_tokens=0), "invalid_request"),
    (chat("max-frac", max_tokens=2.5), "invalid_request"),
    (chat("temp-nan", temperature="nan"), "invalid_request"),
    (envelope("lower-method", {"prompt": "x"}, "/v1/completions", method="post"), "unsupported_method"),
    # accepted by validation, refused by vLLM itself: its 400 becomes the request's error, the engine goes on
    (
        envelope("content-int", {"messages": [{"role": "user", "content": 5}], "max_tokens": 4}),
        "invalid_request",
    ),
    (chat("tool-choice-no-tools", tool_choice="required"), "invalid_request"),
    (chat("bad-logit-bias", logit_bias={"not-a-token": 1}), "invalid_request"),
    (chat("bad-stop", stop=5), "invalid_request"),
    (completion_line("prompt-int-list-bad", [["x"]], max_tokens=4), "invalid_request"),
    # the job still answers the ordinary lines around them
    (chat("ok-chat"), None),
    (completion_line("ok-completion", "Once upon a time", max_tokens=4), None),
]


@pytest.fixture(scope="module")
def hostile_job(e2e_dir, shared_engines):
    fuzz = hostile_corpus(60, seed=23)
    lines = [line for line, _ in CASES] + fuzz
    path = e2e_dir / "hostile.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))
    output = e2e_dir / "hostile-out"
    # On the session's warm engines: what is checked is each line's outcome, not the engine's start.
    proc = run_cli(
        "run",
        str(path),
        str(output),
        *shared_engines.one_pool_job(e2e_dir),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = sum(1 for line in path.read_bytes().split(b"\n") if line.strip())
    return output, expected


def test_the_job_completes_and_every_line_is_accounted_for_once(hostile_job):
    output, expected = hostile_job
    results = read_jsonl(output.glob("results-*.jsonl"))
    errors = read_jsonl(output.glob("errors-*.jsonl"))
    assert len(results) + len(errors) == expected
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["counts"]["total"] == expected
    ids = [r["custom_id"] for r in results]
    assert len(ids) == len(set(ids))
    assert all(r["response"]["body"]["model"] == MODEL_NAME for r in results)


def test_each_case_gets_its_own_outcome(hostile_job):
    output, _ = hostile_job
    results = {r["custom_id"] for r in read_jsonl(output.glob("results-*.jsonl"))}
    errors = read_jsonl(output.glob("errors-*.jsonl"))
    code_of: dict[object, str] = {}
    for record in errors:
        code = (record["error"] or record["response"]["body"]["error"])["code"]
        line = record["error"]["line"] if record["error"] else None
        code_of[record["custom_id"] if record["custom_id"] is not None else ("line", line)] = code
    for number, (line, expected) in enumerate(CASES, start=1):
        try:
            custom_id = json.loads(line)["custom_id"]
        except (ValueError, RecursionError):
            custom_id = None
        key = custom_id if custom_id in code_of or custom_id in results else ("line", number)
        if expected is None:
            assert key in results, (line[:80], code_of.get(key))
        else:
            assert code_of.get(key) == expected, (line[:80], code_of.get(key))
