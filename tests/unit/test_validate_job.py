"""`nightshift validate` checks lines against the job (--config, --lora-modules, its pools), as `run` would: no false
model_not_found for a model or adapter the job serves, and the lines longer than the context the job would run them
with reported as the job would answer them (context_length_exceeded), counted by the backend's own measure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from tests.lines import write_lines

runner = CliRunner()


def line(custom_id: str, model: str, content: str = "hi", url: str = "/v1/chat/completions", **body) -> str:
    if url == "/v1/embeddings":
        payload = {"model": model, "input": content, **body}
    else:
        payload = {"model": model, "messages": [{"role": "user", "content": content}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": payload})


def code_of(record: dict) -> str:
    """A record's error code: a line that could not be understood carries it in `error`, a request refused as the
    engine would refuse it in its response's body (the two shapes of the job's error file)."""
    return (record["error"] or record["response"]["body"]["error"])["code"]


def validate(*args: str):
    result = runner.invoke(app, ["validate", *args])
    records = [json.loads(text) for text in result.output.splitlines() if text.startswith("{")]
    return result, records


@pytest.fixture
def two_pool_job(tmp_path) -> Path:
    """A LoRA adapter on the chat pool, a second pool of another model: every name a line may give."""
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: /models/base\n"
        "engine:\n  vllm:\n    lora_modules: {sql: /adapters/sql}\n"
        "pools:\n"
        "  - name: chat\n"
        "  - name: embed\n    model: /models/emb\n    served_model_name: emb\n"
        "    engine_overrides: {lora_modules: {}}\n"
    )
    return job


@pytest.fixture
def lines_of_every_name(tmp_path) -> Path:
    return write_lines(
        tmp_path / "in.jsonl",
        [
            line("base", "/models/base"),
            line("adapter", "sql"),
            line("embedding", "emb", url="/v1/embeddings"),
            line("nobody", "gpt-4o"),
        ],
    )


def test_a_lora_and_two_pool_job_gives_no_false_model_not_found(two_pool_job, lines_of_every_name):
    result, records = validate(str(lines_of_every_name), "--config", str(two_pool_job), "--no-tokens")
    assert result.exit_code == 0, result.output
    # Only the line naming a model the job does not serve; its message lists what the job serves.
    assert [(r["custom_id"], r["error"]["code"]) for r in records] == [("nobody", "model_not_found")]
    message = records[0]["error"]["message"]
    assert all(name in message for name in ("/models/base", "emb", "sql"))
    assert "lines      4 (3 valid, 1 invalid)" in result.output


def test_without_the_job_the_same_lines_are_model_not_found(lines_of_every_name):
    """What validate did before it took the job: every line checked against one model name."""
    result, records = validate(str(lines_of_every_name), "--model", "/models/base", "--no-tokens")
    assert result.exit_code == 0, result.output
    assert [r["custom_id"] for r in records] == ["adapter", "embedding", "nobody"]


def test_lora_modules_given_as_a_flag_are_served_names(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [line("a", "poet"), line("b", "m")])
    result, records = validate(
        str(path), "--model", "m", "--lora-modules", "poet=/adapters/poet", "--no-tokens"
    )
    assert result.exit_code == 0, result.output
    assert records == []


def test_lines_longer_than_the_jobs_context_are_reported_as_the_job_would(tmp_path):
    """The fake backend counts words: with --max-model-len 32 a 40-word prompt cannot run, and its record is the
    one the job writes (context_length_exceeded, with its line)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            line("short", str(model), "a few words", max_tokens=4),
            line("long", str(model), " ".join(["w"] * 40), max_tokens=4),
            line("bad", "other"),
        ],
    )
    args = [str(path), "--model", str(model), "--engine", "fake", "--max-model-len", "32"]
    result, records = validate(*args)
    assert result.exit_code == 0, result.output
    assert [(r["custom_id"], code_of(r)) for r in records] == [
        ("long", "context_length_exceeded"),
        ("bad", "model_not_found"),
    ]
    assert records[1]["error"]["line"] == 3
    assert "maximum context length is 32 tokens" in records[0]["response"]["body"]["error"]["message"]
    assert "context_length_exceeded 1, model_not_found 1" in result.output
    assert "the fake engine's word count" in result.output
    # Without the given length the model's own limit holds: nothing is too long.
    result, records = validate(*args[:-2])
    assert [r["custom_id"] for r in records] == ["bad"]


def test_a_bad_job_file_fails_before_reading_the_input(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("pools:\n  - name: a\n  - name: a\n")
    result, _ = validate(str(tmp_path / "missing.jsonl"), "--config", str(job), "--no-tokens")
    assert result.exit_code == 2 and "unique" in result.output


def test_an_http_job_is_checked_by_name_without_contacting_its_servers(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [line("a", "m"), line("b", "other")])
    args = ["--engine", "http", "--endpoint", "http://127.0.0.1:9", "--model", "m"]
    result, records = validate(str(path), *args)
    assert result.exit_code == 0 and result.exception is None, result.output
    assert [(r["custom_id"], code_of(r)) for r in records] == [("b", "model_not_found")]
    # Without --model the servers would name the model: nothing can be checked before the job runs.
    result, _ = validate(str(path), *args[:-2])
    assert result.exit_code == 2 and "give --model" in result.output


def test_a_dataset_job_is_validated_on_its_rendered_prompts(tmp_path):
    """A table with a template: rows that cannot render are counted by the column to blame, a prompt longer than
    the context is the record the job would write, and a template naming a missing column fails before reading."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    rows = [
        {"id": 1, "text": "a few words"},
        {"id": 2, "text": None},
        {"id": 3, "text": " ".join(["w"] * 40)},
    ]
    path = write_lines(tmp_path / "table.jsonl", [json.dumps(row) for row in rows] + ["{broken"])
    common = [
        str(path),
        "--model",
        str(model),
        "--engine",
        "fake",
        "--max-model-len",
        "32",
        "--max-tokens",
        "4",
    ]
    result, records = validate(*common, "--template", "Say {{ text }}", "--id-column", "id")
    assert result.exit_code == 0, result.output
    assert [code_of(r) for r in records] == ["template_error", "context_length_exceeded", "invalid_json"]
    assert "templates  rows not rendered by column: text 1" in result.output
    assert "lines      4 (2 valid, 2 invalid)" in result.output
    result, _ = validate(*common, "--template", "Say {{ body }}")
    assert result.exit_code != 0 and "does not have: body (it has: id, text)" in result.output


def test_a_transcription_table_is_validated_with_its_paths_under_the_tables_directory(tmp_path):
    """`--route transcriptions --audio-column`: a path is under the table's own directory (as `run` reads it), a
    null is the row's error, counted by its column; a speech model is the one that serves the route."""
    model = tmp_path / "whisper"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["WhisperForConditionalGeneration"]}))
    rows = [{"id": "a", "call": "calls/a.wav"}, {"id": "b", "call": None}, {"id": "c", "call": "/srv/c.wav"}]
    path = write_lines(tmp_path / "calls.jsonl", [json.dumps(row) for row in rows])
    common = [
        str(path),
        "--model",
        str(model),
        "--engine",
        "fake",
        "--id-column",
        "id",
        "--audio-column",
        "call",
    ]
    result, records = validate(*common, "--route", "transcriptions")
    assert result.exit_code == 0, result.output
    assert [(r["custom_id"], code_of(r)) for r in records] == [("b", "template_error")]
    assert "templates  rows not rendered by column: call 1" in result.output
    assert "routes     /v1/audio/transcriptions 2" in result.output
    # Chat to a speech model: every row is the route's unsupported_task.
    result, records = validate(*common, "--template", "{{ id }}")
    assert {code_of(r) for r in records} == {"unsupported_task", "template_error"}, records
