"""Request fields on the real engine: structured output (response_format json_schema / json_object, vLLM's
structured_outputs choice and regex) obeyed, `n` and logprobs answered as vLLM's own run-batch answers the same lines,
a schema or regex that cannot compile is that line's error record while the rest of the job succeeds, and a body
field vLLM does not know is an error record naming it. The manifest counts the structured results that parsed.

On the session's warm engines (tests/e2e/warm_cluster.py): what is checked is each line's answer, not an engine's
start. Few lines, few tokens: greedy (or seeded) decoding of the embedded SmolLM2."""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e.cli import run_cli
from tests.e2e.run_batch import bodies, run_batch
from tests.e2e.warm_cluster import CHAT_CONTEXT, ENGINE_FLAGS
from tests.lines import read_job_output, write_lines

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


def line(custom_id: str, text: str, **body) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


# Lines vLLM's run-batch answers too: the oracle runs exactly these.
ORACLE_LINES = [
    line("schema-1", "Pick a colour.", max_tokens=48, temperature=0, response_format=schema_format("c", SCHEMA)),
    line("schema-2", "Is the sky green?", max_tokens=48, temperature=0, response_format=schema_format("c", SCHEMA)),
    line("json-object", "Output the JSON object {\"a\": 1} and nothing else.", max_tokens=32, temperature=0,
         response_format={"type": "json_object"}),
    line("choice", "Yes or no?", max_tokens=4, temperature=0, structured_outputs={"choice": ["yes", "no"]}),
    line("regex", "Give a three digit number.", max_tokens=8, temperature=0,
         structured_outputs={"regex": "[0-9]{3}"}),
    # n > 1 needs sampling (vLLM refuses it greedy): a fixed seed makes it repeatable.
    line("n-2", "Name a fruit.", max_tokens=8, temperature=0.8, seed=42, n=2),
    line("logprobs", "What is 2+2?", max_tokens=6, temperature=0, logprobs=True, top_logprobs=3),
]  # fmt: skip
BAD_LINES = [
    line("bad-schema", "hi", max_tokens=8, temperature=0,
         response_format=schema_format("b", {"type": "object", "properties": {"a": {"type": "not-a-type"}}})),
    line("bad-regex", "hi", max_tokens=8, temperature=0, structured_outputs={"regex": "(unclosed"}),
    line("unknown", "hi", max_tokens=8, temperature=0, foo=1),
]  # fmt: skip
STRUCTURED_JSON = ("schema-1", "schema-2", "json-object")


@pytest.fixture(scope="module")
def fields_job(e2e_dir, shared_engines):
    path = write_lines(e2e_dir / "request-fields.jsonl", ORACLE_LINES + BAD_LINES)
    output = e2e_dir / "request-fields-out"
    proc = run_cli("run", str(path), str(output), *shared_engines.one_pool_job(e2e_dir), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_job_output(output)


@pytest.fixture(scope="module")
def oracle(e2e_dir, embedded_model):
    """vLLM's own run-batch on the lines it serves, with the warm engines' flags and context."""
    return bodies(
        run_batch(
            e2e_dir, "request-fields", ORACLE_LINES, "--model", embedded_model.path, "--served-model-name", MODEL,
            *ENGINE_FLAGS, "--max-model-len", str(CHAT_CONTEXT),
        )
    )  # fmt: skip


def contents(record: dict) -> list[str]:
    return [c["message"]["content"] for c in record["response"]["body"]["choices"]]


def test_accounting_and_the_structured_count(fields_job):
    results, errors, manifest = fields_job
    assert set(results) == {json.loads(x)["custom_id"] for x in ORACLE_LINES}
    assert set(errors) == {"bad-schema", "bad-regex", "unknown"}
    counts = manifest["counts"]
    assert counts["by_error_code"] == {"invalid_request": 3}
    assert counts["structured"] == {"requested": len(STRUCTURED_JSON), "parsed_json": len(STRUCTURED_JSON)}


def test_json_schema_results_validate_against_their_schema(fields_job):
    import jsonschema

    results, _, _ = fields_job
    for custom_id in ("schema-1", "schema-2"):
        (text,) = contents(results[custom_id])
        jsonschema.validate(json.loads(text), SCHEMA)
    (text,) = contents(results["json-object"])
    assert isinstance(json.loads(text), dict)


def test_structured_outputs_choice_and_regex_are_obeyed(fields_job):
    results, _, _ = fields_job
    assert contents(results["choice"])[0] in ("yes", "no")
    assert re.fullmatch("[0-9]{3}", contents(results["regex"])[0])


def test_n_and_logprobs_are_answered(fields_job):
    results, _, _ = fields_job
    choices = results["n-2"]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    logprobs = results["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert logprobs and all(len(token["top_logprobs"]) == 3 for token in logprobs)


def test_bodies_equal_vllms_own_run_batch(fields_job, oracle):
    results, _, _ = fields_job
    assert set(oracle) == set(results)
    for custom_id, theirs in oracle.items():
        assert _comparable(results[custom_id]["response"]["body"]) == _comparable(theirs), custom_id


def test_a_schema_or_regex_that_cannot_compile_is_that_lines_error(fields_job):
    _, errors, _ = fields_job
    for custom_id in ("bad-schema", "bad-regex"):
        response = errors[custom_id]["response"]
        assert response["status_code"] == 400, custom_id
        error = response["body"]["error"]
        assert error["code"] == "invalid_request" and "Grammar error" in error["message"], error


def test_an_unknown_field_is_an_error_record_naming_it(fields_job):
    _, errors, _ = fields_job
    error = errors["unknown"]["error"]
    assert error["code"] == "invalid_request"
    assert error["message"] == "Unrecognized request argument supplied: foo"


def _comparable(body: dict) -> dict:
    """A response body without what legitimately differs between two runs: ids, timestamps, fingerprints."""
    return {k: v for k, v in body.items() if k not in ("id", "created", "system_fingerprint")}
