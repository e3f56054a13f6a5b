"""A KV-starved engine: preemptions and tok/s with a user's settings vs the settings `run` fits to the data.

Setup: the embedded model on the CPU engine with its KV cache cut to `--kv-blocks` blocks of 128 tokens (vLLM's
`num_gpu_blocks_override`; VLLM_CPU_KVCACHE_SPACE takes whole GiB only, and 1 GiB already holds 46,592 tokens).
N chats share a ~200-token system prompt and are each forced to generate `--max-tokens` tokens (ignore_eos,
temperature 0), so every run decodes the same number of tokens. Two runs, one after the other, each its own
`nightshift run` subprocess with the same engine and input:

  user      --max-num-seqs 256 --max-model-len 2048    what a user might type (given values win over fitting,
                                                       which warns that 256 is more than the KV cache holds)
  planned   (no flags)                                 max_model_len and max_num_seqs fitted by `run`

The table: max_model_len and max_num_seqs as the engine ran them, KV cache tokens, preemptions, peak KV usage, when
the "KV cache full" warning first appeared (seconds after the engines were ready), wall time, generation time (first
engine ready → job finished) and output tok/s over generation. Raw numbers: bench/results/kv_starved.json.

    python bench/kv_starved.py                       # 96 chats x 160 tokens, 60 blocks: a few minutes on 2 cores
    python bench/kv_starved.py --n 128 --max-tokens 192
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
MODEL_NAME = "smollm2-135m-instruct"

SYSTEM = (
    "You are a patient tutor for a class of curious high-school students. Answer every question in plain English, "
    "with short sentences and one concrete example drawn from everyday life. Avoid jargon; when a technical word "
    "is unavoidable, define it in the same sentence. Never use lists or headings: write one flowing paragraph. "
    "If a question is ambiguous, pick the most common reading and say which one you picked. Keep a friendly, "
    "encouraging tone, and end with a question that invites the student to think further about the topic. "
    "Be accurate: if you are not sure of a fact, say so instead of guessing, and suggest where to check it."
)
TOPICS = (
    "photosynthesis", "black holes", "compound interest", "plate tectonics", "the immune system", "inflation",
    "the water cycle", "volcanoes", "DNA", "gravity", "rainbows", "earthquakes", "vaccines", "the internet",
)  # fmt: skip


def write_input(path: Path, n: int, max_tokens: int) -> None:
    with path.open("w") as fh:
        for i in range(n):
            body = {
                "model": MODEL_NAME,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Question {i}: explain {TOPICS[i % len(TOPICS)]}."},
                ],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,  # vLLM's extension: decode exactly max_tokens, so both runs do the same work
            }
            line = {"custom_id": f"q-{i:04d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            fh.write(json.dumps(line) + "\n")


def write_config(path: Path, kv_blocks: int) -> None:
    path.write_text(
        "engine:\n"
        "  vllm:\n"
        "    cpu_kvcache_space_gib: 1\n"
        "    extra:\n"
        f"      num_gpu_blocks_override: {kv_blocks}\n"
    )


def run(name: str, flags: list[str], input_path: Path, config: Path, work: Path) -> dict:
    """One `nightshift run`, its stderr read live so the time of the first preemption warning is known."""
    output = work / f"out-{name}"
    cmd = [
        sys.executable, "-m", "pipeline", "run", str(input_path), str(output), "--config", str(config),
        "--no-progress", "--log-format", "json", *flags,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    warnings: list[tuple[float, str]] = []
    start_warnings: list[str] = []  # e.g. fitting's check of a given max_num_seqs
    progress: list[dict] = []

    def read_stderr() -> None:
        for line in proc.stderr:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if "KV cache full" in str(event.get("event", "")):
                warnings.append((time.time(), event["event"]))
            elif event.get("level") == "warning":
                start_warnings.append(event["event"])
            if event.get("event") == "progress":
                progress.append(event)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    stdout = proc.stdout.read()
    proc.wait()
    reader.join(timeout=10)
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"{name}: nightshift run failed ({proc.returncode}):\n{stdout}")
    manifest = json.loads((output / "manifest.json").read_text())
    engine = manifest["engine"]
    ready = (
        dt.datetime.fromisoformat(engine["first_ready_at"]).timestamp() if engine["first_ready_at"] else None
    )
    finished = dt.datetime.fromisoformat(manifest["finished_at"]).timestamp()
    generation = finished - ready if ready else None
    completion = manifest["tokens"]["completion"]
    return {
        "name": name,
        "flags": flags,
        "max_model_len": engine["args"]["max_model_len"],
        "max_num_seqs": engine["args"]["max_num_seqs"],
        "kv_cache_tokens": engine["args"].get("kv_cache_tokens"),
        "preemptions": manifest["preemptions"],
        "kv_cache_usage_peak": engine.get("kv_cache_usage_peak"),
        "prefix_cache_hit_rate": manifest.get("prefix_cache_hit_rate"),
        "warning_after_ready_s": round(warnings[0][0] - ready, 1) if warnings and ready else None,
        "warning": warnings[0][1] if warnings else None,
        "warnings": len(warnings),
        "other_warnings": start_warnings,
        "progress_lines_with_engine_numbers": sum("kv_cache_usage" in p for p in progress),
        "wall_s": round(wall, 1),
        "generation_s": round(generation, 1) if generation else None,
        "completion_tokens": completion,
        "output_tok_per_s": round(completion / generation, 1) if generation else None,
        "fitted": engine.get("fitted"),
        "summary": stdout.strip().splitlines(),
    }


def table(rows: list[dict]) -> str:
    columns = [
        ("run", "name"),
        ("max_model_len", "max_model_len"),
        ("max_num_seqs", "max_num_seqs"),
        ("KV tokens", "kv_cache_tokens"),
        ("preemptions", "preemptions"),
        ("KV peak", "kv_cache_usage_peak"),
        ("warned at (s)", "warning_after_ready_s"),
        ("wall s", "wall_s"),
        ("generation s", "generation_s"),
        ("output tok/s", "output_tok_per_s"),
    ]
    cells = [[h for h, _ in columns]]
    for row in rows:
        cells.append(
            [
                "-" if row[k] is None else f"{row[k]:.0%}" if k == "kv_cache_usage_peak" else str(row[k])
                for _, k in columns
            ]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=96, help="chat requests (default 96)")
    parser.add_argument(
        "--max-tokens", type=int, default=160, help="tokens each request decodes (default 160)"
    )
    parser.add_argument(
        "--kv-blocks", type=int, default=60, help="KV cache blocks of 128 tokens (default 60)"
    )
    parser.add_argument("--user-max-num-seqs", type=int, default=256)
    parser.add_argument("--user-max-model-len", type=int, default=2048)
    parser.add_argument(
        "--order",
        default="user,planned",
        help="which run goes first (default user,planned): swap to check bias",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (inputs, outputs)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kv-starved-"))
    input_path, config = work / "in.jsonl", work / "job.yaml"
    write_input(input_path, args.n, args.max_tokens)
    write_config(config, args.kv_blocks)
    user = [
        "--max-num-seqs",
        str(args.user_max_num_seqs),
        "--max-model-len",
        str(args.user_max_model_len),
    ]
    rows = []
    try:
        runs = {"user": user, "planned": []}
        for name in args.order.split(","):
            flags = runs[name]
            print(f"running {name}: nightshift run ... {' '.join(flags)}", file=sys.stderr, flush=True)
            rows.append(run(name, flags, input_path, config, work))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"{args.n} chats x {args.max_tokens} forced output tokens, KV cache {args.kv_blocks} blocks of 128 tokens"
    )
    print(table(rows))
    for row in rows:
        for warning in row["other_warnings"]:
            print(f"{row['name']}: {warning}")
        if row["warning"]:
            print(f"{row['name']}: {row['warning']}")
        fitted = row["fitted"] or {}
        if fitted.get("max_num_seqs"):
            print(f"{row['name']}: max_num_seqs {fitted['max_num_seqs']['default']['why']}")
        if fitted.get("max_model_len", {}).get("why"):
            print(f"{row['name']}: max_model_len {fitted['max_model_len']['why']}")
    results = BENCH_DIR / "results"
    results.mkdir(exist_ok=True)
    (results / "kv_starved.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
