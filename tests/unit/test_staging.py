"""StagingArea parts; runtime.finalize write_outputs + commit (accounting, commit marker, cleanup)."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.io import staging as staging_module
from pipeline.io.staging import StagedRow, StagingArea
from pipeline.runtime.commit import finalize as finalize_module
from pipeline.runtime.commit.finalize import MANIFEST_NAME, AccountingError, commit, write_outputs
from pipeline.stages.shard import sort_table
from tests.staged_rows import staged_rows


def result_row(custom_id: str, line: int = 1, source: str = "in.jsonl") -> StagedRow:
    record = {
        "id": f"batch_req_{custom_id}",
        "custom_id": custom_id,
        "response": {"status_code": 200},
        "error": None,
    }
    return StagedRow(custom_id, line, source, None, 3, 5, "default", json.dumps(record, ensure_ascii=False))


def error_row(
    line: int, source: str = "in.jsonl", custom_id: str | None = None, code: str = "invalid_json"
) -> StagedRow:
    record = {
        "id": f"batch_req_{source}_{line}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": "bad", "line": line, "source": source},
    }
    return StagedRow(custom_id, line, source, code, 0, 0, "", json.dumps(record))


def random_id(rng: random.Random) -> str:
    alphabet = "abcXYZ019-_éß日😀"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))


def write_in_random_parts(staging: StagingArea, kind: str, rows: list[StagedRow], rng: random.Random) -> int:
    rows = rows[:]
    rng.shuffle(rows)
    parts = 0
    while rows:
        size = rng.randint(1, 9)
        staging.write_rows(kind, rows[:size])
        rows = rows[size:]
        parts += 1
    return parts


@pytest.fixture
def staging(tmp_path: Path) -> StagingArea:
    area = StagingArea(tmp_path / "out")
    area.create()
    return area


def all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


# -- StagingArea ----------------------------------------------------------------------------------------------------


def test_create_layout(staging: StagingArea):
    assert staging.exists()
    assert Path(staging.root).name == "_staging"
    assert {p.name for p in Path(staging.root).iterdir()} == {"requests", "results", "errors"}
    assert staging.count("results") == staging.count("errors") == 0
    assert staging.parts("results") == staging.parts("errors") == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_result_parts_round_trip_each_sorted_by_custom_id(staging: StagingArea, seed: int):
    rng = random.Random(seed)
    ids = sorted({random_id(rng) for _ in range(120)})
    rows = [result_row(cid, line=i + 1) for i, cid in enumerate(ids)]
    parts = write_in_random_parts(staging, "results", rows, rng)

    assert len(staging.parts("results")) == parts > 10
    assert staging.count("results") == len(ids)
    key = lambda r: r.custom_id.encode()  # noqa: E731
    assert sorted(staged_rows(staging, "results"), key=key) == sorted(
        rows, key=key
    )  # every field round-trips
    for part in staging.parts("results"):  # each part is itself sorted
        part_ids = pq.read_table(part, columns=["custom_id"]).column("custom_id").to_pylist()
        assert part_ids == sorted(part_ids)


def test_errors_sort_by_source_then_line(staging: StagingArea):
    rng = random.Random(7)
    rows = [
        error_row(line, source) for source in ("a.jsonl", "b.jsonl", "c/d.jsonl") for line in range(1, 60)
    ]
    rows += [
        error_row(1000 + i, "a.jsonl", custom_id=f"dup-{i}", code="duplicate_custom_id") for i in range(5)
    ]
    write_in_random_parts(staging, "errors", rows, rng)

    assert staging.count("errors") == len(rows)
    everything = pa.concat_tables(staging.read_part(part) for part in staging.parts("errors"))
    ordered = sort_table(everything, "errors")  # the order finalize writes error shards in
    positions = list(
        zip(ordered.column("source").to_pylist(), ordered.column("line").to_pylist(), strict=True)
    )
    assert positions == sorted(positions)
    assert positions[:2] == [("a.jsonl", 1), ("a.jsonl", 2)]  # numeric, not lexical, line order
    assert sorted(staging.iter_column("errors", "error_code")) == sorted(r.error_code for r in rows)


def test_parts_written_atomically_leave_no_temp_files(staging: StagingArea):
    for i in range(20):
        staging.write_rows("results", [result_row(f"r{i:03d}")])
        staging.write_rows("errors", [error_row(i + 1)])
    staging.write_requests(
        [{"custom_id": "q", "url": "/v1/completions", "body": "{}", "line": 1, "source": "s"}]
    )
    staging.write_rows("results", [])  # nothing to write: no empty part
    files = all_files(Path(staging.root))
    assert len(files) == 41
    assert all(p.suffix == ".parquet" and not p.name.startswith(".") for p in files)
    assert len(set(p.name for p in files)) == len(files)  # part names never collide


def test_failed_part_write_leaves_no_visible_part(staging: StagingArea, monkeypatch):
    staging.write_rows("results", [result_row("a")])

    def broken_write_table(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 torn")  # a partial file, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staging_module.pq, "write_table", broken_write_table)
    with pytest.raises(OSError):
        staging.write_rows("results", [result_row("b")])
    assert len(staging.parts("results")) == 1
    assert staging.count("results") == 1
    assert list(staging.iter_column("results", "custom_id")) == ["a"]


def test_failed_part_write_removes_its_temp_file(staging: StagingArea, monkeypatch):
    def broken_write_table(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1 torn")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staging_module.pq, "write_table", broken_write_table)
    with pytest.raises(OSError):
        staging.write_rows("errors", [error_row(1)])
    assert all_files(Path(staging.root)) == []


def test_two_writers_share_a_directory(tmp_path: Path):
    a, b = StagingArea(tmp_path), StagingArea(tmp_path)
    a.create()
    a.write_rows("results", [result_row("x"), result_row("m")])
    b.write_rows("results", [result_row("b"), result_row("y")])
    assert len(a.parts("results")) == 2
    assert [r.custom_id for r in staged_rows(b, "results")] == ["b", "m", "x", "y"]


# -- write_outputs + commit -----------------------------------------------------------------------------------------


def output_files(output: Path) -> set[str]:
    return {p.name for p in output.iterdir() if p.is_file()}


def test_write_outputs_and_commit(staging: StagingArea, monkeypatch):
    output = Path(staging.root).parent
    rng = random.Random(3)
    ids = [f"req-{i:04d}" for i in range(23)]
    write_in_random_parts(staging, "results", [result_row(cid) for cid in ids], rng)
    errors = [error_row(i, code="invalid_json") for i in (5, 1, 9)] + [error_row(2, code="model_not_found")]
    staging.write_rows("errors", errors)

    summary = write_outputs(output, staging, rows_per_shard=10, expected_rows=27)
    assert summary.counts.model_dump() == {
        "total": 27,
        "succeeded": 23,
        "failed": 4,
        "by_error_code": {"invalid_json": 3, "model_not_found": 1},
        "structured": {"requested": 0, "parsed_json": 0},  # no row asked for JSON output
    }
    result_names = [f"results-{k:05d}-of-00003.jsonl" for k in range(3)]
    assert [s.name for s in summary.shards.results] == result_names
    assert [s.name for s in summary.shards.errors] == ["errors-00000-of-00001.jsonl"]
    assert MANIFEST_NAME not in output_files(output)  # shards alone are not a commit
    assert staging.exists()

    seen_ids = []
    for shard in summary.shards.results + summary.shards.errors:
        data = (output / shard.name).read_bytes()
        assert shard.sha256 == hashlib.sha256(data).hexdigest()
        assert shard.rows == len(data.splitlines())
        if shard.name.startswith("results"):
            seen_ids += [json.loads(x)["custom_id"] for x in data.splitlines()]
    assert seen_ids == ids
    error_lines = [json.loads(x) for x in (output / "errors-00000-of-00001.jsonl").read_text().splitlines()]
    assert [e["error"]["line"] for e in error_lines] == [1, 2, 5, 9]

    # commit: manifest written when every shard is complete, _staging removed only after the manifest exists.
    events: list[str] = []
    real_write_json = finalize_module.atomic_write_json
    real_rmtree = shutil.rmtree

    def spy_write_json(path, obj):
        assert set(result_names) <= output_files(output)
        events.append("manifest")
        real_write_json(path, obj)

    def spy_rmtree(path, *args, **kwargs):
        assert (output / MANIFEST_NAME).exists()
        events.append("rmtree")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(finalize_module, "atomic_write_json", spy_write_json)
    monkeypatch.setattr(shutil, "rmtree", spy_rmtree)
    manifest = {"format_version": finalize_module.FORMAT_VERSION, **summary.manifest_fields()}
    commit(output, staging, manifest)

    assert events == ["manifest", "rmtree"]
    assert json.loads((output / MANIFEST_NAME).read_text()) == manifest
    assert not staging.exists()
    assert output_files(output) == set(result_names) | {"errors-00000-of-00001.jsonl", MANIFEST_NAME}
    assert not [p for p in output.iterdir() if p.name.startswith(".")]  # no temp files left


@pytest.mark.parametrize("expected_rows", [3, 5, 0])
def test_accounting_mismatch_commits_nothing(staging: StagingArea, expected_rows: int):
    output = Path(staging.root).parent
    staging.write_rows("results", [result_row("a"), result_row("b"), result_row("c")])
    staging.write_rows("errors", [error_row(4)])
    with pytest.raises(AccountingError, match="output not committed"):
        write_outputs(output, staging, rows_per_shard=10, expected_rows=expected_rows)
    assert output_files(output) == set()  # no manifest, no shards
    assert staging.count("results") == 3  # staging untouched: resume can still finish the job


def test_duplicate_result_staged_twice_is_an_accounting_error(staging: StagingArea):
    output = Path(staging.root).parent
    staging.write_rows("results", [result_row("a"), result_row("dup")])
    staging.write_rows("results", [result_row("dup"), result_row("z")])  # e.g. a retried batch staged again
    with pytest.raises(AccountingError, match="dup"):
        write_outputs(output, staging, rows_per_shard=10, expected_rows=4)
    assert MANIFEST_NAME not in output_files(output)
    assert staging.exists()


def test_rerun_removes_stale_shards_of_another_count(staging: StagingArea):
    output = Path(staging.root).parent
    stale = [f"results-{k:05d}-of-00004.jsonl" for k in range(4)] + ["errors-00000-of-00002.jsonl"]
    stale += ["errors-00001-of-00002.jsonl", "results-00000-of-00001.parquet"]
    for name in stale:
        (output / name).write_text("stale\n")
    (output / MANIFEST_NAME).write_text("{}")
    (output / "notes.txt").write_text("not ours")

    staging.write_rows("results", [result_row(f"r{i}") for i in range(5)])
    summary = write_outputs(output, staging, rows_per_shard=3, expected_rows=5)
    assert output_files(output) == {
        "results-00000-of-00002.jsonl",
        "results-00001-of-00002.jsonl",
        "errors-00000-of-00001.jsonl",
        "notes.txt",
    }
    assert summary.counts.failed == 0
    assert (output / "errors-00000-of-00001.jsonl").read_bytes() == b""
    commit(output, staging, summary.manifest_fields())
    assert MANIFEST_NAME in output_files(output)
