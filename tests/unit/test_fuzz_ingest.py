"""Property: whatever the lines, validation never crashes and every non-blank line is accounted for once."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.io.staging import StagingArea
from pipeline.runtime.ingest.tasks import ingest
from tests.fuzz_lines import line_strategy


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(line_strategy, min_size=1, max_size=40))
def test_ingest_accounts_for_every_line(tmp_path_factory, lines):
    root = tmp_path_factory.mktemp("fuzz")
    path = root / "in.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
    staging = StagingArea(root / "out")
    staging.create()
    report = ingest(path, "smollm2-135m-instruct", staging)
    expected = sum(1 for line in path.read_bytes().split(b"\n") if line.strip())
    assert report.lines == expected
    assert report.valid + report.invalid == expected
    assert staging.count("errors") == report.invalid
    for record in staging.iter_column("errors", "record"):
        parsed = json.loads(record)  # every error record is valid JSON, encodable as UTF-8
        record.encode("utf-8")
        assert parsed["error"]["code"] and parsed["error"]["line"] >= 1


_JSON_BITS = st.sampled_from(
    ['{"a":', "}", "[", "]", ",", '"x"', '"\\ud800"', '"\\u00e9"', "NaN", "-Infinity", "1e400", "12345678901234567890",
     "-0.0", "true", "null", " ", "\t", '"\t"', "\ufeff", "\udcff", "é"]
)  # fmt: skip


@given(st.lists(_JSON_BITS, max_size=12).map("".join))
def test_the_fast_decoder_accepts_and_decodes_exactly_what_json_loads_does(text):
    from pipeline.json_codec import loads as _loads

    raw = text.encode(
        "utf-8", "surrogatepass"
    )  # lone surrogates become the CESU-8 bytes some writers produce
    try:
        expected = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        with pytest.raises(type(exc)):
            _loads(raw)
        return
    assert repr(_loads(raw)) == repr(expected)  # repr: NaN compares unequal to itself, its repr does not


def test_every_kind_of_hostile_line_is_one_error_record_or_one_request():
    """The corpus on the real validator: deep nesting, huge strings, control characters, type-confused fields.
    Nothing raises; each line is exactly one outcome; every code is a stable one; the bounds really fired."""
    from pipeline.protocol import ErrorCode
    from pipeline.stages.validate import InvalidLine, LineValidator, ValidRequest
    from tests.fuzz_lines import hostile_corpus

    validate = LineValidator("smollm2-135m-instruct")
    lines = hostile_corpus(3000, seed=5)
    outcomes = [validate(line.encode("utf-8", "surrogatepass"), n, "in") for n, line in enumerate(lines, 1)]
    assert all(isinstance(o, ValidRequest | InvalidLine) for o in outcomes)
    codes = {o.code for o in outcomes if isinstance(o, InvalidLine)}
    assert codes <= {c.value for c in ErrorCode}
    messages = " ".join(o.record["error"]["message"] for o in outcomes if isinstance(o, InvalidLine))
    for fired in ("nested deeper than", "control characters", "longer than 512 bytes", "stream=true"):
        assert fired in messages
    for request in (o for o in outcomes if isinstance(o, ValidRequest)):
        for field in ("max_tokens", "n", "seed", "top_logprobs"):
            value = request.body.get(field)
            assert value is None or type(value) is int  # read as vLLM reads it, written back
        assert request.body.get("stream") in (None, False)
