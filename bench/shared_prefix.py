"""Shared-prefix benchmark: nightshift vs Ray Data LLM vs `vllm run-batch`, every path on the whole box.

The workload: P different system prompts of ~400 tokens, R chat rows each (a short question after the prompt), the
rows of different prompts interleaved the way an input sorted by anything else would be; and a plain-chat one (short
distinct questions, no shared prompt), where routing has nothing to do and must cost nothing. Every path gets the
same lines and the same engine args (bench/engines.py's EngineArgs: prefix caching on), and ALL the cores of the box
(bench/fair.py), in one of two layouts: one engine bound to all cores (1xN), or N engines of one core each (Nx1):

  nightshift-1xN              `nightshift run --num-engines 1 --cpus-per-engine N`
  nightshift-Nx1              `nightshift run --num-engines N --cpus-per-engine 1`, prefix-aware routing on
  nightshift-Nx1-no-routing   the same with --no-prefix-routing
  ray-data-llm-1xN            `build_processor(vLLMEngineProcessorConfig(concurrency=1, runtime_env=...))`, the
                              engine bound to all cores by runtime_env env_vars VLLM_CPU_OMP_THREADS_BIND=0-(N-1)
  ray-data-llm-Nx1            concurrency=(N, N), each engine's worker claims a core of its own (a worker setup
                              hook in the vLLM stage's runtime_env env_vars)
  run-batch-1xN               `python -m vllm.entrypoints.openai.run_batch` with VLLM_CPU_OMP_THREADS_BIND=0-(N-1)

(Ray is told the node has N GPUs so Ray Data LLM's vLLM stage schedules; vllm-cpu runs on the CPU.) Each engine's
cores are read back from vLLM's own log line `local_rank=0, core ids=[...]`; a path whose cores differ from its
layout is flagged CORES WRONG in the table. Per path: total wall, fixed cost (process start -> first output token),
steady-state tok/s (output tokens / first -> last token), tail (last token -> exit), prefix-cache hit rate — the
token clock and hit counts come from inside each engine core (bench/trace/sitecustomize.py; see bench/README.md).

Every path runs as its own subprocess, never two at once; before each the script waits for the box to be idle
(others share it) and watches foreign CPU during the run (bench/engines.py's machinery). Output tokens are counted
from each path's own outputs. Results go to OUT_DIR/shared_prefix.json.

    python bench/shared_prefix.py                         # 8 prompts x 256 rows x 64 tokens, both workloads
    python bench/shared_prefix.py --quick                 # smoke run: a few rows, a few tokens, no idle wait
    python bench/shared_prefix.py --workloads shared --paths nightshift-1x2,run-batch-1x2
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

import engines as eb  # noqa: E402 - bench/engines.py: idle wait, load watching, the nightshift and run-batch paths
import fair  # noqa: E402 - bench/fair.py: cores, layouts, token clock, core checks

WORKLOADS = ("shared", "plain", "p2")
# P2, the prefix-heavy job: more distinct long system prompts than one engine's KV cache holds. Each engine's cache
# (every path's, the same number of blocks) holds KV_SHARE of the prompts, so a path that runs the rows in their
# interleaved input order evicts a prompt before its next row comes; nightshift's prefix-aware queue hands each
# engine chunks of one prompt at a time.
P2 = {"prompts": 64, "rows_per_prompt": 32, "prompt_words": 1360, "kv_share": 0.25, "max_tokens": 16}
# vLLM's KV block on CPU (vllm/platforms/cpu.py: block_size 128 unless the model needs another).
CPU_BLOCK_TOKENS = 128
# The steady-rate target on P2: nightshift at least this many times the best peer's.
P2_TARGET = 1.3


@dataclass(frozen=True)
class PathSpec:
    name: str
    kind: str  # nightshift | ray-data-llm | run-batch
    layout: fair.Layout
    routing: bool = True


def path_specs(cores: list[int]) -> list[PathSpec]:
    """Every path in both layouts it can run (run-batch has one engine only), named by layout: nightshift-1x2 ..."""
    whole, each = fair.Layout.all_cores(cores), fair.Layout.core_each(cores)
    specs = [
        PathSpec(f"nightshift-{whole.label}", "nightshift", whole),
        PathSpec(f"nightshift-{each.label}", "nightshift", each),
        PathSpec(f"nightshift-{each.label}-no-routing", "nightshift", each, routing=False),
        PathSpec(f"ray-data-llm-{whole.label}", "ray-data-llm", whole),
        PathSpec(f"ray-data-llm-{each.label}", "ray-data-llm", each),
        PathSpec(f"run-batch-{whole.label}", "run-batch", whole),
    ]
    unique: dict[str, PathSpec] = {}
    for spec in specs:  # on a 1-core box both layouts are 1x1
        unique.setdefault(spec.name, spec)
    return list(unique.values())


_WORDS = (
    "policy customer order invoice shipping refund warranty account payment delivery product service support "
    "quality safety report analysis budget schedule contract partner market price discount inventory supplier "
    "review feedback request answer detail summary example format style tone language clear brief polite exact "
    "always never only first second third step rule note check confirm explain describe list compare include"
).split()


def system_prompt(k: int, words: int = 360) -> str:
    """A distinct system prompt of about 1.1 tokens per word of this vocabulary (measured): 360 words ~ 400 tokens,
    1,360 ~ 1,500."""
    rng = random.Random(1000 + k)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 16)))
        sentences.append(sentence.capitalize() + ".")
    return f"You are support assistant number {k} of the company. " + " ".join(sentences)


def shared_prefix_requests(
    prompts: int,
    rows_per_prompt: int,
    max_tokens: int,
    model_name: str,
    seed: int = 0,
    prompt_words: int = 360,
) -> list[dict]:
    questions = [tpl.format(t=topic) for tpl in eb._TEMPLATES for topic in eb._TOPICS]
    random.Random(seed).shuffle(questions)
    systems = [system_prompt(k, prompt_words) for k in range(prompts)]
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


def prompt_tokens(model_dir: str, request: dict) -> int:
    """The tokens of `request`'s messages once the model's chat template is applied: what its prefill costs."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        request["body"]["messages"], tokenize=False, add_generation_prompt=True
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def blocks_for_share(prompts: int, share: float, tokens_per_prompt: int, max_num_seqs: int) -> int:
    """KV blocks for one engine to hold `share` of `prompts` prompts of `tokens_per_prompt` tokens, plus one block
    per running sequence for the part after the shared prompt (its question and answer)."""
    held = max(1, round(prompts * share))
    per_prompt = -(-tokens_per_prompt // CPU_BLOCK_TOKENS)
    return held * per_prompt + max_num_seqs


# ---------------------------------------------------------------------------------------------------- Ray Data LLM


def run_ray_data_llm(
    requests: Path, work: Path, spec: PathSpec, ctx: dict[str, Any], env: dict[str, str]
) -> tuple[eb.Timed, dict, dict]:
    result = work / f"{spec.name}.json"
    result.unlink(missing_ok=True)
    ray_tmp = Path(f"/tmp/nsbench-rdl-{os.getpid()}")
    shutil.rmtree(ray_tmp, ignore_errors=True)
    locks = ray_tmp.with_name(ray_tmp.name + "-cores")  # this run's core claims only
    shutil.rmtree(locks, ignore_errors=True)
    worker = {
        "requests": str(requests),
        "model": ctx["model_dir"],
        "result": str(result),
        "engine": asdict(ctx["args"]),
        "engines": spec.layout.engines,
        "bind": fair.bind_string(ctx["cores"]) if spec.layout.engines == 1 else None,
        "core_locks": str(locks),
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--raydata-worker", json.dumps(worker)]
    # The setup hook (bench/fair.py) and cluster/cpu_cores.py must import in Ray's workers.
    path = os.pathsep.join(filter(None, [str(BENCH_DIR), str(REPO), env.get("PYTHONPATH")]))
    env = {**env, "RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": path}
    timed = eb.timed_subprocess(cmd, env, work / f"{spec.name}.log", ctx["timeout"])
    data = json.loads(result.read_text())
    extra = {**data["timings"], "ray_session": os.path.realpath(ray_tmp / "ray" / "session_latest")}
    return timed, data["outputs"], extra


def raydata_worker(spec_json: str) -> None:
    """The Ray Data LLM path, in its own process: the documented build_processor recipe, nothing of nightshift."""
    t_start = time.perf_counter()
    spec = json.loads(spec_json)
    eng = spec["engine"]
    engines = spec["engines"]
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(eng["kv_cache_gib"])
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    # No GPU here: Ray is told there are some, so that the vLLM stage (which asks for one per engine) can schedule;
    # vllm-cpu ignores the device ids Ray hands it. The CPU stages (chat template, tokenize, detokenize) are actor
    # pools of their own, so Ray gets logical CPUs enough for all of them at once next to the engines (a stage
    # short of logical CPUs would stall the pipeline); the box has the cores it has.
    ray.init(num_cpus=16, num_gpus=engines, include_dashboard=False, log_to_driver=False)
    lines = eb.read_jsonl(Path(spec["requests"]))
    if spec["bind"]:
        # One engine on all cores: its actor's environment carries the bind, as a user would set it.
        runtime_env: dict[str, Any] = {"env_vars": {fair.OMP_BIND: spec["bind"]}}
        stages: dict[str, Any] = {}
    else:
        # One core each: the engine actors' workers claim a core as they start (bench/fair.py: claim_core_hook).
        # Ray turns `worker_process_setup_hook` into this env var only for ray.init's job-wide runtime_env; for the
        # vLLM stage's actors alone the env var itself is what a worker runs at start (ray/_private/workers/
        # default_worker.py).
        runtime_env = {
            "env_vars": {
                fair.CORE_LOCKS_ENV: spec["core_locks"],
                "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "fair.claim_core_hook",
            }
        }
        # The CPU stages would otherwise inherit the processor's runtime_env and claim cores themselves.
        stages = {"runtime_env": {"env_vars": {}}}
    # The CPU stages (chat template, tokenize, detokenize) autoscale from 1 to N actors, as Ray Data LLM's default
    # for concurrency=N; only the engine pool is fixed.
    cpu_stage = {"concurrency": len(os.sched_getaffinity(0)), **stages}
    stage_args = {name: cpu_stage for name in ("chat_template_stage", "tokenize_stage", "detokenize_stage")}
    config = vLLMEngineProcessorConfig(
        model_source=spec["model"],
        engine_kwargs={
            "max_model_len": eng["max_model_len"],
            "max_num_seqs": eng["max_num_seqs"],
            "dtype": eng["dtype"],
            "enforce_eager": eng["enforce_eager"],
            "enable_prefix_caching": eng["enable_prefix_caching"],
            "disable_log_stats": False,
            **({"max_num_batched_tokens": n} if (n := eng.get("max_num_batched_tokens")) else {}),
            **({"gpu_memory_utilization": u} if (u := eng.get("gpu_memory_utilization")) else {}),
            **({"num_gpu_blocks_override": b} if (b := eng.get("num_gpu_blocks_override")) else {}),
        },
        concurrency=(engines, engines),  # a fixed pool, as nightshift's: an int n would autoscale from 1 to n
        batch_size=eng["max_num_seqs"],  # as nightshift's chunks: max_num_seqs rows
        # Each engine holds one "GPU" and one Ray CPU (the cores it computes on are set above).
        placement_group_config={"bundles": [{"CPU": 1, "GPU": 1}]},
        log_engine_metrics=False,
        runtime_env=runtime_env,
        **stage_args,
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


def run_path(
    spec: PathSpec, requests: Path, work: Path, ctx: dict[str, Any], env: dict[str, str]
) -> tuple[eb.Timed, dict, dict, list[str]]:
    """Run one path; also returns the log texts that hold its engines' core-id lines."""
    args, timeout = ctx["args"], ctx["timeout"]
    if spec.kind == "nightshift":
        flags = [
            "--num-engines",
            str(spec.layout.engines),
            "--cpus-per-engine",
            str(spec.layout.cores_per_engine),
        ]
        if not spec.routing:
            flags.append("--no-prefix-routing")
        timed, outputs, extra = eb.run_nightshift(
            requests, work, args, env, timeout, ctx["src"], extra_args=flags, name=spec.name
        )
        texts = fair.ray_session_texts(Path(extra["ray_session"]).parent.parent)
        return timed, outputs, extra, texts + [(work / f"{spec.name}.log").read_text(errors="replace")]
    if spec.kind == "ray-data-llm":
        timed, outputs, extra = run_ray_data_llm(requests, work, spec, ctx, env)
        texts = fair.ray_session_texts(Path(extra["ray_session"]).parent.parent)
        return timed, outputs, extra, texts + [(work / f"{spec.name}.log").read_text(errors="replace")]
    env = {**env, fair.OMP_BIND: fair.bind_string(ctx["cores"])}
    timed, outputs, extra = eb.run_run_batch(
        requests, work, ctx["model_dir"], ctx["model_name"], args, env, timeout, name=spec.name
    )
    return timed, outputs, extra, [(work / f"{spec.name}.log").read_text(errors="replace")]


def timed_run(
    workload: str, spec: PathSpec, requests: Path, work: Path, ctx: dict[str, Any]
) -> dict[str, Any]:
    busy, waited = eb.wait_for_idle(ctx["idle_threshold"], ctx["max_idle_wait"])
    if busy > ctx["idle_threshold"]:
        print(f"  WARNING: box {busy:.0%} busy before {spec.name} after waiting {waited:.0f} s", flush=True)
    trace_dir = work / f"trace-{spec.name}"
    env = fair.trace_env(ctx["env"], trace_dir)
    watcher = eb.LoadWatcher()
    watcher.start()
    try:
        timed, outputs, extra, texts = run_path(spec, requests, work, ctx, env)
    finally:
        load = watcher.stop()
    tokens = sum(o["tokens"] for o in outputs.values() if o["ok"])
    ok = sum(o["ok"] for o in outputs.values())
    traces = fair.read_traces(trace_dir)
    timing = fair.token_timing(traces, timed.started, timed.ended)
    beside = fair.cores_beside_compute(watcher, traces)
    cores = fair.bound_cores(texts)
    expected = spec.layout.expected(ctx["cores"])
    wrong = fair.check_cores(cores, expected)
    if wrong:
        print(f"  !!! CORES WRONG for {spec.name}: {wrong}", flush=True)
    return {
        "workload": workload,
        "path": spec.name,
        "layout": spec.layout.label,
        "wall_s": round(timed.wall_s, 2),
        "output_tokens": tokens,
        "rows_ok": ok,
        "tok_per_s": round(tokens / timed.wall_s, 2),
        **timing,
        # nightshift's own figure (vLLM's counters via its manifest), next to the token clock's for every path.
        "manifest_prefix_cache_hit_rate": extra.get("prefix_cache_hit_rate"),
        "engine_cores": cores,
        "expected_cores": expected,
        "cores_wrong": wrong,
        "cpu_busy_before": round(busy, 3),
        "waited_for_idle_s": round(waited, 1),
        "cores_used": round(timed.cores_used, 2),
        "foreign_cores": load["foreign_cores"],
        "foreign_top": load["foreign_top"],
        "own_cpu_s_by_process": load["own_cpu_s_by_process"],
        **beside,
        "steal_share": timed.steal_share,
        "extra": {k: v for k, v in extra.items() if k != "ray_session"},
    }


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 2) if values else None


def summarize(runs: list[dict], specs: list[PathSpec]) -> dict[str, Any]:
    table: dict[str, dict[str, dict]] = {}
    for workload in WORKLOADS:
        for spec in specs:
            mine = [r for r in runs if r["workload"] == workload and r["path"] == spec.name]
            if not mine:
                continue
            table.setdefault(workload, {})[spec.name] = {
                "kind": spec.kind,
                "layout": spec.layout.label,
                **{
                    k: _median(mine, k)
                    for k in (
                        "wall_s",
                        "tok_per_s",
                        "fixed_s",
                        "generation_s",
                        "steady_tok_per_s",
                        "tail_s",
                        "beside_compute_cores",
                    )
                },
                "output_tokens": mine[0]["output_tokens"],
                "rows_ok": min(r["rows_ok"] for r in mine),
                "foreign_cores": max(r["foreign_cores"] for r in mine),
                "prefix_cache_hit_rate": mine[0].get("prefix_cache_hit_rate"),
                "engine_cores": mine[0]["engine_cores"],
                "cores_wrong": next((r["cores_wrong"] for r in mine if r["cores_wrong"]), None),
                "runs": len(mine),
            }
    # The targets, per nightshift path: steady-state >= 0.97x the best peer on the same cores, fixed cost
    # <= run-batch's + 5 s.
    checks: dict[str, dict[str, Any]] = {}
    for workload, rows in table.items():
        peers = {n: r for n, r in rows.items() if r["kind"] != "nightshift" and r["steady_tok_per_s"]}
        best = max(peers.items(), key=lambda kv: kv[1]["steady_tok_per_s"], default=None)
        run_batch = next((r for r in rows.values() if r["kind"] == "run-batch"), None)
        for name, row in rows.items():
            if row["kind"] != "nightshift":
                continue
            check: dict[str, Any] = {}
            if best and row["steady_tok_per_s"]:
                ratio = row["steady_tok_per_s"] / best[1]["steady_tok_per_s"]
                check["steady_vs_best_peer"] = {
                    "peer": best[0],
                    "ratio": round(ratio, 3),
                    "ok": ratio >= 0.97,
                }
            if workload == "p2" and best and row["steady_tok_per_s"]:
                ratio = row["steady_tok_per_s"] / best[1]["steady_tok_per_s"]
                check["p2_steady_vs_best_peer"] = {
                    "peer": best[0],
                    "ratio": round(ratio, 3),
                    "ok": ratio >= P2_TARGET,
                }
            if run_batch and run_batch["fixed_s"] is not None and row["fixed_s"] is not None:
                extra = row["fixed_s"] - run_batch["fixed_s"]
                check["fixed_minus_run_batch_s"] = {"value": round(extra, 2), "ok": extra <= 5.0}
            checks[f"{workload}: {name}"] = check
    return {"table": table, "checks": checks}


def format_summary(summary: dict[str, Any]) -> str:
    header = (
        f"{'workload':<8} {'path':<28} {'wall s':>7} {'tok/s':>7} {fair.timing_columns()} {'hit rate':>8} "
        f"{'foreign':>7} {'beside':>6}  engine cores"
    )
    lines = [header, "-" * len(header)]
    for workload, rows in summary["table"].items():
        for path, row in rows.items():
            cores = " ".join(str(c) for c in row["engine_cores"]) or "?"
            flag = f"  !!! CORES WRONG: {row['cores_wrong']}" if row["cores_wrong"] else ""
            lines.append(
                f"{workload:<8} {path:<28} {fair.fmt(row['wall_s']):>7} {fair.fmt(row['tok_per_s']):>7} "
                f"{fair.timing_cells(row)} {fair.fmt(row['prefix_cache_hit_rate'], '.3f'):>8} "
                f"{row['foreign_cores']:>7.2f} {fair.fmt(row.get('beside_compute_cores'), '.2f'):>6}  {cores}{flag}"
            )
    lines.append("")
    lines.append(
        "fixed = process start -> first output token; gen = first -> last token; steady = tokens / gen;"
    )
    lines.append("tail = last token -> exit (from each engine core's token clock: bench/README.md)")
    lines.append(
        "beside = cores the path's own processes used beside the engines' compute threads between first and last token"
    )
    lines.append("")
    for name, check in summary["checks"].items():
        parts = []
        if s := check.get("steady_vs_best_peer"):
            parts.append(f"steady {s['ratio']:.3f}x {s['peer']} ({'ok' if s['ok'] else 'BELOW 0.97x'})")
        if p2 := check.get("p2_steady_vs_best_peer"):
            verdict = "ok" if p2["ok"] else f"BELOW {P2_TARGET}x"
            parts.append(f"P2 target {P2_TARGET}x: {p2['ratio']:.3f}x {p2['peer']} ({verdict})")
        if f := check.get("fixed_minus_run_batch_s"):
            parts.append(f"fixed {f['value']:+.1f} s vs run-batch ({'ok' if f['ok'] else 'OVER +5 s'})")
        lines.append(f"{name:<40} " + "; ".join(parts))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None, names: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--prompts", type=int, default=8, help="distinct system prompts (default 8)")
    p.add_argument("--rows-per-prompt", type=int, default=256, help="rows per system prompt (default 256)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="engine max_num_seqs for all paths (default 64)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 prompts x 16 rows x 8 tokens, max_num_seqs 8, shared workload, no idle wait, no re-timing",
    )
    p.add_argument(
        "--prompt-words", type=int, default=360, help="words per system prompt (default 360, ~400 tokens)"
    )
    p.add_argument(
        "--kv-share",
        type=float,
        help="size every engine's KV cache (num_gpu_blocks_override) to hold this share of the prompts",
    )
    p.add_argument(
        "--p2",
        action="store_true",
        help=(
            "the prefix-heavy job: workload p2, {prompts} prompts of ~1,500 tokens x {rows_per_prompt} rows x "
            "{max_tokens} tokens, each engine's KV cache holding {kv_share:.0%} of the prompts (a flag given with "
            "it wins where it differs from its default)"
        )
        .format(**P2)
        .replace("%", "%%"),  # argparse %-formats help text: the share's literal % must reach it escaped
    )
    p.add_argument(
        "--workloads", default="shared,plain", help="comma-separated subset of " + ",".join(WORKLOADS)
    )
    p.add_argument(
        "--paths", default=",".join(names or []), help="comma-separated subset of " + ",".join(names or [])
    )
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
    ns = p.parse_args(argv)
    if ns.p2:
        # The preset's values where the command line left the default.
        defaults = {action.dest: action.default for action in p._actions}
        for name, value in P2.items():
            if getattr(ns, name) == defaults[name]:
                setattr(ns, name, value)
        if ns.workloads == defaults["workloads"]:
            ns.workloads = "p2"
    if ns.quick:
        # Enough chunks (max_num_seqs rows each) that every engine of a layout gets work and starts.
        ns.prompts, ns.rows_per_prompt, ns.max_tokens, ns.max_num_seqs = 2, 16, 8, 8
        if ns.workloads == "shared,plain":
            ns.workloads = "shared"
        ns.max_idle_wait, ns.foreign_retries = 0, 0
    return ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cores = fair.box_cores()
    specs = path_specs(cores)
    names = [s.name for s in specs]
    ns = parse_args(argv, names)
    if ns.raydata_worker:
        raydata_worker(ns.raydata_worker)
        return {}
    paths = [p for p in ns.paths.split(",") if p]
    workloads = [w for w in ns.workloads.split(",") if w]
    if unknown := (set(paths) - set(names)) | (set(workloads) - set(WORKLOADS)):
        raise SystemExit(f"unknown path(s) or workload(s): {sorted(unknown)}; paths here: {names}")
    from pipeline.models import resolve_model

    model = resolve_model(None)
    n = ns.prompts * ns.rows_per_prompt
    rows_of = {
        "shared": lambda: shared_prefix_requests(
            ns.prompts, ns.rows_per_prompt, ns.max_tokens, model.name, prompt_words=ns.prompt_words
        ),
        "p2": lambda: shared_prefix_requests(
            ns.prompts, ns.rows_per_prompt, ns.max_tokens, model.name, prompt_words=ns.prompt_words
        ),
        "plain": lambda: eb.make_requests(n, ns.max_tokens, model.name, ignore_eos=True),
    }
    requests_of = {workload: rows_of[workload]() for workload in workloads}
    blocks, tokens_per_prompt = None, None
    if ns.kv_share:
        sample = next(iter(requests_of.get("p2") or requests_of.get("shared") or []), None)
        if sample is None:
            raise SystemExit(
                "--kv-share sizes the cache by the shared prompts: run the shared or p2 workload"
            )
        tokens_per_prompt = prompt_tokens(str(model.path), sample)
        blocks = blocks_for_share(ns.prompts, ns.kv_share, tokens_per_prompt, ns.max_num_seqs)
        print(
            f"KV cache per engine: {blocks} blocks of {CPU_BLOCK_TOKENS} tokens ({blocks * CPU_BLOCK_TOKENS:,} "
            f"tokens) for {ns.kv_share:.0%} of {ns.prompts} prompts of {tokens_per_prompt} tokens",
            flush=True,
        )
    args = eb.EngineArgs(max_num_seqs=ns.max_num_seqs, num_gpu_blocks_override=blocks)
    # The nightshift timed is this tree's (or a committed revision's), never whatever `nightshift` is on PATH.
    src = eb.snapshot_source(ns.nightshift_rev, ns.out_dir.resolve() / "src") if ns.nightshift_rev else REPO
    ctx = {
        "args": args,
        "env": eb.bench_env(args),
        "cores": cores,
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
        eb.write_jsonl(requests, requests_of[workload])
        inputs[workload] = (requests, work)

    by_name = {s.name: s for s in specs}
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
                        run = timed_run(workload, by_name[path], requests, work, ctx)
                    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
                        print(f"  FAILED: {str(exc)[-3000:]}", flush=True)
                        failures.append({"workload": workload, "path": path, "error": str(exc)[-6000:]})
                        break
                    print(
                        f"  {run['wall_s']:.1f} s, {run['output_tokens']} tokens, {run['tok_per_s']:.1f} tok/s; "
                        f"fixed {fair.fmt(run.get('fixed_s'))} s, steady {fair.fmt(run.get('steady_tok_per_s'))} "
                        f"tok/s; rows ok {run['rows_ok']}/{n}, foreign {run['foreign_cores']:.2f} cores, "
                        f"hit rate {run.get('prefix_cache_hit_rate')}, cores {run['engine_cores']}",
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

    summary = summarize(runs, specs)
    summary.update(
        {
            "prompts": ns.prompts,
            "rows_per_prompt": ns.rows_per_prompt,
            "rows": n,
            "max_tokens": ns.max_tokens,
            "prompt_words": ns.prompt_words,
            "prompt_tokens": tokens_per_prompt,
            "kv_share": ns.kv_share,
            "box_cores": cores,
            "layouts": {s.name: s.layout.label for s in specs},
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
