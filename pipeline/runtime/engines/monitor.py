"""The job's monitor: one small Ray actor that engine actors talk to.

- Engine stats: Ray Data actors are not addressable from the driver, so engines push their numbers (every ~2 s)
  and the driver reads them for the progress display and the manifest.
- Attempt ledger: when an engine process dies, Ray restarts the actor and re-runs its unfinished batches. The
  ledger counts how often each request was started. A request caught in one crash is simply retried (the crash
  may have been a lost node or a neighbour's fault); caught in two, it is run alone, so a third crash is surely its
  own — then it is isolated as an `engine_error` record instead of stalling the job. A poison request therefore
  costs at most three engine restarts.
- Work per engine: rows each engine began and finished, and where the rows that were in flight on an engine when it
  died ran again (the manifest's `recovery.engines`: which engine lost work, on which node, and who re-ran it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)

SOLO_FROM_ATTEMPT = 3  # the attempt from which a request runs alone


class JobMonitor:
    def __init__(self) -> None:
        self._engines: dict[str, dict[str, Any]] = {}
        self._attempts: dict[str, int] = {}
        self._solo_running: set[str] = (
            set()
        )  # started alone and not finished: if seen again, it killed the engine
        self._chunk_on: dict[int, str] = {}  # chunk in flight -> the engine that last began it
        self._chunk_runs: dict[int, int] = {}  # chunk in flight -> times it began on an engine
        self._work: dict[str, dict[str, Any]] = {}  # engine -> rows begun, finished, re-run elsewhere

    # -- engine stats ---------------------------------------------------------------------------------------
    def report(self, actor_id: str, info: dict[str, Any]) -> None:
        self._engines[actor_id] = info

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return dict(self._engines)

    # -- attempt ledger ---------------------------------------------------------------------------------------
    def begin(
        self, chunk: int, engine: str, rows: int, attempt: int = 1, custom_ids: list[str] | None = None
    ) -> dict[str, str]:
        """Register a chunk of `rows` requests about to run on `engine` (its `attempt`-th time: the work queue
        hands a chunk out again when the engine holding it died); returns the requests that must not run
        normally: "solo" or "isolate".

        A chunk's first attempt costs one entry while it runs, whatever its size: requests are tracked one by one
        only in chunks that were caught in an engine's death (`custom_ids` given), a few in a healthy job."""
        self._engine_work(engine)["begun"] += rows
        before = self._chunk_on.get(chunk)
        self._chunk_on[chunk] = engine
        # Times the chunk actually reached an engine: a chunk handed out again may have died with its engine before
        # it began (leased, not yet running); such a lease put none of its requests at risk.
        runs = self._chunk_runs.get(chunk, 0) + 1
        self._chunk_runs[chunk] = runs
        if before is not None and before != engine:  # it was in flight on `before` when that engine died
            rerun = self._engine_work(before)["rerun_on"]
            rerun[engine] = rerun.get(engine, 0) + rows
        if attempt <= 1 or runs <= 1 or not custom_ids:
            return {}
        attempts = self._attempts
        plan: dict[str, str] = {}
        for custom_id in custom_ids:
            # Every request of a chunk that runs again was in flight in each earlier run of the chunk.
            count = max(attempts.get(custom_id, 0) + 1, runs)
            attempts[custom_id] = count
            if custom_id in self._solo_running:
                plan[custom_id] = "isolate"  # it ran alone and the engine died: it is the poison
            elif count >= SOLO_FROM_ATTEMPT:
                plan[custom_id] = "solo"
        return plan

    def finished(self, engine: str, rows: int, chunk: int | None = None) -> None:
        """`engine` staged `rows` finished rows of `chunk` (the rest of what it began is in flight)."""
        self._engine_work(engine)["finished"] += rows
        if chunk is not None:
            self._chunk_on.pop(chunk, None)
            self._chunk_runs.pop(chunk, None)

    def _engine_work(self, engine: str) -> dict[str, Any]:
        work = self._work.get(engine)
        if work is None:
            work = self._work[engine] = {"begun": 0, "finished": 0, "rerun_on": {}, "cause": None}
        return work

    def engine_died(self, engine: str, cause: str) -> None:
        """`engine` saw its engine die (e.g. "EngineDeadError") and is exiting so that Ray restarts it. An engine
        lost with its node or killed outright says nothing: it is known by the rows it left in flight."""
        self._engine_work(engine)["cause"] = cause

    def work(self) -> dict[str, dict[str, Any]]:
        """Per engine: rows begun, finished and in flight, its node, whether it is a restarted actor, and where
        the rows it had in flight when it died were run again (`rerun_on`: engine -> rows)."""
        out = {}
        for engine, work in self._work.items():
            info = self._engines.get(engine, {})
            out[engine] = {
                "node_id": info.get("node_id"),
                "restarted": bool(info.get("restarted")),
                "begun": work["begun"],
                "finished": work["finished"],
                "in_flight": work["begun"] - work["finished"],
                "rerun_on": dict(work["rerun_on"]),
                "cause": work["cause"],
            }
        return out

    def solo_started(self, custom_id: str) -> None:
        self._solo_running.add(custom_id)

    def solo_finished(self, custom_id: str) -> None:
        self._solo_running.discard(custom_id)

    def retried_count(self) -> int:
        """How many requests were started more than once (sampled live; `retries` is the full account)."""
        return sum(1 for v in self._attempts.values() if v > 1)

    def retries(self) -> dict[str, int]:
        """Requests started more than once, and how often (a measure of recomputation after failures)."""
        return {k: v for k, v in self._attempts.items() if v > 1}


def summarize_recovery(work: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest's account of lost engines (see JobMonitor.work): how many engine actors Ray restarted, and per
    engine that died with work in flight: its node, the cause it reported (None: lost outright, with its process or
    node), the rows it had in flight (begun, not finished), the rows that ran again elsewhere, and on which engines
    (and nodes). Rows re-run can exceed rows in flight: a chunk the engine finished whose output had not yet left
    its process (or its node's object store) is lost with it, and re-runs too."""
    lost = {}
    for engine, info in work.items():
        if not info["rerun_on"] and info["cause"] is None:
            continue
        lost[engine] = {
            "node_id": info["node_id"],
            "cause": info["cause"],
            "rows_in_flight": info["in_flight"],
            "rows_rerun": sum(info["rerun_on"].values()),
            "rerun_on": [
                {"engine": other, "node_id": work.get(other, {}).get("node_id"), "rows": rows}
                for other, rows in sorted(info["rerun_on"].items())
            ],
        }
    return {
        "engine_restarts": sum(1 for info in work.values() if info["restarted"]),
        "engines_lost": lost,
    }


@dataclass(frozen=True)
class EngineSummary:
    """The engines' numbers over all engines (summarize_engines): the live display's and the manifest's. The
    defaults are a summary of no engine at all."""

    # Engine actors that reported.
    engines: int = 0
    # When the first engine was ready (epoch seconds): engine start ends, generation begins. None: none ready yet.
    first_ready_at: float | None = None
    # Of the engines, warm ones another job had started (this job did not pay their start).
    reused: int = 0
    # Sequences the engines preempted and recomputed (KV cache full), summed over engines.
    num_preemptions: int = 0
    # Prefix-cache hits / queries over all engines, to 4 places; None: no query yet.
    prefix_cache_hit_rate: float | None = None
    # LoRA adapters loaded into engines' slots, first loads and swaps (None: no engine serves adapters).
    adapter_loads: int | None = None
    # KV cache usage (0..1): the mean of the engines' last readings; None: none reported.
    kv_cache_usage: float | None = None
    # The highest KV cache usage (0..1) any engine reported; None: none reported.
    kv_cache_usage_peak: float | None = None
    # KV cache capacity of one engine (the first one's), in tokens.
    kv_cache_tokens_per_engine: int | None = None
    # The first engine's effective engine args (what it actually ran with).
    effective_args: dict[str, Any] = field(default_factory=dict)
    # CPU engines: the cores each one computed on (empty where vLLM bound them itself).
    cpu_cores: list[Any] = field(default_factory=list)
    # Every sampling default the first engine applied, the model's generation_config included.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # Per engine actor: its pool and node, whether it was warm, adapter loads, the rows and chunks it ran, and
    # how busy it was between its first and last request.
    per_engine: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per pool: the engine's own max_num_seqs (given, fitted, or decided by the engine as it started), the
    # requests each of its actors kept inside it (2 x that, unless max_in_flight was given) and the peak of
    # requests inside the engine.
    in_flight: dict[str, dict[str, Any]] = field(default_factory=dict)


def summarize_engines(snapshot: dict[str, dict[str, Any]]) -> EngineSummary:
    """Totals over all engines: preemptions, prefix-cache hit rate, KV capacity and usage (the mean of the engines'
    last readings, and the highest reading any engine reported); plus the first engine's args."""
    preemptions = sum(e["stats"].get("num_preemptions", 0) for e in snapshot.values())
    queries = sum(e["stats"].get("prefix_cache_queries", 0) for e in snapshot.values())
    hits = sum(e["stats"].get("prefix_cache_hits", 0) for e in snapshot.values())
    usage = [
        e["stats"]["kv_cache_usage"]
        for e in snapshot.values()
        if e["stats"].get("kv_cache_usage") is not None
    ]
    peaks = [
        e["stats"]["kv_cache_usage_peak"]
        for e in snapshot.values()
        if e["stats"].get("kv_cache_usage_peak") is not None
    ]
    loads = [
        e["stats"]["adapter_loads"] for e in snapshot.values() if e["stats"].get("adapter_loads") is not None
    ]
    first = next(iter(snapshot.values()), {})
    ready = [e["ready_at"] for e in snapshot.values() if e.get("ready_at")]
    return EngineSummary(
        engines=len(snapshot),
        first_ready_at=min(ready) if ready else None,
        reused=sum(1 for e in snapshot.values() if e.get("reused")),
        num_preemptions=preemptions,
        prefix_cache_hit_rate=round(hits / queries, 4) if queries else None,
        adapter_loads=sum(loads) if loads else None,
        kv_cache_usage=round(sum(usage) / len(usage), 4) if usage else None,
        kv_cache_usage_peak=round(max(peaks), 4) if peaks else None,
        kv_cache_tokens_per_engine=first.get("stats", {}).get("kv_cache_tokens"),
        effective_args=first.get("effective_args", {}),
        cpu_cores=sorted(
            cores for e in snapshot.values() if (cores := e["stats"].get("extra", {}).get("cpu_cores"))
        ),
        sampling_defaults=first.get("sampling_defaults", {}),
        per_engine={
            actor: {
                "pool": e["pool"],
                "node_id": e.get("node_id"),
                "reused": bool(e.get("reused")),  # a warm engine, started before this job
                **({"adapter_loads": n} if (n := e["stats"].get("adapter_loads")) is not None else {}),
                **(e.get("activity") or {}),
            }
            for actor, e in sorted(snapshot.items())
        },
        in_flight={
            e["pool"]: {
                "max_num_seqs": (e.get("effective_args") or {}).get("max_num_seqs"),
                "window": e.get("in_flight_window"),
                **(
                    {"peak_requests_inside": peak}
                    if (peak := e["stats"].get("extra", {}).get("peak_requests_inside")) is not None
                    else {}
                ),
            }
            for e in snapshot.values()
        },
    )


def preemption_remedy(
    preemptions: int, effective_args: dict[str, Any], longest_sequence: int | None = None
) -> str | None:
    """The warning for a KV cache that ran full, with settings that would have fitted (None if it did not).

    vLLM preempts and recomputes when running sequences outgrow the KV cache: throughput drops while the engine
    looks merely slow. Concurrency that fits = KV tokens / the longest a sequence grows: max_model_len, or less when
    fitting measured the requests (`longest_sequence`: prompt + max_tokens of the longest). Then a lower
    max_model_len would only cut outputs, so max_num_seqs is the remedy named.
    """
    if preemptions <= 0:
        return None
    kv_tokens = effective_args.get("kv_cache_tokens") or 0
    context = effective_args.get("max_model_len") or 0
    seqs = effective_args.get("max_num_seqs") or 0
    if not kv_tokens or not context or not seqs:
        return f"KV cache full: {preemptions} preemptions; lower max_num_seqs or max_model_len"
    grows_to = min(context, longest_sequence) if longest_sequence else context
    usable = kv_tokens - (effective_args.get("block_size") or 0)  # vLLM keeps one block as its null block
    fitting_seqs = min(max(1, usable // grows_to), max(1, seqs - 1))
    if longest_sequence:
        return (
            f"KV cache full: {preemptions} preemptions; lower max_num_seqs to {fitting_seqs} (KV cache: "
            f"{kv_tokens} tokens; these requests grow to {grows_to} tokens each, so a max_model_len below that "
            f"would only cut their outputs)"
        )
    fitting_context = max(16, kv_tokens // seqs)
    return (
        f"KV cache full: {preemptions} preemptions; lower max_num_seqs to {fitting_seqs} "
        f"or max_model_len to {fitting_context} (KV cache: {kv_tokens} tokens)"
    )


class EngineWatch:
    """The driver's live view of the engines: polls the monitor at most every `every_s` seconds (engines push every
    ~2 s) and warns once, as soon as preemptions appear, with the settings that would have avoided them.

    `poll` is safe to call from several threads (the progress ticker and the result loop).
    """

    def __init__(
        self,
        snapshot: Callable[[], dict[str, dict[str, Any]]],
        every_s: float = 2.0,
        longest_sequence: int | None = None,
    ) -> None:
        self._snapshot = snapshot
        self.every_s = every_s
        self.longest_sequence = longest_sequence  # from fitting: makes the remedy exact
        self.summary: EngineSummary | None = None  # the last good reading (None: none yet)
        self.engines: dict[str, dict[str, Any]] = {}  # the engines' last raw reports (for the job's recorder)
        self.warned = False
        self._last = float("-inf")
        self._lock = threading.Lock()

    @classmethod
    def of_monitor(
        cls, monitor: Any, longest_sequence: int | None = None, every_s: float = 2.0
    ) -> EngineWatch:
        """`longest_sequence`: the fit record's, when fitting bounded every request's output."""
        import ray

        return cls(lambda: ray.get(monitor.snapshot.remote(), timeout=10), every_s, longest_sequence)

    def poll(self) -> EngineSummary | None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                return self.summary
            self._last = now
            try:
                self.engines = self._snapshot()
                summary = self.summary = summarize_engines(self.engines)
            except Exception as exc:  # noqa: BLE001 - a slow or restarting monitor must not stop the job
                log.debug("engine stats unavailable", error=str(exc))
                return self.summary
            remedy = preemption_remedy(summary.num_preemptions, summary.effective_args, self.longest_sequence)
            if remedy and not self.warned:
                self.warned = True
                log.warning(remedy)
            return summary
