"""`nightshift run` end to end on the real vLLM engine and the embedded model: one engine start for the module.

Covers every bad-input kind, sorting across shard boundaries, the manifest, and response fidelity against
vLLM's own batch runner used as an oracle on the same valid lines. Its own engine (not the session's warm ones,
tests/e2e/warm_cluster.py): a user's first `nightshift run`, from start to report, is the subject.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.cli import run_cli
from tests.e2e.run_batch import bodies, run_batch
from tests.lines import MODEL_NAME, chat_line, completion_line, read_jsonl, write_lines
from tests.runs import foreign_lines

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Name three primary colors.",
    "What is 2+2?",
    "Who wrote Hamlet?",
    "Write a haiku about the sea.",
    "What do bees make?",
    "How many days are in a leap year?",
    "What is the largest planet in our solar system?",
    "Translate 'good morning' into Spanish.",
]
VALID_CHATS = [chat_line(f"chat-{i:02d}", q, max_tokens=24, temperature=0) for i, q in enumerate(QUESTIONS)]
VALID_COMPLETIONS = [completion_line("cmpl-00", "Once upon a time", max_tokens=12, temperature=0)]

# One sequence at a time, here and in the oracle: greedy decoding in bf16 is only bit-stable when the batch
# composition is the same, and the comparison is about the serving layer, not about batching numerics.
ENGINE_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "1"]
# The job itself leaves max_model_len to fitting, so the oracle comparison also shows that fitting the context
# changes no response body.
JOB_FLAGS = ["--max-num-seqs", "1"]
# The embedded model's context limit: a prompt this long cannot run at any max_model_len.
MODEL_LIMIT = 8192

# (line, expected error code): each kind of bad input the contract names.
BAD_LINES = [
    ("{this is not json", "invalid_json"),
    (
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}),
        "missing_custom_id",
    ),
    (
        json.dumps({"custom_id": "", "method": "POST", "url": "/v1/chat/completions", "body": {}}),
        "missing_custom_id",
    ),
    (
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"}),
        "invalid_request",
    ),
    (
        json.dumps({"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
        "unsupported_task",
    ),
    (
        json.dumps(
            {"custom_id": "moderate", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}}
        ),
        "unsupported_url",
    ),
    (chat_line("streamed", "hi", stream=True), "stream_unsupported"),
    (chat_line("other-model", "hi", model="gpt-4o"), "model_not_found"),
    (chat_line("chat-01", "a duplicate custom_id"), "duplicate_custom_id"),
    (chat_line("too-long", "word " * (MODEL_LIMIT + 100), max_tokens=8), "context_length_exceeded"),
    (chat_line("bad-temperature", "hi", temperature=-1), "invalid_request"),
    (chat_line("bad-top-k", "hi", top_k=-5), "invalid_request"),  # only vLLM's sampling params know this one
]


@pytest.fixture(scope="module")
def job(e2e_dir, embedded_model):
    lines = VALID_CHATS[:4] + [b for b, _ in BAD_LINES[:6]] + VALID_CHATS[4:] + VALID_COMPLETIONS
    lines += [b for b, _ in BAD_LINES[6:]]
    input_path = write_lines(e2e_dir / "mixed.jsonl", lines)
    output = e2e_dir / "out"
    # A NIGHTSHIFT_HOME of its own that shares only the prepared model: the driver starts as on a fresh machine
    # (it imports vLLM to learn its engine-arg names), so the output check below sees a first run's output too.
    home = e2e_dir / "home"
    home.mkdir()
    (home / "models").symlink_to(Path(embedded_model.path).parent)
    proc = run_cli(
        "run",
        str(input_path),
        str(output),
        *JOB_FLAGS,
        "--rows-per-shard",
        "3",
        "--no-progress",
        env={"NIGHTSHIFT_HOME": str(home)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return input_path, output, lines, proc


def test_exit_and_summary(job):
    _, output, lines, proc = job
    tail = proc.stdout.strip().splitlines()
    assert tail[0].startswith(f"rows       {len(lines)} total, 9 ok, {len(BAD_LINES)} failed")
    assert str(output) in tail[-1]


def test_a_clean_run_prints_only_its_own_lines(job):
    _, _, _, proc = job
    assert foreign_lines(proc.stdout, proc.stderr) == [], proc.stderr


def test_every_bad_input_kind_is_one_error_record(job):
    """README "Failure model", row "a bad line", on the real engine: each bad line is exactly one error record of
    its kind, and every other line has its result."""
    input_path, output, lines, _ = job
    results = read_jsonl(output.glob("results-*.jsonl"))
    errors = read_jsonl(output.glob("errors-*.jsonl"))
    assert len(results) + len(errors) == len(lines)
    line_of = {}
    for number, line in enumerate(lines, start=1):
        try:
            line_of.setdefault(json.loads(line).get("custom_id"), number)
        except ValueError:
            pass
    by_line = {}
    for record in errors:
        if record["error"] is not None:
            assert record["response"] is None
            assert record["error"]["source"] == str(input_path)
            by_line[record["error"]["line"]] = record["error"]["code"]
        else:  # understood, then rejected by the engine: the OpenAI error body
            assert record["response"]["status_code"] == 400
            assert record["response"]["body"]["error"]["message"]
            by_line[line_of[record["custom_id"]]] = record["response"]["body"]["error"]["code"]
    expected = {lines.index(line) + 1: code for line, code in BAD_LINES}
    assert by_line == expected


def test_results_are_real_answers_sorted_across_shards(job):
    _, output, _, _ = job
    shards = sorted(output.glob("results-*.jsonl"))
    assert len(shards) == 3  # 9 results, 3 per shard
    ids = [r["custom_id"] for r in read_jsonl(shards)]
    assert ids == sorted(ids) and len(ids) == len(set(ids)) == 9
    answers = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(shards)}
    assert "4" in answers["chat-01"]["choices"][0]["message"]["content"]
    assert "Shakespeare" in answers["chat-02"]["choices"][0]["message"]["content"]
    assert answers["cmpl-00"]["object"] == "text_completion" and answers["cmpl-00"]["choices"][0]["text"]
    assert all(b["model"] == MODEL_NAME for b in answers.values())


def test_manifest_reports_engine_and_counts(job):
    _, output, lines, _ = job
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["counts"]["total"] == len(lines)
    assert manifest["counts"]["succeeded"] == 9
    assert sum(manifest["counts"]["by_error_code"].values()) == len(BAD_LINES)
    args = manifest["engine"]["args"]
    assert args["enable_prefix_caching"] is True and args["max_num_seqs"] == 1
    assert args["kv_cache_tokens"] > 0
    assert manifest["engine"]["backend"] == "vllm"
    assert manifest["model"]["source"] == "embedded" and manifest["model"]["revision"]
    assert manifest["tokens"]["completion"] > 0
    assert "preemptions" in manifest and [s["rows"] for s in manifest["shards"]["results"]] == [3, 3, 3]


def _comparable(body: dict) -> dict:
    """A response body without what legitimately differs between two runs: ids, timestamps, fingerprints."""
    body = {k: v for k, v in body.items() if k not in ("id", "created", "system_fingerprint")}
    return body


def test_bodies_match_vllm_run_batch_oracle(job, e2e_dir, embedded_model):
    _, output, _, _ = job
    oracle = bodies(run_batch(e2e_dir, "chat", VALID_CHATS, "--model", embedded_model.path, "--served-model-name", MODEL_NAME, *ENGINE_FLAGS))  # fmt: skip
    ours = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(output.glob("results-*.jsonl"))}
    assert set(oracle) == {json.loads(line)["custom_id"] for line in VALID_CHATS}
    for custom_id, body in oracle.items():
        assert _comparable(ours[custom_id]) == _comparable(body), custom_id


def test_max_model_len_is_fitted_and_the_too_long_prompt_never_reached_the_engine(job):
    _, output, lines, proc = job
    manifest = json.loads((output / "manifest.json").read_text())
    fitted = manifest["engine"]["fitted"]
    context = fitted["max_model_len"]
    assert (
        context["source"] == "fitted"
        and context["model_limit"] == MODEL_LIMIT
        and context["block_size"] == 128
    )
    # Valid requests are short; those without max_tokens are budgeted 256 output tokens: one or a few blocks.
    longest = fitted["measured"]["prompt_plus_max_tokens"]["max"]
    assert context["value"] == -(-longest // 128) * 128 < MODEL_LIMIT
    assert manifest["engine"]["args"]["max_model_len"] == context["value"]  # what vLLM ran with
    assert fitted["max_num_seqs"]["default"]["source"] == "given"
    assert fitted["context_length_exceeded"] == 1
    errors = {r["custom_id"]: r for r in read_jsonl(output.glob("errors-*.jsonl"))}
    message = errors["too-long"]["response"]["body"]["error"]["message"]
    assert f"maximum context length is {MODEL_LIMIT} tokens" in message
    assert "max_model_len" in proc.stdout and "(fitted)" in proc.stdout  # the summary names the fitted values


def test_fitting_counts_prompt_tokens_exactly_as_the_engine_does(job, embedded_model):
    from pipeline.tokens import PromptCounter

    _, output, lines, _ = job
    counter = PromptCounter.for_model(embedded_model.path)
    requests = {}
    for line in lines:
        try:
            request = json.loads(line)
            requests.setdefault(request["custom_id"], request)
        except (ValueError, KeyError, TypeError):
            pass
    results = read_jsonl(output.glob("results-*.jsonl"))
    for record in results:
        request = requests[record["custom_id"]]
        counted = counter.count(request["url"], request["body"])
        assert counted == [record["response"]["body"]["usage"]["prompt_tokens"]], record["custom_id"]


def test_the_report_draws_every_chart_from_the_real_engine(job):
    # The real engine reports its KV cache usage, so unlike the fake engine's report no chart is left a sentence.
    from pipeline.observe.report import CHARTS
    from tests.report_charts import chart_svgs, drawn

    _, output, _, _ = job
    svgs = chart_svgs((output / "report.html").read_text())
    assert sorted(svgs) == sorted(CHARTS)
    assert all(drawn(svg) for svg in svgs.values())
