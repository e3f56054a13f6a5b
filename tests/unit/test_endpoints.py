"""The route registry: one entry per URL family, and every consumer (validation, counting, budgets, prefix keys,
the fake engine, Parquet columns) reading it. Fake bodies are checked against vLLM's own response models."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from typing import Any

import pytest

from pipeline.endpoints import ENDPOINTS, SUPPORTED_URLS, endpoint_answering, endpoint_for, urls_for_task
from pipeline.engines.base import EngineRequest, EngineSpec, build_engine
from pipeline.io.writers import flatten_records
from pipeline.max_tokens import output_budget
from pipeline.protocol import ErrorCode, dumps, result_record
from pipeline.stages.prefix_key import prefix_key
from pipeline.stages.validate import InvalidLine, LineValidator, ValidRequest

CHAT_MODEL, EMBED_MODEL = "chat-model", "embed-model"

# One body per route, as a user would write it.
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 5},
    "/v1/responses": {
        "input": "What is the capital of France?",
        "instructions": "Be brief.",
        "max_output_tokens": 7,
    },
    "/v1/embeddings": {"input": ["The cat sat on the mat.", "hello world"]},
    "/v1/score": {"text_1": "capital of France", "text_2": ["Paris is the capital.", "Bananas are yellow."]},
    "/score": {"queries": "capital of France", "documents": ["Paris is the capital."]},
    "/v1/rerank": {
        "query": "capital of France",
        "documents": ["Bananas.", "Paris is the capital.", "x"],
        "top_n": 2,
    },
    "/rerank": {"query": "q", "documents": ["a", "b"]},
    "/v2/rerank": {"query": "q", "documents": ["a", "b"]},
    "/v1/audio/transcriptions": {"file_url": "https://example.com/call.wav", "language": "en"},
    "/v1/audio/translations": {"file_url": "data:audio/wav;base64,UklGRg==", "max_completion_tokens": 9},
}
# Speech to text: usage in seconds of audio, not tokens; both answer in one shape, listed as transcriptions.
SPEECH = ("/v1/audio/transcriptions", "/v1/audio/translations")


def test_the_registry_serves_exactly_the_documented_urls():
    assert set(SUPPORTED_URLS) == set(BODIES)
    assert len(SUPPORTED_URLS) == len(set(SUPPORTED_URLS))  # no URL claimed twice
    assert {e.name for e in ENDPOINTS} == {
        "chat",
        "completions",
        "responses",
        "embeddings",
        "score",
        "rerank",
        "transcriptions",
        "translations",
    }
    assert endpoint_for("/v1/moderations") is None
    assert urls_for_task("embed") == [
        "/v1/embeddings",
        "/v1/score",
        "/score",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
    ]
    assert urls_for_task("generate") == ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    assert urls_for_task("transcription") == list(SPEECH)


def fake_answer(url: str, body: dict[str, Any], **args: Any):
    engine = build_engine(EngineSpec("fake", "/models/fake", CHAT_MODEL, args))
    return asyncio.run(engine.generate(EngineRequest("id-1", url, {**body, "model": CHAT_MODEL})))


@pytest.mark.parametrize("url", list(BODIES))
def test_fake_answer_is_recognised_counted_and_flattened(url):
    endpoint = endpoint_for(url)
    result = fake_answer(url, BODIES[url])
    assert result.status_code == 200, result.body
    assert endpoint.usage(result.body) == (result.prompt_tokens, result.completion_tokens)
    row = flatten_records([dumps(result_record("id-1", result.body))]).to_pylist()[0]
    if url in SPEECH:
        assert endpoint_answering(result.body) is endpoint_for(SPEECH[0])
        assert result.body["usage"] == {"type": "duration", "seconds": 1}
        assert (result.prompt_tokens, result.completion_tokens) == (0, 0)
        assert row["route"] == "transcriptions" and row["content"] == result.body["text"] != ""
        return
    assert endpoint_answering(result.body) is endpoint
    assert result.prompt_tokens > 0
    assert (result.completion_tokens > 0) is endpoint.generates
    assert row["route"] == endpoint.name
    assert row["prompt_tokens"] == result.prompt_tokens


def test_fake_answers_are_deterministic():
    for url, body in BODIES.items():
        assert fake_answer(url, body).body == fake_answer(url, body).body


@pytest.mark.parametrize("url", list(BODIES))
def test_fake_bodies_parse_as_vllms_own_response_models(url):
    """The fake is shaped like the real thing: vLLM's own pydantic response model of the route accepts it."""
    pytest.importorskip("vllm")
    from pydantic import TypeAdapter

    from pipeline.engines.vllm_engine import _import

    endpoint = endpoint_for(url)
    body = fake_answer(url, BODIES[url]).body
    parsed = TypeAdapter(_import(endpoint.vllm.response)).validate_python(body)
    if url in SPEECH:  # vLLM's speech-to-text answers name no model
        assert parsed.model_dump(mode="json") == body
        return
    assert parsed.model_dump(mode="json")["model"] == CHAT_MODEL


def test_fake_embeddings_have_the_requested_dimensions_and_unit_length():
    body = fake_answer("/v1/embeddings", {"input": ["a", "b", "a"], "dimensions": 16}).body
    vectors = [d["embedding"] for d in body["data"]]
    assert [len(v) for v in vectors] == [16, 16, 16] and [d["index"] for d in body["data"]] == [0, 1, 2]
    assert vectors[0] == vectors[2] != vectors[1]
    assert math.isclose(math.sqrt(sum(x * x for x in vectors[0])), 1.0, rel_tol=1e-5)
    default = fake_answer("/v1/embeddings", {"input": "a"}, embedding_dimensions=24).body
    assert len(default["data"][0]["embedding"]) == 24
    encoded = fake_answer(
        "/v1/embeddings", {"input": "a", "dimensions": 16, "encoding_format": "base64"}
    ).body
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    assert list(struct.unpack("<16f", raw)) == vectors[0]


def test_fake_rerank_is_sorted_and_cut_at_top_n():
    body = fake_answer("/v1/rerank", BODIES["/v1/rerank"]).body
    scores = [r["relevance_score"] for r in body["results"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    row = flatten_records([dumps(result_record("r", body))]).to_pylist()[0]
    assert row["scores"] == scores and row["ranking"] == [r["index"] for r in body["results"]]


def test_fake_pooling_request_longer_than_the_context_is_refused():
    result = fake_answer("/v1/embeddings", {"input": "word " * 50}, max_model_len=32)
    assert result.status_code == 400 and result.error_code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert fake_answer("/v1/embeddings", {"input": "word " * 30}, max_model_len=32).ok  # no output to fit


def test_parquet_columns_per_route():
    rows = {}
    for url, body in BODIES.items():
        answer = fake_answer(url, body).body
        rows[url] = flatten_records([dumps(result_record("r", answer))]).to_pylist()[0]
    chat, responses = rows["/v1/chat/completions"], rows["/v1/responses"]
    assert chat["content"] and chat["finish_reason"] == "length" and chat["embeddings"] is None
    assert (
        responses["content"]
        and responses["finish_reason"] == "length"
        and responses["completion_tokens"] == 7
    )
    embeddings = rows["/v1/embeddings"]["embeddings"]
    assert len(embeddings) == 2 and len(embeddings[0]) == 384 and rows["/v1/embeddings"]["content"] is None
    assert len(rows["/v1/score"]["scores"]) == 2 and rows["/v1/score"]["ranking"] is None
    assert rows["/v1/rerank"]["ranking"] is not None and rows["/v1/rerank"]["completion_tokens"] == 0


def test_output_budgets():
    assert output_budget("/v1/embeddings", {"input": "x"}) == (0, False)
    assert output_budget("/v1/rerank", BODIES["/v1/rerank"]) == (0, False)
    assert output_budget("/v1/responses", {"input": "x", "max_output_tokens": 9}) == (9, False)
    assert output_budget("/v1/responses", {"input": "x"}, chat_default=100) == (100, True)
    assert output_budget("/v1/responses", {"input": "x"}, generation_default=50) == (50, False)


def test_prefix_keys_follow_the_route():
    instructions = "You are a careful assistant. " * 20
    a = prefix_key("/v1/responses", {"instructions": instructions, "input": "one"})
    b = prefix_key("/v1/responses", {"instructions": instructions, "input": "two"})
    assert a is not None and a == b
    assert prefix_key("/v1/embeddings", {"input": instructions * 3}) is None  # pooling: no prefix cache


# -- validation against the served models' tasks ---------------------------------------------------------------------


def line(url: str, body: dict[str, Any], custom_id: str = "x") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_route_the_model_cannot_serve_is_unsupported_task():
    validate = LineValidator({CHAT_MODEL: "generate"})
    outcome = validate(line("/v1/embeddings", {"input": "x"}), 1, "in.jsonl")
    assert isinstance(outcome, InvalidLine) and outcome.code == "unsupported_task"
    message = outcome.record["error"]["message"]
    assert "/v1/embeddings" in message and "'generate'" in message
    reverse = LineValidator({EMBED_MODEL: "embed"})(
        line("/v1/chat/completions", BODIES["/v1/chat/completions"]), 1, "f"
    )
    assert (
        isinstance(reverse, InvalidLine)
        and reverse.code == "unsupported_task"
        and "'embed'" in reverse.record["error"]["message"]
    )


def test_an_unknown_task_lets_every_route_through():
    outcome = LineValidator(CHAT_MODEL)(line("/v1/embeddings", {"input": "x"}), 1, "f")
    assert isinstance(outcome, ValidRequest) and outcome.body["model"] == CHAT_MODEL


def test_a_body_without_model_goes_to_a_served_model_that_can_serve_its_route():
    validate = LineValidator({CHAT_MODEL: "generate", EMBED_MODEL: "embed"})
    chat = validate(line("/v1/chat/completions", BODIES["/v1/chat/completions"], "a"), 1, "f")
    embed = validate(line("/v1/embeddings", {"input": "x"}, "b"), 2, "f")
    assert chat.body["model"] == CHAT_MODEL and embed.body["model"] == EMBED_MODEL
    missing = validate(line("/v1/embeddings", {"input": "x", "model": "other"}, "c"), 3, "f")
    assert isinstance(missing, InvalidLine) and missing.code == "model_not_found"
    assert "'chat-model', 'embed-model'" in missing.record["error"]["message"]


@pytest.mark.parametrize(
    "url, body",
    [
        ("/v1/embeddings", {}),
        ("/v1/embeddings", {"input": "x", "encoding_format": "bytes"}),
        ("/v1/score", {"text_1": "a"}),
        ("/v1/rerank", {"query": "q", "documents": []}),
        ("/v1/responses", {"input": ""}),
    ],
)
def test_route_checks_are_invalid_request(url, body):
    outcome = LineValidator(CHAT_MODEL)(line(url, body), 1, "f")
    assert isinstance(outcome, InvalidLine) and outcome.code == "invalid_request"


def test_pooling_routes_do_not_read_sampling_fields_but_refuse_streams():
    validate = LineValidator(EMBED_MODEL)
    # Not a field of the embeddings API: not read as a sampling field, but refused by name (vLLM would ignore it).
    unknown = validate(line("/v1/embeddings", {"input": "x", "temperature": "hot"}, "a"), 1, "f")
    assert isinstance(unknown, InvalidLine) and unknown.code == "invalid_request"
    assert unknown.record["error"]["message"] == "Unrecognized request argument supplied: temperature"
    assert isinstance(
        validate(line("/v1/embeddings", {"input": "x", "user": "u1"}, "c"), 3, "f"), ValidRequest
    )
    streamed = validate(line("/v1/embeddings", {"input": "x", "stream": "true"}, "b"), 2, "f")
    assert isinstance(streamed, InvalidLine) and streamed.code == "stream_unsupported"
    responses = LineValidator(CHAT_MODEL)(
        line("/v1/responses", {"input": "x", "max_output_tokens": "0"}), 1, "f"
    )
    assert isinstance(responses, InvalidLine) and responses.code == "invalid_request"


# -- counting with a real tokenizer agrees with the engine ---------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_counter():
    pytest.importorskip("transformers")
    from pipeline.models import MissingDependencyError, resolve_model
    from pipeline.tokens import PromptCounter

    try:
        model = resolve_model("embedded:minilm")
    except MissingDependencyError as exc:
        pytest.skip(str(exc))
    return PromptCounter.for_model(model.path, task=model.task)


def test_pooling_prompts_count_as_the_engine_counts(minilm_counter):
    """Usage vLLM reported for these requests on all-MiniLM-L6-v2 (see tests/e2e/test_routes_real_engine.py)."""
    count = minilm_counter.count
    assert count("/v1/embeddings", {"input": "The cat sat on the mat."}) == [9]
    score = {
        "text_1": "What is the capital of France?",
        "text_2": ["Paris is the capital of France.", "Bananas are yellow."],
    }
    assert sum(count("/v1/score", score)) == 24  # each text its own sequence: query once, then each document
    assert sum(count("/v2/rerank", {"query": "capital", "documents": ["Paris", "yellow"]})) == 9


def test_every_speech_to_text_answer_shape_is_recognised():
    """json, verbose_json and diarized_json answers of vLLM's speech-to-text serving (their text in `content`)."""
    transcriptions = endpoint_for(SPEECH[0])
    usage = {"type": "duration", "seconds": 1}
    shapes = [
        {"text": "hi", "usage": usage},
        {"duration": 1.0, "language": "en", "text": "hi", "segments": [], "words": None, "usage": usage},
        {"task": "transcribe", "duration": 1.0, "text": "hi", "segments": [], "usage": usage},
    ]
    for body in shapes:
        assert endpoint_answering(body) is transcriptions, body
        assert transcriptions.flatten(body) == {"content": "hi"}
    assert endpoint_answering({"text": "hi", "choices": []}) is None
