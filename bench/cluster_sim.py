"""Simulated cluster: many fake engines on several local Ray nodes; are they kept busy, and how long is the tail?

A LocalCluster (cluster/local.py: one real raylet per node on this machine) with --nodes nodes (the first is the
head, where the driver attaches), each offering --engines-per-node `engine_slot`s and --node-cpus logical CPUs.
One nightshift job (`run_job`, in this process) runs --rows chat requests on nodes x engines-per-node fake engines:
`cpus_per_engine: 0` and one `engine_slot` each, so they spread evenly over the nodes; they sleep under the fake
engine's token-time model, they do not compute, so 16 of them fit on 2 real cores. Each request sets its own
`max_tokens`, drawn from a lognormal (median --median-tokens, sigma --sigma) clipped to [16, 1024]: the spread of
output lengths a real batch has. The fake engine holds a request for prefill_s x prompt tokens + decode_s x
max_tokens, at most --max-concurrency at once per engine.

Measurement. The fake engine logs which requests it ran (`call_log`) but not when, so the bench adds a probe of its
own: a Ray `worker_process_setup_hook` (every worker process of the job runs it) that wraps
`FakeEngine.generate` and appends `start end` (wall clock) per request to `engine-<pid>.tsv`, plus the process's Ray
node id to `engine-<pid>.json`, in a probe directory. From those timelines:

  busy       per engine, the share of the time between its first request's start and its last request's end with
             at least one request inside the engine (target: every engine >= 95%)
  busy/span  per engine, its busy time over the whole generation span (no target: an engine that ran dry early
             scores low here, not in `busy`)
  occupancy  per engine over its own span, mean min(requests inside, max_concurrency) / max_concurrency: how full
             its continuous batch was (no target; 100% is a batch that never had a free slot)
  tail       the share of the generation span (first request start -> last request end) taken by the last 5% of
             rows to finish (target: <= 5%; the job-wall share is reported too)
  packing    the ideal span, sum of request costs / (engines x max_concurrency), over the measured span

It also prints whatever the manifest says about placement (any key with "placement" or "node" in it; nothing if
absent) and where the probe saw each engine run. The raw numbers go to OUT_DIR/cluster_sim.json.

    python bench/cluster_sim.py                      # 4 nodes x 4 engines, 200,000 requests (a few minutes)
    python bench/cluster_sim.py --rows 20000         # quicker
    python bench/cluster_sim.py --rows-per-task 256  # chunk size given instead of the pipeline's default
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
MODEL_NAME = "smollm2-135m-instruct"
MIN_TOKENS, MAX_TOKENS = 16, 1024
BUSY_TARGET = 0.95
TAIL_ROWS = 0.05
TAIL_TARGET = 0.05
PROBE_ENV = "NSBENCH_PROBE_DIR"

_TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "compound interest", "plate tectonics",
    "the immune system", "machine learning", "the water cycle", "inflation", "the Roman Empire",
)  # fmt: skip
_TEMPLATES = (
    "What is {t}? Answer briefly.",
    "Write a short essay about {t}.",
    "Explain {t} step by step to a high-school student.",
    "Give me three surprising facts about {t}.",
)


# -- workload ---------------------------------------------------------------------------------------------------------


def output_lengths(rows: int, median: float, sigma: float, seed: int = 1) -> list[int]:
    """max_tokens per request: lognormal around `median`, clipped to [MIN_TOKENS, MAX_TOKENS]."""
    rng = random.Random(seed)
    mu = math.log(median)
    return [min(MAX_TOKENS, max(MIN_TOKENS, round(rng.lognormvariate(mu, sigma)))) for _ in range(rows)]


def generate(path: Path, lengths: list[int], seed: int = 1) -> None:
    rng = random.Random(seed + 1)
    with open(path, "w", encoding="utf-8", buffering=1 << 20) as out:
        for n, max_tokens in enumerate(lengths):
            body = {
                "model": MODEL_NAME,
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": rng.choice(_TEMPLATES).format(t=rng.choice(_TOPICS))},
                ],
                "max_tokens": max_tokens,
            }
            line = {
                "custom_id": f"req-{n:07d}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body,
            }
            out.write(json.dumps(line) + "\n")


# -- the probe (runs in every worker process of the job) ---------------------------------------------------------------


def install_probe() -> None:
    """Wrap FakeEngine.generate to log `start end` per request, per process. Never disturbs the engine."""
    probe_dir = os.environ.get(PROBE_ENV)
    if not probe_dir:
        return
    try:
        from pipeline.engines import fake
    except Exception:  # noqa: BLE001 - a process that cannot import the pipeline runs no engine
        return
    if getattr(fake.FakeEngine.generate, "_nsbench_probe", False):
        return
    original = fake.FakeEngine.generate
    pid = os.getpid()
    lines: list[str] = []
    state = {"inside": 0, "described": False}

    def flush() -> None:
        if lines:
            with open(os.path.join(probe_dir, f"engine-{pid}.tsv"), "a") as fh:
                fh.write("".join(lines))
            lines.clear()

    def describe(engine: Any) -> None:
        state["described"] = True
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001
            node_id = None
        facts = {"pid": pid, "node_id": node_id, "max_num_seqs": getattr(engine, "max_num_seqs", None)}
        with open(os.path.join(probe_dir, f"engine-{pid}.json"), "w") as fh:
            json.dump(facts, fh)

    async def generate(self: Any, request: Any) -> Any:
        if not state["described"]:
            describe(self)
        start = time.time()
        state["inside"] += 1
        try:
            return await original(self, request)
        finally:
            state["inside"] -= 1
            lines.append(f"{start:.6f}\t{time.time():.6f}\n")
            # At every idle moment (so the last request is on disk when the engine runs dry) or every 2,000 rows.
            if state["inside"] == 0 or len(lines) >= 2000:
                flush()

    generate._nsbench_probe = True  # type: ignore[attr-defined]
    fake.FakeEngine.generate = generate


def read_probe(probe_dir: Path) -> dict[int, dict[str, Any]]:
    """pid -> {"intervals": [(start, end)], "node_id", "max_num_seqs"}."""
    engines: dict[int, dict[str, Any]] = {}
    for tsv in sorted(probe_dir.glob("engine-*.tsv")):
        pid = int(tsv.stem.split("-")[1])
        intervals = []
        for line in tsv.read_text().splitlines():
            start, end = line.split("\t")
            intervals.append((float(start), float(end)))
        facts_path = tsv.with_suffix(".json")
        facts = json.loads(facts_path.read_text()) if facts_path.exists() else {}
        engines[pid] = {"intervals": intervals, **facts}
    return engines


# -- analysis (pure) ---------------------------------------------------------------------------------------------------


def busy_fraction(intervals: list[tuple[float, float]]) -> float:
    """Share of [first start, last end] covered by at least one interval."""
    if not intervals:
        return 0.0
    spans = sorted(intervals)
    first, last = spans[0][0], max(end for _, end in spans)
    if last <= first:
        return 1.0
    covered = 0.0
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            covered += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    covered += cur_end - cur_start
    return covered / (last - first)


def longest_idle(intervals: list[tuple[float, float]]) -> float:
    """The longest stretch with nothing inside, between the first start and the last end."""
    gap = 0.0
    reach = None
    for start, end in sorted(intervals):
        if reach is not None and start > reach:
            gap = max(gap, start - reach)
        reach = end if reach is None else max(reach, end)
    return gap


def occupancy(intervals: list[tuple[float, float]], slots: int) -> float:
    """Time-weighted mean of min(inside, slots) / slots over [first start, last end]."""
    if not intervals or slots < 1:
        return 0.0
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    first, last = events[0][0], events[-1][0]
    if last <= first:
        return 1.0
    area = 0.0
    inside = 0
    prev = first
    for t, step in events:
        area += min(inside, slots) * (t - prev)
        inside += step
        prev = t
    return area / (slots * (last - first))


def tail_share(ends: list[float], begin: float, finish: float, last_rows: float = TAIL_ROWS) -> float:
    """Share of [begin, finish] after the moment (1 - last_rows) of the rows had finished."""
    if not ends or finish <= begin:
        return 0.0
    ordered = sorted(ends)
    k = max(0, math.ceil(len(ordered) * (1 - last_rows)) - 1)
    return (finish - ordered[k]) / (finish - begin)


def finished_by(ends: list[float], moments: list[float]) -> list[int]:
    ordered = sorted(ends)
    return [bisect.bisect_right(ordered, t) for t in moments]


def placement_entries(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every manifest entry whose key mentions placement or a node, with its path (not descending into them)."""
    found: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if "placement" in str(key).lower() or "node" in str(key).lower():
                found.append((where, item))
            else:
                found.extend(placement_entries(item, where))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found.extend(placement_entries(item, f"{path}[{i}]"))
    return found


# -- main -------------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from cluster.local import NodeSpec, mixed_cluster
    from pipeline.config import JobConfig
    from pipeline.runtime.job import run_job

    work: Path = args.work
    shutil.rmtree(work, ignore_errors=True)
    probe_dir = work / "probe"
    probe_dir.mkdir(parents=True)
    lengths = output_lengths(args.rows, args.median_tokens, args.sigma)
    requests = work / "requests.jsonl"
    generate(requests, lengths)
    engines = args.nodes * args.engines_per_node
    fake = {
        "decode_seconds_per_token": args.decode_s,
        "prefill_seconds_per_token": args.prefill_s,
        "max_concurrency": args.max_concurrency,
    }
    resources: dict[str, Any] = {
        "num_engines": engines,
        "cpus_per_engine": 0,
        "resources_per_engine": {"engine_slot": 1},
    }
    if args.rows_per_task:
        resources["rows_per_task"] = args.rows_per_task
    job = {
        "input": str(requests),
        "output": str(work / "out"),
        "engine": {"backend": "fake", "fake": fake},
        "resources": resources,
    }
    # Requests' cost under the time model (prompt tokens as the fake counts them: words of "role: content" lines).
    prompt_words = 2 + 1 + 6  # "system: ..." and "user: ..." lines of a few words; the prefill share is small
    costs = [args.prefill_s * prompt_words * 2 + args.decode_s * n for n in lengths]
    ideal_span = sum(costs) / (engines * args.max_concurrency)
    print(
        f"{args.rows} requests, max_tokens lognormal median {args.median_tokens} sigma {args.sigma} clipped to "
        f"[{MIN_TOKENS}, {MAX_TOKENS}]: mean {statistics.mean(lengths):.0f}, p50 {statistics.median(lengths):.0f}, "
        f"max {max(lengths)}; {sum(lengths) / 1e6:.1f}M output tokens",
        flush=True,
    )
    print(
        f"{args.nodes} nodes x {args.engines_per_node} fake engines, decode {args.decode_s * 1e3:g} ms/token, "
        f"{args.max_concurrency} at once per engine: ideal generation span {ideal_span:.0f} s; "
        f"longest request {max(costs):.1f} s",
        flush=True,
    )

    os.environ[PROBE_ENV] = str(probe_dir)
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    if ray.is_initialized():
        ray.shutdown()
    names = ["head"] + [f"node-{i}" for i in range(1, args.nodes)]
    specs = [
        NodeSpec(name=name, num_cpus=args.node_cpus, resources={"engine_slot": args.engines_per_node})
        for name in names
    ]
    load_before = [round(x, 2) for x in os.getloadavg()]
    with mixed_cluster(specs) as cluster:
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            runtime_env={
                "worker_process_setup_hook": install_probe,
                "env_vars": {PROBE_ENV: str(probe_dir)},
            },
        )
        try:
            config = JobConfig.model_validate(job)
            t0 = time.time()
            outcome = run_job(config, show_progress=False)
            t1 = time.time()
        finally:
            ray.shutdown()
        node_names = {node_id: name for name, node_id in cluster.node_ids.items()}
    load_after = [round(x, 2) for x in os.getloadavg()]
    manifest = outcome.manifest
    return analyse(
        args, read_probe(probe_dir), manifest, node_names, t0, t1, ideal_span, job, load_before, load_after
    )


def analyse(
    args: argparse.Namespace,
    probe: dict[int, dict[str, Any]],
    manifest: dict[str, Any],
    node_names: dict[str, str],
    t0: float,
    t1: float,
    ideal_span: float,
    job: dict[str, Any],
    load_before: list[float],
    load_after: list[float],
) -> dict[str, Any]:
    starts = [s for e in probe.values() for s, _ in e["intervals"]]
    ends = [end for e in probe.values() for _, end in e["intervals"]]
    gen_begin, gen_end = min(starts), max(ends)
    span = gen_end - gen_begin
    per_engine = []
    for pid, e in sorted(probe.items(), key=lambda kv: (node_names.get(kv[1].get("node_id"), "?"), kv[0])):
        iv = e["intervals"]
        first, last = min(s for s, _ in iv), max(x for _, x in iv)
        per_engine.append(
            {
                "pid": pid,
                "node": node_names.get(e.get("node_id"), e.get("node_id")),
                "requests": len(iv),
                "first_start_s": round(first - gen_begin, 2),
                "last_end_s": round(last - gen_begin, 2),
                "busy": round(busy_fraction(iv), 4),
                # Busy time over the whole generation span: an engine that ran dry early scores low here.
                "busy_of_span": round(busy_fraction(iv) * (last - first) / span, 4) if span else None,
                "occupancy": round(occupancy(iv, e.get("max_num_seqs") or args.max_concurrency), 4),
                "longest_idle_s": round(longest_idle(iv), 2),
            }
        )
    tail_gen = tail_share(ends, gen_begin, gen_end)
    ordered = sorted(ends)
    t95 = ordered[max(0, math.ceil(len(ordered) * (1 - TAIL_ROWS)) - 1)]
    result = {
        "config": {
            "nodes": args.nodes,
            "engines_per_node": args.engines_per_node,
            "node_cpus": args.node_cpus,
            "rows": args.rows,
            "median_tokens": args.median_tokens,
            "sigma": args.sigma,
            "decode_seconds_per_token": args.decode_s,
            "prefill_seconds_per_token": args.prefill_s,
            "max_concurrency": args.max_concurrency,
            "job": job,
        },
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "job_wall_s": round(t1 - t0, 2),
        "manifest_wall_time_s": manifest.get("wall_time_s"),
        "generation": {
            "begin_after_job_start_s": round(gen_begin - t0, 2),
            "span_s": round(span, 2),
            "after_last_request_s": round(t1 - gen_end, 2),
            "ideal_span_s": round(ideal_span, 2),
            "packing": round(ideal_span / span, 4) if span else None,
            "requests_seen": len(ends),
            "rows_95pct_done_at_s": round(t95 - gen_begin, 2),
            "rows_done_at_quarters": finished_by(
                ends, [gen_begin + span * q for q in (0.25, 0.5, 0.75, 0.95)]
            ),
        },
        "tail_share_of_generation": round(tail_gen, 4),
        "tail_share_of_job_wall": round((gen_end - t95) / (t1 - t0), 4),
        "engines": per_engine,
        "manifest_counts": manifest.get("counts"),
        "manifest_placement": [[where, value] for where, value in placement_entries(manifest)],
        "manifest_routing": manifest.get("routing"),
        "manifest_pools": manifest.get("pools"),
        "manifest_leases": (manifest.get("recovery") or {}).get("leases"),
    }
    busy = [e["busy"] for e in per_engine]
    result["targets"] = [
        {
            "target": f"every engine busy >= {BUSY_TARGET:.0%} (min over {len(busy)})",
            "value": f"{min(busy):.1%}" if busy else "-",
            "verdict": "PASS" if busy and min(busy) >= BUSY_TARGET else "FAIL",
        },
        {
            "target": f"last {TAIL_ROWS:.0%} of rows <= {TAIL_TARGET:.0%} of the generation span",
            "value": f"{tail_gen:.1%}",
            "verdict": "PASS" if tail_gen <= TAIL_TARGET else "FAIL",
        },
        {
            "target": f"expected engines: {args.nodes * args.engines_per_node}",
            "value": str(len(per_engine)),
            "verdict": "PASS" if len(per_engine) == args.nodes * args.engines_per_node else "FAIL",
        },
        {
            "target": f"requests seen by the probe: {args.rows}",
            "value": str(len(ends)),
            "verdict": "PASS" if len(ends) == args.rows else "FAIL",
        },
    ]
    return result


def report(result: dict[str, Any]) -> str:
    out = []
    gen = result["generation"]
    out.append(
        f"job wall {result['job_wall_s']:.1f} s; generation {gen['begin_after_job_start_s']:.1f} s after the job "
        f"started, span {gen['span_s']:.1f} s (ideal {gen['ideal_span_s']:.1f} s: packing {gen['packing']:.0%}), "
        f"{gen['after_last_request_s']:.1f} s from the last request to the job's end"
    )
    out.append(
        f"rows finished at 25/50/75/95% of the span: {gen['rows_done_at_quarters']}; 95% of rows done "
        f"{gen['rows_95pct_done_at_s']:.1f} s into the span"
    )
    out.append("")
    out.append(
        f"{'engine pid':>10} {'node':<8} {'requests':>8} {'first s':>8} {'last s':>8} {'busy':>7} "
        f"{'busy/span':>9} {'occupancy':>9} {'longest idle s':>14}"
    )
    for e in result["engines"]:
        out.append(
            f"{e['pid']:>10} {e['node']!s:<8} {e['requests']:>8} {e['first_start_s']:>8.1f} {e['last_end_s']:>8.1f} "
            f"{e['busy']:>7.1%} {e['busy_of_span']:>9.1%} {e['occupancy']:>9.1%} {e['longest_idle_s']:>14.2f}"
        )
    out.append("")
    width = max(len(t["target"]) for t in result["targets"])
    out.append(f"{'target':<{width}}  {'value':>8}  verdict")
    for t in result["targets"]:
        out.append(f"{t['target']:<{width}}  {t['value']:>8}  {t['verdict']}")
    out.append(f"(tail as a share of the whole job's wall time: {result['tail_share_of_job_wall']:.1%})")
    out.append("")
    placement = result["manifest_placement"]
    if placement:
        out.append("manifest, placement entries:")
        for where, value in placement:
            out.append(f"  {where}: {json.dumps(value, default=str)[:300]}")
    else:
        out.append("manifest: no placement entries (no key mentions placement or a node)")
    for key in ("manifest_routing", "manifest_pools"):
        if result.get(key):
            out.append(f"{key.removeprefix('manifest_')}: {json.dumps(result[key], default=str)[:600]}")
    out.append(
        f"load average (1/5/15 min): before {result['load_average_before']}, after {result['load_average_after']}"
    )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--engines-per-node", type=int, default=4)
    parser.add_argument(
        "--node-cpus", type=int, default=1, help="logical CPUs per node (ingest, finalize tasks)"
    )
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--median-tokens", type=float, default=128)
    parser.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of max_tokens")
    parser.add_argument("--decode-s", type=float, default=0.004, help="fake decode seconds per token")
    parser.add_argument("--prefill-s", type=float, default=0.0, help="fake prefill seconds per prompt token")
    parser.add_argument("--max-concurrency", type=int, default=64, help="sequences per fake engine at once")
    parser.add_argument("--rows-per-task", type=int, default=None, help="chunk size; default: the pipeline's")
    parser.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "nightshift-bench-cluster-sim"
    )
    parser.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results")
    args = parser.parse_args()

    load = os.getloadavg()[0]
    if load > 1.5:
        print(
            f"warning: load average {load:.1f}: other work on this box will distort the timelines", flush=True
        )
    result = run(args)
    print()
    print(report(result))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "cluster_sim.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"results: {path}")
    shutil.rmtree(args.work / "out", ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
