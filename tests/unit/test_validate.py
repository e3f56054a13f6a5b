"""LineValidator: one test per error code it produces, the DESIGN §3 error-record shape, and valid lines."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.protocol import ErrorCode
from pipeline.stages.validate import InvalidLine, LineValidator, ValidRequest

MODEL = "smollm2-135m-instruct"
SOURCE = "input.jsonl"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", **extra}


def line(
    custom_id: Any = "req-1",
    url: Any = CHAT,
    body: Any = None,
    method: Any = "POST",
    drop: tuple[str, ...] = (),
) -> str:
    """One request line; `drop` names envelope fields to leave out."""
    obj: dict[str, Any] = {"custom_id": custom_id, "method": method, "url": url, "body": body or chat_body()}
    for key in drop:
        del obj[key]
    return json.dumps(obj)


@pytest.fixture
def validate():
    return LineValidator(MODEL)


def assert_invalid(outcome: ValidRequest | InvalidLine, code: ErrorCode, line_no: int = 1) -> dict[str, Any]:
    """The error record has exactly the DESIGN §3 'line could not be understood' shape."""
    assert isinstance(outcome, InvalidLine), outcome
    record = outcome.record
    assert set(record) == {"id", "custom_id", "response", "error"}
    assert record["id"].startswith("batch_req_")
    assert record["response"] is None
    assert set(record["error"]) == {"code", "message", "line", "source"}
    assert record["error"]["code"] == code.value
    assert isinstance(record["error"]["message"], str) and record["error"]["message"]
    assert record["error"]["line"] == line_no
    assert record["error"]["source"] == SOURCE
    assert outcome.code == code.value
    assert outcome.line == line_no
    assert outcome.source == SOURCE
    json.dumps(record)  # serializable as an error line
    return record


# -- invalid_json -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param("this is not json", id="garbage"),
        pytest.param('{"custom_id": "a", "url": "/v1/chat/completions", "body": {', id="truncated"),
        pytest.param(
            b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "\xff\xfe"}}', id="bad-utf8"
        ),
        pytest.param(b"\xc3\x28", id="bad-utf8-only"),
        pytest.param("", id="empty"),
    ],
)
def test_invalid_json_unparseable(validate, raw):
    record = assert_invalid(validate(raw, 1, SOURCE), ErrorCode.INVALID_JSON)
    assert record["custom_id"] is None


@pytest.mark.parametrize(
    "raw, kind",
    [("[1, 2, 3]", "list"), ("42", "int"), ('"a string"', "str"), ("null", "NoneType"), ("true", "bool")],
)
def test_invalid_json_not_an_object(validate, raw, kind):
    record = assert_invalid(validate(raw, 1, SOURCE), ErrorCode.INVALID_JSON)
    assert record["custom_id"] is None
    assert kind in record["error"]["message"]


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x\\udc00"}}', id="escape"
        ),
        pytest.param(
            b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x\xed\xa0\x80"}}', id="cesu8"
        ),
        pytest.param(
            b'{"custom_id": "a\\ud800", "url": "/v1/completions", "body": {"prompt": "x"}}', id="in-id"
        ),
    ],
)
def test_lone_surrogate_is_invalid_json(validate, raw):
    outcome = validate(raw, 1, SOURCE)
    assert_invalid(outcome, ErrorCode.INVALID_JSON)
    # Whatever the outcome, the record must be writable as UTF-8 (staging and shards are UTF-8).
    json.dumps(outcome.record, ensure_ascii=False).encode("utf-8")


# -- missing_custom_id --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "custom_id, shown",
    [
        pytest.param(None, None, id="null"),
        pytest.param("", "", id="empty"),
        pytest.param(123, None, id="int"),
        pytest.param(["a"], None, id="list"),
        pytest.param({"a": 1}, None, id="object"),
        pytest.param(True, None, id="bool"),
    ],
)
def test_missing_custom_id(validate, custom_id, shown):
    record = assert_invalid(validate(line(custom_id=custom_id), 1, SOURCE), ErrorCode.MISSING_CUSTOM_ID)
    assert record["custom_id"] == shown


def test_missing_custom_id_absent(validate):
    record = assert_invalid(
        validate(line(drop=("custom_id",)), 2, SOURCE), ErrorCode.MISSING_CUSTOM_ID, line_no=2
    )
    assert record["custom_id"] is None


# -- invalid_request: envelope ------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["url", "body"])
def test_invalid_request_envelope_missing_field(validate, field):
    record = assert_invalid(validate(line(drop=(field,)), 1, SOURCE), ErrorCode.INVALID_REQUEST)
    assert record["custom_id"] == "req-1"
    assert field in record["error"]["message"]


@pytest.mark.parametrize("body", [[1, 2], "a body", 7], ids=["list", "str", "int"])
def test_invalid_request_body_not_an_object(validate, body):
    raw = json.dumps({"custom_id": "req-1", "method": "POST", "url": CHAT, "body": body})
    record = assert_invalid(validate(raw, 1, SOURCE), ErrorCode.INVALID_REQUEST)
    assert record["custom_id"] == "req-1"
    assert "body" in record["error"]["message"]


def test_invalid_request_body_null(validate):
    raw = json.dumps({"custom_id": "req-1", "method": "POST", "url": CHAT, "body": None})
    assert_invalid(validate(raw, 1, SOURCE), ErrorCode.INVALID_REQUEST)


# -- invalid_request: route schema --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"model": MODEL}, id="no-messages"),
        pytest.param({"model": MODEL, "messages": []}, id="empty-messages"),
        pytest.param({"model": MODEL, "messages": "hi"}, id="messages-not-list"),
        pytest.param({"model": MODEL, "messages": [{"content": "hi"}]}, id="message-without-role"),
        pytest.param({"model": MODEL, "messages": [{"role": 1, "content": "hi"}]}, id="role-not-str"),
        pytest.param({"model": MODEL, "messages": ["hi"]}, id="message-not-object"),
    ],
)
def test_invalid_request_chat(validate, body):
    record = assert_invalid(validate(line(body=body), 1, SOURCE), ErrorCode.INVALID_REQUEST)
    assert "messages" in record["error"]["message"]


def test_invalid_request_names_the_bad_message(validate):
    body = {"messages": [{"role": "system", "content": "x"}, {"content": "no role"}]}
    record = assert_invalid(validate(line(body=body), 1, SOURCE), ErrorCode.INVALID_REQUEST)
    assert "messages[1]" in record["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [{"model": MODEL}, {"model": MODEL, "prompt": ""}, {"model": MODEL, "prompt": []}],
    ids=["no-prompt", "empty-str", "empty-list"],
)
def test_invalid_request_completions_without_prompt(validate, body):
    record = assert_invalid(validate(line(url=COMPLETIONS, body=body), 1, SOURCE), ErrorCode.INVALID_REQUEST)
    assert "prompt" in record["error"]["message"]


# -- invalid_request: sampling ranges -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_completion_tokens", 0),
        ("n", 0),
        ("presence_penalty", 3),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.5),
        ("top_logprobs", -1),
        ("temperature", "hot"),
        ("max_tokens", 5.5),
        ("max_tokens", -3),
        ("max_tokens", "many"),
        ("max_tokens", 1e30),  # pydantic (so vLLM's server) cannot read it as an integer: that request's 400
        ("n", [1]),
        ("seed", 2**70),
        ("stream", "maybe"),
        ("stream", {}),
        ("top_p", "nan"),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
    ],
)
def test_invalid_request_sampling_out_of_range(validate, field, value):
    record = assert_invalid(
        validate(line(body=chat_body(**{field: value})), 1, SOURCE), ErrorCode.INVALID_REQUEST
    )
    assert f"body.{field}" in record["error"]["message"]
    assert record["custom_id"] == "req-1"


def test_unreadable_number_says_what_was_expected(validate):
    record = assert_invalid(
        validate(line(body=chat_body(temperature="hot")), 1, SOURCE), ErrorCode.INVALID_REQUEST
    )
    assert "number" in record["error"]["message"] and "'hot'" in record["error"]["message"]


@pytest.mark.parametrize(
    "field, value, read_as",
    [
        # What vLLM's request models (pydantic, lax) make of them: the body carries the value vLLM will use.
        ("temperature", "0.7", 0.7),
        ("temperature", True, 1.0),
        ("max_tokens", "5", 5),
        ("max_tokens", 5.0, 5),
        ("max_tokens", True, 1),
        ("n", "2", 2),
        ("seed", "7", 7),
        ("logprobs", "true", True),
        ("stream", "False", False),
        ("stream", 0, False),
        ("stream", "no", False),
    ],
)
def test_fields_are_coerced_as_vllm_coerces_them(validate, field, value, read_as):
    outcome = validate(line(body=chat_body(**{field: value})), 1, SOURCE)
    assert isinstance(outcome, ValidRequest), outcome
    assert outcome.body[field] == read_as and type(outcome.body[field]) is type(read_as)


def test_completions_logprobs_is_a_count(validate):
    outcome = validate(line(url=COMPLETIONS, body=completion_body(logprobs="2")), 1, SOURCE)
    assert isinstance(outcome, ValidRequest) and outcome.body["logprobs"] == 2
    assert_invalid(
        validate(line("b", COMPLETIONS, completion_body(logprobs=-1)), 1, SOURCE), ErrorCode.INVALID_REQUEST
    )


@pytest.mark.parametrize(
    "field, raw_value", [("temperature", "NaN"), ("max_tokens", "Infinity"), ("top_p", "NaN")]
)
def test_non_finite_sampling_values_rejected(validate, field, raw_value):
    # json.dumps writes float("nan") / float("inf") as the bare NaN / Infinity tokens json.loads accepts
    raw = json.dumps({"custom_id": "x", "url": COMPLETIONS, "body": {"prompt": "p", field: float(raw_value)}})
    assert raw_value in raw
    record = assert_invalid(validate(raw, 1, SOURCE), ErrorCode.INVALID_REQUEST)
    assert f"body.{field}" in record["error"]["message"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 0),
        ("temperature", 2.0),
        ("top_p", 1),
        ("top_p", 0.01),
        ("max_tokens", 1),
        ("n", 1),
        ("presence_penalty", 2),
        ("presence_penalty", -2),
        ("top_logprobs", 0),
    ],
)
def test_sampling_boundaries_accepted(validate, field, value):
    outcome = validate(line(body=chat_body(**{field: value})), 1, SOURCE)
    assert isinstance(outcome, ValidRequest)
    assert outcome.body[field] == value


# -- unsupported_method / unsupported_url / stream_unsupported / model_not_found -----------------------------------


@pytest.mark.parametrize("method", ["GET", "PUT", "delete", "post", "Post", " POST"])
def test_unsupported_method(validate, method):
    # HTTP methods are case-sensitive, and OpenAI's Batch API takes exactly "POST".
    record = assert_invalid(validate(line(method=method), 1, SOURCE), ErrorCode.UNSUPPORTED_METHOD)
    assert record["custom_id"] == "req-1"
    assert repr(method) in record["error"]["message"]


def test_method_is_optional(validate):
    assert isinstance(validate(line(drop=("method",)), 1, SOURCE), ValidRequest)
    assert isinstance(validate(line(custom_id="b", method="POST"), 2, SOURCE), ValidRequest)


@pytest.mark.parametrize(
    "url", ["/v1/moderations", "/v1/foo", "v1/chat/completions", "/v1/chat/completions/"]
)
def test_unsupported_url(validate, url):
    record = assert_invalid(validate(line(url=url), 1, SOURCE), ErrorCode.UNSUPPORTED_URL)
    assert record["custom_id"] == "req-1"
    message = record["error"]["message"]
    assert url in message and CHAT in message and COMPLETIONS in message  # says what is supported


def test_a_batch_serves_only_its_endpoint():
    """The Batch API server's batches (limits.only_url = the batch's endpoint): a line for another served route is
    that line's error record; the endpoint's own lines, under any of its spellings, run."""
    from pipeline.config import InputLimits

    validate = LineValidator(MODEL, limits=InputLimits(only_url=CHAT))
    assert isinstance(validate(line(), 1, SOURCE), ValidRequest)
    record = assert_invalid(
        validate(line(custom_id="c", url=COMPLETIONS, body=completion_body()), 1, SOURCE),
        ErrorCode.UNSUPPORTED_URL,
    )
    assert COMPLETIONS in record["error"]["message"] and CHAT in record["error"]["message"]


@pytest.mark.parametrize("field", ["media_io_kwargs", "mm_processor_kwargs"])
def test_a_server_batch_refuses_lines_that_set_how_media_is_fetched(field):
    """vLLM takes these per request (a fetch's timeout, a processor's limits); the Batch API server's batches
    (limits.refused_fields) make such a line its own invalid_request, naming the field. A CLI job passes them."""
    from pipeline.config import InputLimits

    given = line(body=chat_body(**{field: {"image": {"timeout": 600}}}))
    assert isinstance(LineValidator(MODEL)(given, 1, SOURCE), ValidRequest)
    validate = LineValidator(MODEL, limits=InputLimits(refused_fields=[field]))
    record = assert_invalid(validate(given, 1, SOURCE), ErrorCode.INVALID_REQUEST)
    assert f"body.{field}" in record["error"]["message"] and record["custom_id"] == "req-1"


def test_only_url_must_be_a_served_route():
    from pydantic import ValidationError

    from pipeline.config import InputLimits

    with pytest.raises(ValidationError, match="not a route nightshift serves"):
        InputLimits(only_url="/v1/moderations")


@pytest.mark.parametrize(
    "url, body",
    [
        (CHAT, chat_body(stream=True)),
        (COMPLETIONS, completion_body(stream=True)),
        # vLLM's own run-batch tests send the string; its request model reads these as true and streams
        (CHAT, chat_body(stream="True")),
        (CHAT, chat_body(stream="yes")),
        (COMPLETIONS, completion_body(stream=1)),
        (COMPLETIONS, completion_body(stream="on")),
    ],
)
def test_stream_unsupported(validate, url, body):
    record = assert_invalid(validate(line(url=url, body=body), 1, SOURCE), ErrorCode.STREAM_UNSUPPORTED)
    assert record["custom_id"] == "req-1"


def test_stream_false_is_fine(validate):
    assert isinstance(validate(line(body=chat_body(stream=False)), 1, SOURCE), ValidRequest)


@pytest.mark.parametrize("model", ["gpt-4o", "", "SmolLM2-135M-Instruct"])
def test_model_not_found(validate, model):
    body = {**chat_body(), "model": model}
    record = assert_invalid(validate(line(body=body), 1, SOURCE), ErrorCode.MODEL_NOT_FOUND)
    assert record["custom_id"] == "req-1"
    assert MODEL in record["error"]["message"]  # says which model the job serves


# -- duplicate_custom_id ------------------------------------------------------------------------------------------


def test_duplicate_custom_id_first_runs_later_error(validate):
    first = validate(line("dup"), 1, "a.jsonl")
    other = validate(line("other"), 2, "a.jsonl")
    second = validate(line("dup", url=COMPLETIONS, body=completion_body()), 3, "a.jsonl")
    third = validate(line("dup"), 7, "b.jsonl")
    assert isinstance(first, ValidRequest) and first.custom_id == "dup"
    assert isinstance(other, ValidRequest)
    for outcome, line_no, source in ((second, 3, "a.jsonl"), (third, 7, "b.jsonl")):
        assert isinstance(outcome, InvalidLine)
        record = outcome.record
        assert record["custom_id"] == "dup"
        assert record["response"] is None
        assert record["error"]["code"] == ErrorCode.DUPLICATE_CUSTOM_ID.value
        assert record["error"]["line"] == line_no
        assert record["error"]["source"] == source


@pytest.mark.parametrize(
    "first_raw",
    [
        pytest.param(line("dup", url="/v1/moderations"), id="unsupported-url"),
        pytest.param(line("dup", body=chat_body(temperature=-1)), id="invalid-request"),
        pytest.param(line("dup", body={**chat_body(), "model": "other"}), id="model-not-found"),
        pytest.param(line("dup", method="GET"), id="unsupported-method"),
        pytest.param(line("dup", drop=("url",)), id="schema"),
    ],
)
def test_duplicate_after_invalid_first_occurrence(validate, first_raw):
    first = validate(first_raw, 1, SOURCE)
    assert isinstance(first, InvalidLine) and first.code != ErrorCode.DUPLICATE_CUSTOM_ID.value
    # The later line is valid on its own, but the id was already owned by line 1.
    second = validate(line("dup"), 2, SOURCE)
    record = assert_invalid(second, ErrorCode.DUPLICATE_CUSTOM_ID, line_no=2)
    assert record["custom_id"] == "dup"
    assert "dup" in record["error"]["message"]


def test_unparseable_lines_do_not_claim_ids(validate):
    assert_invalid(validate('{"custom_id": "x", ', 1, SOURCE), ErrorCode.INVALID_JSON)
    assert_invalid(validate(line(""), 2, SOURCE), ErrorCode.MISSING_CUSTOM_ID, line_no=2)
    assert isinstance(validate(line("x"), 3, SOURCE), ValidRequest)


def test_duplicates_are_per_validator():
    assert isinstance(LineValidator(MODEL)(line("a"), 1, SOURCE), ValidRequest)
    assert isinstance(LineValidator(MODEL)(line("a"), 1, SOURCE), ValidRequest)


# -- valid lines --------------------------------------------------------------------------------------------------


def test_valid_chat_line(validate):
    outcome = validate(line("req-1", body=chat_body(temperature=0, max_tokens=5)), 4, SOURCE)
    assert outcome == ValidRequest(
        "req-1",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 5},
        4,
        SOURCE,
    )


def test_valid_completion_line_keeps_unknown_fields(validate):
    body = completion_body(seed=3, stop=["\n"], logprobs=2)
    outcome = validate(line("c", url=COMPLETIONS, body=body), 1, SOURCE)
    assert isinstance(outcome, ValidRequest)
    assert outcome.url == COMPLETIONS
    assert outcome.body == body


@pytest.mark.parametrize(
    "body",
    [{"messages": [{"role": "user", "content": "hi"}]}, {"model": None, "messages": [{"role": "user"}]}],
)
def test_body_without_model_gets_the_jobs(validate, body):
    outcome = validate(line(body=body), 1, SOURCE)
    assert isinstance(outcome, ValidRequest)
    assert outcome.body["model"] == MODEL
    assert "model" not in body or body["model"] is None  # the caller's dict is not mutated


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(line("x").encode(), id="bytes"),
        pytest.param(line("x"), id="str"),
        pytest.param(json.loads(line("x")), id="dict"),
        pytest.param(("\ufeff" + line("x")).encode(), id="utf8-bom"),
    ],
)
def test_accepts_bytes_str_and_dict(validate, raw):
    assert isinstance(validate(raw, 1, SOURCE), ValidRequest)


def test_unicode_custom_id_and_content(validate):
    body = {"messages": [{"role": "user", "content": "héllo 世界 😀"}]}
    outcome = validate(line("ключ-😀", body=body).encode(), 1, SOURCE)
    assert isinstance(outcome, ValidRequest)
    assert outcome.custom_id == "ключ-😀"
    assert outcome.body["messages"][0]["content"] == "héllo 世界 😀"


def test_line_numbers_are_the_callers_one_based_numbers(validate):
    lines = [line("a"), "garbage", line("b"), line("a")]
    outcomes = [validate(raw, number, SOURCE) for number, raw in enumerate(lines, start=1)]
    assert [o.line for o in outcomes] == [1, 2, 3, 4]
    assert [type(o).__name__ for o in outcomes] == [
        "ValidRequest",
        "InvalidLine",
        "ValidRequest",
        "InvalidLine",
    ]
    assert outcomes[1].record["error"]["line"] == 2
    assert outcomes[3].record["error"] == {
        "code": "duplicate_custom_id",
        "message": outcomes[3].record["error"]["message"],
        "line": 4,
        "source": SOURCE,
    }


def test_every_produced_code_is_a_stable_code():
    produced = {
        "invalid_json",
        "missing_custom_id",
        "invalid_request",
        "unsupported_method",
        "unsupported_url",
        "stream_unsupported",
        "model_not_found",
        "unsupported_task",
        "duplicate_custom_id",
        "invalid_custom_id",
        "line_too_long",
    }
    assert produced <= {c.value for c in ErrorCode}


# -- hostile input: bounds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [200, 1_000, 100_000])
def test_deep_nesting_is_an_error_record_not_a_crash(validate, depth):
    raw = "[" * depth + "]" * depth
    record = assert_invalid(validate(raw, 1, SOURCE), ErrorCode.INVALID_JSON)
    assert "nested deeper than 128" in record["error"]["message"]


def test_deep_nesting_inside_a_valid_envelope(validate):
    body = chat_body(response_format={"type": "json_object", "x": json.loads("[" * 150 + "]" * 150)})
    record = assert_invalid(validate(line(body=body), 1, SOURCE), ErrorCode.INVALID_JSON)
    assert "limits.max_json_depth" in record["error"]["message"]


def test_brackets_in_strings_do_not_count_as_nesting(validate):
    outcome = validate(line(body=chat_body(messages=[{"role": "user", "content": "[{" * 5_000}])), 1, SOURCE)
    assert isinstance(outcome, ValidRequest)


def test_nesting_limit_is_configurable():
    from pipeline.config import InputLimits

    raw = line(body=chat_body(chat_template_kwargs={"a": {"b": {"c": {"d": {"e": {"f": {"g": {}}}}}}}}))
    assert isinstance(LineValidator(MODEL)(raw, 1, SOURCE), ValidRequest)
    tight = LineValidator(MODEL, limits=InputLimits(max_json_depth=8))
    assert_invalid(tight(raw, 1, SOURCE), ErrorCode.INVALID_JSON)


@pytest.mark.parametrize(
    "custom_id, says",
    [
        ("   ", "blank"),
        ("\t\n", "blank"),
        ("a\x00b", "control"),
        ("line\nbreak", "control"),
        ("esc\x1b[31m", "control"),
        ("del\x7f", "control"),
        ("c1\x85", "control"),
        ("x" * 513, "longer than 512 bytes"),
        ("é" * 257, "longer than 512 bytes"),  # 514 UTF-8 bytes in 257 characters
    ],
)
def test_invalid_custom_id(validate, custom_id, says):
    record = assert_invalid(validate(line(custom_id=custom_id), 1, SOURCE), ErrorCode.INVALID_CUSTOM_ID)
    assert says in record["error"]["message"]


def test_custom_id_at_the_limit_is_fine(validate):
    assert isinstance(validate(line(custom_id="x" * 512), 1, SOURCE), ValidRequest)
    assert isinstance(validate(line(custom_id="é" * 256), 2, SOURCE), ValidRequest)
    assert isinstance(validate(line(custom_id=" padded id "), 3, SOURCE), ValidRequest)


def test_huge_custom_id_is_not_echoed(validate):
    record = assert_invalid(validate(line(custom_id="x" * 1_000_000), 1, SOURCE), ErrorCode.INVALID_CUSTOM_ID)
    assert record["custom_id"] is None and len(json.dumps(record)) < 1_000


# -- the audio routes: file_url as run-batch takes it -------------------------------------------------------------

TRANSCRIBE = "/v1/audio/transcriptions"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        pytest.param({"model": "whisper"}, "body.file_url is required", id="no-file-url"),
        pytest.param({"model": "whisper", "file_url": 7}, "body.file_url is required", id="not-a-string"),
        pytest.param(
            {"model": "whisper", "file": "a.wav"}, "give the audio as body.file_url", id="form-file"
        ),
        pytest.param(
            {"model": "whisper", "file_url": "gopher://h/a.wav"}, "http(s), data: or file://", id="scheme"
        ),
        pytest.param(
            {"model": "whisper", "file_url": "data:,x", "temperature": "hot"}, "temperature", id="field"
        ),
        pytest.param({"model": "whisper", "file_url": "data:,x", "audio": True}, "audio", id="unknown-field"),
    ],
)
def test_an_audio_line_that_cannot_run_is_its_error(body, says):
    validate = LineValidator({"whisper": "transcription"})
    record = assert_invalid(validate(line(url=TRANSCRIBE, body=body), 1, SOURCE), ErrorCode.INVALID_REQUEST)
    assert says in record["error"]["message"], record["error"]["message"]


def test_audio_lines_go_to_a_speech_model_and_only_there():
    validate = LineValidator({MODEL: "generate", "whisper": "transcription"})
    for url in (TRANSCRIBE, "/v1/audio/translations"):
        body = {"model": "whisper", "file_url": "https://example.com/a.wav", "language": "en", "seed": 3}
        assert isinstance(validate(line(f"{url}-whisper", url, body), 1, SOURCE), ValidRequest)
        to_chat_model = line(f"{url}-chat", url, {**body, "model": MODEL})
        record = assert_invalid(validate(to_chat_model, 1, SOURCE), ErrorCode.UNSUPPORTED_TASK)
        assert "runs the 'generate' task" in record["error"]["message"]
    # A chat line to the speech model: the model cannot serve it, said as such.
    record = assert_invalid(
        validate(line(body=chat_body(model="whisper")), 1, SOURCE), ErrorCode.UNSUPPORTED_TASK
    )
    assert "/v1/audio/transcriptions" in record["error"]["message"]
