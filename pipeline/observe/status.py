"""`nightshift status OUTPUT`: where a job stands, from its output location alone (local or s3://).

    finished     manifest.json is there: its counts, throughput, pools, errors and cost
    running      no manifest; the driver saved `_staging/timeline.json` within STALE_AFTER_S
    interrupted  no manifest; the timeline is older than that (or absent): `nightshift resume OUTPUT` continues it

An unfinished job's counts are what staging holds (the checkpoint, so they are exact even after a crash); its
throughput, ETA and per-pool numbers come from the driver's last timeline sample. Reads only: it never changes
OUTPUT.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pipeline.config import StorageConfig
from pipeline.io.writers import MANIFEST_NAME, output_target
from pipeline.observe.recorder import SAVE_EVERY_S
from pipeline.observe.timeline import STAGES, TIMELINE_NAME, Timeline

STALE_AFTER_S = 3 * SAVE_EVERY_S  # a running driver saves its timeline every SAVE_EVERY_S


class NoJobError(ValueError):
    """OUTPUT holds neither a finished nor an unfinished nightshift job."""


def job_status(output: str, storage: StorageConfig | None = None, now: float | None = None) -> dict[str, Any]:
    """The status as a JSON-ready dict (what `--json` prints)."""
    now = time.time() if now is None else now
    target = output_target(output, storage or StorageConfig())
    if target.exists(MANIFEST_NAME):
        return _finished(output, json.loads(target.read_bytes(MANIFEST_NAME)))
    staging = target.staging_area()
    if not staging.exists():
        raise NoJobError(f"{output} holds no nightshift job (no manifest.json, no _staging/)")
    return _unfinished(output, staging, now)


def _finished(output: str, manifest: dict[str, Any]) -> dict[str, Any]:
    counts = manifest["counts"]
    return {
        "output": output,
        "state": "finished",
        "job_id": manifest["job_id"],
        "stage": None,
        "rows": {"total": counts["total"], "done": counts["total"], "failed": counts["failed"]},
        "tokens": manifest["tokens"],
        "output_tokens_per_s": manifest["throughput"]["output_tokens_per_s"],
        "rows_per_s": manifest["throughput"]["rows_per_s"],
        "eta_s": 0.0,
        "wall_time_s": manifest["wall_time_s"],
        "pools": {
            name: {
                "rows": int(p.get("rows") or 0),
                "completion_tokens": int(p.get("completion_tokens") or 0),
                "engines": p.get("engines"),
                "output_tokens_per_s": p.get("output_tokens_per_s"),
            }
            for name, p in (manifest.get("pools") or {}).items()
        },
        "errors_by_code": counts["by_error_code"],
        "cost": manifest.get("cost"),
        "updated_at": None,
    }


def _unfinished(output: str, staging: Any, now: float) -> dict[str, Any]:
    state = staging.read_job()
    timeline = Timeline()
    path = f"{staging.root}/{TIMELINE_NAME}"
    if staging.files.exists(path):
        timeline = Timeline.from_json(staging.files.read_bytes(path))
    errors_by_code: dict[str, int] = {}
    for code in staging.iter_column("errors", "error_code"):
        errors_by_code[code or "unknown"] = errors_by_code.get(code or "unknown", 0) + 1
    failed = sum(errors_by_code.values())
    done = staging.count("results") + failed
    total = state.input.lines if state.input else timeline.total_rows
    live = timeline.updated_at is not None and now - timeline.updated_at <= STALE_AFTER_S
    last = timeline.last or {}
    rows_rate = timeline.rate("rows_done") if live else None
    eta = (total - done) / rows_rate if live and rows_rate and total is not None else None
    running_stage = next((s for s in STAGES if (timeline.stages.get(s) or {}).get("end", 0) is None), None)
    return {
        "output": output,
        "state": "running" if live else "interrupted",
        "job_id": state.job_id,
        "stage": running_stage if live else None,
        "rows": {"total": total, "done": done, "failed": failed},
        "tokens": {"prompt": last.get("prompt_tokens", 0), "completion": last.get("completion_tokens", 0)},
        "output_tokens_per_s": round(timeline.rate("completion_tokens") or 0.0, 2) if live else 0.0,
        "rows_per_s": round(rows_rate or 0.0, 2),
        "eta_s": None if eta is None else round(eta, 1),
        "wall_time_s": round(last["t"] - timeline.runs[0], 3) if last and timeline.runs else None,
        "pools": {
            name: {"rows": p.get("rows", 0), "completion_tokens": p.get("completion_tokens", 0), "engines": n}
            for name, p in (last.get("pools") or {}).items()
            for n in [sum(1 for e in (last.get("engines") or {}).values() if e.get("pool") == name)]
        },
        "errors_by_code": dict(sorted(errors_by_code.items())),
        "cost": None,
        "updated_at": timeline.updated_at,
    }


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"
        if seconds >= 3600
        else (f"{seconds // 60}m{seconds % 60:02d}s")
    )


def render(status: dict[str, Any]) -> Any:
    """The status as a rich renderable (printed once, or redrawn in place by --watch)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    colors = {"finished": "green", "running": "cyan", "interrupted": "yellow"}
    rows = status["rows"]
    total = rows["total"]
    share = f" ({rows['done'] / total:.0%})" if total else ""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    state = status["state"] + (f" · {status['stage']}" if status.get("stage") else "")
    head.add_row("job", f"{status['job_id']}  [{colors[status['state']]}]{state}[/]")
    head.add_row("output", status["output"])
    head.add_row(
        "rows",
        f"{rows['done']} of {total if total is not None else '?'} done{share}, {rows['failed']} failed",
    )
    head.add_row(
        "tokens", f"{status['tokens']['prompt']} prompt, {status['tokens']['completion']} completion"
    )
    head.add_row(
        "throughput", f"{status['output_tokens_per_s']:.1f} output tok/s, {status['rows_per_s']:.1f} rows/s"
    )
    if status["state"] == "running":
        head.add_row("ETA", _duration(status["eta_s"]))
    if status["state"] == "interrupted":
        head.add_row("next", f"nightshift resume {status['output']}")
    parts: list[Any] = [head]
    if status["pools"]:
        pools = Table(title="pools", title_justify="left", show_edge=False)
        for column in ("pool", "engines", "rows", "completion tokens"):
            pools.add_column(column, justify="right" if column != "pool" else "left")
        for name, p in sorted(status["pools"].items()):
            pools.add_row(name, str(p.get("engines") or ""), str(p["rows"]), str(p["completion_tokens"]))
        parts.append(pools)
    if status["errors_by_code"]:
        errors = Table(title="errors", title_justify="left", show_edge=False)
        errors.add_column("code")
        errors.add_column("rows", justify="right")
        for code, n in status["errors_by_code"].items():
            errors.add_row(code, str(n))
        parts.append(errors)
    if status.get("cost"):
        from pipeline.observe.cost import cost_lines

        parts.append(Text("\n".join(cost_lines(status["cost"]))))
    return Group(*parts)
