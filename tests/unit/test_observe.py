"""The job's observers as pure functions: usage histograms, the timeline, cost, Prometheus metrics and the Grafana
dashboard, the report's charts, and `status` from an output location."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from pipeline import prices
from pipeline.cli import app
from pipeline.observe import cost, usage
from pipeline.observe.metrics import METRICS, families
from pipeline.observe.report import CHARTS, render_report
from pipeline.observe.timeline import Timeline, rates
from tests.report_charts import chart_svgs, drawn, synthetic_job

DASHBOARD = Path(__file__).parents[2] / "pipeline" / "observe" / "grafana-dashboard.json"


# -- usage --------------------------------------------------------------------------------------------------------


def test_percentiles_from_merged_histograms_are_close_and_never_above_the_max():
    rng = random.Random(3)
    values = [rng.lognormvariate(4, 1) for _ in range(5000)]
    halves = [usage.histogram(pa.array(values[:2500]), 1.0), usage.histogram(pa.array(values[2500:]), 1.0)]
    merged = usage.merge([{"x": h} for h in halves])["x"]
    assert merged["count"] == 5000 and merged["max"] == max(values)
    exact = sorted(values)
    for q in (50, 90, 99):
        true = exact[int(q / 100 * len(exact)) - 1]
        got = usage.percentile(merged, q, 1.0)
        assert true <= got <= true * 1.045, (q, true, got)
    assert usage.percentile(merged, 100, 1.0) == max(values)


def test_zeros_and_nulls():
    h = usage.histogram(pa.array([0.0, 0.0, None, 0.5]), 0.001)
    assert h["count"] == 3
    assert usage.distribution(h, 0.001)["p50"] == 0.0


# -- timeline -------------------------------------------------------------------------------------------------------


def test_thinning_keeps_totals_and_the_last_sample():
    timeline = Timeline(max_samples=10)
    for i in range(100):
        timeline.add({"t": float(i), "completion_tokens": 10 * i})
    assert len(timeline.samples) <= 10
    assert timeline.last == {"t": 99.0, "completion_tokens": 990}
    times, values = rates(timeline.samples, "completion_tokens")
    assert values and all(v == pytest.approx(10.0) for v in values)
    assert Timeline.from_json(timeline.to_json()).samples == timeline.samples


# -- cost -----------------------------------------------------------------------------------------------------------


def test_cost_and_break_even():
    out = cost.job_cost(
        gpu_hour_price={"*": 3.6},  # 0.001 per second per unit
        hosted={"name": None, "input": 1.0, "output": 2.0},
        pools={"cuda": {"engines": 2, "gpus_per_engine": 1, "nodes": 1}},
        wall_s=100.0,
        startup_s=20.0,
        prompt_tokens=100_000,
        completion_tokens=50_000,
        rows=1000,
    )
    assert out["owned_cost"] == pytest.approx(0.2)  # 2 GPUs x 100 s
    assert out["hosted_cost"] == pytest.approx(0.2)  # 0.1 + 0.1
    # Fixed 0.04 (20 s x 2 GPUs); marginal 0.16 / 150k tokens; hosted 0.2 / 150k tokens.
    assert out["break_even_tokens"] == pytest.approx(0.04 / (0.2 / 150_000 - 0.16 / 150_000), rel=1e-3)
    assert out["break_even_rows"] == pytest.approx(out["break_even_tokens"] / 150, rel=1e-2)
    cpu = cost.job_cost(
        gpu_hour_price={"cpu": 1.0},
        hosted=None,
        pools={"cpu": {"engines": 4, "gpus_per_engine": 0, "nodes": 2}},
        wall_s=3600.0,
        startup_s=1.0,
        prompt_tokens=1,
        completion_tokens=1,
        rows=1,
    )
    assert cpu["pools"]["cpu"] == {"price_per_hour": 1.0, "unit": "node", "units": 2, "cost": 2.0}
    assert cpu["break_even_rows"] is None


def test_hosted_price_presets_and_pairs():
    assert prices.parse_hosted_price("openai-gpt-4o-mini-batch")["input"] > 0
    assert prices.parse_hosted_price("0.1/0.4") == {"name": None, "input": 0.1, "output": 0.4}
    with pytest.raises(ValueError, match="INPUT/OUTPUT"):
        prices.parse_hosted_price("cheap")
    assert prices.parse_gpu_hour_prices(["2", "rocm=1.5"]) == {"*": 2.0, "rocm": 1.5}
    with pytest.raises(ValueError, match="POOL=PRICE"):
        prices.parse_gpu_hour_prices(["cuda=lots"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hosted-price", "cheap"], "unknown hosted price"),
        (["--gpu-hour-price", "cuda=lots"], "POOL=PRICE"),
        (["--metrics-port", "70000"], "--metrics-port"),
    ],
)
def test_bad_flags_fail_before_any_work(tmp_path, flags, message):
    result = CliRunner().invoke(app, ["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), *flags])
    assert result.exit_code == 2
    assert message in result.output
    assert not (tmp_path / "out").exists()


# -- metrics and the dashboard --------------------------------------------------------------------------------------


def _sample() -> dict:
    engine = {
        "pool": "cuda",
        "in_flight": 7,
        "kv_cache_usage": 0.5,
        "preemptions": 2,
        "prefix_cache_queries": 10,
        "prefix_cache_hits": 5,
        "rows": 3,
        "prompt_tokens": 30,
        "completion_tokens": 40,
        "restarted": True,
    }
    return {
        "t": 10.0,
        "rows_total": 100,
        "rows_done": 40,
        "rows_failed": 1,
        "prompt_tokens": 300,
        "completion_tokens": 400,
        "output_tokens_per_s": 12.5,
        "eta_s": 60.0,
        "pools": {"cuda": {"rows": 39, "prompt_tokens": 300, "completion_tokens": 400}},
        "engines": {"cuda-1": engine},
        "retried_requests": 4,
    }


def _exposition(sample) -> str:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    timeline = Timeline()
    timeline.stage_started("ingest", now=1.0)
    timeline.stage_ended("ingest", now=3.0)
    timeline.stage_started("engines", now=2.0)

    class Once:
        def collect(self):
            return families(sample, timeline, {"job_id": "j", "model": "m", "backend": "fake"}, now=5.0)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Once())
    return generate_latest(registry).decode()


def _names(exposition: str) -> set[str]:
    return {
        line.split("{")[0].split(" ")[0]
        for line in exposition.splitlines()
        if line and not line.startswith("#")
    }


def test_every_metric_is_exported_with_its_values():
    text = _exposition(_sample())
    assert _names(text) == set(METRICS)
    assert 'nightshift_engine_completion_tokens_total{engine="cuda-1",pool="cuda"} 40.0' in text
    assert 'nightshift_stage_active{stage="engines"} 1.0' in text
    assert 'nightshift_stage_duration_seconds{stage="ingest"} 2.0' in text
    assert "nightshift_engine_restarts_total 1.0" in text
    assert "custom_id" not in text
    for name, (kind, _) in METRICS.items():
        assert name.endswith("_total") == (kind == "counter"), name


def test_dashboard_uses_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs
    used = {name for expr in exprs for name in re.findall(r"\bnightshift_[a-z_]+\b", expr)}
    assert used and used <= set(METRICS), used - set(METRICS)
    # Every series the job exports is on some panel.
    assert used == set(METRICS) - {"nightshift_job_info"}


# -- the report -----------------------------------------------------------------------------------------------------


def test_every_chart_is_drawn():
    page = render_report(*synthetic_job())
    svgs = chart_svgs(page)
    assert sorted(svgs) == sorted(CHARTS)
    empty = [chart for chart, svg in svgs.items() if not drawn(svg)]
    assert not empty
    assert "http://" not in page.replace("http://www.w3.org", "")  # nothing fetched: SVG namespaces only
    assert "temperature" in page and "max_num_seqs" in page


def test_a_chart_without_data_is_a_sentence_not_an_empty_plot():
    manifest, timeline, histograms = synthetic_job()
    manifest["counts"]["by_error_code"] = {}
    page = render_report(manifest, timeline, histograms)
    assert "errors" not in chart_svgs(page)
    assert "No errors." in page


# -- status ---------------------------------------------------------------------------------------------------------


def _staged_job(tmp_path, updated_ago: float):
    from pipeline.config import JobConfig
    from pipeline.io.staging import StagedRow, StagingArea
    from pipeline.state import JobInput, JobState

    out = tmp_path / "out"
    staging = StagingArea(out)
    staging.create()
    state = JobState(job_id="j1", config=JobConfig(), ingested=True)
    state.input = JobInput(fingerprint="f", lines=10, valid=9, invalid=1)
    staging.write_job(state)
    staging.write_rows(
        "results", [StagedRow(f"r{i}", i, "in", None, 3, 5, "default", "{}") for i in range(4)]
    )
    staging.write_rows("errors", [StagedRow(None, 9, "in", "invalid_json", 0, 0, "", "{}")])
    now = time.time()
    timeline = Timeline(runs=[now - 60], updated_at=now - updated_ago)
    timeline.stage_started("engines", now=now - 50)
    for i in range(5):
        timeline.add(
            {
                "t": now - 50 + 10 * i,
                "rows_done": i,
                "completion_tokens": 50 * i,
                "pools": {"default": {"rows": i, "completion_tokens": 50 * i}},
                "engines": {},
            }
        )
    staging.files.write_bytes(f"{staging.root}/timeline.json", timeline.to_json())
    return out


def test_status_of_a_running_and_of_an_interrupted_job(tmp_path):
    from pipeline.observe.status import job_status

    running = job_status(str(_staged_job(tmp_path, updated_ago=1)))
    assert running["state"] == "running" and running["stage"] == "engines"
    assert running["rows"] == {"total": 10, "done": 5, "failed": 1}
    assert running["output_tokens_per_s"] == pytest.approx(5.0)
    assert running["eta_s"] == pytest.approx(50.0)  # 5 rows left at 0.1 rows/s
    assert running["errors_by_code"] == {"invalid_json": 1}

    result = CliRunner().invoke(app, ["status", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    stale = job_status(str(_staged_job(tmp_path / "b", updated_ago=3600)))
    assert stale["state"] == "interrupted" and stale["eta_s"] is None
    shown = CliRunner().invoke(app, ["status", str(tmp_path / "b" / "out")])
    assert "interrupted" in shown.output and "nightshift resume" in shown.output


def test_status_of_no_job(tmp_path):
    result = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert result.exit_code == 2 and "holds no nightshift job" in result.output


def test_the_summary_names_the_fitted_args_from_the_manifests_fit_record():
    from pipeline.observe.summary import fitted_line

    fitted = json.loads((Path(__file__).resolve().parents[1] / "fixtures/state/manifest.json").read_text())[
        "engine"
    ]["fitted"]
    assert fitted_line(fitted) == "max_model_len 80 (fitted)"
    pools = {
        "a": {"value": 22, "source": "fitted", "why": ""},
        "b": {"value": 8, "source": "given", "why": ""},
    }
    both = {**fitted, "max_num_seqs": pools, "context_length_exceeded": 2}
    assert fitted_line(both) == (
        "max_model_len 80 (fitted), max_num_seqs a 22 (fitted), b 8 (given), "
        "2 request(s) too long for the model, not run"
    )
    assert fitted_line({**fitted, "max_num_seqs": {"a": pools["a"]}}).endswith("max_num_seqs 22 (fitted)")
    assert fitted_line({"enabled": False, "reason": "off"}) == "" and fitted_line(None) == ""
    assert fitted_line({"enabled": True, "skipped": "no tokenizer"}) == ""


def test_the_recorder_loads_the_chart_library_once_results_come_in(monkeypatch):
    """The report's chart library is imported on a thread while the engines run (its half second off the job's
    tail), once the first rows are done: not while engines start and need every core, and not for a job without
    a report."""
    from pipeline.observe import report
    from pipeline.observe.progress import JobCounters
    from pipeline.observe.recorder import JobRecorder

    calls: list[str] = []
    monkeypatch.setattr(report, "preload_charts", lambda: calls.append("preload"))
    counters = JobCounters(total=10)
    quiet = JobRecorder()
    quiet.sample(counters, {}, {}, force=True)
    recorder = JobRecorder()
    recorder.charts_wanted = True
    recorder.sample(counters, {}, {}, force=True)
    assert calls == []  # nothing done yet: the engines are still starting
    counters.add(3, 0, 30, 30)
    quiet.sample(counters, {}, {}, force=True)
    assert calls == []  # no report wanted
    recorder.sample(counters, {}, {}, force=True)
    counters.add(3, 0, 30, 30)
    recorder.sample(counters, {}, {}, force=True)
    assert calls == ["preload"]  # once
    resumed = JobRecorder()  # a resumed job's counters start with its earlier rows done
    resumed.charts_wanted = True
    earlier = JobCounters(total=10, done=6)
    resumed.sample(earlier, {}, {}, force=True)
    assert calls == ["preload"]
    earlier.add(1, 0, 10, 10)
    resumed.sample(earlier, {}, {}, force=True)
    assert calls == ["preload", "preload"]
