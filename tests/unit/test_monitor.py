"""The job monitor's pure parts: the attempt ledger and the preemption warning."""

from __future__ import annotations

from pipeline.runtime.monitor import JobMonitor, preemption_remedy


def test_preemption_remedy_names_settings_that_fit():
    assert preemption_remedy(0, {"kv_cache_tokens": 7680, "max_model_len": 2048, "max_num_seqs": 96}) is None
    message = preemption_remedy(32, {"kv_cache_tokens": 7680, "max_model_len": 2048, "max_num_seqs": 96})
    assert message == (
        "KV cache full: 32 preemptions; lower max_num_seqs to 3 or max_model_len to 80 (KV cache: 7680 tokens)"
    )


def test_ledger_retries_then_runs_alone_then_isolates():
    ledger = JobMonitor()
    assert ledger.begin(["a", "b"]) == {}  # all normal
    assert ledger.begin(["a", "b"]) == {}  # one crash: maybe not its fault, still normal
    assert ledger.begin(["a"]) == {"a": "solo"}  # caught in two crashes: run alone
    ledger.solo_started("a")
    assert ledger.begin(["a"]) == {"a": "isolate"}  # died alone: the poison
    assert ledger.retries() == {"a": 4, "b": 2}


def test_a_solo_run_that_finishes_clears_suspicion():
    ledger = JobMonitor()
    for _ in range(2):
        ledger.begin(["a"])
    assert ledger.begin(["a"]) == {"a": "solo"}
    ledger.solo_started("a")
    ledger.solo_finished("a")
    assert ledger.begin(["a"]) == {"a": "solo"}
