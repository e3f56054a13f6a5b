"""Embeddings, score and rerank end to end on the real engine with the embedded all-MiniLM-L6-v2 (embedded:minilm):
bodies as vLLM's own run-batch returns them for the same lines, vectors as sentence-transformers encodes them,
and the routes the model cannot serve as error records."""

from __future__ import annotations

import json
import math

import pytest

from tests.e2e.cli import run_cli
from tests.e2e.run_batch import run_batch
from tests.lines import read_jsonl, write_lines

pytestmark = pytest.mark.slow

MODEL = "all-minilm-l6-v2"


def line(custom_id: str, url: str, **body) -> str:
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}}
    )


TEXTS = [
    "The cat sat on the mat.",
    "A dog slept on the rug.",
    "Paris is the capital of France.",
    "hello world",
]
# Lines vLLM's run-batch answers too: the oracle runs exactly these.
ORACLE_LINES = [
    line("emb-1", "/v1/embeddings", input=TEXTS[0]),
    line("emb-2", "/v1/embeddings", input=TEXTS[1:]),
    line("emb-3", "/v1/embeddings", input=[101, 7592, 2088, 102]),  # token ids: [CLS] hello world [SEP]
    line("emb-4", "/v1/embeddings", input="base64 please", encoding_format="base64"),
    line("emb-5", "/v1/embeddings", input="x", dimensions=16),  # MiniLM has no Matryoshka dims: vLLM's 400
    line(
        "score-1",
        "/v1/score",
        text_1="What is the capital of France?",
        text_2=[TEXTS[2], "Bananas are yellow."],
    ),
    line("score-2", "/score", queries="capital of France", documents=[TEXTS[2]]),
    line("score-3", "/v1/score", data_1=["cat", "dog"], data_2=["kitten", "puppy"]),
    line(
        "rerank-1",
        "/v1/rerank",
        query="What is the capital of France?",
        documents=["Bananas.", TEXTS[2]],
        top_n=1,
    ),
    line("rerank-2", "/rerank", query="capital", documents=["Paris", "yellow", "Rome"]),
    line("rerank-3", "/v2/rerank", query="pets", documents=TEXTS[:2]),
]
# Lines nightshift answers without the engine.
OTHER_LINES = [
    line("chat-1", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}]),  # unsupported_task
    line("resp-1", "/v1/responses", input="hi"),  # unsupported_task
    line(
        "too-long", "/v1/embeddings", input="word " * 600
    ),  # over MiniLM's 256 tokens: context_length_exceeded
    line(
        "bytes", "/v1/embeddings", input="x", encoding_format="bytes"
    ),  # a binary body cannot be a batch line
]
EXPECTED_ERRORS = {
    "emb-5": "invalid_request",
    "chat-1": "unsupported_task",
    "resp-1": "unsupported_task",
    "too-long": "context_length_exceeded",
    "bytes": "invalid_request",
}


@pytest.fixture(scope="session")
def minilm():
    from pipeline.models import MissingDependencyError, resolve_model

    try:
        return resolve_model("embedded:minilm")
    except MissingDependencyError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def pooling_job(e2e_dir, minilm, shared_engines):
    """On the session's warm engines (tests/e2e/warm_cluster.py): what is checked is each body, not the engine's
    start."""
    lines = ORACLE_LINES[:5] + OTHER_LINES + ORACLE_LINES[5:]
    input_path = write_lines(e2e_dir / "pooling.jsonl", lines)
    output = e2e_dir / "pooling-out"
    proc = run_cli(
        "run", str(input_path), str(output), "--model", "embedded:minilm",
        *shared_engines.one_pool_job(e2e_dir, chat=False), "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["custom_id"]: r for r in read_jsonl(output.glob("results-*.jsonl"))}
    errors = {r["custom_id"]: r for r in read_jsonl(output.glob("errors-*.jsonl"))}
    return lines, output, results, errors


@pytest.fixture(scope="session")
def oracle(e2e_dir, minilm):
    """vLLM's own run-batch on the same lines, the same model and name."""
    return run_batch(e2e_dir, "pooling", ORACLE_LINES, "--model", minilm.path, "--served-model-name", MODEL)


def error_code(record: dict) -> str:
    if record["error"] is not None:
        return record["error"]["code"]
    return record["response"]["body"]["error"]["code"]


def test_accounting_and_error_records(pooling_job):
    lines, output, results, errors = pooling_job
    assert len(results) + len(errors) == len(lines)
    assert {custom_id: error_code(r) for custom_id, r in errors.items()} == EXPECTED_ERRORS
    assert "'embed'" in errors["chat-1"]["error"]["message"]  # names the model's task
    assert "/v1/chat/completions" in errors["chat-1"]["error"]["message"]
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["counts"]["succeeded"] == len(results) == len(ORACLE_LINES) - 1
    assert manifest["model"]["task"] == "embed" and manifest["engine"]["args"]["task"] == "embed"
    assert manifest["tokens"]["completion"] == 0 and manifest["tokens"]["prompt"] > 0
    fitted = manifest["engine"]["fitted"]
    assert fitted["max_model_len"]["model_limit"] == 256  # sentence_bert_config.json's max_seq_length


def test_every_result_line_parses_as_vllms_own_batch_output(pooling_job):
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput

    _, output, results, _ = pooling_job
    for path in output.glob("results-*.jsonl"):
        for text in path.read_text().splitlines():
            parsed = BatchRequestOutput.model_validate_json(text)
            assert parsed.response is not None and parsed.response.body is not None


def test_bodies_equal_vllms_own_run_batch(pooling_job, oracle):
    _, _, results, errors = pooling_job
    assert set(oracle) == {json.loads(x)["custom_id"] for x in ORACLE_LINES}
    for custom_id, theirs in oracle.items():
        if theirs["error"] is not None:  # run-batch keeps the error apart from the body
            assert (
                theirs["error"]["error"]["message"]
                == errors[custom_id]["response"]["body"]["error"]["message"]
            )
            continue
        ours = results[custom_id]["response"]["body"]
        assert _comparable(ours) == _comparable(theirs["response"]["body"]), custom_id
        close(_numbers(ours), _numbers(theirs["response"]["body"]), custom_id)


def test_vectors_equal_sentence_transformers_encoding(pooling_job, minilm):
    """The model's own library encodes the same texts to the same unit vectors (vLLM computes in float16 on CPU)."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer

    _, _, results, _ = pooling_job
    expected = (
        SentenceTransformer(minilm.path, device="cpu").encode(TEXTS, normalize_embeddings=True).tolist()
    )
    ours = [results["emb-1"]["response"]["body"]["data"][0]["embedding"]]
    ours += [d["embedding"] for d in results["emb-2"]["response"]["body"]["data"]]
    for i, (a, b) in enumerate(zip(ours, expected, strict=True)):
        assert len(a) == 384
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 5e-3, TEXTS[i]
        assert sum(x * y for x, y in zip(a, b, strict=True)) > 0.9999, TEXTS[i]


def test_parquet_columns_from_real_bodies(pooling_job):
    from pipeline.io.writers import flatten_records

    _, output, results, _ = pooling_job
    lines = [text for path in output.glob("results-*.jsonl") for text in path.read_text().splitlines()]
    rows = {row["custom_id"]: row for row in flatten_records(lines).to_pylist()}
    emb = rows["emb-2"]
    assert emb["route"] == "embeddings" and len(emb["embeddings"]) == 3 and len(emb["embeddings"][0]) == 384
    body = results["emb-2"]["response"]["body"]
    close(emb["embeddings"][1], body["data"][1]["embedding"], "emb-2", tolerance=1e-7)  # float32, exact
    assert rows["emb-4"]["embeddings"] is None  # base64 stays in `response`
    assert rows["score-1"]["scores"] == [d["score"] for d in results["score-1"]["response"]["body"]["data"]]
    assert rows["rerank-2"]["ranking"] == [
        r["index"] for r in results["rerank-2"]["response"]["body"]["results"]
    ]
    assert (
        rows["rerank-1"]["prompt_tokens"] == results["rerank-1"]["response"]["body"]["usage"]["prompt_tokens"]
    )


def test_counting_agrees_with_the_engines_usage(pooling_job, minilm):
    from pipeline.tokens import PromptCounter

    lines, _, results, _ = pooling_job
    counter = PromptCounter.for_model(minilm.path, task=minilm.task)
    requests = {json.loads(x)["custom_id"]: json.loads(x) for x in lines}
    for custom_id, record in results.items():
        request = requests[custom_id]
        counted = sum(counter.count(request["url"], request["body"]))
        assert counted == record["response"]["body"]["usage"]["prompt_tokens"], custom_id


def _comparable(body: dict) -> dict:
    """A body without what differs by run (ids, clocks) and with numbers left to `close`."""
    skip = ("id", "created")
    out = {}
    for key, value in body.items():
        if key in skip:
            continue
        if key == "data":
            value = [{k: v for k, v in d.items() if k not in ("embedding", "score")} for d in value]
        if key == "results":
            value = [{k: v for k, v in r.items() if k != "relevance_score"} for r in value]
        out[key] = value
    return out


def _numbers(body: dict) -> list[float]:
    numbers: list[float] = []
    for item in body.get("data") or []:
        vector = item.get("embedding", item.get("score"))
        if isinstance(vector, str):
            import base64
            import struct

            raw = base64.b64decode(vector)
            vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        numbers.extend(vector if isinstance(vector, list) else [vector])
    numbers.extend(r["relevance_score"] for r in body.get("results") or [])
    return numbers


def close(a: list[float], b: list[float], what: str, tolerance: float = 1e-4) -> None:
    assert len(a) == len(b), what
    worst = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    assert worst <= tolerance and all(math.isfinite(x) for x in a), f"{what}: differs by {worst}"
