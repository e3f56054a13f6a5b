"""Engine-overhead benchmark: nightshift vs raw vLLM offline vs vLLM's run-batch, one run, same work.

All three paths get the same N chat requests (deterministic, varied short questions, greedy, fixed max_tokens), the
same engine args and all the cores of the box (bench/fair.py: raw-offline and run-batch by
VLLM_CPU_OMP_THREADS_BIND=0-(N-1), nightshift by --num-engines/--cpus-per-engine per --layout; each engine's cores are
checked against vLLM's `core ids=[...]` log line), and each runs as its own subprocess, one after the other (never
concurrently: on a 2-core box two engines would time each other's contention, not themselves):

  nightshift   `nightshift run IN OUT ...`                                   (process + Ray + engine + finalize)
  raw-offline  this file re-run as a worker: `LLM(...)` then `llm.chat(...)`  (whole process; generation also alone)
  run-batch    `python -m vllm.entrypoints.openai.run_batch -i IN -o OUT ...` (whole process)

Output tokens are counted from each path's own outputs (usage.completion_tokens, or len(token_ids) offline), never
assumed from max_tokens. Each run reports its fixed cost (process start -> first output token) and steady-state
rate (output tokens / first -> last token) from a token clock inside the engine core (bench/trace/), the prefix-cache
hit rate, and where its wall time went (phases from vLLM's own log timestamps),
CPU seconds per process of ours, and any CPU taken by other processes or the hypervisor: on a shared 2-core box a
timing with someone else's job in it is re-taken (--foreign-retries). The table and the per-run details go to
OUT_DIR/engines.json.

    python bench/engines.py --quick                      # smoke run: 16 requests x 8 tokens
    python bench/engines.py                              # 2048 requests x 64 tokens, once
    python bench/engines.py --layout each                # nightshift as one engine per core (default: one on all)
    python bench/engines.py --nightshift-rev HEAD        # time the last commit, not a tree being edited
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
PATHS = ("nightshift", "raw-offline", "run-batch")

import fair  # noqa: E402 - bench/fair.py: cores, layouts, token clock, core checks

# Varied short user questions: every prompt is distinct (so prefix caching only shares the chat template's header,
# the same for every path), and lengths vary a little like a real batch.
_TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "compound interest", "plate tectonics",
    "the immune system", "machine learning", "the water cycle", "inflation", "the Roman Empire",
    "volcanoes", "DNA", "electric cars", "the stock market", "climate change", "the printing press",
    "vaccines", "gravity", "the internet", "jazz music", "the Moon landing", "rainbows", "earthquakes",
    "bees", "coffee", "the Olympic Games", "solar panels", "sleep", "the human heart", "chess",
    "recycling", "tides", "democracy", "antibiotics", "the Great Wall of China", "batteries",
    "Shakespeare", "glaciers", "bread baking", "prime numbers",
)  # fmt: skip
_TEMPLATES = (
    "What is {t}?",
    "Explain {t} in one sentence.",
    "Why is {t} important?",
    "Give me three facts about {t}.",
    "How would you describe {t} to a child?",
    "What is a common misconception about {t}?",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "Summarize the history of {t}.",
    "What question would an expert ask about {t}?",
    "Name one surprising thing about {t}.",
    "How does {t} affect everyday life?",
    "What should a beginner know about {t}?",
)


@dataclass(frozen=True)
class EngineArgs:
    """The one engine configuration all three paths run with."""

    max_model_len: int = 2048
    # nightshift's default, and the value the engine notes measured: 64 concurrent 64-token chats fit the KV cache
    # many times over (2 GiB ≈ 93k tokens vs 64 x ~110), so there is no preemption to blur the comparison.
    max_num_seqs: int = 64
    dtype: str = "bfloat16"
    enforce_eager: bool = True  # graph compilation costs minutes on CPU
    enable_prefix_caching: bool = True  # nightshift's default
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE; whole GiB only
    # None: each path keeps vLLM's default, which depends on how the engine was built (the `LLM` class gets a
    # larger one than run-batch and nightshift, on CPU and GPU alike: vllm/engine/arg_utils.py get_batch_defaults);
    # a number reaches every path.
    max_num_batched_tokens: int | None = None
    # None: each path's default, and they differ: nightshift's is 0.9, vLLM 0.32's 0.92 (on a GPU, a smaller KV
    # cache for nightshift). A number reaches every path.
    gpu_memory_utilization: float | None = None
    # None: the KV cache is what kv_cache_gib gives. A number caps every path's engines at that many KV blocks
    # (vLLM's num_gpu_blocks_override, honoured on CPU too): the prefix-heavy bench sizes each engine's cache to hold
    # a share of the job's prefixes.
    num_gpu_blocks_override: int | None = None


@dataclass
class RunResult:
    path: str
    repeat: int
    wall_s: float
    output_tokens: int
    rows_ok: int
    rows_failed: int
    tok_per_s: float
    cpu_busy_before: float  # share of all cores busy in the second before the run: other load on the box
    cores_used: float  # busy core-seconds / wall during the run (whole box)
    waited_for_idle_s: float
    foreign_cores: float  # CPU used during the run by processes that are not ours (another job on the box)
    steal_share: float  # CPU time taken by the hypervisor's other guests during the run
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- requests


def make_requests(n: int, max_tokens: int, model_name: str, ignore_eos: bool, seed: int = 0) -> list[dict]:
    """N OpenAI Batch chat lines, the same for every call with the same arguments."""
    combos = [tpl.format(t=topic) for tpl in _TEMPLATES for topic in _TOPICS]
    random.Random(seed).shuffle(combos)
    lines = []
    for i in range(n):
        # Past len(combos) prompts repeat with a suffix so they stay distinct.
        question = combos[i % len(combos)] + ("" if i < len(combos) else f" (variant {i // len(combos)})")
        body: dict[str, Any] = {
            "model": model_name,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if ignore_eos:
            # vLLM's ChatCompletionRequest and SamplingParams both take ignore_eos with the same meaning, so every
            # path generates exactly max_tokens and the paths do the same amount of decode work.
            body["ignore_eos"] = True
        lines.append(
            {"custom_id": f"req-{i:05d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return lines


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------- machine load


def _cpu_fields() -> list[int]:
    """The aggregate `cpu` line of /proc/stat: user nice system idle iowait irq softirq steal ..."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all cores since boot."""
    fields = _cpu_fields()
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def cpu_busy_fraction(interval: float = 1.0) -> float:
    """Share of the whole box busy over `interval` s: a check that nothing else is running before we time."""
    b0, t0 = _cpu_jiffies()
    time.sleep(interval)
    b1, t1 = _cpu_jiffies()
    return (b1 - b0) / max(1, t1 - t0)


def wait_for_idle(threshold: float, max_wait_s: float, quiet_s: float = 10.0) -> tuple[float, float]:
    """Wait until the box has been (nearly) idle for `quiet_s`, since another job on a 2-core box would be timed
    with ours; a single idle second is often just the gap between someone else's test runs.

    Returns (busiest share seen in the quiet window, seconds waited); the caller records both, idle or not.
    """
    start = time.monotonic()
    window: list[float] = []
    while time.monotonic() - start < max_wait_s:
        window.append(cpu_busy_fraction())
        if window[-1] > threshold:
            window = []
        elif len(window) >= quiet_s:
            break
    return max(window or [cpu_busy_fraction()]), time.monotonic() - start


_LABELS: dict[str, str] = {}


def _python_label(entry: Path, comm: str, start_ticks: str) -> str:
    """A readable name for a bare `python` process: its script or module (Ray's helpers, vLLM's spawn children)."""
    key = f"{entry.name}:{start_ticks}"  # pids get reused over a long bench; (pid, start time) do not
    if key not in _LABELS:
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            return comm
        words = [a.decode(errors="replace") for a in argv[1:] if a]
        label = comm
        for i, word in enumerate(words):
            if word == "-m" and i + 1 < len(words):
                label = f"{comm} -m {words[i + 1]}"
                break
            if word.endswith(".py"):
                label = f"{comm} {Path(word).name}"
                break
            if word == "-c":
                label = f"{comm} -c"
                break
        _LABELS[key] = label
    return _LABELS[key]


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, cpu ticks so far, command name) for every live process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2 :].split()
        if name.startswith("python"):
            name = _python_label(entry, name, rest[19])
        table[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]), name)
    return table


RUN_MARKER = (
    "NSBENCH_RUN"  # set in every timed subprocess's environment; Ray workers and vLLM children inherit it
)


class LoadWatcher(threading.Thread):
    """Samples CPU per process during a timed run: ours (by name, to see where a path spends CPU) and foreign.

    A process is ours if it descends from this one or carries RUN_MARKER in its environment (a reparented Ray
    process still does). Checking for idleness only before a run misses a job that starts half way through; on a
    shared 2-core box that is the difference between timing an engine and timing two.
    """

    def __init__(self, period_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self._stop_event = threading.Event()
        self.foreign_ticks = 0
        self.foreign_by_name: dict[str, int] = {}
        self.own_by_name: dict[str, int] = {}
        self._marked: dict[int, bool] = {}
        self._start = time.monotonic()
        # (epoch seconds at the end of a sample, our CPU ticks by process name within it): what ran beside the
        # engines' compute during generation (`own_cores_between`).
        self.own_samples: list[tuple[float, dict[str, int]]] = []

    def _has_marker(self, pid: int) -> bool:
        if pid not in self._marked:
            try:
                self._marked[pid] = f"{RUN_MARKER}=".encode() in Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                self._marked[pid] = False
        return self._marked[pid]

    def _mine(self, table: dict[int, tuple[int, int, str]]) -> set[int]:
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        mine, todo = set(), [os.getpid(), *(pid for pid in table if self._has_marker(pid))]
        while todo:
            pid = todo.pop()
            if pid not in mine:
                mine.add(pid)
                todo.extend(children.get(pid, []))
        return mine

    def run(self) -> None:
        before = _proc_table()
        while not self._stop_event.wait(self.period_s):
            now = _proc_table()
            mine = self._mine(now)
            sample: dict[str, int] = {}
            for pid, (_, ticks, name) in now.items():
                delta = ticks - before[pid][1] if pid in before else ticks
                if delta <= 0:
                    continue
                if pid in mine:
                    self.own_by_name[name] = self.own_by_name.get(name, 0) + delta
                    sample[name] = sample.get(name, 0) + delta
                elif pid in before:  # a foreign process's CPU before we started watching is not ours to count
                    self.foreign_ticks += delta
                    self.foreign_by_name[name] = self.foreign_by_name.get(name, 0) + delta
            self.own_samples.append((time.time(), sample))
            before = now

    def own_cores_between(self, start: float, end: float) -> dict[str, float]:
        """Cores our processes used, by name, in the samples that ended inside [start, end] (epoch seconds), over
        the time those samples span: e.g. between the first and the last output token, what computed beside the
        engines (`VLLM::Worker` is the engines' compute; everything else takes cores from it)."""
        inside = [(at, ticks) for at, ticks in self.own_samples if start + self.period_s <= at <= end]
        if not inside:
            return {}
        span = inside[-1][0] - inside[0][0] + self.period_s
        hz = os.sysconf("SC_CLK_TCK")
        totals: dict[str, int] = {}
        for _, ticks in inside:
            for name, n in ticks.items():
                totals[name] = totals.get(name, 0) + n
        return {name: round(n / hz / span, 3) for name, n in sorted(totals.items(), key=lambda kv: -kv[1])}

    def stop(self) -> dict[str, Any]:
        self._stop_event.set()
        self.join()
        hz = os.sysconf("SC_CLK_TCK")
        elapsed = max(1e-6, time.monotonic() - self._start)

        def top(counts: dict[str, int], k: int) -> dict[str, float]:
            return {name: round(t / hz, 1) for name, t in sorted(counts.items(), key=lambda kv: -kv[1])[:k]}

        return {
            "foreign_cores": round(self.foreign_ticks / hz / elapsed, 3),
            "foreign_top": top(self.foreign_by_name, 5),
            "own_cpu_s_by_process": top(self.own_by_name, 12),
        }


# ---------------------------------------------------------------------------------------------------- subprocesses


def bench_env(args: EngineArgs) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    # Never attach to somebody else's Ray, and never inherit a thread cap or core bind: each path's cores are set
    # by the bench (bench/fair.py), the same box for every path.
    for name in ("RAY_ADDRESS", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        env.pop(name, None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[RUN_MARKER] = str(os.getpid())
    # nightshift's engines claim cores with lock files in a node-wide directory; on a shared box another job's
    # engines hold some of them, and the path would run on fewer cores than it was given. The bench measures
    # layouts, not other jobs' claims (foreign load is watched separately): its runs claim in a directory of their own.
    env["NIGHTSHIFT_CPU_LOCK_DIR"] = f"/tmp/nsbench-cores-{os.getpid()}"
    return env


@dataclass
class Timed:
    wall_s: float
    cores_used: float  # busy core-seconds of the whole box / wall
    # Share of the box's CPU time the hypervisor gave to someone else: invisible load that no process list shows.
    steal_share: float
    started: float  # epoch seconds, to place the engine's own log lines in the run
    ended: float


def timed_subprocess(
    cmd: list[str], env: dict[str, str], log: Path, timeout_s: float, cwd: Path = REPO
) -> Timed:
    """Run `cmd` to completion and time it. Raises with the log's tail on failure."""
    f0 = _cpu_fields()
    b0, _ = _cpu_jiffies()
    started = time.time()
    start = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=cwd)
    wall = time.perf_counter() - start
    ended = time.time()
    b1, _ = _cpu_jiffies()
    f1 = _cpu_fields()
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{cmd[:3]}... exited {proc.returncode}; last lines of {log}:\n{tail}")
    hz = os.sysconf("SC_CLK_TCK")
    steal = (f1[7] - f0[7]) / max(1, sum(f1[:8]) - sum(f0[:8])) if len(f0) > 7 else 0.0
    return Timed(wall, (b1 - b0) / hz / wall, round(steal, 4), started, ended)


def _openai_outputs(records: list[dict]) -> dict[str, dict[str, Any]]:
    """custom_id -> {tokens, text, ok} from Batch output records (nightshift shards or run-batch output)."""
    out = {}
    for rec in records:
        response = rec.get("response") or {}
        body = response.get("body") or {}
        ok = response.get("status_code") == 200 and not rec.get("error")
        usage = body.get("usage") or {}
        choices = body.get("choices") or [{}]
        out[rec.get("custom_id")] = {
            "tokens": int(usage.get("completion_tokens") or 0),
            "text": (choices[0].get("message") or {}).get("content"),
            "ok": ok,
        }
    return out


def snapshot_source(rev: str, dest: Path) -> Path:
    """A committed revision's `pipeline/` (and `cluster/`) extracted under `dest`, to time that code rather than a
    working tree someone may be editing while the bench runs. Reads the repo; writes only under `dest`."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    root = dest / f"src-{commit[:12]}"
    if not (root / "pipeline" / "__main__.py").exists():
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", commit, "pipeline", "cluster"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def run_nightshift(
    requests: Path,
    work: Path,
    args: EngineArgs,
    env: dict[str, str],
    timeout_s: float,
    src: Path | None = None,
    extra_args: list[str] | None = None,
    name: str = "nightshift",
) -> tuple[Timed, dict, dict]:
    """`extra_args`: further `nightshift run` flags (engines, routing); `name`: of the run's output and log."""
    out = work / f"{name}-out"
    shutil.rmtree(out, ignore_errors=True)
    if src is None:
        exe = Path(sys.executable).with_name("nightshift")
        launcher = [str(exe if exe.exists() else "nightshift")]
        cwd = REPO
    else:
        # `python -m pipeline` from inside the snapshot: sys.path[0] and PYTHONPATH (which Ray's workers inherit)
        # both put the snapshot ahead of the editable install of the working tree.
        launcher = [sys.executable, "-m", "pipeline"]
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))}
        cwd = src
    cmd = [
        *launcher, "run", str(requests), str(out),
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--dtype", args.dtype,
        "--enforce-eager" if args.enforce_eager else "--no-enforce-eager",
        "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
        "--cpu-kvcache-space", str(args.kv_cache_gib),
        "--no-progress",
        *(extra_args or []),
    ]  # fmt: skip
    if args.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    # No flags for these: nightshift takes further vLLM args from the job file's engine.vllm.extra (YAML reads JSON).
    extra = {
        arg: value
        for arg, value in (
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("num_gpu_blocks_override", args.num_gpu_blocks_override),
        )
        if value is not None
    }
    if extra:
        job = work / f"{name}-job.yaml"
        job.write_text(json.dumps({"engine": {"vllm": {"extra": extra}}}))
        cmd += ["--config", str(job)]
    # A private Ray temp dir: the engine's logs (in Ray's session logs) are then this run's, even if another Ray
    # runs on the box; kept short because Ray puts unix sockets under it (path length limit).
    ray_tmp = Path(f"/tmp/nsbench-ray-{os.getpid()}")
    shutil.rmtree(ray_tmp, ignore_errors=True)
    timed = timed_subprocess(cmd, {**env, "RAY_TMPDIR": str(ray_tmp)}, work / f"{name}.log", timeout_s, cwd)
    records = [r for shard in sorted(out.glob("*-of-*.jsonl")) for r in read_jsonl(shard)]
    manifest = json.loads((out / "manifest.json").read_text())
    extra = {
        "manifest_wall_time_s": manifest.get("wall_time_s"),
        "manifest_completion_tokens": (manifest.get("tokens") or {}).get("completion"),
        "manifest_engine_args": (manifest.get("engine") or {}).get("args"),
        "preemptions": manifest.get("preemptions"),
        "prefix_cache_hit_rate": manifest.get("prefix_cache_hit_rate"),
        "routing": manifest.get("routing"),
        # Engine logs live in Ray's session logs, not in the subprocess output.
        "ray_session": os.path.realpath(ray_tmp / "ray" / "session_latest"),
    }
    return timed, _openai_outputs(records), extra


def run_raw_offline(
    requests: Path, work: Path, model_dir: str, args: EngineArgs, env: dict[str, str], timeout_s: float
) -> tuple[Timed, dict, dict]:
    result = work / "raw-offline.json"
    result.unlink(missing_ok=True)
    spec = {"requests": str(requests), "model": model_dir, "result": str(result), "engine": asdict(args)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--raw-worker", json.dumps(spec)]
    timed = timed_subprocess(cmd, env, work / "raw-offline.log", timeout_s)
    data = json.loads(result.read_text())
    return timed, data["outputs"], data["timings"]


def run_run_batch(
    requests: Path,
    work: Path,
    model_dir: str,
    model_name: str,
    args: EngineArgs,
    env: dict[str, str],
    timeout_s: float,
    name: str = "run-batch",
    extra_args: list[str] | None = None,
) -> tuple[Timed, dict, dict]:
    """`env` should carry VLLM_CPU_OMP_THREADS_BIND (the cores it gets); `name`: of the run's output and log;
    `extra_args`: further run-batch flags (LoRA adapters)."""
    out = work / f"{name}-out.jsonl"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.run_batch",
        "-i", str(requests), "-o", str(out),
        "--model", model_dir, "--served-model-name", model_name,
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--dtype", args.dtype,
        "--enforce-eager" if args.enforce_eager else "--no-enforce-eager",
        "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.num_gpu_blocks_override is not None:
        cmd += ["--num-gpu-blocks-override", str(args.num_gpu_blocks_override)]
    cmd += extra_args or []
    timed = timed_subprocess(cmd, env, work / f"{name}.log", timeout_s)
    return timed, _openai_outputs(read_jsonl(out)), {}


# ---------------------------------------------------------------------------------------------------- raw worker


def raw_worker(spec_json: str) -> None:
    """The raw-offline path, run in its own process: plain `LLM` + `llm.chat`, nothing of nightshift imported."""
    t_start = time.perf_counter()
    spec = json.loads(spec_json)
    eng = spec["engine"]
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(eng["kv_cache_gib"])
    from vllm import LLM, SamplingParams

    lines = read_jsonl(Path(spec["requests"]))
    conversations = [line["body"]["messages"] for line in lines]
    # The SamplingParams equivalent of each request body (what vLLM's chat layer derives from the same fields).
    params = [
        SamplingParams(
            temperature=line["body"]["temperature"],
            max_tokens=line["body"]["max_tokens"],
            ignore_eos=bool(line["body"].get("ignore_eos", False)),
        )
        for line in lines
    ]
    t_import = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=eng["dtype"],
        max_model_len=eng["max_model_len"],
        max_num_seqs=eng["max_num_seqs"],
        enforce_eager=eng["enforce_eager"],
        enable_prefix_caching=eng["enable_prefix_caching"],
        max_num_batched_tokens=eng.get("max_num_batched_tokens"),  # None: vLLM's default for the LLM class
        num_gpu_blocks_override=eng.get("num_gpu_blocks_override"),
        # vLLM's default when not given (None is not accepted here).
        **({"gpu_memory_utilization": u} if (u := eng.get("gpu_memory_utilization")) else {}),
        # nightshift and run-batch log engine stats (running/waiting, throughput); keep the same small cost here.
        disable_log_stats=False,
    )
    t_engine = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    t_gen = time.perf_counter()
    results = {
        line["custom_id"]: {"tokens": len(o.outputs[0].token_ids), "text": o.outputs[0].text, "ok": True}
        for line, o in zip(lines, outputs, strict=True)
    }
    tokens = sum(r["tokens"] for r in results.values())
    timings = {
        "import_s": round(t_import - t_start, 3),
        "engine_start_s": round(t_engine - t_import, 3),
        "generate_s": round(t_gen - t_engine, 3),
        "generate_tok_per_s": round(tokens / (t_gen - t_engine), 2),
    }
    Path(spec["result"]).write_text(json.dumps({"outputs": results, "timings": timings}))
    # Engine-core subprocess goes away with the LLM object; explicit so the process exits promptly.
    del llm


# ---------------------------------------------------------------------------------------------------- evidence


_STATS_LINE = re.compile(
    r"Avg generation throughput: ([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs"
)
_THREAD_LINE = re.compile(
    r"OpenMP thread binding|core ids=|reserved_cpus|OMP_NUM_THREADS|Torch threads|set_num_threads|Explicitly set|"
    r"KV cache size",
    re.IGNORECASE,
)


def engine_log_facts(texts: list[str]) -> dict[str, Any]:
    """What the engine itself logged: thread setup lines, and its 10 s stats (generation tok/s, running/waiting)."""
    thread_lines: list[str] = []
    gen, running, waiting = [], [], []
    for text in texts:
        for line in text.splitlines():
            if (m := _STATS_LINE.search(line)) is not None:
                gen.append(float(m.group(1)))
                running.append(int(m.group(2)))
                waiting.append(int(m.group(3)))
            elif _THREAD_LINE.search(line) and len(thread_lines) < 12:
                thread_lines.append(line.strip()[-220:])
    busy = [g for g, r in zip(gen, running, strict=True) if r > 0]
    return {
        "thread_lines": thread_lines,
        "stats_samples": len(gen),
        "median_gen_tok_per_s_while_running": round(statistics.median(busy), 1) if busy else None,
        "max_running": max(running, default=None),
        "max_waiting": max(waiting, default=None),
    }


_VLLM_TS = re.compile(r"(?:DEBUG|INFO|WARNING|ERROR) (\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2}) ")
_ENGINE_INIT = re.compile(r"Resolved architecture")  # the first thing an engine under construction logs
_ENGINE_READY = re.compile(r"init engine \(profile, create kv cache, warmup model\) took")
# Every path shuts its engine down right after the last row; the first shutdown line marks the end of generation.
_ENGINE_DONE = re.compile(r"\[shutdown\]")


def engine_phases(texts: list[str], started: float, ended: float) -> dict[str, float | None]:
    """Where a run's wall time went, from vLLM's own log timestamps (1 s resolution, local time): before the engine
    (process, imports, Ray), engine start, generation, and after (output, teardown)."""
    year = time.localtime(started).tm_year
    marks: dict[str, float] = {}
    for text in texts:
        for line in text.splitlines():
            m = _VLLM_TS.search(line)
            if m is None:
                continue
            month, day, hh, mm, ss = (int(g) for g in m.groups())
            at = time.mktime((year, month, day, hh, mm, ss, 0, 0, -1))
            for name, pattern, first in (
                ("init", _ENGINE_INIT, True),
                ("ready", _ENGINE_READY, True),
                ("done", _ENGINE_DONE, True),
            ):
                if pattern.search(line) and (name not in marks or not first):
                    marks[name] = at
    if not {"init", "ready", "done"} <= marks.keys():
        return {"before_engine_s": None, "engine_start_s": None, "generation_s": None, "after_s": None}
    return {
        "before_engine_s": round(marks["init"] - started, 1),
        "engine_start_s": round(marks["ready"] - marks["init"], 1),
        "generation_s": round(marks["done"] - marks["ready"], 1),
        "after_s": round(ended - marks["done"], 1),
    }


def log_texts(path: str, work: Path, extra: dict) -> list[str]:
    if path == "nightshift":
        session = Path(extra.get("ray_session") or "/nonexistent") / "logs"
        files = sorted(session.glob("worker-*.err")) + sorted(session.glob("worker-*.out"))
        return [f.read_text(errors="replace") for f in files] + [(work / "nightshift.log").read_text()]
    return [(work / f"{path}.log").read_text(errors="replace")]


# ---------------------------------------------------------------------------------------------------- driver


def run_one(path: str, repeat: int, ctx: dict[str, Any]) -> tuple[RunResult, dict]:
    work: Path = ctx["work"]
    busy, waited = wait_for_idle(ctx["idle_threshold"], ctx["max_idle_wait"])
    if busy > ctx["idle_threshold"]:
        print(f"  WARNING: box {busy:.0%} busy before {path} after waiting {waited:.0f} s", flush=True)
    trace_dir = work / f"trace-{path}"
    env = fair.trace_env(ctx["env"], trace_dir)
    layout: fair.Layout = ctx["layout"] if path == "nightshift" else fair.Layout.all_cores(ctx["cores"])
    if path != "nightshift":  # nightshift binds its engines itself, from --num-engines/--cpus-per-engine
        env[fair.OMP_BIND] = fair.bind_string(ctx["cores"])
    watcher = LoadWatcher()
    watcher.start()
    if path == "nightshift":
        flags = ["--num-engines", str(layout.engines), "--cpus-per-engine", str(layout.cores_per_engine)]
        timed, outputs, extra = run_nightshift(
            ctx["requests"], work, ctx["args"], env, ctx["timeout"], ctx["nightshift_src"], extra_args=flags
        )
    elif path == "raw-offline":
        timed, outputs, extra = run_raw_offline(
            ctx["requests"], work, ctx["model_dir"], ctx["args"], env, ctx["timeout"]
        )
    else:
        timed, outputs, extra = run_run_batch(
            ctx["requests"], work, ctx["model_dir"], ctx["model_name"], ctx["args"], env, ctx["timeout"]
        )
    foreign = watcher.stop()
    if foreign["foreign_cores"] > 0.1:
        print(
            f"  WARNING: other processes used {foreign['foreign_cores']:.2f} cores during {path}: {foreign}"
        )
    extra["foreign_top_cpu_s"] = foreign["foreign_top"]
    extra["own_cpu_s_by_process"] = foreign["own_cpu_s_by_process"]
    texts = log_texts(path, work, extra)
    extra["engine_log"] = engine_log_facts(texts)
    extra["phases"] = engine_phases(texts, timed.started, timed.ended)
    extra["layout"] = layout.label
    extra["token_timing"] = fair.token_timing(fair.read_traces(trace_dir), timed.started, timed.ended)
    extra["engine_cores"] = fair.bound_cores(texts)
    extra["cores_wrong"] = fair.check_cores(extra["engine_cores"], layout.expected(ctx["cores"]))
    if extra["cores_wrong"]:
        print(f"  !!! CORES WRONG for {path}: {extra['cores_wrong']}", flush=True)
    wall, cores = timed.wall_s, timed.cores_used
    tokens = sum(o["tokens"] for o in outputs.values() if o["ok"])
    ok = sum(o["ok"] for o in outputs.values())
    result = RunResult(
        path=path,
        repeat=repeat,
        wall_s=round(wall, 3),
        output_tokens=tokens,
        rows_ok=ok,
        rows_failed=ctx["n"] - ok,  # missing rows count as failed too
        tok_per_s=round(tokens / wall, 2),
        cpu_busy_before=round(busy, 3),
        cores_used=round(cores, 2),
        waited_for_idle_s=round(waited, 1),
        foreign_cores=foreign["foreign_cores"],
        steal_share=timed.steal_share,
        extra=extra,
    )
    return result, outputs


def _median_phases(phases: list[dict[str, Any]]) -> dict[str, float | None]:
    keys = {k for p in phases for k, v in p.items() if v is None or isinstance(v, int | float)}
    out: dict[str, float | None] = {}
    for key in sorted(keys):
        values = [p[key] for p in phases if p.get(key) is not None]
        out[key] = round(statistics.median(values), 1) if values else None
    return out


def summarize(runs: list[RunResult], texts: dict[str, dict]) -> dict[str, Any]:
    """Per-path medians over repeats, and the two ratios the bench exists for (output tok/s, end to end)."""
    table: dict[str, dict[str, Any]] = {}
    for path in PATHS:
        mine = [r for r in runs if r.path == path]
        if not mine:
            continue
        row = {
            "wall_s": round(statistics.median(r.wall_s for r in mine), 3),
            "output_tokens": int(statistics.median(r.output_tokens for r in mine)),
            "tok_per_s": round(statistics.median(r.tok_per_s for r in mine), 2),
            "cores_used": round(statistics.median(r.cores_used for r in mine), 2),
            "foreign_cores": max(r.foreign_cores for r in mine),
            "rows_failed": max(r.rows_failed for r in mine),
            "steal_share": max(r.steal_share for r in mine),
            "runs": len(mine),
            "phases": _median_phases([r.extra.get("phases") or {} for r in mine]),
            "token_timing": _median_phases([r.extra.get("token_timing") or {} for r in mine]),
            "layout": mine[0].extra.get("layout"),
            "engine_cores": mine[0].extra.get("engine_cores"),
            "cores_wrong": next((r.extra["cores_wrong"] for r in mine if r.extra.get("cores_wrong")), None),
        }
        if path == "raw-offline":
            row["generate_s"] = round(statistics.median(r.extra["generate_s"] for r in mine), 3)
            row["generate_tok_per_s"] = round(
                statistics.median(r.extra["generate_tok_per_s"] for r in mine), 2
            )
        table[path] = row
    # Greedy decoding: identical text is expected, though batch composition can flip a near-tie in bf16.
    raw = texts.get("raw-offline", {})
    for path in ("nightshift", "run-batch"):
        if path in table and raw:
            mine = texts.get(path, {})
            table[path]["same_text_as_raw"] = sum(
                1 for k, v in raw.items() if mine.get(k, {}).get("text") == v["text"]
            )
    ratios = {}
    if {"nightshift", "raw-offline"} <= table.keys():
        ratios["nightshift/raw-offline"] = round(
            table["nightshift"]["tok_per_s"] / table["raw-offline"]["tok_per_s"], 3
        )
    if {"nightshift", "run-batch"} <= table.keys():
        ratios["nightshift/run-batch"] = round(
            table["nightshift"]["tok_per_s"] / table["run-batch"]["tok_per_s"], 3
        )
    # The fair-bench targets: steady-state >= 0.97x the best peer on the same cores; fixed cost <= run-batch's + 5 s.
    checks: dict[str, Any] = {}
    mine = (table.get("nightshift") or {}).get("token_timing") or {}
    peers = {p: (table[p].get("token_timing") or {}) for p in ("raw-offline", "run-batch") if p in table}
    steady = {p: t["steady_tok_per_s"] for p, t in peers.items() if t.get("steady_tok_per_s")}
    if mine.get("steady_tok_per_s") and steady:
        best = max(steady, key=lambda p: steady[p])
        ratio = mine["steady_tok_per_s"] / steady[best]
        checks["steady_vs_best_peer"] = {"peer": best, "ratio": round(ratio, 3), "ok": ratio >= 0.97}
    if mine.get("fixed_s") is not None and (peers.get("run-batch") or {}).get("fixed_s") is not None:
        extra = mine["fixed_s"] - peers["run-batch"]["fixed_s"]
        checks["fixed_minus_run_batch_s"] = {"value": round(extra, 2), "ok": extra <= 5.0}
    return {
        "table": table,
        "ratios": ratios,
        "targets": {"nightshift/raw-offline": 0.9, "nightshift/run-batch": 1.0},
        "checks": checks,
    }


def write_summary(out: Path, summary: dict[str, Any], table: str) -> None:
    """The bench's JSON record, then its table on the terminal."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print()
    print(table)
    print(f"\nwritten: {out}")


def format_table(summary: dict[str, Any]) -> str:
    # cores: whole-box CPU during the run; foreign: CPU of processes not ours (should be ~0 for a clean timing).
    header = f"{'path':<12} {'wall s':>8} {'out tokens':>11} {'tok/s':>8} {'cores':>6} {'foreign':>7} {'failed':>6}  note"
    lines = [header, "-" * len(header)]
    for path, row in summary["table"].items():
        note = ""
        if path == "raw-offline":
            note = f"generation alone: {row['generate_s']:.1f} s, {row['generate_tok_per_s']:.1f} tok/s"
        elif "same_text_as_raw" in row:
            note = f"same text as raw: {row['same_text_as_raw']}/{summary['n']}"
        lines.append(
            f"{path:<12} {row['wall_s']:>8.1f} {row['output_tokens']:>11} {row['tok_per_s']:>8.1f} "
            f"{row['cores_used']:>6.2f} {row['foreign_cores']:>7.2f} {row['rows_failed']:>6}  {note}"
        )
    # Where the wall time went, from vLLM's own log timestamps (1 s resolution): the engine phases are the same
    # work on every path, so a difference there is the path's; "before engine" is process + imports (+ Ray).
    lines.append("")
    lines.append(
        f"{'phases, s':<12} {'before engine':>14} {'engine start':>13} {'generation':>11} {'after':>7}"
    )
    for path, row in summary["table"].items():
        ph = row.get("phases") or {}
        cells = [ph.get(k) for k in ("before_engine_s", "engine_start_s", "generation_s", "after_s")]
        shown = ["-" if c is None else f"{c:.1f}" for c in cells]
        lines.append(f"{path:<12} {shown[0]:>14} {shown[1]:>13} {shown[2]:>11} {shown[3]:>7}")
    # Fixed cost and steady state from the engines' own token clocks (bench/fair.py), and the cores vLLM logged.
    lines.append("")
    lines.append(f"{'path':<12} {'layout':>6} {fair.timing_columns()} {'hit rate':>8}  engine cores")
    for path, row in summary["table"].items():
        tt = row.get("token_timing") or {}
        cores = " ".join(str(c) for c in row.get("engine_cores") or []) or "?"
        flag = f"  !!! CORES WRONG: {row['cores_wrong']}" if row.get("cores_wrong") else ""
        lines.append(
            f"{path:<12} {row.get('layout') or '-':>6} {fair.timing_cells(tt)} "
            f"{fair.fmt(tt.get('prefix_cache_hit_rate'), '.3f'):>8}  {cores}{flag}"
        )
    lines.append("")
    for name, value in summary["ratios"].items():
        target = summary["targets"][name]
        verdict = "ok" if value >= target else "BELOW TARGET"
        lines.append(f"{name:<24} {value:.3f}x  (target >= {target}x: {verdict})")
    if c := summary["checks"].get("steady_vs_best_peer"):
        ok = "ok" if c["ok"] else "BELOW TARGET"
        lines.append(f"{'steady nightshift/' + c['peer']:<24} {c['ratio']:.3f}x  (target >= 0.97x: {ok})")
    if c := summary["checks"].get("fixed_minus_run_batch_s"):
        ok = "ok" if c["ok"] else "OVER TARGET"
        lines.append(f"{'fixed, vs run-batch':<24} {c['value']:+.1f} s  (target <= +5 s: {ok})")
    return "\n".join(lines)


def git_state() -> dict[str, Any]:
    """The nightshift code being timed: other work may change the tree between runs, so record what it was."""

    def git(*cmd: str) -> str:
        proc = subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True)
        # Only the trailing newline: porcelain lines start with a status column that may be a space.
        return proc.stdout.rstrip("\n") if proc.returncode == 0 else ""

    dirty = [
        line[3:] for line in git("status", "--porcelain").splitlines() if not line[3:].startswith("bench/")
    ]
    return {"commit": git("rev-parse", "HEAD").strip(), "dirty_files": dirty}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--n", type=int, default=2048, help="requests (default 2048: minutes of generation)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="engine max_num_seqs for all paths (default 64)"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="rounds; the path order rotates each round (default 1)"
    )
    p.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results", help="engines.json and work files")
    p.add_argument(
        "--natural-stops",
        action="store_true",
        help="do not send ignore_eos: requests stop at EOS, so paths may produce different token counts",
    )
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ",".join(PATHS))
    p.add_argument("--timeout", type=float, default=3600, help="per-run timeout in seconds")
    p.add_argument(
        "--idle-threshold",
        type=float,
        default=0.15,
        help="before each run, wait while the box is busier than this",
    )
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="a run where other processes used more cores is re-timed",
    )
    p.add_argument(
        "--foreign-retries",
        type=int,
        default=2,
        help="re-timings allowed per run, after foreign load or a failure (default 2)",
    )
    p.add_argument("--max-idle-wait", type=float, default=900, help="longest wait for an idle box, seconds")
    p.add_argument(
        "--nightshift-rev",
        help="time this committed revision of nightshift (extracted under OUT_DIR) instead of the working tree",
    )
    p.add_argument(
        "--nightshift-src",
        type=Path,
        help="time the nightshift in this directory (one holding pipeline/), e.g. a patched copy; overrides --nightshift-rev",
    )
    p.add_argument(
        "--layout",
        choices=("all", "each"),
        default="all",
        help="nightshift's engines: one on all cores (all, default) or one per core (each); raw-offline and "
        "run-batch always run one engine on all cores",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 16 requests x 8 tokens, max_num_seqs 4, no idle wait, no re-timing",
    )
    p.add_argument("--raw-worker", help=argparse.SUPPRESS)  # internal: the raw-offline subprocess
    ns = p.parse_args(argv)
    if ns.quick:
        # Several chunks (max_num_seqs rows each), so that every engine of --layout each gets work and starts.
        ns.n, ns.max_tokens, ns.max_num_seqs, ns.max_idle_wait, ns.foreign_retries = 16, 8, 4, 0, 0
    return ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns = parse_args(argv)
    if ns.raw_worker:
        raw_worker(ns.raw_worker)
        return {}
    paths = [p for p in ns.paths.split(",") if p]
    if unknown := set(paths) - set(PATHS):
        raise SystemExit(f"unknown path(s): {sorted(unknown)}")

    sys.path.insert(0, str(REPO))  # run as `python bench/engines.py` from anywhere
    from pipeline.models import resolve_model

    model = resolve_model(None)
    args = EngineArgs(max_num_seqs=ns.max_num_seqs)
    work = (ns.out_dir / "work").resolve()  # absolute: nightshift may run from a snapshot dir
    work.mkdir(parents=True, exist_ok=True)
    requests = work / "requests.jsonl"
    # Never whatever `nightshift` is on PATH (an editable install may point at another checkout): this tree.
    src = snapshot_source(ns.nightshift_rev, ns.out_dir.resolve() / "src") if ns.nightshift_rev else REPO
    if ns.nightshift_src:
        src = ns.nightshift_src.resolve()
        if not (src / "pipeline" / "__main__.py").exists():
            raise SystemExit(f"--nightshift-src {src}: no pipeline/__main__.py there")
    write_jsonl(requests, make_requests(ns.n, ns.max_tokens, model.name, ignore_eos=not ns.natural_stops))
    ctx = {
        "work": work,
        "requests": requests,
        "args": args,
        "env": bench_env(args),
        "model_dir": str(model.path),
        "model_name": model.name,
        "timeout": ns.timeout,
        "n": ns.n,
        "nightshift_src": src,
        "cores": (cores := fair.box_cores()),
        "layout": fair.Layout.all_cores(cores) if ns.layout == "all" else fair.Layout.core_each(cores),
        "idle_threshold": ns.idle_threshold,
        "max_idle_wait": ns.max_idle_wait,
    }

    load_before = os.getloadavg()
    runs: list[RunResult] = []
    texts: dict[str, dict] = {}
    discarded: list[dict] = []
    failures: list[dict] = []
    for repeat in range(ns.repeats):
        # Rotating the order spreads any warm-cache or thermal advantage of going first/last across paths.
        order = paths[repeat % len(paths) :] + paths[: repeat % len(paths)]
        for path in order:
            for attempt in range(1 + ns.foreign_retries):
                print(f"[repeat {repeat}] {path} ...", flush=True)
                try:
                    result, outputs = run_one(path, repeat, ctx)
                except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
                    # Recorded, not fatal: one failed run must not throw away the others' timings.
                    print(f"  FAILED: {str(exc)[-2000:]}", flush=True)
                    failures.append(
                        {"path": path, "repeat": repeat, "attempt": attempt, "error": str(exc)[-4000:]}
                    )
                    continue
                print(
                    f"  {result.wall_s:.1f} s, {result.output_tokens} tokens, {result.tok_per_s:.1f} tok/s, "
                    f"cores used {result.cores_used:.2f}, box busy before {result.cpu_busy_before:.0%}",
                    flush=True,
                )
                if result.foreign_cores <= ns.max_foreign or attempt == ns.foreign_retries:
                    break
                # Another job shared the CPU: that timing measures contention, not the path. Time it again.
                print(f"  discarded (foreign load {result.foreign_cores:.2f} cores), retrying", flush=True)
                discarded.append(asdict(result))
            else:
                continue  # every attempt failed: the path has no timing this round
            runs.append(result)
            texts.setdefault(path, {k: {"text": v["text"]} for k, v in outputs.items()})

    summary = summarize(runs, texts)
    summary.update(
        {
            "n": ns.n,
            "max_tokens": ns.max_tokens,
            "ignore_eos": not ns.natural_stops,
            "engine_args": asdict(args),
            "model": {"name": model.name, "path": str(model.path)},
            "git": git_state(),
            "nightshift_rev": ns.nightshift_rev,
            "nightshift_src": str(src) if src else None,
            "machine": {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load_before]},
            "runs": [asdict(r) for r in runs],
            "discarded_runs": discarded,
            "failures": failures,
        }
    )
    write_summary(ns.out_dir / "engines.json", summary, format_table(summary))
    return summary


if __name__ == "__main__":  # required: vLLM starts its engine core with spawn
    main()
