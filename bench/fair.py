"""What makes the engine benches compare equals, shared by bench/engines.py, bench/shared_prefix.py and others.

- Every path gets the whole box: the cores this process may run on (`box_cores()`), either as one engine bound to
  all of them or as one engine per core (`Layout`). vLLM's CPU backend binds its compute threads itself; left to
  `VLLM_CPU_OMP_THREADS_BIND=auto` it binds one engine to one core, so paths that differ only in who sets the bind
  would be timing different hardware.
- The cores each engine really computed on are read back from vLLM's own log line
  (`local_rank=0, core ids=[...]`) and checked against the layout the path was meant to get (`check_cores`).
- Fixed cost and steady-state rate come from a token clock inside every engine core (bench/trace/sitecustomize.py,
  switched on by `trace_env`): the wall-clock time of the first and of the last scheduler step that emitted output
  tokens. fixed = first token - process start; steady = output tokens / (last token - first token).
  `result_timing` measures the same by results (requests finished), from the same clocks: what a bench whose unit
  is the row reports (bench/lora_routing.py; the clock also runs inside nightshift's fake engine).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
TRACE_DIR = BENCH_DIR / "trace"
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def box_cores() -> list[int]:
    """The cores this process may run on (its affinity mask): the box every path gets."""
    return sorted(os.sched_getaffinity(0))


def free_port() -> int:
    """A loopback port nothing listens on now, for a server the bench starts."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bind_string(cores: list[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for one engine on `cores`: '0-1' when contiguous, else '0,2,5'."""
    cores = sorted(cores)
    if cores == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)


@dataclass(frozen=True)
class Layout:
    """How a path spreads engines over the box: `engines` engines of `cores_per_engine` cores each."""

    engines: int
    cores_per_engine: int

    @property
    def label(self) -> str:
        return f"{self.engines}x{self.cores_per_engine}"

    def expected(self, cores: list[int]) -> list[list[int]]:
        """Each engine's cores, lowest first: what the core-id log lines must show."""
        k = self.cores_per_engine
        return [sorted(cores[i * k : (i + 1) * k]) for i in range(self.engines)]

    @classmethod
    def all_cores(cls, cores: list[int]) -> Layout:
        return cls(1, len(cores))

    @classmethod
    def core_each(cls, cores: list[int]) -> Layout:
        return cls(len(cores), 1)


def trace_env(env: dict[str, str], trace_dir: Path) -> dict[str, str]:
    """`env` with the token clock on, writing into `trace_dir` (emptied first)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    for old in trace_dir.glob("engine-*.json*"):
        old.unlink()
    path = os.pathsep.join(filter(None, [str(TRACE_DIR), env.get("PYTHONPATH")]))
    return {**env, "NSBENCH_TRACE_DIR": str(trace_dir), "PYTHONPATH": path}


def read_traces(trace_dir: Path) -> list[dict[str, Any]]:
    """One record per engine core that emitted tokens (an engine process that never generated writes nothing)."""
    traces = []
    for file in sorted(trace_dir.glob("engine-*.json")):
        try:
            traces.append(json.loads(file.read_text()))
        except (OSError, ValueError):
            continue
    return [t for t in traces if t.get("first_token_at")]


def token_timing(traces: list[dict[str, Any]], started: float, ended: float) -> dict[str, Any]:
    """Fixed cost, steady-state rate and tail of one run, from the engines' token clocks (epoch seconds)."""
    if not traces:
        return {"engines_traced": 0}
    first = min(t["first_token_at"] for t in traces)
    last = max(t["last_token_at"] for t in traces)
    tokens = sum(t["tokens"] for t in traces)
    queries = sum(t.get("prefix_queries", 0) for t in traces)
    hits = sum(t.get("prefix_hits", 0) for t in traces)
    span = max(1e-6, last - first)
    return {
        "engines_traced": len(traces),
        "fixed_s": round(first - started, 2),  # process start -> first output token (any engine)
        "generation_s": round(last - first, 2),  # first -> last output token (all engines)
        "steady_tok_per_s": round(tokens / span, 2),
        "tail_s": round(ended - last, 2),  # last token -> process exit (output writing, shutdown)
        "trace_tokens": tokens,
        # With several engines: how far apart their first tokens were (a late engine lowers the steady rate).
        "first_token_spread_s": round(max(t["first_token_at"] for t in traces) - first, 2),
        "per_engine_tok_per_s": [
            round(t["tokens"] / max(1e-6, t["last_token_at"] - t["first_token_at"]), 1) for t in traces
        ],
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "prefix_cache_queries": queries,
    }


def result_timing(traces: list[dict[str, Any]], started: float, ended: float) -> dict[str, Any]:
    """Fixed cost and steady rate of one run by results (requests finished inside the engines), from the same
    clocks: fixed = process start -> the first request any engine finished; steady = requests finished after
    that one step / (last result - first result)."""
    done = [t for t in traces if t.get("first_result_at")]
    if not done:
        return {"engines_with_results": 0}
    first_engine = min(done, key=lambda t: t["first_result_at"])
    first = first_engine["first_result_at"]
    last = max(t["last_result_at"] for t in done)
    results = sum(t["results"] for t in done)
    after = results - first_engine["first_results"]
    span = last - first
    return {
        "engines_with_results": len(done),
        "fixed_s": round(first - started, 2),
        "results_s": round(span, 2),
        "results": results,
        "steady_rows_per_s": round(after / span, 2) if span > 0 else None,
        "tail_s": round(ended - last, 2),
        "first_result_spread_s": round(max(t["first_result_at"] for t in done) - first, 2),
    }


_CORE_IDS = re.compile(r"local_rank=0, core ids=\[([\d,\s]*)\]")


def cores_beside_compute(watcher: Any, traces: list[dict[str, Any]]) -> dict[str, Any]:
    """Between the first and the last output token: the cores the path's processes used beside the engines' compute
    threads (vLLM's `VLLM::Worker`), in all and the largest by process. With every core given to the engines, each
    of these steals from a compute thread, and one engine's threads wait for each other at every step."""
    if not traces:
        return {}
    first = min(t["first_token_at"] for t in traces)
    last = max(t["last_token_at"] for t in traces)
    by_name = watcher.own_cores_between(first, last)
    beside = {name: cores for name, cores in by_name.items() if name != "VLLM::Worker"}
    return {
        "engine_compute_cores": by_name.get("VLLM::Worker"),
        "beside_compute_cores": round(sum(beside.values()), 3) if by_name else None,
        "beside_compute_top": dict(list(beside.items())[:8]),
    }


def bound_cores(texts: list[str]) -> list[list[int]]:
    """Every engine's cores, as vLLM logged them (`local_rank=0, core ids=[...]`, one line per engine start)."""
    found = []
    for text in texts:
        for m in _CORE_IDS.finditer(text):
            found.append(sorted(int(x) for x in m.group(1).replace(",", " ").split()))
    return found


def check_cores(found: list[list[int]], expected: list[list[int]]) -> str | None:
    """None if the engines computed on the cores the path was meant to get, else what differs (to flag loudly)."""
    if sorted(found) == sorted(expected):
        return None
    if found and len(found) < len(expected) and all(found.count(c) <= expected.count(c) for c in found):
        # Right cores, fewer engines: one never got work (an input smaller than a chunk per engine) or failed.
        return f"only {len(found)} of {len(expected)} engines started: bound to {found}, expected {expected}"
    return f"engines bound to {found or 'nothing logged'}, expected {expected}"


def ray_session_texts(ray_tmp: Path) -> list[str]:
    """The worker logs of the Ray session under RAY_TMPDIR=`ray_tmp` (where engine actors' vLLM lines go)."""
    logs = Path(os.path.realpath(ray_tmp / "ray" / "session_latest")) / "logs"
    files = sorted(logs.glob("worker-*.err")) + sorted(logs.glob("worker-*.out"))
    return [f.read_text(errors="replace") for f in files]


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def timing_columns() -> str:
    return f"{'fixed s':>8} {'gen s':>7} {'steady tok/s':>12} {'tail s':>7}"


def timing_cells(timing: dict[str, Any]) -> str:
    return (
        f"{fmt(timing.get('fixed_s')):>8} {fmt(timing.get('generation_s')):>7} "
        f"{fmt(timing.get('steady_tok_per_s')):>12} {fmt(timing.get('tail_s')):>7}"
    )


# Ray Data LLM's engines, one core each: a Ray worker-process setup hook (runtime_env `worker_process_setup_hook`,
# given only to the vLLM stage) claims the lowest free core with a lock file, as nightshift's engines do
# (cluster/cpu_cores.py), and hands it to vLLM; the engine-core subprocess inherits it.
CORE_LOCKS_ENV = "NSBENCH_CORE_LOCKS"
_held: list[Any] = []


def claim_core_hook() -> None:
    if OMP_BIND in os.environ:
        return
    from cluster.cpu_cores import claim_cores

    claim = claim_cores(1, directory=Path(os.environ[CORE_LOCKS_ENV]))
    if claim is not None:
        _held.append(claim)  # held for the worker process's life
        os.environ[OMP_BIND] = claim.omp_bind
