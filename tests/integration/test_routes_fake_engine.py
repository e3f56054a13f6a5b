"""Every route through the whole job on a local Ray cluster with the fake engine: accounting, the model's task
deciding which routes it serves, and the flattened Parquet columns of each route."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.lines import chat_line, completion_line, read_jsonl

pytestmark = pytest.mark.usefixtures("local_ray")


def route_line(custom_id: str, url: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


GENERATIVE = [
    chat_line("chat-1", "What is the capital of France?", max_tokens=5),
    completion_line("cmpl-1", "Once upon a time", max_tokens=3),
    route_line("resp-1", "/v1/responses", input="Hi there", instructions="Be brief.", max_output_tokens=6),
    route_line(
        "resp-2", "/v1/responses", input=[{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]
    ),
]
POOLING = [
    route_line("emb-1", "/v1/embeddings", input="The cat sat on the mat."),
    route_line("emb-2", "/v1/embeddings", input=["one", "two", "three"], dimensions=8),
    route_line("score-1", "/v1/score", text_1="capital", text_2=["Paris", "yellow"]),
    route_line("score-2", "/score", queries=["a", "b"], documents=["c", "d"]),
    route_line("rerank-1", "/v1/rerank", query="capital", documents=["Paris", "yellow", "Rome"], top_n=2),
    route_line("rerank-2", "/rerank", query="q", documents=["a"]),
    route_line("rerank-3", "/v2/rerank", query="q", documents=["a", "b"]),
]


def _run(tmp_path, model, lines, name):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / name),
            "model": model,
            "engine": {"backend": "fake", "fake": {"output_tokens": 4, "embedding_dimensions": 12}},
            "resources": {"num_engines": 1, "cpus_per_engine": 0.5},
            "output_options": {"format": "parquet"},
        }
    )
    outcome = run_job(config, show_progress=False)
    results = pq.read_table(sorted((tmp_path / name).glob("results-*.parquet"))).to_pylist()
    errors = pq.read_table(sorted((tmp_path / name).glob("errors-*.parquet"))).to_pylist()
    return outcome, {r["custom_id"]: r for r in results}, {r["custom_id"]: r for r in errors}


def test_a_generative_model_answers_its_routes_and_refuses_pooling_ones(tmp_path):
    outcome, results, errors = _run(tmp_path, None, GENERATIVE + POOLING[:2], "generate")
    assert set(results) == {"chat-1", "cmpl-1", "resp-1", "resp-2"}
    assert {custom_id: json.loads(e["error"])["code"] for custom_id, e in errors.items()} == {
        "emb-1": "unsupported_task",
        "emb-2": "unsupported_task",
    }
    assert "'generate'" in json.loads(errors["emb-1"]["error"])["message"]
    assert results["chat-1"]["route"] == "chat" and results["chat-1"]["completion_tokens"] == 5
    assert results["resp-1"]["route"] == "responses" and len(results["resp-1"]["content"].split()) == 6
    assert results["cmpl-1"]["finish_reason"] == "length"
    manifest = outcome.manifest
    assert manifest["counts"]["total"] == 6 and manifest["counts"]["succeeded"] == 4


def test_an_embedding_model_answers_pooling_routes_with_flattened_columns(tmp_path):
    chat = route_line("chat-1", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}])
    outcome, results, errors = _run(tmp_path, "embedded:minilm", [*POOLING, chat], "pool")
    assert set(results) == {json.loads(line)["custom_id"] for line in POOLING}
    assert json.loads(errors["chat-1"]["error"])["code"] == "unsupported_task"
    assert [len(v) for v in results["emb-2"]["embeddings"]] == [8, 8, 8]  # the requested dimensions
    assert len(results["emb-1"]["embeddings"][0]) == 12  # the fake's configured default
    assert len(results["score-1"]["scores"]) == 2 and len(results["score-2"]["scores"]) == 2
    assert len(results["rerank-1"]["ranking"]) == 2 and results["rerank-3"]["route"] == "rerank"
    for row in results.values():
        assert row["completion_tokens"] == 0 and row["prompt_tokens"] > 0 and row["content"] is None
    manifest = outcome.manifest
    assert manifest["model"]["name"] == "all-minilm-l6-v2" and manifest["model"]["task"] == "embed"
    assert manifest["tokens"]["completion"] == 0


def test_jsonl_results_keep_the_whole_body(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(POOLING[:1]) + "\n")
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "model": "embedded:minilm",
            "engine": {"backend": "fake"},
            "resources": {"num_engines": 1, "cpus_per_engine": 0.5},
        }
    )
    run_job(config, show_progress=False)
    (record,) = read_jsonl((tmp_path / "out").glob("results-*.jsonl"))
    body = record["response"]["body"]
    assert body["object"] == "list" and len(body["data"][0]["embedding"]) == 384


def test_one_model_per_pool_each_line_runs_on_a_pool_serving_its_model(tmp_path):
    """A chat pool and an embedding pool in one job: each line goes to the pool serving its `model` (or, without
    one, to the first model that can serve its route); another name is model_not_found."""
    lines = [
        route_line("a-chat", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}]),
        route_line(
            "b-chat",
            "/v1/chat/completions",
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "yo"}],
        ),
        route_line("c-emb", "/v1/embeddings", input="no model named"),
        route_line("d-emb", "/v1/embeddings", model="all-minilm-l6-v2", input=["x", "y"]),
        route_line("e-rerank", "/v1/rerank", query="q", documents=["a", "b"]),
        route_line("f-resp", "/v1/responses", input="hello"),
        route_line("g-missing", "/v1/embeddings", model="gpt-4o", input="x"),
        route_line("h-wrong", "/v1/embeddings", model="smollm2-135m-instruct", input="x"),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "engine": {"backend": "fake", "fake": {"output_tokens": 3}},
            "pools": [
                {"name": "chat", "cpus_per_engine": 0.5},
                {"name": "embed", "model": "embedded:minilm", "cpus_per_engine": 0.5},
            ],
        }
    )
    outcome = run_job(config, show_progress=False)
    results = {r["custom_id"]: r for r in read_jsonl((tmp_path / "out").glob("results-*.jsonl"))}
    errors = {
        r["custom_id"]: r["error"]["code"] for r in read_jsonl((tmp_path / "out").glob("errors-*.jsonl"))
    }
    served_by = {custom_id: r["response"]["body"]["model"] for custom_id, r in results.items()}
    assert served_by == {
        "a-chat": "smollm2-135m-instruct",
        "b-chat": "smollm2-135m-instruct",
        "c-emb": "all-minilm-l6-v2",
        "d-emb": "all-minilm-l6-v2",
        "e-rerank": "all-minilm-l6-v2",
        "f-resp": "smollm2-135m-instruct",
    }
    assert errors == {"g-missing": "model_not_found", "h-wrong": "unsupported_task"}
    manifest = outcome.manifest
    models = manifest["models"]
    assert (
        models["smollm2-135m-instruct"]["pools"] == ["chat"] and models["smollm2-135m-instruct"]["rows"] == 3
    )
    assert models["all-minilm-l6-v2"]["pools"] == ["embed"] and models["all-minilm-l6-v2"]["rows"] == 3
    assert (
        models["all-minilm-l6-v2"]["completion_tokens"] == 0
        and models["smollm2-135m-instruct"]["completion_tokens"] == 9
    )
    assert manifest["pools"]["chat"]["rows"] == 3 and manifest["pools"]["embed"]["rows"] == 3
    assert manifest["counts"]["total"] == len(lines) and manifest["counts"]["succeeded"] == 6


def test_a_pool_whose_model_has_no_lines_starts_no_engine(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(route_line("only", "/v1/embeddings", input="x") + "\n")
    config = JobConfig.model_validate(
        {
            "input": str(path),
            "output": str(tmp_path / "out"),
            "engine": {"backend": "fake"},
            "pools": [
                {"name": "chat", "cpus_per_engine": 0.5},
                {"name": "embed", "model": "embedded:minilm", "cpus_per_engine": 0.5},
            ],
        }
    )
    manifest = run_job(config, show_progress=False).manifest
    assert set(manifest["pools"]) == {"embed"} and manifest["models"]["smollm2-135m-instruct"]["rows"] == 0
