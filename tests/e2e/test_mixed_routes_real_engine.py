"""A held-out mix of every route through `nightshift run` on the real engine, one job serving two models (a chat
pool with the embedded SmolLM2 and an embedding pool with embedded:minilm), with a tool-call parser set: accounting
holds, every line lands on a model that can serve it or is an error record saying why, and every body parses with
vLLM's own models (run-batch's BatchRequestOutput for the routes it serves, the route's response model for the rest)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cli import run_cli
from tests.e2e.warm_cluster import CHAT_CONTEXT
from tests.lines import read_jsonl, write_lines

pytestmark = pytest.mark.slow

CHAT, EMBED = "smollm2-135m-instruct", "all-minilm-l6-v2"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def line(custom_id: str, url: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


LINES = [
    line(
        "chat-1",
        "/v1/chat/completions",
        model=CHAT,
        messages=user("What is 2+2?"),
        max_tokens=16,
        temperature=0,
    ),
    line("chat-2", "/v1/chat/completions", messages=user("Name a colour."), max_tokens=8, temperature=0),
    line(
        "chat-tool",
        "/v1/chat/completions",
        messages=user("What is the weather in Paris?"),
        tools=[TOOL],
        tool_choice="required",
        max_tokens=48,
        temperature=0,
    ),
    line("cmpl-1", "/v1/completions", prompt="The capital of France is", max_tokens=8, temperature=0),
    line(
        "resp-1",
        "/v1/responses",
        input="Say hello.",
        instructions="Be brief.",
        max_output_tokens=10,
        temperature=0,
    ),
    line("emb-1", "/v1/embeddings", input="The cat sat on the mat."),
    line("emb-2", "/v1/embeddings", model=EMBED, input=["one", "two"]),
    line("score-1", "/v1/score", text_1="capital of France", text_2=["Paris", "Bananas"]),
    line("score-2", "/score", model=EMBED, queries="q", documents=["a"]),
    line("rerank-1", "/v1/rerank", query="capital of France", documents=["Bananas", "Paris"], top_n=1),
    line("rerank-2", "/v2/rerank", query="pets", documents=["cat", "car"]),
    # Lines that cannot run: a route the named model cannot serve, both ways; a model no pool serves.
    line("bad-emb", "/v1/embeddings", model=CHAT, input="x"),
    line("bad-chat", "/v1/chat/completions", model=EMBED, messages=user("hi")),
    line("bad-model", "/v1/embeddings", model="text-embedding-3-small", input="x"),
]
EXPECTED_ERRORS = {
    "bad-emb": "unsupported_task",
    "bad-chat": "unsupported_task",
    "bad-model": "model_not_found",
}
SERVED_BY = {
    **{k: CHAT for k in ("chat-1", "chat-2", "chat-tool", "cmpl-1", "resp-1")},
    **{k: EMBED for k in ("emb-1", "emb-2", "score-1", "score-2", "rerank-1", "rerank-2")},
}


@pytest.fixture(scope="module")
def mixed_job(e2e_dir, shared_engines):
    """On the session's warm engines (tests/e2e/warm_cluster.py): what is checked is where each line ran and what
    came back, not the engines' start."""
    input_path = write_lines(e2e_dir / "mixed-routes.jsonl", LINES)
    config = e2e_dir / "two-models.yaml"
    config.write_text(
        f"engine: {{warm_engines: {shared_engines.keeper}}}\n"
        "pools:\n"
        f"  - {{name: chat, cpus_per_engine: 1, engine_overrides: {{max_model_len: {CHAT_CONTEXT}}}}}\n"
        "  - {name: embed, model: 'embedded:minilm', cpus_per_engine: 1}\n"
    )
    output = e2e_dir / "mixed-routes-out"
    proc = run_cli(
        "run", str(input_path), str(output), "--config", str(config), *shared_engines.job_args(pools_in_config=True),
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["custom_id"]: r for r in read_jsonl(output.glob("results-*.jsonl"))}
    errors = {r["custom_id"]: r for r in read_jsonl(output.glob("errors-*.jsonl"))}
    manifest = json.loads((output / "manifest.json").read_text())
    return output, results, errors, manifest


def test_accounting_and_where_each_line_ran(mixed_job):
    _, results, errors, manifest = mixed_job
    assert len(results) + len(errors) == len(LINES) == manifest["counts"]["total"]
    codes = {k: (r["error"] or r["response"]["body"]["error"])["code"] for k, r in errors.items()}
    assert codes == EXPECTED_ERRORS
    assert {k: r["response"]["body"]["model"] for k, r in results.items()} == SERVED_BY
    models = manifest["models"]
    assert (
        models[CHAT]["pools"] == ["chat"] and models[CHAT]["rows"] == 5 and models[CHAT]["task"] == "generate"
    )
    assert (
        models[EMBED]["pools"] == ["embed"]
        and models[EMBED]["rows"] == 6
        and models[EMBED]["task"] == "embed"
    )
    assert models[EMBED]["completion_tokens"] == 0 and models[CHAT]["completion_tokens"] > 0
    assert sum(m["prompt_tokens"] for m in models.values()) == manifest["tokens"]["prompt"]


def test_every_body_parses_with_vllms_own_models(mixed_job):
    from pydantic import TypeAdapter
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput

    from pipeline.endpoints import endpoint_answering
    from pipeline.engines.vllm_engine import _import

    output, results, _, _ = mixed_job
    run_batch_routes = {
        "chat",
        "embeddings",
        "score",
        "rerank",
    }  # what run-batch's own union of bodies covers
    for path in output.glob("results-*.jsonl"):
        for text in path.read_text().splitlines():
            record = json.loads(text)
            endpoint = endpoint_answering(record["response"]["body"])
            if endpoint.name in run_batch_routes:
                assert BatchRequestOutput.model_validate_json(text).response.body is not None
            else:  # completions, responses: the envelope as run-batch's, the body as the route's response model
                envelope = {**record, "response": {**record["response"], "body": None}}
                BatchRequestOutput.model_validate(envelope)
                TypeAdapter(_import(endpoint.vllm.response)).validate_python(record["response"]["body"])


def test_the_tool_call_parser_is_in_force(mixed_job):
    _, results, _, manifest = mixed_job
    args = manifest["engine"]["args"]
    assert args["tool_call_parser"] == "hermes" and args["enable_auto_tool_choice"] is True
    message = results["chat-tool"]["response"]["body"]["choices"][0]["message"]
    # Without the parser this request is vLLM's 400 ("requires --tool-call-parser to be set"); with it, a tool
    # call (what a 135M model puts in its arguments is its own affair: they are JSON).
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])
    assert results["chat-tool"]["response"]["body"]["choices"][0]["finish_reason"] == "tool_calls"


def test_answers_are_real(mixed_job):
    _, results, _, _ = mixed_job
    assert "4" in results["chat-1"]["response"]["body"]["choices"][0]["message"]["content"]
    assert "Paris" in results["cmpl-1"]["response"]["body"]["choices"][0]["text"]
    ranked = results["rerank-1"]["response"]["body"]["results"]
    assert [r["document"]["text"] for r in ranked] == ["Paris"]
    assert len(results["emb-2"]["response"]["body"]["data"][1]["embedding"]) == 384
