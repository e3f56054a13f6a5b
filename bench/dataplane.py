"""Data-plane benchmark: nightshift with a zero-cost fake engine next to a Ray Data anchor and a bare pyarrow floor.

One run generates (once per size, cached; streamed to disk, so 10M rows need no more memory than 100k) an OpenAI
Batch JSONL file of N rows (~300 bytes a line: realistic chat bodies, custom_ids in a scrambled order) and a
Parquet copy (`body` as a JSON string), then times, one after the other on the same input (never concurrently — on
a small box they would time each other's contention):

  pyarrow-jsonl        pyarrow.json.read_json → sort by custom_id → sharded Parquet (zstd)      (the floor)
  raydata-rows         the anchor: ray.data.read_json → map_batches building one OpenAI Batch result line per row
                       in Python (fake chat response: id, choices, usage; json.dumps per row) → sort("custom_id")
                       → repartition(target_num_rows_per_block=rows_per_shard) → write_json, a file per block
  raydata-bare         the same without the per-row step: read_json → sort → write_json
  nightshift-jsonl     `python -m pipeline run IN.jsonl OUT --engine fake --no-progress ...`   (local → local)
  pyarrow-parquet      pyarrow.parquet.read_table → sort → sharded Parquet          (unless --skip-parquet)
  nightshift-parquet   nightshift with IN.parquet                                    (unless --skip-parquet)
  nightshift-table     a dataset job: a Parquet table (id, ~300 B of text, two more columns) with --template "{{ text }}"
  nightshift-table-lines  the same rows as Batch lines (Parquet), the requests the template makes   (unless --skip-table)

Every path runs as its own subprocess on the same cores (the anchor's ray.init gets num_cpus = the machine's cores,
what nightshift's local Ray gets). Measured: wall time (process start to exit), the peak RSS of the driver process
alone and of its whole process tree (Ray's workers and raylet included; psutil, polled every 20 ms), and the
driver's own CPU seconds: nightshift's manifest `driver.cpu_s` (from run_job's start), the anchor's
time.process_time() at its end (from process start, imports included; after ray.init in the JSON too).

Targets, for nightshift-jsonl: wall ≤ 1.3x raydata-rows; driver peak RSS ≤ 2 GiB (stated at 10M rows, checked at
every size); the first request reaches an engine within 15 s of the process's start at every size (fitting is on,
as by default: the engines stream on args fitted early to a sample of the input); wall per row at the largest size within 10% of the smallest (`--rows 1M,10M`); and, kept from before,
nightshift ≤ 3x the pyarrow floor; a dataset job ≤ 1.1x the same rows as Batch lines. Driver CPU seconds per million
rows is reported (it should not grow with rows).
The tables go to stdout, the raw numbers to OUT_DIR/dataplane.json.

    python bench/dataplane.py                          # 1M rows
    python bench/dataplane.py --rows 100k              # quicker
    python bench/dataplane.py --rows 1M,10M --skip-parquet   # the scaling target (10M: ~3 GB input, ~1 h)
    python bench/dataplane.py --profile                # + py-spy profile of the nightshift driver (JSONL)
    python bench/dataplane.py --table-only             # a dataset job against the same rows as Batch lines
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
from functools import partial
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


def _permutation(rows: int, seed: int) -> tuple[int, int]:
    """(a, c) of the bijection k -> (a*k + c) mod rows: request numbers in a scrambled order without a list of them
    in memory (10M rows must stream to disk)."""
    import math

    rng = random.Random(seed)
    a = max(1, int(rows * 0.6180339887)) | 1
    while math.gcd(a, rows) != 1:
        a += 2
    return a, rng.randrange(rows)


def request_numbers(rows: int, seed: int = 1):
    """Every number in range(rows) exactly once, in a scrambled order, one at a time."""
    a, c = _permutation(rows, seed)
    return ((a * k + c) % rows for k in range(rows))


def generate(work: Path, rows: int, seed: int = 1, parquet: bool = True) -> tuple[Path, Path | None]:
    """requests-N.jsonl (and, if asked, a Parquet copy) with `rows` requests; reused when already there.

    Streams: one line at a time to the JSONL file and batches of 100k rows to the Parquet writer, so memory stays
    flat at any size."""
    jsonl = work / f"requests-{rows}.jsonl"
    parquet_path = work / f"requests-{rows}.parquet"
    if jsonl.exists() and (parquet_path.exists() or not parquet):
        return jsonl, parquet_path if parquet else None
    import pyarrow as pa
    import pyarrow.parquet as pq

    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    width = max(7, len(str(rows - 1)))
    t0 = time.monotonic()
    batch: dict[str, list] = {"custom_id": [], "method": [], "url": [], "body": []}
    schema = pa.schema([(name, pa.string()) for name in batch])
    tmp_jsonl = jsonl.with_suffix(".tmp")
    tmp_parquet = Path(str(parquet_path) + ".tmp")
    writer = pq.ParquetWriter(str(tmp_parquet), schema, compression="zstd") if parquet else None
    try:
        with open(tmp_jsonl, "w", encoding="utf-8", buffering=1 << 20) as out:
            for n in request_numbers(rows, seed):
                custom_id = f"req-{n:0{width}d}-{rng.getrandbits(24):06x}"
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
                line = json.dumps(
                    {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body},
                    ensure_ascii=False,
                )
                out.write(line + "\n")
                if writer is None:
                    continue
                batch["custom_id"].append(custom_id)
                batch["method"].append("POST")
                batch["url"].append("/v1/chat/completions")
                batch["body"].append(json.dumps(body, ensure_ascii=False))
                if len(batch["custom_id"]) >= 100_000:
                    writer.write_table(pa.table(batch, schema=schema))
                    batch = {k: [] for k in batch}
        if writer is not None and batch["custom_id"]:
            writer.write_table(pa.table(batch, schema=schema))
    finally:
        if writer is not None:
            writer.close()
    tmp_jsonl.rename(jsonl)
    if writer is not None:
        tmp_parquet.rename(parquet_path)
    size = jsonl.stat().st_size
    print(
        f"generated {rows} rows in {time.monotonic() - t0:.1f} s: {jsonl} ({size / 1e6:.0f} MB, "
        f"{size / rows:.0f} B/row)"
        + (f", {parquet_path} ({parquet_path.stat().st_size / 1e6:.0f} MB)" if parquet else ""),
        flush=True,
    )
    return jsonl, parquet_path if parquet else None


TABLE_TEMPLATE = "{{ text }}"
TABLE_MAX_TOKENS = 32


def generate_table(work: Path, rows: int, seed: int = 2) -> tuple[Path, Path]:
    """A dataset job's input and the same rows as Batch lines, both Parquet, reused when already there:
    table-N.parquet (`id` in a scrambled order, `text` of ~300 bytes, `topic`, `stars`) and table-N-lines.parquet
    (`custom_id` = the id, `body` = the request the template makes of the row: its text as the user message, the
    same max_tokens). Streams 100k rows at a time."""
    table_path, lines_path = work / f"table-{rows}.parquet", work / f"table-{rows}-lines.parquet"
    if table_path.exists() and lines_path.exists():
        return table_path, lines_path
    import pyarrow as pa
    import pyarrow.parquet as pq

    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    table_schema = pa.schema(
        [("id", pa.int64()), ("text", pa.string()), ("topic", pa.string()), ("stars", pa.int64())]
    )
    lines_schema = pa.schema([(name, pa.string()) for name in ("custom_id", "method", "url", "body")])
    width = max(7, len(str(rows - 1)))
    tmp_table, tmp_lines = Path(f"{table_path}.tmp"), Path(f"{lines_path}.tmp")
    t0 = time.monotonic()
    with (
        pq.ParquetWriter(tmp_table, table_schema, compression="zstd") as tables,
        pq.ParquetWriter(tmp_lines, lines_schema, compression="zstd") as lines,
    ):
        batch: dict[str, list] = {name: [] for name in table_schema.names}
        for n in request_numbers(rows, seed):
            topic = rng.choice(_TOPICS)
            text = " ".join(rng.choice(_TEMPLATES).format(t=rng.choice(_TOPICS)) for _ in range(10))[:300]
            for name, value in zip(table_schema.names, (n, text, topic, rng.randint(1, 5)), strict=True):
                batch[name].append(value)
            if len(batch["id"]) >= 100_000:
                _write_table_batch(tables, lines, batch, table_schema, lines_schema, width)
        if batch["id"]:
            _write_table_batch(tables, lines, batch, table_schema, lines_schema, width)
    tmp_table.rename(table_path)
    tmp_lines.rename(lines_path)
    print(f"generated a table of {rows} rows in {time.monotonic() - t0:.1f} s: {table_path}", flush=True)
    return table_path, lines_path


def _write_table_batch(tables, lines, batch, table_schema, lines_schema, width) -> None:
    import pyarrow as pa

    tables.write_table(pa.table(batch, schema=table_schema))
    bodies = [
        json.dumps(
            {"messages": [{"role": "user", "content": text}], "max_tokens": TABLE_MAX_TOKENS},
            ensure_ascii=False,
        )
        for text in batch["text"]
    ]
    count = len(bodies)
    # The id a dataset job gives an integer id (pipeline/datasets/render.sortable_id): both runs sort alike.
    ids = [f"#{value + (1 << 63):016x}" for value in batch["id"]]
    lines.write_table(
        pa.table(
            {
                "custom_id": ids,
                "method": ["POST"] * count,
                "url": ["/v1/chat/completions"] * count,
                "body": bodies,
            },
            schema=lines_schema,
        )
    )
    for values in batch.values():
        values.clear()


# -- measurement ------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    wall_s: float = 0.0
    rows: int = 0
    peak_driver_rss: int = 0
    peak_tree_rss: int = 0
    driver_cpu_s: float | None = None  # the driver process's own CPU seconds (all its threads)
    exit_code: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    notes: str = ""
    started_at: float = 0.0  # epoch seconds the process was started (what `first_request_s` counts from)

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
    run.started_at = time.time()
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
    name: str,
    input_path: Path,
    out: Path,
    rows_per_shard: int,
    config: Path,
    log: Path,
    extra: tuple[str, ...] = (),
) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "pipeline", "run", str(input_path), str(out),
        "--engine", "fake", "--no-progress", "--log-format", "json",
        "--rows-per-shard", str(rows_per_shard), "--config", str(config), *extra,
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
    run.driver_cpu_s = (manifest.get("driver") or {}).get("cpu_s")
    run.phases = _phases(log, manifest)
    # The first request an engine took, from the process's start: with fitting on, whether the engines wait for
    # the whole input to be read and fitted, or take requests while it is read (the early fit).
    firsts = [
        e["first_request_at"] for e in manifest["engine"]["per_engine"].values() if e.get("first_request_at")
    ]
    if firsts:
        run.phases["first_request_s"] = round(min(firsts) - run.started_at, 2)
    early = (manifest["engine"].get("fitted") or {}).get("early")
    if early:
        run.phases["early_fit_rows_held"] = early["rows_held"]
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


# -- the Ray Data anchor ----------------------------------------------------------------------------------------------

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
_WORD_OF_BYTE = [_WORDS[byte % len(_WORDS)] for byte in range(256)]


def response_line(row: dict[str, Any], created: int = 1_700_000_000) -> str:
    """One OpenAI Batch result line for a request row, built the way the fake engine and the result record build
    theirs: prompt text, `max_tokens` words of text seeded by the prompt's digest, usage, the batch envelope."""
    import hashlib

    body = row["body"]
    prompt = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in body.get("messages") or ())
    prompt_tokens = max(1, len(prompt.split()))
    completion_tokens = int(body.get("max_tokens") or 16)
    cycle = [_WORD_OF_BYTE[b] for b in hashlib.sha256(prompt.encode()).digest()]
    text = " ".join((cycle * (completion_tokens // len(cycle) + 1))[:completion_tokens])
    custom_id = row["custom_id"]
    digest = hashlib.sha256(custom_id.encode()).hexdigest()
    response = {
        "id": f"chatcmpl-{digest[:24]}",
        "object": "chat.completion",
        "created": created,
        "model": body.get("model"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    record = {
        "id": f"batch_req_{digest[24:48]}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"req_{digest[:32]}", "body": response},
        "error": None,
    }
    return json.dumps(record, ensure_ascii=False)


def _respond(batch: Any) -> Any:
    import pyarrow as pa

    rows = batch.to_pylist()
    return pa.table({"custom_id": [r["custom_id"] for r in rows], "line": [response_line(r) for r in rows]})


def raydata_worker(input_path: str, out: str, rows_per_shard: int, per_row: bool, num_cpus: int) -> None:
    """The anchor: Ray Data read_json → (map_batches: one response line per row, in Python) → sort → write_json."""
    import logging

    import ray
    from ray.data import DataContext

    t0 = time.monotonic()
    # "local": a private instance, never an existing cluster on this box (as nightshift does).
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    t_init = time.monotonic()
    cpu_ready = time.process_time()
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.enable_auto_log_stats = False
    shutil.rmtree(out, ignore_errors=True)
    # Ray's default JSON reader (pyarrow's, which reads JSON Lines); `lines=True` would switch to pandas' reader,
    # several times slower. Ray splits the one file's blocks so the per-row step runs on every core.
    ds = ray.data.read_json(input_path)
    if per_row:
        ds = ds.map_batches(_respond, batch_format="pyarrow")
    # A single input file sorts in one partition, which would be written as one file by one task: split the sorted
    # rows into blocks of rows_per_shard (streaming), one file each, written in parallel.
    ds = ds.sort("custom_id").repartition(target_num_rows_per_block=rows_per_shard)
    ds.write_json(out)
    t_done = time.monotonic()
    ray.shutdown()
    print(
        json.dumps(
            {
                "ray_init_s": round(t_init - t0, 2),
                "pipeline_s": round(t_done - t_init, 2),
                "driver_cpu_s": round(time.process_time(), 3),
                "driver_cpu_after_init_s": round(time.process_time() - cpu_ready, 3),
            }
        ),
        flush=True,
    )


def count_lines(out: Path) -> tuple[int, int]:
    """(lines, files) of the JSON files a path wrote."""
    lines = files = 0
    for path in sorted(out.rglob("*.json*")):
        files += 1
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 24):
                lines += chunk.count(b"\n")
    return lines, files


def run_raydata(name: str, input_path: Path, out: Path, rows_per_shard: int, per_row: bool, cpus: int) -> Run:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-raydata", str(input_path), str(out)]
    cmd += ["--rows-per-shard", str(rows_per_shard), "--worker-cpus", str(cpus)]
    cmd += ["--worker-per-row"] if per_row else []
    run, output = _measure(cmd)
    run.name = name
    if run.exit_code:
        run.notes = f"failed (exit {run.exit_code})"
        print(output[-3000:], file=sys.stderr)
        return run
    stats = json.loads([line for line in output.splitlines() if line.startswith("{")][-1])
    run.driver_cpu_s = stats.pop("driver_cpu_s")
    run.rows, files = count_lines(out)
    run.phases = stats | {"files": files}
    _ray_leftovers()
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

WALL_VS_ANCHOR = 1.3  # nightshift-jsonl wall / raydata-rows wall
TABLE_VS_LINES = 1.1  # a dataset job's wall / the same rows as Batch lines
WALL_VS_PYARROW = 3.0
DRIVER_RSS_LIMIT = 2 * GIB  # the target is stated at 10M rows; it is checked at every size
SCALING_TOLERANCE = 0.10  # wall per row at the largest size vs the smallest
FIRST_REQUEST_S = (
    15.0  # from the process start to the first request an engine takes (fitting on), at every size
)


def parse_rows(text: str) -> list[int]:
    """'1M,10M' / '100k' / '1000000' -> row counts."""
    sizes = []
    for part in text.replace("_", "").split(","):
        part = part.strip().lower()
        scale = {"k": 1_000, "m": 1_000_000}.get(part[-1:], 1)
        sizes.append(int(float(part.rstrip("km")) * scale))
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"bad --rows {text!r}")
    return sizes


def _size(rows: int) -> str:
    return f"{rows / 1e6:g}M" if rows >= 1_000_000 else f"{rows / 1e3:g}k"


def targets(runs_by_size: dict[int, list[Run]]) -> list[dict[str, Any]]:
    """The checks, one dict each: what, value, limit, verdict (PASS / FAIL / None for figures without a target)."""
    checks: list[dict[str, Any]] = []

    def check(what: str, value: str, limit: str, ok: bool | None) -> None:
        checks.append({"target": what, "value": value, "limit": limit, "verdict": _verdict(ok)})

    for rows, runs in runs_by_size.items():
        by_name = {run.name: run for run in runs}
        anchor = by_name.get("raydata-rows")
        for run in runs:
            if not run.name.startswith("nightshift"):
                continue
            label = f"{run.name} @{_size(rows)}"
            if run.exit_code:
                check(f"{label} completed", run.notes, "exit 0", False)
                continue
            if run.driver_cpu_s is not None:
                per_m = run.driver_cpu_s / (rows / 1e6)
                check(f"{label} driver CPU s per M rows", f"{per_m:.1f} s", "-", None)
            if run.name == "nightshift-jsonl" and anchor and not anchor.exit_code:
                ratio = run.wall_s / anchor.wall_s
                check(
                    f"{label} wall / raydata-rows",
                    f"{ratio:.2f}x",
                    f"<= {WALL_VS_ANCHOR}x",
                    ratio <= WALL_VS_ANCHOR,
                )
            floor = by_name.get("pyarrow-" + run.name.split("-", 1)[1])
            if floor and not floor.exit_code:
                ratio = run.wall_s / floor.wall_s
                check(
                    f"{label} wall / {floor.name}",
                    f"{ratio:.2f}x",
                    f"<= {WALL_VS_PYARROW}x",
                    ratio <= WALL_VS_PYARROW,
                )
            first = run.phases.get("first_request_s")
            check(
                f"{label} first request reaches an engine",
                f"{first:.1f} s" if first is not None else "n/a",
                f"<= {FIRST_REQUEST_S:.0f} s",
                first is not None and first <= FIRST_REQUEST_S,
            )
            check(
                f"{label} driver peak RSS",
                f"{run.peak_driver_rss / GIB:.2f} GiB",
                "<= 2 GiB (at 10M)",
                run.peak_driver_rss <= DRIVER_RSS_LIMIT,
            )
    for rows, runs in runs_by_size.items():
        by_name = {run.name: run for run in runs}
        table, lines = by_name.get("nightshift-table"), by_name.get("nightshift-table-lines")
        if table and lines and not table.exit_code and not lines.exit_code:
            ratio = table.wall_s / lines.wall_s
            check(
                f"nightshift-table @{_size(rows)} wall / the same rows as Batch lines",
                f"{ratio:.2f}x",
                f"<= {TABLE_VS_LINES}x",
                ratio <= TABLE_VS_LINES,
            )
    sizes = sorted(runs_by_size)
    if len(sizes) >= 2:
        small, large = sizes[0], sizes[-1]
        for name in ("nightshift-jsonl", "nightshift-parquet"):
            a = next((r for r in runs_by_size[small] if r.name == name and not r.exit_code), None)
            b = next((r for r in runs_by_size[large] if r.name == name and not r.exit_code), None)
            if a and b:
                change = (b.wall_s / large) / (a.wall_s / small) - 1
                check(
                    f"{name} wall per row @{_size(large)} vs @{_size(small)}",
                    f"{change:+.1%}",
                    f"<= +{SCALING_TOLERANCE:.0%}",
                    change <= SCALING_TOLERANCE,
                )
    else:
        check(
            "nightshift wall per row @10M vs @1M", "n/a (one size run)", f"<= +{SCALING_TOLERANCE:.0%}", None
        )
    return checks


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "FAIL")


def _table(runs: list[Run]) -> str:
    anchor = next((r for r in runs if r.name == "raydata-rows" and not r.exit_code), None)
    lines = [
        f"{'path':<20} {'rows':>9} {'wall s':>8} {'rows/s':>9} {'driver RSS':>10} {'tree RSS':>9} "
        f"{'driver CPU s':>12} {'CPU s/Mrow':>10} {'vs anchor':>9}",
    ]
    for run in runs:
        if run.exit_code:
            lines.append(f"{run.name:<20} {'FAILED':>9}  {run.notes}")
            continue
        cpu = f"{run.driver_cpu_s:.1f}" if run.driver_cpu_s is not None else "-"
        per_m = (
            f"{run.driver_cpu_s / (run.rows / 1e6):.1f}" if run.driver_cpu_s is not None and run.rows else "-"
        )
        ratio = f"{run.wall_s / anchor.wall_s:.2f}x" if anchor else "-"
        lines.append(
            f"{run.name:<20} {run.rows:>9} {run.wall_s:>8.1f} {run.rows_per_s:>9.0f} "
            f"{run.peak_driver_rss / GIB:>8.2f} G {run.peak_tree_rss / GIB:>7.2f} G {cpu:>12} {per_m:>10} {ratio:>9}"
        )
    return "\n".join(lines)


def _targets_table(checks: list[dict[str, Any]]) -> str:
    width = max(len(c["target"]) for c in checks)
    lines = [f"{'target':<{width}}  {'value':>20}  {'limit':>18}  verdict"]
    for c in checks:
        lines.append(f"{c['target']:<{width}}  {c['value']:>20}  {c['limit']:>18}  {c['verdict']}")
    return "\n".join(lines)


def run_size(
    args: argparse.Namespace,
    rows: int,
    jsonl: Path,
    parquet: Path | None,
    config: Path,
    load_by_run: dict[str, list[float]],
) -> list[Run]:
    """Every path on one input size, one after the other; each path's output is removed after it is timed."""
    plan: list[tuple[str, Path, Any]] = []
    kinds = (
        [] if args.table_only else [("jsonl", jsonl)] + ([] if parquet is None else [("parquet", parquet)])
    )
    for kind, path in kinds:
        out = args.work / f"out-pyarrow-{kind}"
        if not args.skip_floor:
            floor = partial(run_baseline, f"pyarrow-{kind}", path, out, args.rows_per_shard)
            plan.append((f"pyarrow-{kind}", out, floor))
        if kind == "jsonl" and not args.skip_anchor:
            for name, per_row in (("raydata-rows", True), ("raydata-bare", False)):
                out = args.work / f"out-{name}"
                start = partial(run_raydata, name, path, out, args.rows_per_shard, per_row, args.cpus)
                plan.append((name, out, start))
        out = args.work / f"out-nightshift-{kind}"
        log = args.out_dir / f"nightshift-{kind}-{rows}.log"
        start = partial(run_nightshift, f"nightshift-{kind}", path, out, args.rows_per_shard, config, log)
        plan.append((f"nightshift-{kind}", out, start))
    if not args.skip_table:
        table, lines = generate_table(args.work, rows)
        template = ("--template", TABLE_TEMPLATE, "--id-column", "id", "--max-tokens", str(TABLE_MAX_TOKENS))
        for name, path, extra in (
            ("nightshift-table", table, template),
            ("nightshift-table-lines", lines, ()),
        ):
            out = args.work / f"out-{name}"
            log = args.out_dir / f"{name}-{rows}.log"
            start = partial(run_nightshift, name, path, out, args.rows_per_shard, config, log, extra)
            plan.append((name, out, start))
    runs = []
    for name, out, start in plan:
        print(f"running {name} @{_size(rows)} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
        load_by_run[f"{name}@{rows}"] = [round(x, 2) for x in os.getloadavg()]
        runs.append(start())
        if not args.keep_outputs:
            shutil.rmtree(out, ignore_errors=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows",
        type=parse_rows,
        default=[1_000_000],
        help="row counts, e.g. 100k, 1M, 10M or 1M,10M (each runs)",
    )
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
    parser.add_argument(
        "--cpus",
        type=int,
        default=os.cpu_count(),
        help="CPUs the Ray Data anchor's ray.init gets (nightshift's local Ray gets the machine's cores)",
    )
    parser.add_argument("--skip-parquet", action="store_true")
    parser.add_argument("--skip-anchor", action="store_true", help="no Ray Data anchor runs")
    parser.add_argument("--skip-floor", action="store_true", help="no pyarrow floor runs")
    parser.add_argument(
        "--skip-table",
        action="store_true",
        help="no dataset-job runs (a table with a template, and its lines)",
    )
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="only the dataset-job runs (the table, and the same rows as lines)",
    )
    parser.add_argument(
        "--keep-outputs", action="store_true", help="keep every path's output (disk: ~1 GB/M rows)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also py-spy the nightshift driver (JSONL input)"
    )
    parser.add_argument("--worker-baseline", nargs=2, metavar=("INPUT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-raydata", nargs=2, metavar=("INPUT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-per-row", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-cpus", type=int, default=os.cpu_count(), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker_baseline:
        baseline_worker(*args.worker_baseline, args.rows_per_shard)
        return
    if args.worker_raydata:
        raydata_worker(*args.worker_raydata, args.rows_per_shard, args.worker_per_row, args.worker_cpus)
        return

    load = os.getloadavg()
    if load[0] > 1.0:
        print(
            f"warning: load average {load[0]:.1f}: other work on this box will distort the timings",
            flush=True,
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    config = args.work / "job.yaml"
    fake = {"output_tokens": 16, "prefill_seconds_per_token": 0.0, "decode_seconds_per_token": 0.0}
    job: dict[str, Any] = {"engine": {"fake": fake}}
    job["resources"] = {"num_engines": args.engines, "cpus_per_engine": 1}
    if args.rows_per_task:
        job["resources"]["rows_per_task"] = args.rows_per_task

    runs_by_size: dict[int, list[Run]] = {}
    load_by_run: dict[str, list[float]] = {}
    for rows in args.rows:
        jsonl, parquet = (
            (None, None) if args.table_only else generate(args.work, rows, parquet=not args.skip_parquet)
        )
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(job))  # JSON is YAML
        runs = runs_by_size[rows] = run_size(args, rows, jsonl, parquet, config, load_by_run)
        print()
        print(f"@{_size(rows)} rows")
        print(_table(runs))
        for run in runs:
            print(f"  {run.name}: {run.phases} {run.notes}")
        print(flush=True)

    checks = targets(runs_by_size)
    print(_targets_table(checks))
    load_end = [round(x, 2) for x in os.getloadavg()]
    print(f"load average (1/5/15 min): start {[round(x, 2) for x in load]}, end {load_end}")
    result = {
        "rows": args.rows,
        "rows_per_shard": args.rows_per_shard,
        "cpus": os.cpu_count(),
        "anchor_cpus": args.cpus,
        "load_average_at_start": [round(x, 2) for x in load],
        "load_average_at_end": load_end,
        "load_average_before_each_run": load_by_run,
        "nightshift_config": job,
        "runs": {
            str(rows): [asdict(r) | {"rows_per_s": round(r.rows_per_s, 1)} for r in runs]
            for rows, runs in runs_by_size.items()
        },
        "targets": checks,
    }
    (args.out_dir / "dataplane.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.out_dir / 'dataplane.json'}")
    if args.profile:
        rows = args.rows[-1]
        jsonl, _ = generate(args.work, rows, parquet=False)
        profile_nightshift(jsonl, args.work / "out-profile", args.rows_per_shard, config, args.out_dir)


if __name__ == "__main__":
    main()
