"""`report.html`: the job as one self-contained page, written by finalize beside the manifest (before it: a
committed job's report is complete).

Summary, cost, per-request usage; charts drawn with matplotlib (Agg) as SVG, each embedded as a data: URI image —
no script, no network, and no clash between the charts' SVG ids; the engine and sampling settings in force. Its
inputs are the manifest, the job's timeline (observe/timeline.py) and finalize's usage histograms
(observe/usage.py): nothing is read again from the output.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import threading
from typing import Any

import structlog

from pipeline.observe.timeline import STAGES, Timeline, rates
from pipeline.observe.usage import USAGE_COLUMNS, bin_lower_edge, bin_upper_edge, distribution

log = structlog.get_logger(__name__)

REPORT_NAME = "report.html"


def request_usage(histograms: dict[str, dict[str, Any]]) -> Any:
    """The manifest's `usage` (manifest.RequestUsage) from finalize's merged histograms; None with no results."""
    from pipeline.manifest import RequestUsage

    if not histograms or not any(h["count"] for h in histograms.values()):
        return None
    return RequestUsage(
        **{
            name: distribution(histograms[name], floor) if name in histograms else None
            for name, floor in USAGE_COLUMNS.items()
        }
    )


def write_report(
    output: Any, manifest: Any, timeline: Timeline, histograms: dict[str, dict[str, Any]]
) -> str | None:
    """Render and write OUTPUT/report.html; its name, or None when it could not be written (logged)."""
    try:
        page = render_report(manifest.model_dump(mode="json"), timeline, histograms)
        output.put_bytes(REPORT_NAME, page.encode())
        return REPORT_NAME
    except Exception as exc:  # noqa: BLE001 - the report is a view of the job; the output is what was asked for
        log.warning("job report not written", error=f"{type(exc).__name__}: {exc}")
        return None


# -- charts --------------------------------------------------------------------------------------------------------


def preload_charts() -> None:
    """Import matplotlib ahead of the report, on a thread of its own while the engines run: half a second that
    would otherwise fall between the last result and the job's exit."""

    def load() -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot  # noqa: F401
        except Exception:  # noqa: BLE001 - the report imports again and says what failed
            pass

    threading.Thread(target=load, name="report-preload", daemon=True).start()


def _figure(height: float = 2.8):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "nightshift", "font.size": 9})
    fig, ax = plt.subplots(figsize=(7.5, height), dpi=100)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    return buf.getvalue()


def _data(artists) -> None:
    """Mark what a chart draws from the data (not axes or grid): tests check each chart has some."""
    for artist in artists if isinstance(artists, list | tuple) else [artists]:
        artist.set_gid("data")


def _throughput_chart(timeline: Timeline, t0: float) -> str | None:
    samples = timeline.samples
    if len(samples) < 2:
        return None
    fig, ax = _figure()
    times, values = rates(samples, "completion_tokens")
    _data(ax.plot([t - t0 for t in times], values, label="all pools", linewidth=2))
    pools = sorted({p for s in samples for p in s.get("pools", {})})
    if len(pools) > 1:
        for pool in pools:
            series = [
                {"t": s["t"], "v": s.get("pools", {}).get(pool, {}).get("completion_tokens", 0)}
                for s in samples
            ]
            pt, pv = rates(series, "v")
            _data(ax.plot([t - t0 for t in pt], pv, label=pool, linewidth=1))
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("output tokens/s")
    ax.legend(loc="upper right", fontsize=8)
    return _svg(fig)


def _engine_chart(timeline: Timeline, t0: float, key: str, label: str) -> str | None:
    samples = timeline.samples
    engines = sorted({e for s in samples for e in s.get("engines", {})})
    points = {
        e: [(s["t"] - t0, s["engines"][e].get(key)) for s in samples if e in s.get("engines", {})]
        for e in engines
    }
    points = {e: [(t, v) for t, v in pts if v is not None] for e, pts in points.items()}
    if not any(points.values()):
        return None
    fig, ax = _figure()
    for engine, pts in points.items():
        if pts:
            _data(
                ax.plot(
                    [t for t, _ in pts],
                    [v for _, v in pts],
                    label=engine,
                    linewidth=1.2,
                    drawstyle="steps-post",
                )
            )
    # A preemption marker where an engine's preemption count went up since the sample before.
    marks = []
    for engine in engines:
        before = 0
        for s in samples:
            now = s.get("engines", {}).get(engine, {}).get("preemptions")
            if now is not None:
                if now > before:
                    marks.append(s["t"] - t0)
                before = now
    for i, t in enumerate(marks):
        ax.axvline(t, color="red", alpha=0.5, linewidth=1, label="preemptions" if i == 0 else None)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel(label)
    if key == "kv_cache_usage":
        ax.set_ylim(0, 1.05)
    if len(points) <= 8 or marks:
        ax.legend(loc="upper right", fontsize=7)
    return _svg(fig)


def _histogram_chart(h: dict[str, Any] | None, floor: float, label: str) -> str | None:
    if not h or not h["count"]:
        return None
    fig, ax = _figure(2.4)
    bins = sorted((int(i), n) for i, n in h["bins"].items())
    lefts = [bin_lower_edge(i, floor) for i, _ in bins]
    widths = [max(bin_upper_edge(i, floor) - bin_lower_edge(i, floor), floor) for i, _ in bins]
    _data(list(ax.bar(lefts, [n for _, n in bins], width=widths, align="edge", color="#4c72b0")))
    if max(bin_upper_edge(i, floor) for i, _ in bins) > 64 * max(floor, min(lefts) or floor):
        ax.set_xscale("symlog", linthresh=floor)
    ax.set_xlabel(label)
    ax.set_ylabel("requests")
    return _svg(fig)


def _errors_chart(by_code: dict[str, int]) -> str | None:
    if not by_code:
        return None
    fig, ax = _figure(max(1.4, 0.35 * len(by_code) + 0.8))
    codes = sorted(by_code, key=lambda c: by_code[c])
    _data(list(ax.barh(codes, [by_code[c] for c in codes], color="#c44e52")))
    ax.set_xlabel("rows")
    return _svg(fig)


def _stages_chart(stages: dict[str, dict[str, float | None]], t0: float, now: float) -> str | None:
    spans = [(name, stages[name]) for name in STAGES if name in stages]
    if not spans:
        return None
    fig, ax = _figure(1.2 + 0.3 * len(spans))
    for row, (_name, span) in enumerate(spans):
        start = span["start"] - t0
        end = (span.get("end") or now) - t0
        _data(ax.broken_barh([(start, max(end - start, 0.01))], (row - 0.35, 0.7), color="#55a868"))
    ax.set_yticks(range(len(spans)), [name for name, _ in spans])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the job started")
    return _svg(fig)


# -- the page ------------------------------------------------------------------------------------------------------


def _table(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(v if isinstance(v, str) else json.dumps(v))}</td></tr>"
        for k, v in rows
    )
    return f"<table>{cells}</table>"


def _chart(chart_id: str, title: str, svg: str | None, empty: str) -> str:
    if svg is None:
        return f'<section><h2>{html.escape(title)}</h2><p class="empty">{html.escape(empty)}</p></section>'
    uri = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()
    return (
        f'<section><h2>{html.escape(title)}</h2><figure class="chart" id="chart-{chart_id}">'
        f'<img alt="{html.escape(title)}" src="{uri}"></figure></section>'
    )


CHARTS = ("throughput", "in-flight", "kv-cache", "prompt-lengths", "completion-lengths", "errors", "stages")

_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px;margin-bottom:4px} h2{font-size:16px;margin:18px 0 6px}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:8px 24px}
table{border-collapse:collapse;font-size:13px} th{text-align:left;padding:2px 12px 2px 0;color:#555;font-weight:500}
td{padding:2px 0;font-family:ui-monospace,monospace} figure{margin:0} img{max-width:100%}
.empty{color:#777;font-style:italic} .muted{color:#666;font-size:13px}
"""


def _structured_row(structured: dict[str, int] | None) -> list[tuple[str, str]]:
    """The summary's structured-output row: results that asked for JSON and how many parsed (none asked: no row)."""
    if not structured or not structured.get("requested"):
        return []
    return [("structured output", f"{structured['parsed_json']} of {structured['requested']} parsed as JSON")]


def _adapter_rows(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's LoRA rows: per adapter its rows and tokens, and the engines' adapter loads (none: no rows)."""
    rows = [
        (
            f"adapter {name}",
            f"{a['rows']} rows, {a['prompt_tokens']} prompt + {a['completion_tokens']} completion tokens (on {model})",
        )
        for model, served in (manifest.get("models") or {}).items()
        for name, a in (served.get("adapters") or {}).items()
    ]
    if manifest.get("adapter_loads") is not None:
        rows.append(("adapter loads", f"{manifest['adapter_loads']} (into the engines' LoRA slots)"))
    return rows


def render_report(manifest: dict[str, Any], timeline: Timeline, histograms: dict[str, dict[str, Any]]) -> str:
    """The whole page, as a string (pure: the manifest as written, the timeline, the usage histograms)."""
    from pipeline.observe.cost import cost_lines

    counts, tokens = manifest["counts"], manifest["tokens"]
    t0 = min(
        [*(timeline.runs or []), *(s["start"] for s in (manifest.get("stages") or {}).values())] or [0.0]
    )
    finished = dt.datetime.fromisoformat(manifest["finished_at"]).timestamp()
    summary = [
        ("job", manifest["job_id"]),
        ("model", f"{manifest['model']['name']} ({manifest['model']['path']})"),
        ("engine", f"{manifest['engine']['backend']}, {manifest['engine']['engines']} engine(s)"),
        ("rows", f"{counts['total']} total, {counts['succeeded']} ok, {counts['failed']} failed"),
        ("tokens", f"{tokens['prompt']} prompt, {tokens['completion']} completion"),
        *_structured_row(counts.get("structured")),
        *_adapter_rows(manifest),
        ("wall time", f"{manifest['wall_time_s']:.1f} s (this run)"),
        (
            "throughput",
            f"{manifest['throughput']['output_tokens_per_s']:.1f} output tok/s, "
            f"{manifest['throughput']['rows_per_s']:.1f} rows/s",
        ),
        ("preemptions", str(manifest.get("preemptions", 0))),
        (
            "prefix-cache hit rate",
            "n/a"
            if manifest.get("prefix_cache_hit_rate") is None
            else f"{manifest['prefix_cache_hit_rate']:.0%}",
        ),
        ("runs", str(max(1, len(timeline.runs)))),
    ]
    usage = manifest.get("usage") or {}
    usage_rows = [
        (name, f"p50 {d['p50']}  p90 {d['p90']}  p99 {d['p99']}  max {d['max']}  mean {d['mean']}")
        for name, d in usage.items()
        if d
    ]
    cost = cost_lines(manifest.get("cost"))
    fitted = manifest["engine"].get("fitted") or {}
    charts = [
        _chart(
            "throughput",
            "Output tokens/s over time (all pools, and per pool)",
            _throughput_chart(timeline, t0),
            "Too few samples: the engines ran for less than two sampling intervals.",
        ),
        _chart(
            "in-flight",
            "Requests in flight per engine (red: preemptions)",
            _engine_chart(timeline, t0, "in_flight", "requests in flight"),
            "No engine reports.",
        ),
        _chart(
            "kv-cache",
            "KV cache usage per engine (red: preemptions)",
            _engine_chart(timeline, t0, "kv_cache_usage", "KV cache usage"),
            "This engine backend does not report KV cache usage.",
        ),
        _chart(
            "prompt-lengths",
            "Prompt length (tokens per request)",
            _histogram_chart(histograms.get("prompt_tokens"), 1.0, "prompt tokens"),
            "No results.",
        ),
        _chart(
            "completion-lengths",
            "Completion length (tokens per request)",
            _histogram_chart(histograms.get("completion_tokens"), 1.0, "completion tokens"),
            "No results.",
        ),
        _chart("errors", "Errors by code", _errors_chart(counts["by_error_code"]), "No errors."),
        _chart(
            "stages", "Stages", _stages_chart(manifest.get("stages") or {}, t0, finished), "No stage times."
        ),
    ]
    settings = _table(sorted(manifest["engine"]["args"].items()))
    sampling = (
        _table(sorted(manifest["engine"]["sampling_defaults"].items()))
        or "<p class='empty'>none reported</p>"
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>nightshift job {html.escape(manifest["job_id"])}</title>
<style>{_STYLE}</style></head><body>
<h1>nightshift job {html.escape(manifest["job_id"])}</h1>
<p class="muted">{html.escape(manifest["created_at"])} → {html.escape(manifest["finished_at"])} ·
input {html.escape(str(manifest["input"].get("location")))} · nightshift {
        html.escape(manifest["nightshift_version"])
    }</p>
<div class="grid"><section><h2>Summary</h2>{_table(summary)}</section>
<section><h2>Cost</h2>{
        _table([(line[:10].strip(), line[10:].strip()) for line in cost])
        if cost
        else "<p class='empty'>No prices given (--gpu-hour-price, --hosted-price).</p>"
    }
<h2>Per request</h2>{_table(usage_rows) if usage_rows else "<p class='empty'>No results.</p>"}</section></div>
{"".join(charts)}
<div class="grid"><section><h2>Engine settings (effective)</h2>{settings}</section>
<section><h2>Sampling defaults (effective)</h2>{sampling}
<h2>Fitted</h2>{
        _table(
            sorted(
                (k, v)
                for k, v in fitted.items()
                if k in ("max_model_len", "max_num_seqs", "longest_sequence")
            )
        )
        if fitted
        else "<p class='empty'>not fitted</p>"
    }</section></div>
</body></html>
"""
    return page
