"""Where the seconds before the first token go: one small `nightshift run` (fake or real engine) next to run-batch.

Runs a few chat rows (examples/chat.jsonl, repeated to --rows) through each path once and prints a timeline, in
seconds from process start, from timestamps the run leaves behind:

  driver log    nightshift's own structured log (--log-format json): input validated (ingest + fit, which overlap
                Ray's start), job finished
  engine log    vLLM's lines in the Ray session's worker logs or run-batch's output (1 s resolution): engine
                construction begins ("Resolved architecture"), engine ready ("init engine ... took")
  token clock   first and last output token (bench/trace/sitecustomize.py)
  exit          process end

    python bench/startup.py                      # nightshift fake, nightshift vllm (1xN), run-batch (1xN), 8 rows
    python bench/startup.py --paths nightshift-fake --rows 8
    python bench/startup.py --paths nightshift-warm,run-batch --rows 200

nightshift-warm is the daily loop of `nightshift up`: the runtime is started, one run starts its engine (reported as
"nightshift-warm-first"), and the run measured is the next one of the same rows, on that engine, warm. Its token
clock is the engine's busy spell that began after the measured run started (the same engine served both runs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

import engines as eb  # noqa: E402
import fair  # noqa: E402

PATHS = ("nightshift-fake", "nightshift-vllm", "run-batch")
WARM = "nightshift-warm"


def _vllm_marks(texts: list[str], year: int) -> dict[str, float]:
    marks: dict[str, float] = {}
    for text in texts:
        for line in text.splitlines():
            m = eb._VLLM_TS.search(line)
            if m is None:
                continue
            month, day, hh, mm, ss = (int(g) for g in m.groups())
            at = time.mktime((year, month, day, hh, mm, ss, 0, 0, -1))
            for name, pattern in (
                ("engine construction begins", eb._ENGINE_INIT),
                ("engine ready", eb._ENGINE_READY),
            ):
                if pattern.search(line):
                    marks[name] = min(marks.get(name, at), at)
    return marks


def _driver_marks(log: Path) -> dict[str, float]:
    marks: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        name = event.get("event")
        stamp = event.get("timestamp")
        if name and stamp and name not in marks:
            marks[name] = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return marks


def _timeline(
    timed: eb.Timed, texts: list[str], driver: dict[str, float], traces: list[dict[str, Any]]
) -> dict[str, float]:
    """Seconds from the run's start of each mark: the driver's, the engine's (its log) and the token clock's, with
    only the engine's busy spells that began in this run (a warm engine served earlier runs too)."""
    marks = {
        f"driver: {k}": v
        for k, v in driver.items()
        if k in ("input validated", "engine args fitted to the data")
    }
    marks.update(
        {
            f"engine: {k}": v
            for k, v in _vllm_marks(texts, time.localtime(timed.started).tm_year).items()
            if v >= timed.started - 1  # vLLM's log has 1 s resolution
        }
    )
    starts = [t for trace in traces for t in trace.get("busy_starts") or [trace["first_token_at"]]]
    starts = [t for t in starts if t >= timed.started]
    if starts:
        marks["first output token"] = min(starts)
        marks["last output token"] = max(t["last_token_at"] for t in traces)
    marks["exit"] = timed.ended
    return {k: round(v - timed.started, 1) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}


def run_warm(requests: Path, work: Path, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """`nightshift up`, a first run (it starts the runtime's engine), then the measured run on the warm engine."""
    trace_dir = work / f"trace-{WARM}"
    home = work / "warm-home"  # `up`'s state lives here: no runtime of the user's is found or disturbed
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    from cluster.home import nightshift_home

    (home / "models").symlink_to(nightshift_home() / "models")  # the embedded model, converted once
    ray_tmp = Path(f"/tmp/nsbench-up-{os.getpid()}")  # the runtime's Ray: its session logs hold the engine's
    shutil.rmtree(ray_tmp, ignore_errors=True)
    env = {
        **fair.trace_env(ctx["env"], trace_dir),
        "NIGHTSHIFT_HOME": str(home),
        "NIGHTSHIFT_WARM": "1",
        "RAY_TMPDIR": str(ray_tmp),
    }
    cli = [sys.executable, "-m", "pipeline"]
    flags = ["--log-format", "json", "--num-engines", "1", "--cpus-per-engine", str(len(ctx["cores"]))]
    t0 = time.time()
    subprocess.run(
        [*cli, "up", "--idle-timeout", "10m"], env=env, check=True, timeout=ctx["timeout"], cwd=REPO
    )
    results = []
    try:
        print(f"  up in {time.time() - t0:.1f} s", flush=True)
        for name in (f"{WARM}-first", WARM):
            timed, _, _ = eb.run_nightshift(
                requests, work, ctx["args"], env, ctx["timeout"], REPO, flags, name=name
            )
            log = (work / f"{name}.log").read_text(errors="replace")
            if "on the warm runtime" not in log:
                raise RuntimeError(f"{name} did not run on the warm runtime: {log[-2000:]}")
            texts = [*fair.ray_session_texts(ray_tmp), log]
            manifest = json.loads((work / f"{name}-out" / "manifest.json").read_text())
            results.append(
                {
                    "path": name,
                    "wall_s": round(timed.wall_s, 1),
                    "timeline": _timeline(
                        timed, texts, _driver_marks(work / f"{name}.log"), fair.read_traces(trace_dir)
                    ),
                    "cores": fair.bound_cores(texts),
                    "engines_reused": manifest["engine"]["reused"],
                }
            )
    finally:
        subprocess.run([*cli, "down"], env=env, timeout=ctx["timeout"], cwd=REPO)
    return results


def run(path: str, requests: Path, work: Path, ctx: dict[str, Any]) -> dict[str, Any]:
    trace_dir = work / f"trace-{path}"
    env = fair.trace_env(ctx["env"], trace_dir)
    args = ctx["args"]
    cores = ctx["cores"]
    if path.startswith("nightshift"):
        flags = ["--log-format", "json", "--num-engines", "1", "--cpus-per-engine", str(len(cores))]
        if path == "nightshift-fake":
            flags += ["--engine", "fake"]
        timed, _, extra = eb.run_nightshift(requests, work, args, env, ctx["timeout"], REPO, flags, name=path)
        texts = fair.ray_session_texts(Path(extra["ray_session"]).parent.parent)
        driver = _driver_marks(work / f"{path}.log")
    else:
        env = {**env, fair.OMP_BIND: fair.bind_string(cores)}
        timed, _, extra = eb.run_run_batch(
            requests, work, ctx["model_dir"], ctx["model_name"], args, env, ctx["timeout"], name=path
        )
        texts, driver = [], {}
    texts.append((work / f"{path}.log").read_text(errors="replace"))
    return {
        "path": path,
        "wall_s": round(timed.wall_s, 1),
        "timeline": _timeline(timed, texts, driver, fair.read_traces(trace_dir)),
        "cores": fair.bound_cores(texts),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--paths", default=",".join(PATHS), help=f"any of {', '.join((*PATHS, WARM))}")
    p.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results")
    p.add_argument("--timeout", type=float, default=1800)
    ns = p.parse_args(argv)
    from pipeline.models import resolve_model

    model = resolve_model(None)
    args = eb.EngineArgs()
    work = (ns.out_dir / "work" / "startup").resolve()
    work.mkdir(parents=True, exist_ok=True)
    # The example's chat lines only: its other lines are there to show error records, and run-batch stops on them.
    lines = [
        line
        for line in eb.read_jsonl(REPO / "examples" / "chat.jsonl")
        if line.get("url") == "/v1/chat/completions" and "model" in line.get("body", {})
    ]
    rows = []
    for i in range(ns.rows):
        line = json.loads(json.dumps(lines[i % len(lines)]))
        line["custom_id"] = f"req-{i:05d}"
        line["body"]["model"] = model.name
        rows.append(line)
    requests = work / "requests.jsonl"
    eb.write_jsonl(requests, rows)
    ctx = {
        "args": args,
        "env": eb.bench_env(args),
        "cores": fair.box_cores(),
        "model_dir": str(model.path),
        "model_name": model.name,
        "timeout": ns.timeout,
    }
    results = []
    for path in [x for x in ns.paths.split(",") if x]:
        print(f"{path} ...", flush=True)
        for result in run_warm(requests, work, ctx) if path == WARM else [run(path, requests, work, ctx)]:
            results.append(result)
            reused = f", engines reused {result['engines_reused']}" if "engines_reused" in result else ""
            print(f"  {result['path']}: wall {result['wall_s']} s, engine cores {result['cores']}{reused}")
            for name, at in result["timeline"].items():
                print(f"  {at:>7.1f} s  {name}")
    out = ns.out_dir / "startup.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten: {out}")
    shutil.rmtree(work / "trace-nightshift-fake", ignore_errors=True)


if __name__ == "__main__":  # required: vLLM starts its engine core with spawn
    main()
