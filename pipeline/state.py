"""The job state: what `_staging/job.json` holds, so that `resume` continues a job as it began.

    job_id, config          written when the job starts: its identity and its spec (what `resume` re-reads)
    model                   the model the job serves, as resolved when ingest began
    input, lengths, ingest  written once ingest has run (`ingested`): what was read, measured (a Lengths), and where
    fit                     the engine args fitted to the data (a FitRecord, runtime/ingest/fit.py), decided once

The driver writes it after each step (staging.write_job) and reads it back (staging.read_job): on resume, and
for the fitted args it hands the engines.

A pure module (pydantic only, no Ray, no vLLM): io/staging.py reads and writes it, the runtime fills it in.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline.config import JobConfig
from pipeline.fit_record import FitRecord, Lengths
from pipeline.models import ResolvedModel

__all__ = ["InputSummary", "JobInput", "IngestRecord", "JobState"]


class _Kept(BaseModel):
    # extra="allow", not "ignore": a job.json written by another version of nightshift may hold keys this one does
    # not know. They neither stop `resume` nor get lost: they are kept, and written back with the state, so a
    # version that knows them finds them intact. Assignments are validated: a step that stores a wrong type fails
    # where it does so, not when the state is read back on resume.
    model_config = ConfigDict(extra="allow", validate_assignment=True, protected_namespaces=())


class InputSummary(_Kept):
    """The input the job read (the manifest's `input`)."""

    location: str | None = Field(
        default=None,
        description="Where the input was read from: a local path, a glob, an s3:// or http(s):// URL. None only "
        "for a job begun by a version that did not record it.",
    )
    fingerprint: str = Field(
        description="The input's fingerprint (e.g. sha256:…); `resume` refuses an input that no longer matches."
    )
    size_bytes: int | None = Field(
        default=None,
        description="Bytes read. None only for a job begun by a version that did not record it.",
    )
    lines: int = Field(description="Non-blank input lines (rows): the accounting base.")


class JobInput(InputSummary):
    """What ingest made of the input: its summary, and how many of its lines are requests to run."""

    valid: int = Field(description="Requests in the work list (lines that passed validation and measuring).")
    invalid: int = Field(description="Lines that became error records before any engine ran.")
    prefix_keyed: int = Field(
        default=0,
        description="Valid requests with a prefix key (a shared leading prompt worth routing by); 0 for a job "
        "begun before requests were keyed.",
    )

    def summary(self) -> InputSummary:
        """The part of it the manifest reports."""
        return InputSummary.model_validate(self.model_dump(include=set(InputSummary.model_fields)))


class IngestRecord(_Kept):
    """Where ingest ran and how long its steps took (the manifest's `ingest`)."""

    nodes: list[str] = Field(description="Ray node ids that ran ingest's tasks, sorted.")
    tasks_by_node: dict[str, dict[str, int]] = Field(
        description="Per step (scan, read, dedup, …): Ray node id → tasks it ran (`local`: in the driver)."
    )
    seconds: dict[str, float] = Field(description="Per step: its wall time in seconds.")
    range_bytes: int | None = Field(
        default=None, description="The size of the byte ranges large JSONL files were read in."
    )
    streamed: bool = Field(
        default=False,
        description="Engines took requests while ingest still read the input (nothing was fitted to it, or the "
        "args were fitted early to a sample of it: engine.fitted.early).",
    )
    finished_at: float | None = Field(default=None, description="When ingest ended (epoch seconds).")
    tokenizer_loads: int = Field(
        default=0,
        description="Tokenizers ingest's tasks loaded to measure the requests: one per process that had not "
        "loaded the model's before (0 when measuring is off, or on a warm runtime's task hosts that had).",
    )
    first_work_handed_over_at: float | None = Field(
        default=None,
        description="Streaming: when the first requests were handed to the engines (epoch seconds).",
    )
    rows_dropped_after_running: int = Field(
        default=0,
        description="Streaming: rows engines made of requests later found to repeat an earlier line's "
        "custom_id, dropped (their lines are duplicate_custom_id error records).",
    )


class JobState(_Kept):
    """`_staging/job.json`. Fields are filled in as the job goes; None until their step has run."""

    job_id: str = Field(description="Job identity: seeds output ids; kept across resume.")
    config: JobConfig = Field(
        description="The job's spec as it started (before fitting): what `resume` runs again."
    )
    model: ResolvedModel | None = Field(
        default=None, description="The job's own model (its first pool's), as resolved when ingest began."
    )
    input: JobInput | None = Field(default=None, description="What ingest read and validated.")
    lengths: Lengths | None = Field(
        default=None,
        description="The request lengths ingest measured, for fitting (pipeline/fit_record.py); None when the job "
        "is not fitted or was not measured during ingest.",
    )
    ingest: IngestRecord | None = Field(default=None, description="Where ingest ran, per step.")
    ingested: bool = Field(
        default=False,
        description="Ingest finished: the work list and its error records are staged. Until then a resumed job "
        "redoes ingest whole.",
    )
    fit: FitRecord | None = Field(
        default=None,
        description="The engine args fitted to the data: what, from what and why (pipeline/fit_record.py, decided "
        "by runtime/ingest/fit.py; the manifest's engine.fitted): fitting off, skipped, or its decision. None "
        "until decided.",
    )
