"""runtime.finalize cut short and run again (as `nightshift resume` runs it): the plan, the mapped groups and the
finished shards are kept, only the rest is done, and the output is byte-identical to an uninterrupted finalize.
Without Ray, so the task functions run in this process and can be interrupted by monkeypatching them. Also: when a
cluster counts as several hosts (which pins tasks to the driver's node for local paths)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.io.staging import StagingArea
from pipeline.runtime.commit import finalize as finalize_module
from pipeline.runtime.commit.finalize import FinalizeOutputs, write_outputs
from tests.staged_rows import error_row, result_row, stage_randomly, unicode_ids

ROWS_PER_SHARD = 40
RESULTS, ERRORS = 300, 90  # 8 result shards, 3 error shards


class Interrupted(Exception):
    """The driver dying part way, as seen from finalize."""


@pytest.fixture(autouse=True)
def without_ray():
    """These tests interrupt the task functions in this process: a Ray an earlier module left running would run
    them as Ray tasks instead (finalize runs on Ray whenever it is initialized)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    """An OUTPUT whose staging holds every row of a job, not yet finalized."""
    output = tmp_path / "staged"
    staging = StagingArea(output)
    staging.create()
    stage_randomly(staging, "results", [result_row(cid) for cid in unicode_ids(RESULTS)])
    stage_randomly(
        staging, "errors", [error_row(line, f"in-{line % 2}.jsonl") for line in range(ERRORS)], seed=5
    )
    return output


def finalize(output: Path, fmt: str = "jsonl", rows_per_shard: int = ROWS_PER_SHARD) -> FinalizeOutputs:
    return write_outputs(output, StagingArea(output), rows_per_shard, RESULTS + ERRORS, format=fmt)


def shard_files(output: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(output.iterdir()) if p.is_file()}


def copy_of(staged: Path, name: str) -> Path:
    return Path(shutil.copytree(staged, staged.parent / name))


class Calls:
    """Spies on the task functions: which ran, with which (kind, index); `fail` makes one raise, once."""

    def __init__(self, monkeypatch, fail: tuple[str, str, int] | None = None) -> None:
        self.seen: dict[str, list[tuple[str, int]]] = {}
        self.fail = fail
        for name, index_at in (
            ("_key_task", "group"),
            ("_cut_task", None),
            ("_map_task", "group"),
            ("_reduce_task", "shard"),
        ):
            monkeypatch.setattr(
                finalize_module, name, self._spy(name, getattr(finalize_module, name), index_at)
            )

    def _spy(self, name, real, index_at):
        def call(ctx, item):
            kind, index = item.kind, getattr(item, index_at) if index_at is not None else -1
            if self.fail == (name, kind, index):
                self.fail = None
                raise Interrupted(f"{name} {kind} {index}")
            self.seen.setdefault(name, []).append((kind, index))
            return real(ctx, item)

        return call


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_reduce_cut_short_rewrites_only_the_missing_shards(staged: Path, monkeypatch, fmt: str):
    expected = finalize(copy_of(staged, "uninterrupted"), fmt)
    reference = shard_files(staged.parent / "uninterrupted")

    with monkeypatch.context() as patch:
        calls = Calls(patch, fail=("_reduce_task", "results", 3))
        with pytest.raises(Interrupted):
            finalize(staged, fmt)
    assert calls.seen["_reduce_task"] == [("results", 0), ("results", 1), ("results", 2)]
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in staged.glob("results-*")}
    assert len(before) == 3 and "manifest.json" not in shard_files(staged)

    with monkeypatch.context() as patch:
        calls = Calls(patch)
        summary = finalize(staged, fmt)
    # No planning, no routing again: the plan and every group's pieces were recorded by the first attempt.
    assert set(calls.seen) == {"_reduce_task"}
    assert calls.seen["_reduce_task"] == [("results", k) for k in range(3, 8)] + [
        ("errors", k) for k in range(3)
    ]
    for name, stamp in before.items():  # the finished shards were left alone
        assert ((staged / name).stat().st_ino, (staged / name).stat().st_mtime_ns) == stamp
    assert summary.shards == expected.shards and summary.counts == expected.counts
    assert shard_files(staged) == reference
    assert [s.rows for s in summary.shards.results] == [40] * 7 + [20]


def test_a_map_cut_short_reroutes_only_the_unmapped_groups(staged: Path, monkeypatch):
    monkeypatch.setattr(finalize_module, "MAP_TASK_ROWS", 100)  # a few groups per kind
    expected = finalize(copy_of(staged, "uninterrupted"))
    reference = shard_files(staged.parent / "uninterrupted")

    with monkeypatch.context() as patch:
        calls = Calls(patch, fail=("_map_task", "results", 1))
        with pytest.raises(Interrupted):
            finalize(staged)
    assert calls.seen["_map_task"] == [("results", 0)] and "_reduce_task" not in calls.seen
    assert len([c for c in calls.seen["_key_task"] if c[0] == "results"]) >= 3  # groups of staged parts

    with monkeypatch.context() as patch:
        calls = Calls(patch)
        summary = finalize(staged)
    assert "_key_task" not in calls.seen and "_cut_task" not in calls.seen  # the plan was kept
    mapped = calls.seen["_map_task"]
    assert ("results", 0) not in mapped and ("results", 1) in mapped and ("errors", 0) in mapped
    assert len(calls.seen["_reduce_task"]) == 8 + 3
    assert summary.shards == expected.shards and summary.counts == expected.counts
    assert shard_files(staged) == reference


def test_interrupted_before_the_plan_was_recorded_starts_over(staged: Path, monkeypatch):
    reference = finalize(copy_of(staged, "uninterrupted"))
    (staged / "results-00000-of-00001.jsonl").write_text("a previous job's shard\n")
    with monkeypatch.context() as patch:
        Calls(patch, fail=("_cut_task", "results", -1))
        with pytest.raises(Interrupted):
            finalize(staged)
    assert (staged / "results-00000-of-00001.jsonl").exists()  # OUTPUT untouched until the plan is made
    assert finalize(staged).shards == reference.shards
    assert not (staged / "results-00000-of-00001.jsonl").exists()
    assert shard_files(staged) == shard_files(staged.parent / "uninterrupted")


def test_a_plan_that_no_longer_fits_is_made_again(staged: Path, monkeypatch):
    pristine = copy_of(staged, "other-size")
    with monkeypatch.context() as patch:
        Calls(patch, fail=("_reduce_task", "results", 2))
        with pytest.raises(Interrupted):
            finalize(staged)
    # Another shard size than the interrupted attempt planned (the job spec says otherwise now): nothing of that
    # attempt is reused, and its shards are replaced.
    summary = finalize(staged, rows_per_shard=100)
    reference = finalize(pristine, rows_per_shard=100)
    assert summary.shards == reference.shards
    assert [s.rows for s in summary.shards.results] == [100, 100, 100]
    assert shard_files(staged) == shard_files(pristine)
    assert not list(staged.glob("results-*-of-00008.jsonl"))
