"""The body fields each route knows (`Endpoint.body_fields`) and what validation does with any other; `n`, JSON
output and the fake's answers to them."""

from __future__ import annotations

import importlib
import json
import typing

import pytest

from pipeline.endpoints import ENDPOINTS, FakeContext, endpoint_for
from pipeline.endpoints.base import OPENAI_BOOKKEEPING_FIELDS, parses_as_json
from pipeline.stages.validate import InvalidLine, LineValidator, ValidRequest

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MODEL = "m"


def _vllm_fields(request_path: str) -> set[str]:
    """Every field name and alias of vLLM's request model (each model of a union), as vLLM's OpenAIBaseModel
    compares a body's keys with them before it ignores the rest."""
    from pydantic import BaseModel

    def models(t: typing.Any) -> list[type[BaseModel]]:
        if isinstance(t, type) and issubclass(t, BaseModel):
            return [t]
        return [m for arg in typing.get_args(t) for m in models(arg)]

    module, name = request_path.split(":")
    names: set[str] = set()
    for model in models(getattr(importlib.import_module(module), name)):
        for field_name, info in model.model_fields.items():
            names.add(field_name)
            if info.alias:
                names.add(info.alias)
    return names


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.name)
def test_body_fields_are_the_installed_vllms(endpoint):
    """A vLLM upgrade that adds (or drops) a request field fails here, not in users' batches: copy the set shown."""
    pytest.importorskip("vllm")
    known = _vllm_fields(endpoint.vllm.request)
    assert endpoint.body_fields == known, (
        f"{endpoint.name}: vLLM knows {sorted(known - endpoint.body_fields)} that body_fields lacks, and "
        f"body_fields has {sorted(endpoint.body_fields - known)} that vLLM does not know; the set now: "
        f"{' '.join(sorted(known))}"
    )


def _line(url: str, body: dict, custom_id: str = "a") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _check(url: str, body: dict):
    return LineValidator(MODEL)(_line(url, body), 1, "f")


def _refused(url: str, body: dict) -> str:
    outcome = _check(url, body)
    assert isinstance(outcome, InvalidLine) and outcome.code == "invalid_request", outcome
    return outcome.record["error"]["message"]


MESSAGES = [{"role": "user", "content": "hi"}]


def test_an_unknown_field_is_refused_by_name_as_openai_does():
    assert _refused(CHAT, {"messages": MESSAGES, "foo": 1}) == "Unrecognized request argument supplied: foo"
    assert (
        _refused(CHAT, {"messages": MESSAGES, "max_token": 5, "audio": {}})
        == "Unrecognized request arguments supplied: audio, max_token"
    )


def test_removed_guided_fields_point_at_structured_outputs():
    message = _refused(CHAT, {"messages": MESSAGES, "guided_json": {"type": "object"}})
    assert message.startswith("Unrecognized request argument supplied: guided_json")
    assert "structured_outputs" in message


def test_fields_are_per_route():
    # best_of left vLLM's CompletionRequest; responses has no n and names its limit max_output_tokens; completions'
    # logprobs is a count and it has no top_logprobs.
    assert _refused(COMPLETIONS, {"prompt": "x", "best_of": 2}).endswith(": best_of")
    assert _refused(RESPONSES, {"input": "x", "n": 2}).endswith(": n")
    assert _refused(RESPONSES, {"input": "x", "max_tokens": 5}).endswith(": max_tokens")
    assert _refused(COMPLETIONS, {"prompt": "x", "top_logprobs": 2}).endswith(": top_logprobs")
    assert isinstance(_check(RESPONSES, {"input": "x", "max_output_tokens": 5, "text": {}}), ValidRequest)


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS, RESPONSES])
def test_openai_bookkeeping_fields_pass(url):
    body = (
        {"messages": MESSAGES} if url == CHAT else {"prompt": "x"} if url == COMPLETIONS else {"input": "x"}
    )
    body.update({name: "v" for name in OPENAI_BOOKKEEPING_FIELDS if name != "metadata"}, metadata={"k": "v"})
    assert isinstance(_check(url, body), ValidRequest)


def test_request_fields_vllm_honours_pass_unchanged():
    body = {
        "messages": MESSAGES,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "seed": 7,
        "stop": ["\n"],
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": -100},
        "max_completion_tokens": 8,
        "ignore_eos": True,
        "min_tokens": 2,
        "top_k": 5,
        "min_p": 0.1,
        "response_format": {"type": "json_object"},
        "structured_outputs": {"choice": ["a", "b"]},
    }
    outcome = _check(CHAT, body)
    assert isinstance(outcome, ValidRequest)
    assert outcome.body == {**body, "model": MODEL}


def test_samples_are_n():
    chat, completions, responses = (endpoint_for(u) for u in (CHAT, COMPLETIONS, RESPONSES))
    assert chat.samples({"messages": MESSAGES, "n": 3}) == 3
    assert chat.samples({"messages": MESSAGES}) == 1
    assert completions.samples({"prompt": "x", "n": 2}) == 2
    assert responses.samples({"input": "x"}) == 1
    assert endpoint_for("/v1/embeddings").samples({"input": "x", "n": 4}) == 1


@pytest.mark.parametrize(
    "url, body, asks",
    [
        (CHAT, {"response_format": {"type": "json_object"}}, True),
        (
            CHAT,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            True,
        ),
        (CHAT, {"response_format": {"type": "text"}}, False),
        (CHAT, {"structured_outputs": {"json": {"type": "object"}}}, True),
        (CHAT, {"structured_outputs": {"json_object": True}}, True),
        (CHAT, {"structured_outputs": {"choice": ["a"]}}, False),
        (CHAT, {"structured_outputs": {"regex": "[a-z]+"}}, False),
        (COMPLETIONS, {"structured_outputs": {"json": "{}"}}, True),
        (COMPLETIONS, {}, False),
        (RESPONSES, {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, True),
        (RESPONSES, {"text": {"format": {"type": "text"}}}, False),
        ("/v1/embeddings", {"response_format": {"type": "json_object"}}, False),
    ],
)
def test_asks_json(url, body, asks):
    assert endpoint_for(url).asks_json(body) is asks


def test_output_texts_per_route():
    chat = {"choices": [{"message": {"content": '{"a": 1}'}}, {"message": {"content": "no"}}]}
    assert endpoint_for(CHAT).output_texts(chat) == ['{"a": 1}', "no"]
    assert endpoint_for(COMPLETIONS).output_texts({"choices": [{"text": "[1]"}]}) == ["[1]"]
    response = {"output": [{"type": "message", "content": [{"type": "output_text", "text": "{}"}]}]}
    assert endpoint_for(RESPONSES).output_texts(response) == ["{}"]
    assert [parses_as_json(t) for t in ['{"a": 1}', "no", None, "1", ""]] == [True, False, False, True, False]


def test_fake_answers_n_choices():
    ctx = FakeContext(model=MODEL, request_id="r", created=0, output_tokens=4, embedding_dimensions=8)
    answer = endpoint_for(CHAT).fake({"messages": MESSAGES, "n": 3, "max_tokens": 5}, ctx, [2])
    assert [c["index"] for c in answer.body["choices"]] == [0, 1, 2]
    assert (answer.prompt_tokens, answer.completion_tokens) == (2, 15)
    assert answer.body["usage"] == {"prompt_tokens": 2, "completion_tokens": 15, "total_tokens": 17}


# -- structured output: decided per row where it is answered, counted at finalize --------------------------------

JSON_FORMAT = {"response_format": {"type": "json_object"}}


def _chat_answer(*texts: str) -> dict:
    return {"object": "chat.completion", "choices": [{"message": {"content": t}} for t in texts]}


def test_json_outcome_of_a_row():
    from pipeline.endpoints import json_outcome

    asked = {"messages": MESSAGES, **JSON_FORMAT}
    assert json_outcome(CHAT, asked, 200, _chat_answer('{"a": 1}', "[]")) is True
    assert json_outcome(CHAT, asked, 200, _chat_answer('{"a": 1}', '{"a": ')) is False  # one choice cut short
    assert json_outcome(CHAT, asked, 200, _chat_answer()) is False
    assert (
        json_outcome(CHAT, asked, 400, {"error": {"message": "bad schema"}}) is None
    )  # an error, not a result
    assert json_outcome(CHAT, {"messages": MESSAGES}, 200, _chat_answer("{}")) is None  # never asked


def test_result_table_stages_the_outcome_and_finalize_sums_it():
    import pyarrow as pa

    from pipeline.engines.base import EngineRequest, EngineResult
    from pipeline.observe.report import _structured_row
    from pipeline.observe.usage import structured_of
    from pipeline.runtime.engines.engine_actor import result_table

    asked = {"messages": MESSAGES, **JSON_FORMAT}
    requests = [
        EngineRequest("a", CHAT, asked),
        EngineRequest("b", CHAT, asked),
        EngineRequest("c", CHAT, {"messages": MESSAGES}),
        EngineRequest("d", CHAT, asked),
    ]
    results = [
        EngineResult("a", 200, _chat_answer('{"x": true}')),
        EngineResult("b", 200, _chat_answer('{"x": tr')),
        EngineResult("c", 200, _chat_answer("plain")),
        EngineResult("d", 400, {"error": {"message": "schema"}}),
    ]
    table = result_table(results, [1, 2, 3, 4], ["f"] * 4, "default", requests=requests)
    assert table.column("structured_json").to_pylist() == [True, False, None, None]
    assert structured_of(table) == {"requested": 2, "parsed_json": 1}
    assert result_table(results, [1, 2, 3, 4], ["f"] * 4, "default").column("structured_json").null_count == 4
    # A part staged before the column existed counts nothing.
    assert structured_of(pa.table({"x": [1]})) == {"requested": 0, "parsed_json": 0}
    assert _structured_row({"requested": 2, "parsed_json": 1}) == [
        ("structured output", "1 of 2 parsed as JSON")
    ]
    assert _structured_row({"requested": 0, "parsed_json": 0}) == []


def test_older_staged_parts_read_the_column_as_nulls():
    import pyarrow as pa

    from pipeline.io.staging import STAGED_SCHEMA, with_later_columns

    old = pa.table({name: pa.nulls(1, STAGED_SCHEMA.field(name).type) for name in STAGED_SCHEMA.names[:8]})
    table = with_later_columns(old)
    assert table.schema.field("structured_json").type == pa.bool_()
    assert table.column("structured_json").null_count == 1


def test_unknown_fields_may_pass_for_servers_that_take_their_own():
    from pipeline.config import InputLimits

    body = {"messages": MESSAGES, "grammar": "root ::= 'x'"}  # llama.cpp's own field
    passing = LineValidator(MODEL, limits=InputLimits(refuse_unknown_fields=False))
    assert isinstance(passing(_line(CHAT, body), 1, "f"), ValidRequest)
    assert _refused(CHAT, body) == "Unrecognized request argument supplied: grammar"
