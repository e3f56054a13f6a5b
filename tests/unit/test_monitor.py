"""The job monitor's pure parts: the attempt ledger, the engine summary, the live watch and its warning."""

from __future__ import annotations

from pipeline.observe.progress import engine_line
from pipeline.runtime.engines import monitor as monitor_module
from pipeline.runtime.engines.monitor import (
    EngineSummary,
    EngineWatch,
    JobMonitor,
    preemption_remedy,
    summarize_engines,
    summarize_recovery,
)


def test_preemption_remedy_names_settings_that_fit():
    assert preemption_remedy(0, {"kv_cache_tokens": 7680, "max_model_len": 2048, "max_num_seqs": 96}) is None
    message = preemption_remedy(32, {"kv_cache_tokens": 7680, "max_model_len": 2048, "max_num_seqs": 96})
    assert message == (
        "KV cache full: 32 preemptions; lower max_num_seqs to 3 or max_model_len to 80 (KV cache: 7680 tokens)"
    )


def test_preemption_remedy_with_measured_requests_names_max_num_seqs_only():
    args = {"kv_cache_tokens": 7680, "block_size": 128, "max_model_len": 2048, "max_num_seqs": 256}
    message = preemption_remedy(48, args, longest_sequence=384)
    # 59 usable blocks of 128 (one is vLLM's null block) hold 19 sequences of 384 tokens.
    assert message.startswith(
        "KV cache full: 48 preemptions; lower max_num_seqs to 19 (KV cache: 7680 tokens;"
    )
    assert "grow to 384 tokens each" in message and "max_model_len to" not in message


def test_ledger_retries_then_runs_alone_then_isolates():
    ledger = JobMonitor()
    assert ledger.begin(7, "e1", 2) == {}  # a first attempt: nothing tracked per request
    assert ledger.retries() == {}
    assert ledger.begin(7, "e2", 2, 2, ["a", "b"]) == {}  # one crash: maybe not its fault, still normal
    assert ledger.begin(7, "e3", 2, 3, ["a", "b"]) == {"a": "solo", "b": "solo"}  # two crashes: run alone
    ledger.solo_started("a")
    assert ledger.begin(7, "e4", 2, 4, ["a", "b"]) == {"a": "isolate", "b": "solo"}  # died alone: the poison
    assert ledger.retries() == {"a": 4, "b": 4}


def test_a_chunk_lost_before_it_began_put_none_of_its_requests_at_risk():
    ledger = JobMonitor()
    assert (
        ledger.begin(5, "e2", 2, 2, ["a", "b"]) == {}
    )  # handed out again, but it never ran on the dead engine
    assert ledger.retries() == {}


def test_a_solo_run_that_finishes_clears_suspicion():
    ledger = JobMonitor()
    ledger.begin(1, "e0", 1)
    ledger.begin(1, "e1", 1, 2, ["a"])
    assert ledger.begin(1, "e1", 1, 3, ["a"]) == {"a": "solo"}
    ledger.solo_started("a")
    ledger.solo_finished("a")
    assert ledger.begin(1, "e2", 1, 4, ["a"]) == {"a": "solo"}


def test_first_attempts_cost_one_entry_per_chunk_in_flight():
    ledger = JobMonitor()
    for chunk in range(1000):
        ledger.begin(chunk, "e1", 512)
        ledger.finished("e1", 512, chunk)
    assert ledger.retries() == {} and not ledger._chunk_on and not ledger._attempts  # noqa: SLF001


def test_work_ledger_names_the_engine_that_lost_rows_and_where_they_ran_again():
    ledger = JobMonitor()
    ledger.report("default-1", {"node_id": "node-a", "restarted": False})
    ledger.report("default-2", {"node_id": "node-b", "restarted": False})
    ledger.begin(0, "default-1", 2)
    ledger.begin(1, "default-1", 2)
    ledger.finished("default-1", 2, 0)  # chunk 0 came back; chunk 1 was in flight when it died
    ledger.begin(2, "default-2", 1)
    ledger.finished("default-2", 1, 2)
    ledger.report("default-3", {"node_id": "node-b", "restarted": True})  # default-1's actor, restarted
    ledger.begin(1, "default-3", 2, 2, ["c", "d"])
    ledger.finished("default-3", 2, 1)
    work = ledger.work()
    assert work["default-1"]["in_flight"] == 2 and work["default-3"]["in_flight"] == 0
    summary = summarize_recovery(work)
    assert summary == {
        "engine_restarts": 1,
        "engines_lost": {
            "default-1": {
                "node_id": "node-a",
                "cause": None,
                "rows_in_flight": 2,
                "rows_rerun": 2,
                "rerun_on": [{"engine": "default-3", "node_id": "node-b", "rows": 2}],
            }
        },
    }


def test_an_engine_that_reports_its_death_is_lost_with_its_cause():
    ledger = JobMonitor()
    ledger.begin(0, "default-1", 1)
    ledger.engine_died("default-1", "EngineDeadError")
    ledger.begin(0, "default-2", 1, 2, ["a"])
    lost = summarize_recovery(ledger.work())["engines_lost"]
    assert lost["default-1"]["cause"] == "EngineDeadError"
    assert lost["default-1"]["rerun_on"] == [{"engine": "default-2", "node_id": None, "rows": 1}]
    assert summarize_recovery(JobMonitor().work()) == {"engine_restarts": 0, "engines_lost": {}}


def engine_info(preemptions: int, usage: float, peak: float, hits: int = 0, queries: int = 0) -> dict:
    return {
        "pool": "default",
        "stats": {
            "kv_cache_tokens": 7680,
            "kv_cache_usage": usage,
            "kv_cache_usage_peak": peak,
            "num_preemptions": preemptions,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
        },
        "effective_args": {"kv_cache_tokens": 7680, "max_model_len": 384, "max_num_seqs": 96},
    }


def test_summary_reports_kv_usage_now_and_at_peak():
    summary = summarize_engines({"a": engine_info(3, 0.5, 0.9, 1, 4), "b": engine_info(2, 0.7, 1.0, 1, 4)})
    assert summary.num_preemptions == 5
    assert summary.kv_cache_usage == 0.6 and summary.kv_cache_usage_peak == 1.0
    assert summary.prefix_cache_hit_rate == 0.25
    assert summary.engines == 2 and summary.kv_cache_tokens_per_engine == 7680
    assert summary.in_flight == {"default": {"max_num_seqs": 96, "window": None}}
    assert list(summary.per_engine) == ["a", "b"] and summary.per_engine["a"]["pool"] == "default"


def test_a_summary_of_no_engine_holds_the_defaults():
    assert summarize_engines({}) == EngineSummary()
    empty = EngineSummary()
    assert (empty.engines, empty.reused, empty.num_preemptions) == (0, 0, 0)
    assert empty.effective_args == {} and empty.sampling_defaults == {} and empty.cpu_cores == []
    assert empty.first_ready_at is None and empty.kv_cache_usage is None and empty.adapter_loads is None


def test_engine_watch_warns_once_as_soon_as_preemptions_appear(monkeypatch):
    readings = iter([{}, {"a": engine_info(0, 0.5, 0.5)}, {"a": engine_info(4, 1.0, 1.0)}])
    latest = {}

    def snapshot():
        latest.update(next(readings, latest))
        return dict(latest)

    warnings = []
    monkeypatch.setattr(monitor_module.log, "warning", lambda message, **kw: warnings.append(message))
    watch = EngineWatch(snapshot, every_s=0)
    assert watch.summary is None  # no reading yet
    assert watch.poll().engines == 0
    assert watch.poll().kv_cache_usage == 0.5 and not watch.warned
    assert watch.poll().num_preemptions == 4 and watch.warned
    for _ in range(3):
        watch.poll()
    assert warnings == [
        "KV cache full: 4 preemptions; lower max_num_seqs to 20 or max_model_len to 80 (KV cache: 7680 tokens)"
    ]


def test_engine_watch_polls_at_most_every_interval_and_survives_a_failing_monitor():
    calls = []

    def snapshot():
        calls.append(1)
        if len(calls) > 1:
            raise TimeoutError("monitor busy")
        return {"a": engine_info(0, 0.25, 0.25)}

    watch = EngineWatch(snapshot, every_s=3600)
    first = watch.poll()
    assert watch.poll() is first and len(calls) == 1
    watch.every_s = 0
    assert watch.poll() == first  # the last good reading stays


def test_engine_line_shows_what_is_known():
    assert engine_line(None) == ""
    line = engine_line(summarize_engines({"a": engine_info(12, 0.63, 0.97, 66, 100)}))
    assert line == "KV 63% (peak 97%) · 12 preemptions · prefix hits 66%"
    assert engine_line(EngineSummary()) == ""
