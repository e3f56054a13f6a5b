"""The command line fails fast and clearly on bad flags and locations — before any engine or Ray starts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from tests.lines import chat_line, write_lines

runner = CliRunner()


@pytest.fixture
def batch(tmp_path):
    return write_lines(tmp_path / "in.jsonl", [chat_line("a", "hi"), "not json", chat_line("a", "again")])


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_missing_input_names_the_path(tmp_path):
    result = invoke("run", str(tmp_path / "nope.jsonl"), str(tmp_path / "out"))
    assert result.exit_code == 2
    assert "does not exist" in result.output and "nope.jsonl" in result.output


def test_output_that_is_a_file_is_refused(batch, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    result = invoke("run", str(batch), str(target))
    assert result.exit_code == 2 and "is a file" in result.output


def test_bad_flag_value_names_the_flag(batch, tmp_path):
    result = invoke("run", str(batch), str(tmp_path / "out"), "--max-num-seqs", "0")
    assert result.exit_code == 2
    assert "--max-num-seqs" in result.output
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_unknown_backend_lists_the_choices(batch, tmp_path):
    result = invoke("run", str(batch), str(tmp_path / "out"), "--engine", "turbo")
    assert result.exit_code == 2 and "--engine" in result.output and "'fake'" in result.output


def test_unknown_config_key_names_file_and_key(batch, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("engine:\n  vllm:\n    max_num_seq: 8\n")
    result = invoke("run", str(batch), str(tmp_path / "out"), "--config", str(config))
    assert result.exit_code == 2
    assert "job.yaml" in result.output and "max_num_seq" in result.output


def test_missing_model_directory_fails_before_work(batch, tmp_path):
    result = invoke("run", str(batch), str(tmp_path / "out"), "--model", str(tmp_path / "no-model"))
    assert result.exit_code == 2 and "no-model" in result.output
    assert not (tmp_path / "out" / "_staging").exists()


def test_validate_prints_every_error_record_and_counts(batch):
    result = invoke("validate", str(batch), "--no-tokens")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [r["error"]["code"] for r in records] == ["invalid_json", "duplicate_custom_id"]
    assert [r["error"]["line"] for r in records] == [2, 3]
    assert "lines      3 (1 valid, 2 invalid)" in result.output


def test_validate_reports_hostile_lines_without_a_traceback(tmp_path):
    path = write_lines(
        tmp_path / "hostile.jsonl",
        ["[" * 1_000 + "]" * 1_000, chat_line("s", "hi", stream="True"), chat_line("ok", "hi")],
    )
    result = invoke("validate", str(path), "--no-tokens")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and result.exception is None
    records = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [r["error"]["code"] for r in records] == ["invalid_json", "stream_unsupported"]
    assert "nested deeper than 128" in records[0]["error"]["message"]
