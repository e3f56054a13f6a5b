"""Engines take requests while ingest still reads the input, when nothing is fitted to it (--no-fit, or every
fitted arg given) or when the args are fitted early to a sample of it: the work list is handed over piece by piece. Duplicates are found only once every piece is read,
so a request that loses its custom_id to an earlier line may already have run: its row must leave no trace but its
duplicate_custom_id error record, and the winner's answer must be the one in the output. A request longer than the
early fit's context is held back and runs on engines fitted to the whole input (the fake engine, like vLLM, refuses
a request longer than its max_model_len)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import JobConfig
from pipeline.runtime.job import run_job
from tests.lines import chat_line, read_jsonl, write_lines
from tests.runs import assert_same_shards, kill_driver_half_way, nightshift_ok, run_command, run_uninterrupted

pytestmark = pytest.mark.usefixtures("local_ray")

FILES, ROWS = 6, 400
LONG = (2, 250)  # a line far longer than the rest, in the middle of its file: past what a sample reads


def _job(input_dir: Path, output: Path, fit: bool, early: bool = False) -> JobConfig:
    return JobConfig.model_validate(
        {
            "input": str(input_dir),
            "output": str(output),
            "model": None,
            "engine": {
                "backend": "fake",
                "fake": {"output_tokens": 4},
                # Early: an input this small is fitted exactly unless told otherwise.
                "fit": {"enabled": fit, "early": early, "early_min_bytes": 0},
            },
            "resources": {"num_engines": 2, "cpus_per_engine": 0.5, "rows_per_task": 32},
            "output_options": {"rows_per_shard": 500},
        }
    )


@pytest.fixture(scope="module")
def input_dir(tmp_path_factory) -> tuple[Path, int, int]:
    """Several files (a piece each). Ids repeat within a file and across files; one id's first line is not a
    valid request, so its later, valid line loses too. Returns (dir, lines, losing valid requests)."""
    root = tmp_path_factory.mktemp("streamed")
    lines_total, losers = 0, 0
    for f in range(FILES):
        lines = []
        for i in range(ROWS):
            custom_id = f"f{f}-{i:04d}"
            if i % 97 == 50:  # again, later in the same file
                custom_id = f"f{f}-{i - 3:04d}"
                losers += 1
            elif f > 0 and i % 131 == 7:  # an id first seen in an earlier file
                custom_id = f"f0-{i:04d}"
                losers += 1
            text = f"file {f} line {i}"
            if (f, i) == LONG:
                text += " and on" * 150
            lines.append(chat_line(custom_id, text))
        if f == 0:
            lines[10] = json.dumps(
                {"custom_id": "bad-first", "method": "POST", "url": "/v1/chat/completions"}
            )
        if f == FILES - 1:
            lines.append(chat_line("bad-first", "valid, but the id was claimed by an invalid line"))
            losers += 1
        (root / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
        lines_total += len(lines)
    return root, lines_total, losers


@pytest.fixture(scope="module")
def runs(input_dir, tmp_path_factory):
    root, _, _ = input_dir
    out = tmp_path_factory.mktemp("out")
    streamed = run_job(_job(root, out / "streamed", fit=False), show_progress=False)
    whole = run_job(_job(root, out / "whole", fit=True), show_progress=False)
    early = run_job(_job(root, out / "early", fit=True, early=True), show_progress=False)
    return streamed, whole, early


def _answers(output: Path) -> dict[str, str]:
    rows = read_jsonl(sorted(output.glob("results-*.jsonl")))
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in rows}


def _errors(output: Path) -> set[tuple[str, int, str]]:
    rows = read_jsonl(sorted(output.glob("errors-*.jsonl")))
    return {(r["error"]["source"], r["error"]["line"], r["error"]["code"]) for r in rows}


def test_the_engines_had_work_before_ingest_ended(runs):
    streamed, whole, early = runs
    assert whole.manifest["ingest"]["streamed"] is False
    for run in (streamed, early):
        ingest = run.manifest["ingest"]
        assert ingest["streamed"] is True
        assert ingest["first_work_handed_over_at"] < ingest["finished_at"]


def test_an_early_fit_holds_back_the_request_it_cannot_serve_and_runs_it_refitted(runs):
    _, whole, early = runs
    fitted = early.manifest["engine"]["fitted"]
    info = fitted["early"]
    assert info["rows_held"] == 1 and info["sampled_lines"] < FILES * ROWS
    # The streamed engines' context was too short for the long line; the job's fit is the whole input's.
    assert info["max_model_len"] < fitted["max_model_len"]["value"]
    assert fitted["max_model_len"] == whole.manifest["engine"]["fitted"]["max_model_len"]
    long_id = f"f{LONG[0]}-{LONG[1]:04d}"
    assert long_id in _answers(Path(early.output))
    # Two launches, one after the other: the streamed engines, then the one the held request ran on.
    assert early.manifest["engine"]["engines"] == 3
    per_engine = early.manifest["engine"]["per_engine"].values()
    assert sorted(e["rows"] for e in per_engine)[0] == 1


@pytest.mark.parametrize("which", [0, 2], ids=["no-fit", "early-fit"])
def test_losing_requests_that_ran_leave_only_their_error_record(runs, input_dir, which):
    streamed = runs[which]
    _, lines, losers = input_dir
    assert streamed.manifest["ingest"]["rows_dropped_after_running"] == losers
    results = read_jsonl(sorted(Path(streamed.output).glob("results-*.jsonl")))
    errors = read_jsonl(sorted(Path(streamed.output).glob("errors-*.jsonl")))
    assert len(results) + len(errors) == lines
    assert len({r["custom_id"] for r in results}) == len(results)
    codes = [e["error"]["code"] for e in errors]
    assert codes.count("duplicate_custom_id") == losers
    assert streamed.manifest["counts"]["total"] == lines
    assert streamed.counters.done == lines


def test_the_output_is_what_reading_everything_first_gives(runs):
    """Each id's answer is its first line's (the fake engine's text is drawn from the prompt), and the error
    records are the same lines with the same codes."""
    streamed, whole, early = runs
    for run in (streamed, early):
        assert _answers(Path(run.output)) == _answers(Path(whole.output))
        assert _errors(Path(run.output)) == _errors(Path(whole.output))


@pytest.mark.slow
@pytest.mark.parametrize("fit", [False, True], ids=["no-fit", "early-fit"])
def test_a_streamed_job_killed_half_way_resumes_exactly_once(tmp_path, fit):
    """README "Failure model", row "the driver is killed", for a streamed job whose duplicates ran before they
    were known: `resume` settles them before it lists what is left, and the output equals an uninterrupted run's.
    Fitted early, the job also holds back a request longer than its sample's fit: the resumed job runs it too."""
    n = 2400
    lines = [chat_line(f"id-{(i * 7919) % n:05d}", f"question {i}") for i in range(n)]
    for i in range(100, n, 200):  # a later line takes an earlier line's id
        lines[i] = chat_line(f"id-{((i - 50) * 7919) % n:05d}", f"again {i}")
    # Its first 64 KiB range holds ~360 lines, of which a sample reads the first ~290: line 330 is not sampled.
    lines[330] = chat_line(f"id-{(330 * 7919) % n:05d}", "question 330" + " and on" * 150)
    path = write_lines(tmp_path / "in.jsonl", lines)
    config = tmp_path / "job.yaml"
    config.write_text(
        json.dumps(
            {
                "job_id": "streamed-resume",
                "engine": {
                    "backend": "fake",
                    "fake": {
                        "output_tokens": 4,
                        "decode_seconds_per_token": 0.05,
                        "max_concurrency": 64,
                        "hold_while": str(tmp_path / "hold"),
                    },
                    "fit": {"enabled": fit, "early_min_bytes": 0},
                },
                "resources": {"cpus_per_engine": 0.5, "rows_per_task": 16},
                "output_options": {"rows_per_shard": 700, "staging_rows": 100},
            }
        )
    )
    output = tmp_path / "out"
    run = run_command(path, output, config)
    staged_before = kill_driver_half_way(run, output, n, hold=tmp_path / "hold")
    assert len(staged_before) < n

    nightshift_ok("resume", str(output), "--no-progress")
    results = read_jsonl(output.glob("results-*.jsonl"))
    errors = read_jsonl(output.glob("errors-*.jsonl"))
    assert len(results) + len(errors) == n
    assert len({r["custom_id"] for r in results}) == len(results)
    assert [e["error"]["code"] for e in errors] == ["duplicate_custom_id"] * len(range(100, n, 200))

    clean = tmp_path / "clean"
    manifest = run_uninterrupted(path, clean, config)
    assert manifest["ingest"]["streamed"] is True
    if fit:
        assert manifest["engine"]["fitted"]["early"]["rows_held"] == 1
    assert_same_shards(clean, output)


def test_a_streamed_parquet_input_hands_over_slices_of_its_first_row_groups(tmp_path):
    """A Parquet request file of large row groups, streamed: its first pieces are slices of the first row groups
    (as a JSONL file's first pieces are small byte ranges), so work is handed over before the first group is read;
    every line is answered or refused exactly as when the whole input is read first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 3000
    ids = [f"p-{i:05d}" if i % 211 != 9 else f"p-{i - 5:05d}" for i in range(rows)]  # some ids again
    bodies = [json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) for i in range(rows)]
    bodies[17] = "{not json"
    table = pa.table({"custom_id": ids, "url": ["/v1/chat/completions"] * rows, "body": bodies})
    source = tmp_path / "in"
    source.mkdir()
    pq.write_table(table, source / "requests.parquet", row_group_size=1500)  # two groups, one 3,000-row piece
    streamed = run_job(_job(source, tmp_path / "streamed", fit=False), show_progress=False)
    whole = run_job(_job(source, tmp_path / "whole", fit=True), show_progress=False)
    assert streamed.manifest["ingest"]["streamed"] is True and whole.manifest["ingest"]["streamed"] is False
    pieces = [sum(run.manifest["ingest"]["tasks_by_node"]["read"].values()) for run in (streamed, whole)]
    assert pieces[0] > pieces[1] == 1  # the one run of row groups, in slices when streamed
    assert _answers(streamed.output) == _answers(whole.output)
    assert _errors(streamed.output) == _errors(whole.output)
    counts = streamed.manifest["counts"]
    assert counts["total"] == rows and counts["failed"] == 1 + sum(i % 211 == 9 for i in range(rows))
