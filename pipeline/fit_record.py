"""What fitting measures and decides, as typed records: kept in `_staging/job.json` and reported in the manifest.

    Lengths       the requests' lengths in running totals (job.json `lengths`): each ingest task measures its own
                  requests, the driver merges the aggregates; never one entry per request
    FitRecord     the engine args fitted to them (job.json `fit`, the manifest's `engine.fitted`): one of
                  FitOff (fitting turned off, or the backend's args are not nightshift's), FitSkipped (fitting
                  could not run: e.g. no tokenizer) and FitDecision (what was fitted, from what, per pool)

The JSON of each is what nightshift wrote before they were typed, key for key, so a job interrupted by an earlier
version resumes. Keys an earlier version did not write take their defaults; keys this version does not know are
kept (extra="allow") and written back.

A pure module (pydantic only, no Ray, no vLLM): the runtime (runtime/ingest/) fills the records in; the state, the
manifest and the observers read them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

__all__ = [
    "FitDecision",
    "FitOff",
    "FitRecord",
    "EarlyFit",
    "FitSkipped",
    "Lengths",
    "MaxModelLenFit",
    "MaxNumSeqsFit",
    "MeasuredSummary",
    "TokenStats",
    "decision_of",
    "read_fit_record",
]


class _Record(BaseModel):
    # extra="allow": a record written by another version keeps the keys this one does not know (see state.py).
    model_config = ConfigDict(extra="allow", protected_namespaces=())


# --- measuring ---------------------------------------------------------------------------------------------------

# Lengths fields that add up when two aggregates merge (the others are maxima, or name the longest request).
_SUMMED = (
    "requests",
    "sequences",
    "prompt_sum",
    "need_sum",
    "assumed_output",
    "untokenizable",
    "output_capped",
    "too_long",
    "seconds",
)


class Lengths(_Record):
    """What measuring learned of the requests, in running totals: mergeable in any order (`merge`), with the same
    result as one pass over the input in order (`add`)."""

    requests: int = Field(default=0, description="Requests measured.")
    sequences: int = Field(default=0, description="Sequences they start (one per prompt of a request).")
    longest_need: int = Field(
        default=0, description="The longest sequence's need: its prompt + its output budget, in tokens."
    )
    longest_id: str | None = Field(
        default=None, description="custom_id of the request with the longest need."
    )
    longest_prompt_of_longest: int = Field(default=0, description="That request's prompt tokens.")
    longest_prompt: int = Field(default=0, description="The longest prompt of any request, in tokens.")
    prompt_sum: int = Field(default=0, description="Prompt tokens of every sequence, added up.")
    need_sum: int = Field(
        default=0, description="Needs (prompt + output budget) of every sequence, added up."
    )
    assumed_output: int = Field(
        default=0,
        description="Chat requests budgeted the default output (no max_tokens anywhere: engine.fit."
        "default_max_tokens).",
    )
    untokenizable: int = Field(
        default=0,
        description="Requests the chat template rejected: left to the engine, which rejects them too.",
    )
    output_capped: int = Field(
        default=0,
        description="Requests that set no max_tokens whose prompt fits the model's limit but prompt + default "
        "budget does not: vLLM cuts their output at the end of the context.",
    )
    too_long: int = Field(
        default=0,
        description="Requests that can never run within the model's limit: context_length_exceeded error "
        "records, kept out of the work list.",
    )
    seconds: float = Field(default=0.0, description="Time spent measuring, in seconds (summed over tasks).")
    longest_at: tuple[int, int] | None = Field(
        default=None,
        description="Where the longest request is, (file index, line): of equally long ones the first in the "
        "input is named, so aggregates merged in any order name the request one pass over the input would.",
    )

    def add(
        self,
        custom_id: str,
        prompts: list[int],
        output: int,
        assumed: bool,
        limit: int,
        at: tuple[int, int] | None = None,
    ) -> None:
        """One request, added in input order (a tie keeps the earlier one)."""
        self.requests += 1
        self.assumed_output += assumed
        capped = False
        for prompt in prompts:
            need = prompt + output
            self.sequences += 1
            self.prompt_sum += prompt
            self.need_sum += need
            self.longest_prompt = max(self.longest_prompt, prompt)
            capped |= need > limit
            if need > self.longest_need:
                self.longest_need, self.longest_id, self.longest_prompt_of_longest = need, custom_id, prompt
                self.longest_at = at
        self.output_capped += capped

    def merge(self, other: Lengths) -> Lengths:
        """Fold in the lengths of other requests (another part of the input); returns self. Sums add, maxima take
        the larger; the longest request is the earlier one (by `longest_at`) when two are equally long."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.longest_prompt = max(self.longest_prompt, other.longest_prompt)
        if other.longest_need > self.longest_need or (
            other.longest_need == self.longest_need
            and other.longest_id is not None
            and (self.longest_id is None or _earlier(other.longest_at, self.longest_at))
        ):
            self.longest_need, self.longest_id = other.longest_need, other.longest_id
            self.longest_prompt_of_longest, self.longest_at = (
                other.longest_prompt_of_longest,
                other.longest_at,
            )
        return self

    def summary(self) -> MeasuredSummary:
        """What the manifest reports of them (the fit record's `measured`)."""
        n = self.sequences or 1
        return MeasuredSummary(
            requests=self.requests,
            sequences=self.sequences,
            prompt_tokens=TokenStats(max=self.longest_prompt, mean=round(self.prompt_sum / n, 1)),
            prompt_plus_max_tokens=TokenStats(max=self.longest_need, mean=round(self.need_sum / n, 1)),
            longest_request=self.longest_id,
            assumed_output_requests=self.assumed_output,
            untokenizable_requests=self.untokenizable,
            output_capped_requests=self.output_capped,
            seconds=round(self.seconds, 2),
        )


def _earlier(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is not None and (b is None or a < b)


class TokenStats(_Record):
    """The largest and the mean of a token count over the measured sequences."""

    max: int = Field(description="The largest, in tokens.")
    mean: float = Field(description="The mean, in tokens (one decimal).")


class MeasuredSummary(_Record):
    """What measuring found, as the manifest reports it (from `Lengths.summary`)."""

    requests: int = Field(description="Requests measured.")
    sequences: int = Field(description="Sequences they start.")
    prompt_tokens: TokenStats = Field(description="Prompt tokens per sequence.")
    prompt_plus_max_tokens: TokenStats = Field(description="Prompt + output budget per sequence.")
    longest_request: str | None = Field(description="custom_id of the request with the longest need.")
    assumed_output_requests: int = Field(
        default=0, description="Chat requests without max_tokens, budgeted engine.fit.default_max_tokens."
    )
    untokenizable_requests: int = Field(
        default=0, description="Requests the chat template rejected (left to the engine)."
    )
    output_capped_requests: int = Field(
        default=0,
        description="Requests without max_tokens whose prompt + default budget passes the model's limit.",
    )
    seconds: float = Field(default=0.0, description="Time spent measuring, in seconds.")


# --- deciding ----------------------------------------------------------------------------------------------------

MaxModelLenSource = Literal["given", "fitted", "model limit"]
MaxNumSeqsSource = Literal["given", "fitted", "default", "engine"]


class MaxModelLenFit(_Record):
    """The job's max_model_len: its value and where it came from."""

    value: int = Field(description="The max_model_len the engines run with.")
    source: MaxModelLenSource = Field(
        description="given (--max-model-len), fitted (to the measured requests) or model limit (nothing measured)."
    )
    model_limit: int = Field(description="The longest context the model accepts.")
    block_size: int = Field(description="The KV block the fitted value is rounded up to, in tokens.")
    needed: int | None = Field(
        default=None,
        description="What the requests need: the longest prompt + output budget, rounded up to a block, at most "
        "the model's limit; None when nothing was measured.",
    )
    why: str | None = Field(default=None, description="How `needed` was found, in words.")


class MaxNumSeqsFit(_Record):
    """One pool's max_num_seqs: its value, where it came from, and the KV capacity it was sized by."""

    value: int | None = Field(description="The max_num_seqs the pool's engines run with; None: vLLM decides.")
    source: MaxNumSeqsSource = Field(
        description="given, fitted (to the KV capacity), default (capacity unknown on CPU) or engine (a GPU's "
        "capacity is known once vLLM has measured its memory)."
    )
    sized_for_tokens: int | None = Field(
        default=None, description="The length every sequence was assumed to grow to, in tokens."
    )
    kv_cache_tokens: int | None = Field(
        default=None, description="The pool's KV capacity in tokens, when known before the engine starts."
    )
    fits: int | None = Field(
        default=None, description="Sequences of `sized_for_tokens` the KV cache holds at once, when known."
    )
    why: str = Field(description="How the value was chosen, in words.")


class FitOff(_Record):
    """Nothing was fitted, by choice: fitting is turned off, or the backend's engine args are not nightshift's."""

    enabled: Literal[False] = Field(description="Fitting was not on for this job.")
    reason: str = Field(description="Why nothing was fitted.")


class FitSkipped(_Record):
    """Fitting was on but could not run (e.g. the model's tokenizer is missing): the engine args stay as given."""

    enabled: Literal[True] = Field(description="Fitting was on.")
    skipped: str = Field(description="Why it could not run.")


class EarlyFit(_Record):
    """Streaming with fitting on: the engines started on args fitted to a sample of the input, before it was read
    whole; requests longer than the sample's fit were held back and ran on engines fitted to the whole input."""

    sampled_lines: int = Field(description="Lines the sample read, spread over the input.")
    sample_longest_need: int = Field(
        description="The longest need (prompt + output budget) in the sample, in tokens."
    )
    headroom: float = Field(description="The factor on the sample's longest need the early context allows.")
    max_model_len: int | None = Field(
        description="The context the streamed engines ran with (None: given, or the model's limit: nothing held)."
    )
    max_num_seqs: dict[str, int | None] = Field(
        default_factory=dict, description="Per pool: the max_num_seqs the streamed engines ran with."
    )
    rows_held: int = Field(
        default=0,
        description="Requests that needed more than the early context: held back while ingest ran, then run on "
        "engines started again with the args fitted to the whole input.",
    )
    why: str = Field(description="What was decided early, and what became of the longer requests, in words.")


class FitDecision(_Record):
    """What was fitted, from what, and why: the job's max_model_len, and each pool's max_num_seqs."""

    enabled: Literal[True] = Field(description="Fitting was on.")
    counted_by: str = Field(description="How prompts were counted (the model's tokenizer, the fake's words).")
    measured: MeasuredSummary | None = Field(
        default=None, description="What measuring found; None in records of versions that did not measure."
    )
    context_length_exceeded: int = Field(
        default=0,
        description="Requests that can never run within the model's limit: error records, not run.",
    )
    max_model_len: MaxModelLenFit = Field(description="The job's context length.")
    longest_sequence: int | None = Field(
        default=None,
        description="The longest a sequence can grow (prompt + output budget, fitted), when every request bounds "
        "its output; None when one may run to the end of the context. Makes the preemption remedy exact.",
    )
    max_num_seqs: dict[str, MaxNumSeqsFit] = Field(
        default_factory=dict,
        description="Per pool: its max_num_seqs (empty for a backend whose concurrency is not fitted).",
    )
    notes: list[str] = Field(default_factory=list, description="What a user may want to know.")
    warnings: list[str] = Field(default_factory=list, description="What a user should change.")
    early: EarlyFit | None = Field(
        default=None,
        # Left out when there was none: the record stays key for key what versions before the early fit wrote.
        exclude_if=lambda value: value is None,
        description="Engines took requests while ingest read the input, on args fitted to a sample of it first.",
    )

    def fitted_max_model_len(self) -> int | None:
        """The max_model_len fitting chose, None when it was given or is the model's limit."""
        return self.max_model_len.value if self.max_model_len.source == "fitted" else None

    def fitted_max_num_seqs(self) -> dict[str, int]:
        """Per pool, the max_num_seqs fitting set (not given; None values — the engine decides — left out)."""
        return {
            name: s.value
            for name, s in self.max_num_seqs.items()
            if s.source != "given" and s.value is not None
        }

    def max_num_seqs_given(self, pool: str) -> bool:
        return pool in self.max_num_seqs and self.max_num_seqs[pool].source == "given"


def _fit_kind(data: Any) -> str:
    """Which record a job.json `fit` holds, told by its keys (a dict) or its type (a record)."""
    if isinstance(data, BaseModel):
        return type(data).__name__
    if "skipped" in data:
        return "FitSkipped"
    return "FitDecision" if data.get("enabled") else "FitOff"


FitRecord = Annotated[
    Annotated[FitOff, Tag("FitOff")]
    | Annotated[FitSkipped, Tag("FitSkipped")]
    | Annotated[FitDecision, Tag("FitDecision")],
    Discriminator(_fit_kind),
]
_FIT_RECORD: TypeAdapter[FitOff | FitSkipped | FitDecision] = TypeAdapter(FitRecord)


def read_fit_record(data: dict[str, Any] | None) -> FitOff | FitSkipped | FitDecision | None:
    """The record a manifest's `engine.fitted` (or a job.json's `fit`) holds, as read back from its JSON."""
    return None if data is None else _FIT_RECORD.validate_python(data)


def decision_of(record: FitOff | FitSkipped | FitDecision | None) -> FitDecision | None:
    """The fitted values of a record, None when nothing was fitted (fitting off, skipped, or not decided yet)."""
    return record if isinstance(record, FitDecision) else None
