"""The early fit, without Ray: a sample spread over the input (runtime/ingest/sample.py), the args decided from it,
the requests it cannot serve staged apart and never handed over while ingest runs, and the job's fit once the whole
input is measured (runtime/ingest/fit.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig
from pipeline.engines import fake
from pipeline.engines.fitting import FitTarget
from pipeline.fit_record import decision_of
from pipeline.io.readers import input_source
from pipeline.io.staging import StagingArea
from pipeline.max_tokens import output_budget
from pipeline.models import ResolvedModel
from pipeline.planner import round_up
from pipeline.runtime.ingest import measure
from pipeline.runtime.ingest.fit import EARLY_HEADROOM, decide, decide_early, hold_above, settle_early_fit
from pipeline.runtime.ingest.sample import SAMPLE_PIECES, SAMPLE_ROWS, sample_pieces
from pipeline.runtime.ingest.tasks import held_requests, ingest, is_held, sample_input
from tests.plans import plan_of

MODEL = "smollm2-135m-instruct"
JOB = "job-early"


def chat(custom_id: str, words: int, max_tokens: int = 10) -> str:
    body = {"messages": [{"role": "user", "content": " ".join(["w"] * words)}], "max_tokens": max_tokens}
    return json.dumps({"custom_id": custom_id, "url": "/v1/chat/completions", "body": body})


def word_target(limit: int) -> FitTarget:
    return FitTarget(
        counted_by="words",
        count=lambda requests: [[len(body["messages"][0]["content"].split())] for _, body in requests],
        output_budget=lambda url, body: output_budget(url, body, None, 50),
        model_limit=limit,
        block_size=lambda args, device: 16,
        capacity=lambda args, device: None,
    )


@pytest.fixture
def words(monkeypatch):
    monkeypatch.setattr(fake, "fit_target", lambda model, args, default_max_tokens: word_target(4096))
    config = JobConfig.model_validate({"engine": {"backend": "fake"}})
    model = ResolvedModel(name=MODEL, path="/nowhere", revision=None, source="local-dir")
    spec = measure.measuring(config, model)
    assert spec is not None
    return spec


def staging_at(path: Path) -> StagingArea:
    area = StagingArea(path)
    area.create()
    return area


def ids_in(parts: list[str]) -> set[str]:
    return {cid for part in parts for cid in pq.read_table(part, columns=["custom_id"]).column(0).to_pylist()}


def test_requests_past_the_early_context_are_staged_apart_and_never_handed_over(tmp_path: Path, words):
    # Needs (prompt words + max_tokens 10): short 13, long 210. A long line that loses its id to an earlier line
    # leaves the held parts too, though streaming never hands them over.
    lines = [chat(f"s-{i:03d}", 3) for i in range(300)]
    lines[40] = chat("long-a", 200)
    lines[250] = chat("long-b", 200)
    lines[260] = chat("s-001", 200)  # a duplicate: s-001's first line wins
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    staging = staging_at(tmp_path / "out")
    handed: list[str] = []

    report = ingest(
        path,
        MODEL,
        staging,
        job_id=JOB,
        measure=words,
        range_bytes=2000,  # several pieces, each handed over as it is staged
        parallel=False,
        on_requests=handed.extend,
        hold_above=64,
    )

    held = held_requests(staging)
    assert held and all(is_held(part) for part in held)
    assert not any(is_held(part) for part in handed)
    assert ids_in(held) == {"long-a", "long-b"}
    assert ids_in(handed) | ids_in(held) == {f"s-{i:03d}" for i in range(300) if i not in (40, 250, 260)} | {
        "long-a",
        "long-b",
    }
    assert report.held == 3  # as staged, the duplicate with them; dedup then took it out
    assert report.lengths.longest_need == 210


def test_without_an_early_fit_nothing_is_held(tmp_path: Path, words):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([chat("a", 3), chat("b", 300)]) + "\n")
    staging = staging_at(tmp_path / "out")
    report = ingest(path, MODEL, staging, job_id=JOB, measure=words, parallel=False)
    assert held_requests(staging) == [] and report.held == 0
    assert ids_in(staging.request_files()) == {"a", "b"}


def test_the_sample_reads_from_every_part_of_a_large_input(tmp_path: Path, words):
    rows = 20_000
    path = tmp_path / "in.jsonl"
    with path.open("w") as out:
        for i in range(rows):
            # Long lines only in the last tenth of the file: a sample of its head would miss them.
            out.write(chat(f"r-{i:05d}", 100 if i >= rows * 9 // 10 else 5) + "\n")
    staging = staging_at(tmp_path / "out")
    sample = sample_input(input_source(path), MODEL, staging, words, JOB, parallel=False)
    assert not sample.whole
    assert SAMPLE_ROWS // 2 <= sample.lines <= SAMPLE_ROWS
    assert sample.lengths.longest_need == 110
    assert 0 < sample.lengths.requests < rows


def test_a_sample_of_a_small_input_is_the_whole_input(tmp_path: Path, words):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(chat(f"r-{i}", 5) for i in range(300)) + "\nnot json\n")
    sample = sample_input(input_source(path), MODEL, staging_at(tmp_path / "out"), words, JOB, parallel=False)
    assert sample.whole and sample.lines == 301 and sample.lengths.requests == 300


def test_sample_pieces_are_spread_evenly_and_cover_a_few_pieces_whole(tmp_path: Path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(chat(f"r-{i:05d}", 5) for i in range(5000)) + "\n")
    pieces, _ = input_source(path).plan_reads(1000, piece_rows=1)
    chosen, each, every = sample_pieces(pieces)
    assert len(pieces) > SAMPLE_PIECES and len(chosen) == SAMPLE_PIECES and not every
    assert chosen[0].start == 0 and chosen[-1].start >= pieces[-len(pieces) // SAMPLE_PIECES - 1].start
    assert each == SAMPLE_ROWS // SAMPLE_PIECES
    few = pieces[:3]
    assert sample_pieces(few)[1:] == (SAMPLE_ROWS // 3, True)


def _config() -> tuple[JobConfig, ResolvedModel]:
    config = JobConfig.model_validate({"engine": {"backend": "fake"}})
    return config, ResolvedModel(name=MODEL, path="/nowhere", revision=None, source="local-dir")


def test_the_early_context_allows_headroom_and_the_job_keeps_it_when_nothing_was_held(tmp_path: Path, words):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(chat(f"r-{i:05d}", 20 if i % 1000 else 60) for i in range(10_000)) + "\n")
    staging = staging_at(tmp_path / "out")
    config, model = _config()
    sample = sample_input(input_source(path), MODEL, staging, words, JOB, parallel=False)
    early = decide_early(plan_of(config, model), staging, JOB, sample)
    assert early is not None
    need = sample.lengths.longest_need
    assert early.max_model_len.value == round_up(math.ceil(need * EARLY_HEADROOM), 16)
    assert hold_above(early) == early.max_model_len.value
    assert "fitted early" in (early.max_model_len.why or "")

    report = ingest(
        path, MODEL, staging, job_id=JOB, measure=words, parallel=False, hold_above=hold_above(early)
    )
    full = decide(plan_of(config, model), staging, JOB, report.lengths)
    kept = decision_of(settle_early_fit(early, full, sample, rows_held=0))
    assert kept is not None and kept.early is not None
    assert kept.max_model_len == early.max_model_len  # what the engines ran: a resume runs the same
    assert kept.early.rows_held == 0 and kept.early.sampled_lines == sample.lines
    assert kept.measured == decision_of(full).measured  # what the whole input measured

    refit = decision_of(settle_early_fit(early, full, sample, rows_held=2))
    assert refit is not None and refit.early is not None and refit.early.rows_held == 2
    assert refit.max_model_len == decision_of(full).max_model_len
    assert refit.early.max_model_len == early.max_model_len.value
    assert "held back" in refit.early.why


def test_a_sample_that_measured_nothing_decides_nothing_early(tmp_path: Path, words):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(["not json"] * 5000) + "\n")
    staging = staging_at(tmp_path / "out")
    config, model = _config()
    sample = sample_input(input_source(path), MODEL, staging, words, JOB, parallel=False)
    assert not sample.whole and sample.lengths.requests == 0
    assert decide_early(plan_of(config, model), staging, JOB, sample) is None


def test_a_streamed_ingest_reads_small_ranges_first_and_stages_the_same_work(tmp_path: Path, words):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(chat(f"r-{i:05d}", 3 + i % 7) for i in range(30_000)) + "\n")  # ~3 MiB
    handed: list[list[str]] = []
    streamed = staging_at(tmp_path / "streamed")
    ingest(
        path,
        MODEL,
        streamed,
        job_id=JOB,
        measure=words,
        parallel=False,
        range_bytes=8 << 20,
        on_requests=handed.append,
    )
    whole = staging_at(tmp_path / "whole")
    ingest(path, MODEL, whole, job_id=JOB, measure=words, parallel=False, range_bytes=8 << 20)

    def rows(parts: list[str]) -> list[tuple]:
        return sorted(
            (r["custom_id"], r["line"], r["body"]) for p in parts for r in pq.read_table(p).to_pylist()
        )

    # Read as one range, the file would be handed over whole, at the end; the ramp's first range is 1 MiB.
    assert len(handed) >= 2
    first = pq.read_table(handed[0][0], columns=["line"]).column(0).to_pylist()
    assert first[0] == 1 and len(first) < 30_000 // 2
    assert rows(streamed.request_files()) == rows(whole.request_files())
