"""The progress display: engine numbers in log lines, refreshed on a clock while no result arrives."""

from __future__ import annotations

import time

from pipeline.observe import progress as progress_module
from pipeline.observe.progress import JobCounters, ProgressDisplay
from pipeline.runtime.engines.monitor import EngineSummary


def test_log_lines_carry_the_engines_numbers_while_no_result_arrives(monkeypatch):
    lines = []
    monkeypatch.setattr(progress_module.log, "info", lambda event, **fields: lines.append((event, fields)))
    polls = []

    def engines():
        polls.append(1)
        return EngineSummary(
            kv_cache_usage=0.5, kv_cache_usage_peak=0.75, num_preemptions=3, prefix_cache_hit_rate=0.6
        )

    with ProgressDisplay(JobCounters(total=10), enabled=False, log_every=0.0, engines=engines, tick=0.05):
        deadline = time.monotonic() + 5
        while len(polls) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)  # no update() from here: the ticker alone must refresh
    assert len(polls) >= 3
    event, fields = lines[-1]
    assert event == "progress" and fields["rows_total"] == 10
    assert (fields["kv_cache_usage"], fields["kv_cache_usage_peak"], fields["preemptions"]) == (0.5, 0.75, 3)
    assert fields["prefix_cache_hit_rate"] == 0.6


def test_without_engines_there_is_no_ticker_and_no_engine_fields(monkeypatch):
    lines = []
    monkeypatch.setattr(progress_module.log, "info", lambda event, **fields: lines.append((event, fields)))
    with ProgressDisplay(JobCounters(total=1), enabled=False, log_every=0.0) as display:
        display.update(force=True)
        assert display._ticker is None
    assert "kv_cache_usage" not in lines[-1][1]
