"""Data-plane benchmark: nightshift with a zero-cost fake engine vs a bare pyarrow read → sort → write, same data.

One run generates (once, cached) a 1,000,000-row OpenAI Batch JSONL file (~300 bytes a line: realistic chat bodies,
shuffled custom_ids) and a Parquet copy (`body` as a JSON string), then times, one after the other (never
concurrently — on a small box they would time each other's contention):

  nightshift-jsonl     `python -m pipeline run IN.jsonl OUT --engine fake --no-progress ...`   (local → local)
  nightshift-parquet   the same with IN.parquet
  pyarrow-jsonl        pyarrow.json.read_json → sort by custom_id → sharded Parquet (zstd)      (the floor)
  pyarrow-parquet      pyarrow.parquet.read_table → sort → sharded Parquet

Each runs as its own subprocess; its peak RSS is polled (psutil, 20 ms) for the driver process alone and for its
whole process tree (Ray's workers and raylet included). Targets: nightshift ≤ 3x the pyarrow wall time, driver peak
RSS ≤ 2 GiB. The table and the raw numbers go to OUT_DIR/dataplane.json.

    python bench/dataplane.py                          # 1M rows
    python bench/dataplane.py --rows 100000            # quicker
    python bench/dataplane.py --profile                # + py-spy profile of the nightshift driver (JSONL)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
MODEL_NAME = "smollm2-135m-instruct"
GIB = 1 << 30

_TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "compound interest", "plate tectonics",
    "the immune system", "machine learning", "the water cycle", "inflation", "the Roman Empire",
    "volcanoes", "DNA", "electric cars", "the stock market", "climate change", "the printing press",
    "vaccines", "gravity", "the internet", "jazz music", "the Moon landing", "rainbows", "earthquakes",
)  # fmt: skip
_TEMPLATES = (
    "What is {t}? Answer briefly.",
    "Explain {t} in one sentence for a newsletter.",
    "Why is {t} important to a high-school student?",
    "Give me three surprising facts about {t}.",
    "How would you describe {t} to a curious child?",
    "What is a common misconception about {t}, and why?",
)
_SYSTEMS = ("You are a helpful assistant.", "You are a concise tutor.", "Answer in plain English.")


# -- data -------------------------------------------------------------------------------------------------------------


def generate(work: Path, rows: int, seed: int = 1) -> tuple[Path, Path]:
    """requests.jsonl and requests.parquet with `rows` requests; reused when already there."""
    jsonl = work / f"requests-{rows}.jsonl"
    parquet = work / f"requests-{rows}.parquet"
    if jsonl.exists() and parquet.exists():
        return jsonl, parquet
    import pyarrow as pa
    import pyarrow.parquet as pq

    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    numbers = list(range(rows))
    rng.shuffle(numbers)
    t0 = time.monotonic()
    batch: dict[str, list] = {"custom_id": [], "method": [], "url": [], "body": []}
    tmp_jsonl = jsonl.with_suffix(".tmp")
    with (
        open(tmp_jsonl, "w", encoding="utf-8") as out,
        pq.ParquetWriter(
            str(parquet) + ".tmp",
            pa.schema(
                [
                    ("custom_id", pa.string()),
                    ("method", pa.string()),
                    ("url", pa.string()),
                    ("body", pa.string()),
                ]
            ),
            compression="zstd",
        ) as writer,
    ):
        for n in numbers:
            custom_id = f"req-{n:07d}-{rng.getrandbits(24):06x}"
            topic = rng.choice(_TOPICS)
            body = {
                "model": MODEL_NAME,
                "messages": [
                    {"role": "system", "content": rng.choice(_SYSTEMS)},
                    {"role": "user", "content": rng.choice(_TEMPLATES).format(t=topic)},
                ],
                "max_tokens": rng.choice((16, 32, 64)),
                "temperature": rng.choice((0, 0.2, 0.7)),
            }
            body_text = json.dumps(body, ensure_ascii=False)
            line = json.dumps(
                {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body},
                ensure_ascii=False,
            )
            out.write(line + "\n")
            batch["custom_id"].append(custom_id)
            batch["method"].append("POST")
            batch["url"].append("/v1/chat/completions")
            batch["body"].append(body_text)
            if len(batch["custom_id"]) >= 100_000:
                writer.write_table(pa.table(batch))
                batch = {k: [] for k in batch}
        if batch["custom_id"]:
            writer.write_table(pa.table(batch))
    tmp_jsonl.rename(jsonl)
    Path(str(parquet) + ".tmp").rename(parquet)
    size = jsonl.stat().st_size
    print(
        f"generated {rows} rows in {time.monotonic() - t0:.1f} s: {jsonl} ({size / 1e6:.0f} MB, "
        f"{size / rows:.0f} B/row), {parquet} ({parquet.stat().st_size / 1e6:.0f} MB)",
        flush=True,
    )
    return jsonl, parquet


# -- measurement ------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    wall_s: float = 0.0
    rows: int = 0
    peak_driver_rss: int = 0
    peak_tree_rss: int = 0
    exit_code: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    notes: str = ""

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall_s if self.wall_s else 0.0


def _measure(
    cmd: list[str], env: dict[str, str] | None = None, log_path: Path | None = None
) -> tuple[Run, str]:
    """Run `cmd`, polling its RSS (driver alone, and the whole tree); returns the run and its stderr."""
    import psutil

    run = Run(" ".join(cmd[:3]))
    stderr_path = log_path or Path(tempfile.mkstemp(suffix=".log")[1])
    t0 = time.monotonic()
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO, text=True)
        ps = psutil.Process(proc.pid)
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                try:
                    driver = ps.memory_info().rss
                    tree = driver
                    for child in ps.children(recursive=True):
                        try:
                            tree += child.memory_info().rss
                        except psutil.Error:
                            pass
                    run.peak_driver_rss = max(run.peak_driver_rss, driver)
                    run.peak_tree_rss = max(run.peak_tree_rss, tree)
                except psutil.Error:
                    pass
                stop.wait(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        stdout, _ = proc.communicate()
        run.wall_s = time.monotonic() - t0
        stop.set()
        poller.join()
    run.exit_code = proc.returncode
    return run, stdout + Path(stderr_path).read_text()


def _ray_leftovers() -> None:
    # Every nightshift run starts (and stops) its own private Ray; make sure none lingers between runs.
    time.sleep(2)


def run_nightshift(
    name: str, input_path: Path, out: Path, rows_per_shard: int, config: Path, log: Path
) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "pipeline", "run", str(input_path), str(out),
        "--engine", "fake", "--no-progress", "--log-format", "json",
        "--rows-per-shard", str(rows_per_shard), "--config", str(config),
    ]  # fmt: skip
    run, output = _measure(cmd, log_path=log)
    run.name = name
    manifest_path = out / "manifest.json"
    if run.exit_code or not manifest_path.exists():
        run.notes = f"failed (exit {run.exit_code}); see {log}"
        print(output[-3000:], file=sys.stderr)
        return run
    manifest = json.loads(manifest_path.read_text())
    run.rows = manifest["counts"]["total"]
    run.phases = _phases(log, manifest)
    _ray_leftovers()
    return run


def _phases(log: Path, manifest: dict[str, Any]) -> dict[str, float]:
    """Seconds from the job's start to each logged milestone (JSON logs), plus the manifest's wall time."""
    import datetime as dt

    start = dt.datetime.fromisoformat(manifest["created_at"])
    phases: dict[str, float] = {}
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "input validated" and "timestamp" in event:
            stamp = dt.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
            phases["ingest_done_s"] = round((stamp - start).total_seconds(), 2)
    phases["job_wall_s"] = manifest["wall_time_s"]
    return phases


def baseline_worker(input_path: str, out: str, rows_per_shard: int) -> None:
    """The floor: read everything, sort by custom_id, write range-partitioned Parquet shards. No validation."""
    import pyarrow.compute as pc
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    t0 = time.monotonic()
    if input_path.endswith(".parquet"):
        table = pq.read_table(input_path)
    else:
        table = pj.read_json(input_path, read_options=pj.ReadOptions(block_size=16 << 20))
    t_read = time.monotonic()
    table = table.take(pc.sort_indices(table, sort_keys=[("custom_id", "ascending")]))
    t_sort = time.monotonic()
    out_dir = Path(out)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    count = max(1, -(-table.num_rows // rows_per_shard))
    for k in range(count):
        pq.write_table(
            table.slice(k * rows_per_shard, rows_per_shard),
            out_dir / f"results-{k:05d}-of-{count:05d}.parquet",
            compression="zstd",
        )
    t_write = time.monotonic()
    print(
        json.dumps(
            {
                "rows": table.num_rows,
                "read_s": round(t_read - t0, 2),
                "sort_s": round(t_sort - t_read, 2),
                "write_s": round(t_write - t_sort, 2),
            }
        )
    )


def run_baseline(name: str, input_path: Path, out: Path, rows_per_shard: int) -> Run:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-baseline", str(input_path), str(out)]
    cmd += ["--rows-per-shard", str(rows_per_shard)]
    run, output = _measure(cmd)
    run.name = name
    if run.exit_code:
        run.notes = f"failed (exit {run.exit_code})"
        print(output[-3000:], file=sys.stderr)
        return run
    stats = json.loads([line for line in output.splitlines() if line.startswith("{")][0])
    run.rows = stats.pop("rows")
    run.phases = stats
    return run


# -- profiling --------------------------------------------------------------------------------------------------------


def profile_nightshift(input_path: Path, out: Path, rows_per_shard: int, config: Path, work: Path) -> Path:
    """py-spy the driver (JSONL run); writes collapsed stacks and prints where the driver's time goes."""
    raw = work / "profile-driver.txt"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        "py-spy", "record", "--rate", "50", "--format", "raw", "--output", str(raw), "--",
        sys.executable, "-m", "pipeline", "run", str(input_path), str(out),
        "--engine", "fake", "--no-progress", "--rows-per-shard", str(rows_per_shard), "--config", str(config),
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _ray_leftovers()
    summarize_profile(raw)
    return raw


def summarize_profile(raw: Path, top: int = 25) -> None:
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [
            f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")"
            for f in stack.split(";")
        ]
        for frame in set(frames):
            inclusive[frame] += n
        own[frames[-1]] += n
    print(f"\nprofile of the nightshift driver: {total} samples at 50 Hz ({raw})")
    print("  inclusive (share of driver time in the function and what it calls):")
    for frame, n in inclusive.most_common(top):
        print(f"    {100 * n / total:5.1f}%  {frame}")
    print("  self:")
    for frame, n in own.most_common(15):
        print(f"    {100 * n / total:5.1f}%  {frame}")


# -- main -------------------------------------------------------------------------------------------------------------


def _table(runs: list[Run], base: dict[str, Run]) -> str:
    lines = [
        f"{'path':<20} {'rows':>9} {'wall s':>8} {'rows/s':>10} {'driver RSS':>11} {'tree RSS':>9} {'vs pyarrow':>10}",
    ]
    for run in runs:
        ref = base.get(run.name.split("-", 1)[1]) if run.name.startswith("nightshift") else None
        ratio = f"{run.wall_s / ref.wall_s:.1f}x" if ref and ref.wall_s else ""
        lines.append(
            f"{run.name:<20} {run.rows:>9} {run.wall_s:>8.1f} {run.rows_per_s:>10.0f} "
            f"{run.peak_driver_rss / GIB:>9.2f} G {run.peak_tree_rss / GIB:>7.2f} G {ratio:>10}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rows-per-shard", type=int, default=100_000)
    parser.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "nightshift-bench-dataplane"
    )
    parser.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results" / "dataplane")
    parser.add_argument(
        "--rows-per-task", type=int, default=None, help="resources.rows_per_task for nightshift"
    )
    parser.add_argument(
        "--engines",
        type=int,
        default=1,
        help="fake engine actors (1 CPU each); one per core is the natural setup",
    )
    parser.add_argument("--skip-parquet", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="also py-spy the nightshift driver (JSONL input)"
    )
    parser.add_argument("--worker-baseline", nargs=2, metavar=("INPUT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker_baseline:
        baseline_worker(*args.worker_baseline, args.rows_per_shard)
        return

    load = os.getloadavg()[0]
    if load > 1.0:
        print(
            f"warning: load average {load:.1f}: other work on this box will distort the timings", flush=True
        )
    jsonl, parquet = generate(args.work, args.rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    config = args.work / "job.yaml"
    fake = {"output_tokens": 16, "prefill_seconds_per_token": 0.0, "decode_seconds_per_token": 0.0}
    job: dict[str, Any] = {"engine": {"fake": fake}}
    job["resources"] = {"num_engines": args.engines, "cpus_per_engine": 1}
    if args.rows_per_task:
        job["resources"]["rows_per_task"] = args.rows_per_task
    config.write_text(json.dumps(job))  # JSON is YAML

    runs: list[Run] = []
    inputs = [("jsonl", jsonl)] + ([] if args.skip_parquet else [("parquet", parquet)])
    for kind, path in inputs:
        print(f"running pyarrow-{kind} ...", flush=True)
        runs.append(
            run_baseline(f"pyarrow-{kind}", path, args.work / f"out-pyarrow-{kind}", args.rows_per_shard)
        )
        print(f"running nightshift-{kind} ...", flush=True)
        log = args.out_dir / f"nightshift-{kind}.log"
        runs.append(
            run_nightshift(
                f"nightshift-{kind}",
                path,
                args.work / f"out-nightshift-{kind}",
                args.rows_per_shard,
                config,
                log,
            )
        )
    base = {run.name.split("-", 1)[1]: run for run in runs if run.name.startswith("pyarrow")}
    print()
    print(_table(runs, base))
    for run in runs:
        print(f"  {run.name}: {run.phases} {run.notes}")
    verdicts = {}
    for run in runs:
        if run.exit_code:
            verdicts[run.name] = {"failed": True}
        elif run.name.startswith("nightshift") and run.name.split("-", 1)[1] in base:
            ratio = run.wall_s / base[run.name.split("-", 1)[1]].wall_s
            verdicts[run.name] = {
                "ratio_vs_pyarrow": round(ratio, 2),
                "wall_within_3x": ratio <= 3.0,
                "driver_rss_within_2gib": run.peak_driver_rss <= 2 * GIB,
            }
    print(json.dumps(verdicts, indent=2))
    result = {
        "rows": args.rows,
        "rows_per_shard": args.rows_per_shard,
        "cpus": os.cpu_count(),
        "load_average_at_start": load,
        "nightshift_config": job,
        "runs": [asdict(r) | {"rows_per_s": round(r.rows_per_s, 1)} for r in runs],
        "verdicts": verdicts,
    }
    (args.out_dir / "dataplane.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.out_dir / 'dataplane.json'}")
    if args.profile:
        profile_nightshift(jsonl, args.work / "out-profile", args.rows_per_shard, config, args.out_dir)


if __name__ == "__main__":
    main()
