"""Ingest benchmark: read → validate → measure → stage of a large input, and the fit that follows, on local Ray.

Uses the data-plane benchmark's input (bench/dataplane.py: 1,000,000 OpenAI Batch lines, ~300 bytes each, generated
once and cached) and the fake engine's counter for measuring (`--engine vllm`: the embedded model's tokenizer).
Ray is started first and not timed; then, in this process (the driver):

  ingest_wall_s    wall time of runtime.ingest.ingest: scan, read tasks, duplicate buckets
  fit_wall_s       wall time of fit_job (it decides from the aggregate ingest measured)
  driver_cpu_s     time.process_time() of this process across both: what the driver itself spends
  read_tasks_cpu_s the CPU seconds the read tasks spent (on the workers)

Also printed: tasks per step and node, tokenizer loads (once per worker process, not per task), and what fitting
decided. `--serial` runs the same steps in this process without Ray, for comparison.

    python bench/ingest.py                      # 1M rows, JSONL
    python bench/ingest.py --rows 100000 --format parquet
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--engine", choices=("fake", "vllm"), default="fake")
    parser.add_argument(
        "--cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all)"
    )
    parser.add_argument("--serial", action="store_true", help="run every step in this process, without Ray")
    parser.add_argument("--range-mb", type=float, default=None, help="byte range size (default: 64 MiB)")
    parser.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "nightshift-bench-dataplane"
    )
    args = parser.parse_args()

    from bench.dataplane import generate
    from pipeline.config import JobConfig
    from pipeline.fit_record import decision_of
    from pipeline.io.readers import input_source
    from pipeline.io.staging import StagingArea
    from pipeline.job_plan import JobPlan
    from pipeline.runtime.ingest.fit import fit_job
    from pipeline.runtime.ingest.measure import measuring
    from pipeline.runtime.ingest.tasks import ingest
    from pipeline.state import JobInput, JobState

    jsonl, parquet = generate(args.work, args.rows)
    path = jsonl if args.format == "jsonl" else parquet
    out = args.work / "out-ingest"
    shutil.rmtree(out, ignore_errors=True)
    config = JobConfig.model_validate(
        {"input": str(path), "output": str(out), "engine": {"backend": args.engine}}
    )
    plan = JobPlan.of(config).resolve()
    model = plan.model
    if not args.serial:
        import ray

        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    staging = StagingArea(out)
    staging.create()
    source = input_source(str(path))

    t0, c0 = time.monotonic(), time.process_time()
    ranges = {"range_bytes": int(args.range_mb * (1 << 20))} if args.range_mb else {}
    report = ingest(source, model.name, staging, job_id="bench", measure=measuring(config, model), **ranges)
    t1 = time.monotonic()
    counts = JobInput(
        fingerprint=report.fingerprint, lines=report.lines, valid=report.valid, invalid=report.invalid
    )
    state = JobState(job_id="bench", config=config, input=counts, lengths=report.lengths, ingested=True)
    fit_job(plan, staging, state)
    decision = decision_of(state.fit)
    t2, c2 = time.monotonic(), time.process_time()
    print(
        json.dumps(
            {
                "rows": report.lines,
                "format": args.format,
                "engine": args.engine,
                "executor": "in-process" if args.serial else "ray",
                "ingest_wall_s": round(t1 - t0, 2),
                "fit_wall_s": round(t2 - t1, 2),
                "driver_cpu_s": round(c2 - c0, 2),
                "read_tasks_cpu_s": round(report.task_cpu_s, 2),
                "range_mib": round(report.range_bytes / (1 << 20), 1),
                "steps_s": {step: round(s, 2) for step, s in report.seconds.items()},
                "tasks_by_node": report.placement,
                "tokenizer_loads": report.tokenizer_loads,
                "measured": decision.measured.model_dump() if decision and decision.measured else None,
            },
            indent=2,
        )
    )
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
