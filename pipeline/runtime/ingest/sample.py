"""A sample of the input, measured before ingest: what the early fit decides from (runtime/ingest/fit.py), so engines
take requests from the first seconds of a large job instead of after the whole input is read, measured and fitted.

The sample is spread over the input: up to SAMPLE_PIECES pieces evenly across its byte ranges (JSONL) or row groups
(Parquet), the first rows of each, validated and measured exactly as ingest measures them (`_Measure`). It runs as
one task on the cluster, where the tokenizer it loads stays for the ingest tasks that worker runs next. A sample that
read every line of the input is `whole`: such an input is small enough that waiting for the exact fit costs nothing,
and the job fits it as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from pipeline.fit_record import Lengths
from pipeline.io.pieces import InputPiece
from pipeline.io.rows import BadRow
from pipeline.max_tokens import requested_max_tokens
from pipeline.runtime.ingest.measure import context_problem
from pipeline.stages.validate import LineValidator, ValidRequest

SAMPLE_PIECES = 64  # places in the input the sample reads from
SAMPLE_ROWS = 2048  # lines the sample reads in all: a fraction of a second to measure
SAMPLE_RANGE_BYTES = 64 << 10  # the smallest byte range a JSONL sample piece stands for


@dataclass
class Sample:
    """What the sample measured: the lengths of its valid requests (those that can run at all: too long for the
    model is an error record, whatever the fit), how many lines it read, and whether that was every line."""

    lengths: Lengths = field(default_factory=Lengths)
    lines: int = 0
    whole: bool = True
    seconds: float = 0.0

    def merge(self, other: Sample) -> Sample:
        self.lengths.merge(other.lengths)
        self.lines += other.lines
        self.whole &= other.whole
        self.seconds += other.seconds
        return self


def sample_pieces(pieces: list[InputPiece]) -> tuple[list[InputPiece], int, bool]:
    """The pieces the sample reads (evenly spread, at most SAMPLE_PIECES), the lines it reads of each, and whether
    that is every piece. A JSONL range piece's line count is not known before the scan: the sample's own line
    numbers are not the input's, and nothing it measures is staged."""
    chosen = pieces
    if len(pieces) > SAMPLE_PIECES:
        step = len(pieces) / SAMPLE_PIECES
        chosen = [pieces[int(i * step)] for i in range(SAMPLE_PIECES)]
    chosen = [replace(piece, before=0) if piece.before < 0 else piece for piece in chosen]
    return chosen, max(1, SAMPLE_ROWS // max(1, len(chosen))), len(chosen) == len(pieces)


def measure_sample(job, item: tuple[list[InputPiece], int, bool]) -> Sample:
    """The task: the first `rows_each` lines of each piece, validated and measured as ingest does (`job`: the
    ingest tasks' IngestJob, with a MeasureSpec)."""
    pieces, rows_each, every_piece = item
    started = time.monotonic()
    target, limit = job.measure.target(), job.measure.limit
    source = job.source
    source.limits = job.limits
    validator = LineValidator(job.served, job.job_id, job.limits)
    sample = Sample(whole=every_piece)
    requests: list[ValidRequest] = []
    renderer = job.renderer()
    for piece in pieces:
        read = 0
        rows = source.piece_rows(piece)
        try:
            for name, number, payload in rows:
                if read >= rows_each:
                    sample.whole = False  # a line was left unread
                    break
                read += 1
                if renderer is not None:
                    payload, _ = renderer.read(payload, number, piece.file)
                if isinstance(payload, BadRow):
                    continue
                outcome, _ = validator.check(payload, number, name)
                if isinstance(outcome, ValidRequest):
                    requests.append(outcome)
        finally:
            rows.close()
        sample.lines += read
    counts = target.count([(request.url, request.body) for request in requests]) if requests else []
    for request, prompts in zip(requests, counts, strict=True):
        if isinstance(prompts, Exception):
            sample.lengths.untokenizable += 1
            continue
        if prompts and context_problem(max(prompts), requested_max_tokens(request.body), limit):
            sample.lengths.too_long += 1
            continue
        output, assumed = target.output_budget(request.url, request.body)
        sample.lengths.add(request.custom_id, prompts, output, assumed, limit)
    sample.seconds = time.monotonic() - started
    sample.lengths.seconds = sample.seconds
    return sample
