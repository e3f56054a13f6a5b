"""LoRA routing benchmark: a job with more adapters than an engine holds, routed by adapter vs not routed.

The workload: A adapters, R chat rows, row i for adapter i mod A (round-robin in the file, so an engine that takes
rows in input order gets them all mixed), greedy, a fixed small max_tokens with ignore_eos (the same decode work in
every path). Each engine holds `max_loras` adapters at once; a request for another one waits for a slot and swaps
an adapter in. The same lines run through (each its own subprocess, one after the other, never two at once):

  routed      `nightshift run ... --num-engines E`: rows of one adapter go to the engine that holds it
              (stages/prefix_key.py `routing_key`, runtime/engines/work_queue.py owners; idle engines steal)
  unrouted    the same with --no-prefix-routing: every engine takes chunks of mixed adapters in input order
  run-batch   (--engine vllm --with-run-batch) `vllm run-batch` as a reference: one engine (it has no more) bound
              to ALL the cores the nightshift paths share; it counts no adapter loads

Two engines:

  --engine vllm   the real engine on this box's CPU, the embedded SmolLM2-135M, A seeded random adapters made at run
                  time (tests/e2e/lora_adapters.py, rank 8; cached under OUT_DIR/work/adapters). E engines of one
                  core each (bench/fair.py's Nx1 layout). Adapter loads are counted in vLLM's workers
                  (pipeline/engines/vllm_lora_worker.py: slots filled, first loads and swaps) from the moment the
                  engine serves: the manifest's count leaves out the one load per adapter per engine that vLLM's
                  serving layer makes as the engine starts (routed or not); the bench reads those from vLLM's log
                  and shows them apart ("at start").
  --engine fake   a scale simulation, clearly not a measurement of vLLM: the fake engine (pipeline/engines/fake.py)
                  models max_loras slots, a swap costing adapter_load_seconds, and decode time per token; E engines
                  of no CPU each (they sleep), so 8 of them fit on 2 cores.
  --smoke         the fake engine, tiny: the code paths in under a minute (tests run it).

Reported per path, from the manifest (OUTPUT/manifest.json): adapter loads, in all (`adapter_loads`) and per engine
(`engine.per_engine[actor].adapter_loads`), rows per engine, rows stolen, each adapter's rows
(`models[base].adapters[name].rows`); from a clock inside every engine (bench/trace/sitecustomize.py, by results:
the first and last request finished): fixed cost (process start -> first result), steady rate (rows finished after
the first result / first -> last result), tail (last result -> exit); and the wall time. Accounting is checked on
every path: every row answered, each adapter's rows as generated, the per-engine loads adding up to the total.

The paths must run on equal engines: both nightshift manifests' `engine.args` (the effective args) and
`engine.cpu_cores` are compared, and the real engine's cores are read back from vLLM's own log line and checked
against the layout. If they differ, the bench prints what differs and refuses to report (exit 2; the JSON says
why). The table goes to stdout, everything to OUT_DIR/lora_routing-<engine>.json (lora_routing-smoke.json).

    python bench/lora_routing.py --engine fake          # 16 adapters, max_loras 2, 8 engines, 4096 rows: ~2 min
    python bench/lora_routing.py --engine vllm          # 4 adapters, max_loras 1, 2x1 cores, 256 rows: ~5 min
    python bench/lora_routing.py --engine vllm --with-run-batch
    python bench/lora_routing.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

import engines as eb  # noqa: E402 - bench/engines.py: idle wait, load watching, the nightshift and run-batch paths
import fair  # noqa: E402 - bench/fair.py: cores, layouts, the engines' clock, core checks

ADAPTER_RANK = 8  # the adapters made for the real engine; --max-lora-rank follows
# vLLM's serving layer adds every --lora-modules adapter as its engine starts (init_static_loras), and each add puts
# the adapter into a slot: one load per adapter per engine before any work, routed or not. It logs each one.
_STARTUP_LOAD = re.compile(r"Loaded new LoRA adapter: name '")


@dataclass(frozen=True)
class Setup:
    """One bench run's workload and engines, the same for every path."""

    engine: str  # vllm | fake
    adapters: int
    max_loras: int
    engines: int
    rows: int
    max_tokens: int
    # The fake engine's time model (ignored by vllm).
    adapter_load_seconds: float = 0.0
    decode_seconds_per_token: float = 0.0
    max_concurrency: int = 64

    @property
    def adapter_names(self) -> list[str]:
        return [f"lora-{k}" for k in range(self.adapters)]


def adapter_requests(setup: Setup, seed: int = 0) -> list[dict]:
    """The job's lines: row i for adapter i mod A, so consecutive rows name different adapters."""
    names = setup.adapter_names
    base = eb.make_requests(setup.rows, setup.max_tokens, names[0], ignore_eos=True, seed=seed)
    for i, line in enumerate(base):
        line["body"]["model"] = names[i % len(names)]
    return base


def expected_adapter_rows(setup: Setup) -> dict[str, int]:
    names = setup.adapter_names
    return {name: len(range(k, setup.rows, len(names))) for k, name in enumerate(names)}


def make_adapters(setup: Setup, directory: Path, base_dir: str) -> dict[str, str]:
    """The real engine's adapters, {name: path}: seeded random LoRA weights of the base model (non-zero, so they
    change the answers), made once and kept (a directory with its adapter_config.json is reused)."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    from lora_adapters import make_adapter

    paths = {}
    for seed, name in enumerate(setup.adapter_names):
        out = directory / name
        if not (out / "adapter_config.json").exists():
            make_adapter(base_dir, out, seed=seed, rank=ADAPTER_RANK)
        paths[name] = str(out)
    return paths


# ---------------------------------------------------------------------------------------------------- one path


def nightshift_flags(
    setup: Setup, adapters: dict[str, str], routed: bool, job_file: Path | None
) -> list[str]:
    """The `nightshift run` flags a path adds to the engine args every path shares."""
    flags = ["--num-engines", str(setup.engines)]
    if setup.engine == "vllm":
        flags += ["--cpus-per-engine", "1", "--max-loras", str(setup.max_loras)]
        flags += ["--max-lora-rank", str(ADAPTER_RANK)]
        for name, path in adapters.items():
            flags += ["--lora-modules", f"{name}={path}"]
    else:
        # The fake's engines sleep: no CPU each, so all of them fit the box; its adapters are in the job file.
        flags += ["--engine", "fake", "--cpus-per-engine", "0", "--config", str(job_file)]
    if not routed:
        flags.append("--no-prefix-routing")
    return flags


def fake_job(setup: Setup) -> dict[str, Any]:
    """The fake engine's settings (engine.fake): its adapters, slots and time model."""
    return {
        "engine": {
            "fake": {
                "lora_modules": {name: f"/fake/{name}" for name in setup.adapter_names},
                "max_loras": setup.max_loras,
                "adapter_load_seconds": setup.adapter_load_seconds,
                "decode_seconds_per_token": setup.decode_seconds_per_token,
                "max_concurrency": setup.max_concurrency,
            }
        }
    }


def run_fake_nightshift(
    requests: Path, work: Path, env: dict[str, str], flags: list[str], name: str, timeout_s: float
) -> eb.Timed:
    """`nightshift run` with the fake engine: no vLLM engine args to pass (bench/engines.py's run_nightshift passes
    them for the real one)."""
    out = work / f"{name}-out"
    shutil.rmtree(out, ignore_errors=True)
    ray_tmp = Path(f"/tmp/nsbench-ray-{os.getpid()}")  # a private Ray temp dir, as run_nightshift's
    shutil.rmtree(ray_tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pipeline", "run", str(requests), str(out), "--no-progress", *flags]
    env = {**env, "RAY_TMPDIR": str(ray_tmp)}
    return eb.timed_subprocess(cmd, env, work / f"{name}.log", timeout_s)


def manifest_facts(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the bench reads from a nightshift manifest: loads, rows per engine and per adapter, equal-engine facts."""
    engine = manifest.get("engine") or {}
    per_engine = engine.get("per_engine") or {}
    adapter_rows: dict[str, int] = {}
    for model in (manifest.get("models") or {}).values():
        for name, served in (model.get("adapters") or {}).items():
            adapter_rows[name] = adapter_rows.get(name, 0) + served["rows"]
    routing = manifest.get("routing") or {}
    return {
        "adapter_loads": manifest.get("adapter_loads"),
        "loads_by_engine": {actor: e.get("adapter_loads") for actor, e in sorted(per_engine.items())},
        "rows_by_engine": {actor: e.get("rows") for actor, e in sorted(per_engine.items())},
        "adapter_rows": dict(sorted(adapter_rows.items())),
        "rows_ok": (manifest.get("counts") or {}).get("succeeded"),
        "rows_failed": (manifest.get("counts") or {}).get("failed"),
        "rows_stolen": routing.get("rows_stolen"),
        "routing": routing,
        "engine_args": engine.get("args"),
        "cpu_cores": engine.get("cpu_cores"),
        "engines": engine.get("engines"),
        "manifest_wall_time_s": manifest.get("wall_time_s"),
    }


def startup_loads(texts: list[str]) -> int:
    """Adapter loads vLLM's serving layer made as the engines started (one per adapter per engine), from its log."""
    return sum(len(_STARTUP_LOAD.findall(text)) for text in texts)


def accounting(facts: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """Every row answered, each adapter's rows as generated, per-engine loads adding up to the total."""
    loads = [n for n in facts["loads_by_engine"].values() if n is not None]
    checks = {
        "rows_ok": facts["rows_ok"] == setup.rows,
        "adapter_rows": facts["adapter_rows"] == expected_adapter_rows(setup),
        "loads_add_up": facts["adapter_loads"] is not None and sum(loads) == facts["adapter_loads"],
    }
    return {**checks, "ok": all(checks.values())}


def timed_path(
    name: str, setup: Setup, requests: Path, work: Path, ctx: dict[str, Any], routed: bool | None
) -> dict[str, Any]:
    """Run one path (`routed` None: run-batch) and measure it."""
    busy, waited = eb.wait_for_idle(ctx["idle_threshold"], ctx["max_idle_wait"])
    load_before = os.getloadavg()
    trace_dir = work / f"trace-{name}"
    env = fair.trace_env(ctx["env"], trace_dir)
    watcher = eb.LoadWatcher()
    watcher.start()
    texts: list[str] = []
    manifest = None
    try:
        if routed is None:
            timed, outputs, _ = eb.run_run_batch(
                requests,
                work,
                ctx["model_dir"],
                ctx["model_name"],
                ctx["args"],
                {**env, fair.OMP_BIND: fair.bind_string(ctx["cores"])},
                ctx["timeout"],
                name=name,
                extra_args=run_batch_lora_args(setup, ctx["adapters"]),
            )
            rows_ok = sum(o["ok"] for o in outputs.values())
        else:
            flags = nightshift_flags(setup, ctx["adapters"], routed, ctx.get("job_file"))
            if setup.engine == "vllm":
                timed, _, extra = eb.run_nightshift(
                    requests, work, ctx["args"], env, ctx["timeout"], extra_args=flags, name=name
                )
                texts = fair.ray_session_texts(Path(extra["ray_session"]).parent.parent)
            else:
                timed = run_fake_nightshift(requests, work, env, flags, name, ctx["timeout"])
            manifest = json.loads((work / f"{name}-out" / "manifest.json").read_text())
            rows_ok = None
    finally:
        load = watcher.stop()
    texts.append((work / f"{name}.log").read_text(errors="replace"))
    traces = fair.read_traces(trace_dir)
    run: dict[str, Any] = {
        "path": name,
        "routed": routed,
        "wall_s": round(timed.wall_s, 2),
        **fair.result_timing(traces, timed.started, timed.ended),
        "output_tokens_traced": sum(t["tokens"] for t in traces),
        "engine_configs": [t.get("engine_config") for t in traces],
        "cpu_busy_before": round(busy, 3),
        "waited_for_idle_s": round(waited, 1),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "foreign_cores": load["foreign_cores"],
        "foreign_top": load["foreign_top"],
        "steal_share": timed.steal_share,
    }
    if manifest is not None:
        facts = manifest_facts(manifest)
        run.update(facts)
        run["accounting"] = accounting(facts, setup)
        # The manifest counts the loads made while the engines served; those every real engine makes as it starts
        # (one per adapter) are read from vLLM's log and shown apart. The fake makes none.
        run["startup_loads"] = startup_loads(texts) if setup.engine == "vllm" else 0
    else:
        run["rows_ok"] = rows_ok
        run["adapter_loads"] = None  # run-batch counts none
    if setup.engine == "vllm":
        layout = fair.Layout(1, len(ctx["cores"])) if routed is None else fair.Layout(setup.engines, 1)
        run["layout"] = layout.label
        run["logged_cores"] = fair.bound_cores(texts)
        run["expected_cores"] = layout.expected(ctx["cores"])
        run["cores_wrong"] = fair.check_cores(run["logged_cores"], run["expected_cores"])
    return run


def run_batch_lora_args(setup: Setup, adapters: dict[str, str]) -> list[str]:
    """vLLM run-batch's flags for the same adapters and slots nightshift gives its engines (every adapter kept in
    the CPU cache, as nightshift's vLLM engine keeps them)."""
    flags = ["--enable-lora", "--max-loras", str(setup.max_loras), "--max-lora-rank", str(ADAPTER_RANK)]
    flags += ["--max-cpu-loras", str(max(setup.adapters, setup.max_loras)), "--lora-modules"]
    return flags + [f"{name}={path}" for name, path in adapters.items()]


# ---------------------------------------------------------------------------------------------------- compare


def engines_differ(routed: dict[str, Any], unrouted: dict[str, Any]) -> list[str]:
    """What differs between the two nightshift paths' engines (effective args, cores), [] when they are equal."""
    problems = []
    if routed.get("engine_args") != unrouted.get("engine_args"):
        a, b = routed.get("engine_args") or {}, unrouted.get("engine_args") or {}
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        problems.append(
            "engine args differ: " + ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys)
        )
    cores_a = sorted(routed.get("cpu_cores") or [])
    cores_b = sorted(unrouted.get("cpu_cores") or [])
    if cores_a != cores_b:
        problems.append(f"engine cores differ: {cores_a} vs {cores_b}")
    if routed.get("engines") != unrouted.get("engines"):
        problems.append(f"engines differ: {routed.get('engines')} vs {unrouted.get('engines')}")
    for run in (routed, unrouted):
        if run.get("cores_wrong"):
            problems.append(f"{run['path']}: {run['cores_wrong']}")
    return problems


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def compare(routed: dict[str, Any], unrouted: dict[str, Any]) -> dict[str, Any]:
    """Unrouted over routed for loads and wall time (> 1: routing saves), routed over unrouted for steady rate."""
    return {
        "loads_unrouted_over_routed": _ratio(unrouted.get("adapter_loads"), routed.get("adapter_loads")),
        "wall_unrouted_over_routed": _ratio(unrouted["wall_s"], routed["wall_s"]),
        "steady_routed_over_unrouted": _ratio(
            routed.get("steady_rows_per_s"), unrouted.get("steady_rows_per_s")
        ),
        "routed_loads_not_more": (routed.get("adapter_loads") or 0) <= (unrouted.get("adapter_loads") or 0),
    }


def format_table(summary: dict[str, Any]) -> str:
    s = summary["setup"]
    kind = "REAL vLLM engine (CPU)" if s["engine"] == "vllm" else "FAKE engine (a simulation, not vLLM)"
    lines = [
        f"LoRA routing, {kind}: {s['adapters']} adapters, max_loras {s['max_loras']}, {s['engines']} engines"
        f"{' x 1 core' if s['engine'] == 'vllm' else ''}, {s['rows']} rows x {s['max_tokens']} tokens"
        + (
            f"; adapter load {s['adapter_load_seconds']} s, decode {s['decode_seconds_per_token'] * 1000:g} ms/token, "
            f"{s['max_concurrency']} at once"
            if s["engine"] == "fake"
            else ""
        ),
        "",
    ]
    header = (
        f"{'path':<10} {'wall s':>7} {'fixed s':>8} {'steady rows/s':>13} {'tail s':>7} {'loads':>6} "
        f"{'at start':>8} {'stolen':>6} "
        f"{'rows ok':>7} {'foreign':>7}  loads | rows per engine"
    )
    lines += [header, "-" * len(header)]
    for run in summary["runs"]:
        per_engine = "/".join(str(n) for n in (run.get("loads_by_engine") or {}).values()) or "-"
        rows = "/".join(str(n) for n in (run.get("rows_by_engine") or {}).values()) or "-"
        flag = ""
        if run.get("cores_wrong"):
            flag += f"  !!! CORES WRONG: {run['cores_wrong']}"
        if run.get("accounting") and not run["accounting"]["ok"]:
            flag += f"  !!! ACCOUNTING: {run['accounting']}"
        lines.append(
            f"{run['path']:<10} {run['wall_s']:>7.1f} {fair.fmt(run.get('fixed_s')):>8} "
            f"{fair.fmt(run.get('steady_rows_per_s')):>13} {fair.fmt(run.get('tail_s')):>7} "
            f"{fair.fmt(run.get('adapter_loads'), 'd'):>6} {fair.fmt(run.get('startup_loads'), 'd'):>8} "
            f"{fair.fmt(run.get('rows_stolen'), 'd'):>6} "
            f"{run.get('rows_ok')!s:>7} {run['foreign_cores']:>7.2f}  {per_engine} | {rows}{flag}"
        )
    c = summary["comparison"]
    lines += [
        "",
        "fixed = process start -> first request finished in any engine; steady = rows finished after it / first -> "
        "last result;",
        "tail = last result -> exit; loads = adapters loaded into the engines' slots (first loads and swaps) while",
        "they served, the manifest's adapter_loads; at start = the loads vLLM's serving layer made as each engine",
        "started, not in loads (one per adapter per engine, from its 'Loaded new LoRA adapter' log lines; the fake",
        "makes none)",
    ]
    if any(r["path"] == "run-batch" for r in summary["runs"]):
        lines.append(
            "run-batch: one vLLM engine on all the cores the nightshift paths share (it has one); it counts no loads"
        )
    lines += [
        "",
        f"unrouted / routed: loads {fair.fmt(c['loads_unrouted_over_routed'], '.2f')}x, wall "
        f"{fair.fmt(c['wall_unrouted_over_routed'], '.2f')}x; steady rate routed / unrouted "
        f"{fair.fmt(c['steady_routed_over_unrouted'], '.2f')}x",
        "load average before/after each path: "
        + "; ".join(
            f"{r['path']} {r['loadavg_before'][0]:.2f}/{r['loadavg_after'][0]:.2f}" for r in summary["runs"]
        ),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--engine", choices=("vllm", "fake"), default="vllm", help="the real engine or the fake one"
    )
    p.add_argument("--smoke", action="store_true", help="tiny fake-engine run (the code paths; tests run it)")
    p.add_argument("--adapters", type=int, help="adapters (vllm 4, fake 16, smoke 4)")
    p.add_argument("--max-loras", type=int, help="adapters an engine holds at once (vllm 1, fake 2, smoke 1)")
    p.add_argument("--engines", type=int, help="engines (vllm: one per core of the box, fake 8, smoke 2)")
    p.add_argument("--rows", type=int, help="rows (vllm 256, fake 4096, smoke 128)")
    p.add_argument("--max-tokens", type=int, help="output tokens per row (vllm 16, fake 16, smoke 8)")
    p.add_argument("--adapter-load-seconds", type=float, help="fake: seconds per adapter load (fake 0.25)")
    p.add_argument(
        "--decode-seconds-per-token", type=float, help="fake: seconds per output token (fake 0.005)"
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="vllm: engine max_num_seqs (default 64)")
    p.add_argument("--with-run-batch", action="store_true", help="vllm: also vLLM's run-batch on all cores")
    p.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results", help="the JSON and work files")
    p.add_argument("--timeout", type=float, default=1800, help="per-path timeout in seconds")
    p.add_argument(
        "--idle-threshold", type=float, default=0.15, help="wait while the box is busier than this"
    )
    p.add_argument("--max-idle-wait", type=float, help="longest wait for an idle box (vllm 300 s, fake 0)")
    return p.parse_args(argv)


def setup_from(ns: argparse.Namespace, cores: list[int]) -> Setup:
    engine = "fake" if ns.smoke else ns.engine
    if ns.smoke:
        defaults = dict(
            adapters=4, max_loras=1, engines=2, rows=128, max_tokens=8, load=0.05, decode=0.002, conc=16
        )
    elif engine == "fake":
        defaults = dict(
            adapters=16, max_loras=2, engines=8, rows=4096, max_tokens=16, load=0.25, decode=0.005, conc=32
        )
    else:
        defaults = dict(
            adapters=4, max_loras=1, engines=len(cores), rows=256, max_tokens=16, load=0.0, decode=0.0, conc=0
        )
    pick = lambda given, key: defaults[key] if given is None else given  # noqa: E731
    return Setup(
        engine=engine,
        adapters=pick(ns.adapters, "adapters"),
        max_loras=pick(ns.max_loras, "max_loras"),
        engines=pick(ns.engines, "engines"),
        rows=pick(ns.rows, "rows"),
        max_tokens=pick(ns.max_tokens, "max_tokens"),
        adapter_load_seconds=pick(ns.adapter_load_seconds, "load"),
        decode_seconds_per_token=pick(ns.decode_seconds_per_token, "decode"),
        max_concurrency=defaults["conc"] if engine == "fake" else ns.max_num_seqs,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    cores = fair.box_cores()
    setup = setup_from(ns, cores)
    label = "smoke" if ns.smoke else setup.engine
    work = (ns.out_dir / "work" / f"lora-{label}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    from pipeline.models import resolve_model

    model = resolve_model(None)
    args = eb.EngineArgs(max_num_seqs=ns.max_num_seqs)
    if setup.engine == "vllm":
        if setup.engines > len(cores):
            raise SystemExit(
                f"{setup.engines} engines of one core each need {setup.engines} cores; this box has {cores}"
            )
        adapters = make_adapters(setup, (ns.out_dir / "work" / "adapters").resolve(), str(model.path))
        job_file = None
    else:
        adapters = {}
        job_file = work / "job.yaml"
        job_file.write_text(json.dumps(fake_job(setup)))  # YAML reads JSON
    requests = work / "requests.jsonl"
    eb.write_jsonl(requests, adapter_requests(setup))
    max_idle_wait = (
        ns.max_idle_wait if ns.max_idle_wait is not None else (300 if setup.engine == "vllm" else 0)
    )
    ctx = {
        "args": args,
        "env": eb.bench_env(args),
        "cores": cores,
        "model_dir": str(model.path),
        "model_name": model.name,
        "adapters": adapters,
        "job_file": job_file,
        "timeout": ns.timeout,
        "idle_threshold": ns.idle_threshold,
        "max_idle_wait": max_idle_wait,
    }
    paths: list[tuple[str, bool | None]] = [("routed", True), ("unrouted", False)]
    if ns.with_run_batch and setup.engine == "vllm":
        paths.append(("run-batch", None))
    runs = []
    for name, routed in paths:
        print(f"{name} ...", flush=True)
        run = timed_path(name, setup, requests, work, ctx, routed)
        print(
            f"  {run['wall_s']:.1f} s, fixed {fair.fmt(run.get('fixed_s'))} s, steady "
            f"{fair.fmt(run.get('steady_rows_per_s'))} rows/s, adapter loads {run.get('adapter_loads')} "
            f"{run.get('loads_by_engine') or ''}, rows ok {run.get('rows_ok')}/{setup.rows}, "
            f"load {run['loadavg_before'][0]:.2f}, foreign {run['foreign_cores']:.2f} cores",
            flush=True,
        )
        runs.append(run)
    by_name = {r["path"]: r for r in runs}
    summary: dict[str, Any] = {
        "setup": asdict(setup),
        "engine_args": asdict(args) if setup.engine == "vllm" else fake_job(setup)["engine"]["fake"],
        "adapters": adapters,
        "box_cores": cores,
        "git": eb.git_state(),
        "machine": {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
        "comparison": compare(by_name["routed"], by_name["unrouted"]),
        "runs": runs,
    }
    out = ns.out_dir / f"lora_routing-{label}.json"
    problems = engines_differ(by_name["routed"], by_name["unrouted"])
    if problems:
        summary["refused"] = problems
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2))
        print("\n!!! REFUSED: the routed and unrouted paths did not run on equal engines:", flush=True)
        for problem in problems:
            print(f"  {problem}")
        print(f"\nwritten: {out}")
        raise SystemExit(2)
    eb.write_summary(out, summary, format_table(summary))
    return summary


if __name__ == "__main__":  # required: vLLM starts its engine core with spawn
    main()
