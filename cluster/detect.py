"""Detect a node's accelerators from the vendor tools: NVIDIA, then AMD, else CPU.

The parsers are pure functions of the tool's text output (unit-tested against recorded real outputs); the only
side effects live in `run_tool` and `detect_node`. A vendor tool that is missing, fails or prints nothing useful
is a warning, never a crash: the node then falls through to the next vendor, and finally to CPU.

Commands:
- NVIDIA: `nvidia-smi --query-gpu=index,name,memory.total,compute_cap,uuid,driver_version --format=csv,noheader,nounits`
  (drivers older than R510 reject `compute_cap`: the query is retried without it and the capability left unknown).
- AMD: `amd-smi static --json`; fallback `rocm-smi --showproductname --showmeminfo vram --json`.
  amd-smi's JSON shape changed across ROCm releases (a bare list in 6.x, `{"gpu_data": [...]}` later; sizes as
  `{"value": N, "unit": "MB"}`, `"N MB"` or a bare number), so the AMD parsers look values up defensively.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.inventory import Accelerator, NodeInventory
from cluster.stacks import EngineStack, engine_stack_for

__all__ = [
    "NVIDIA_QUERY_FIELDS",
    "SmiOutputError",
    "ToolResult",
    "detect_node",
    "engine_stack_for",
    "EngineStack",
    "normalize_gfx_target",
    "parse_amd_smi_json",
    "parse_nvidia_smi_csv",
    "parse_rocm_smi_json",
    "run_tool",
]

NVIDIA_QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "name",
    "memory.total",
    "compute_cap",
    "uuid",
    "driver_version",
)
_NVIDIA_MISSING = {"", "n/a", "[n/a]", "[not supported]", "not supported"}
_AMD_MISSING = {"", "n/a", "na", "unknown"}


class SmiOutputError(ValueError):
    """A vendor tool printed something this module cannot read."""


@dataclass(frozen=True)
class ToolResult:
    """What one vendor-tool invocation printed."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return (self.stdout + "\n" + self.stderr).strip()


ToolRunner = Callable[[Sequence[str]], "ToolResult | None"]


def run_tool(argv: Sequence[str], timeout: float = 60.0) -> ToolResult | None:
    """Run a vendor tool found on PATH; None when it is not installed."""
    executable = shutil.which(argv[0])
    if executable is None:
        return None
    try:
        completed = subprocess.run(
            [executable, *argv[1:]], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        # A hung driver (nvidia-smi can block for minutes on a wedged GPU) must not hang node startup.
        return ToolResult(returncode=-1, stdout="", stderr=f"{argv[0]} did not finish: {exc}")
    return ToolResult(completed.returncode, completed.stdout, completed.stderr)


# --------------------------------------------------------------------------------------------- NVIDIA


def _nvidia_value(text: str) -> str | None:
    value = text.strip()
    return None if value.lower() in _NVIDIA_MISSING else value


def _mib(text: str | None) -> int | None:
    """'81559' (nounits) or '81559 MiB' -> 81559."""
    if text is None:
        return None
    match = re.match(r"^\s*(\d+(?:\.\d+)?)", text)
    return int(float(match.group(1))) if match else None


def parse_nvidia_smi_csv(text: str, fields: Sequence[str] = NVIDIA_QUERY_FIELDS) -> list[Accelerator]:
    """Parse `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits` output."""
    devices: list[Accelerator] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(fields):
            raise SmiOutputError(
                f"nvidia-smi line {line_number} has {len(cells)} fields, expected {len(fields)} "
                f"({', '.join(fields)}): {line!r}"
            )
        row = dict(zip(fields, cells, strict=True))
        index = _nvidia_value(row.get("index", ""))
        name = _nvidia_value(row.get("name", ""))
        if index is None or not index.isdigit() or name is None:
            raise SmiOutputError(f"nvidia-smi line {line_number} lacks an index or a name: {line!r}")
        devices.append(
            Accelerator(
                vendor="cuda",
                index=int(index),
                model=name,
                memory_mib=_mib(_nvidia_value(row.get("memory.total", ""))),
                compute_capability=_nvidia_value(row.get("compute_cap", "")),
                uuid=_nvidia_value(row.get("uuid", "")),
                driver_version=_nvidia_value(row.get("driver_version", "")),
            )
        )
    return devices


# --------------------------------------------------------------------------------------------- AMD


def normalize_gfx_target(text: str | None) -> str | None:
    """'gfx942:sramecc+:xnack-' -> 'gfx942'; rocm-smi's 'gfx11001' -> 'gfx1101'; 'N/A' -> None.

    Some rocm-smi releases print KFD's gfx_target_version digits unpadded-joined: an RX 7800 XT (gfx1101,
    target version 11.0.1) shows as 'gfx11001'. No real target has five digits, so that form is unambiguous.
    """
    if text is None:
        return None
    target = str(text).strip().lower().split(":", 1)[0]
    if target in _AMD_MISSING:
        return None
    five_digit = re.fullmatch(r"gfx(\d{2})0(\d)([0-9a-f])", target)
    if five_digit:
        major, minor, stepping = five_digit.groups()
        return f"gfx{major}{minor}{stepping}"
    return target if re.fullmatch(r"gfx[0-9a-f]+", target) else None


def _json_payload(text: str, tool: str) -> Any:
    """The JSON document in a tool's output, skipping warning lines some releases print before it."""
    for match in re.finditer(r"^[\[{]", text, flags=re.MULTILINE):
        try:
            payload, _ = json.JSONDecoder().raw_decode(text[match.start() :])
        except json.JSONDecodeError:
            continue
        return payload
    raise SmiOutputError(f"{tool} printed no JSON document: {text.strip()[:200]!r}")


def _amd_text(value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list)):
        return None
    text = str(value).strip()
    return None if text.lower() in _AMD_MISSING else text


_SIZE_UNITS_TO_MIB = {
    "b": 1 / 1024**2,
    "kb": 1 / 1024,
    "kib": 1 / 1024,
    "mb": 1,
    "mib": 1,
    "gb": 1024,
    "gib": 1024,
}


def _amd_size_mib(value: Any) -> int | None:
    """amd-smi VRAM size in any of its shapes -> MiB. amd-smi's 'MB' is MiB (a 24 GiB card reports 24560 MB)."""
    if isinstance(value, dict):
        number, unit = value.get("value"), str(value.get("unit", "MB"))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = value, "MB"
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if not match:
            return None
        number, unit = match.group(1), match.group(2) or "MB"
    else:
        return None
    try:
        scale = _SIZE_UNITS_TO_MIB[unit.strip().lower()]
        return int(round(float(number) * scale))
    except (KeyError, TypeError, ValueError):
        return None


def _amd_gpu_entries(payload: Any) -> list[dict[str, Any]]:
    if isinstance(payload, dict):
        payload = payload.get("gpu_data", payload.get("gpus", [payload]))
    if not isinstance(payload, list):
        raise SmiOutputError("amd-smi JSON is neither a list of GPUs nor {'gpu_data': [...]}")
    # On APUs and EPYC hosts `amd-smi static` also lists CPUs ({"cpu": 0, ...}); only GPU entries count.
    return [entry for entry in payload if isinstance(entry, dict) and "cpu" not in entry]


def parse_amd_smi_json(text: str) -> list[Accelerator]:
    """Parse `amd-smi static --json` (ROCm 6.x list form or the later `{"gpu_data": [...]}` form)."""
    devices: list[Accelerator] = []
    for position, entry in enumerate(_amd_gpu_entries(_json_payload(text, "amd-smi"))):
        asic = entry.get("asic") if isinstance(entry.get("asic"), dict) else {}
        board = entry.get("board") if isinstance(entry.get("board"), dict) else {}
        vram = entry.get("vram") if isinstance(entry.get("vram"), dict) else {}
        driver = entry.get("driver") if isinstance(entry.get("driver"), dict) else {}
        device_id = _amd_text(asic.get("device_id"))
        model = (
            _amd_text(asic.get("market_name"))
            or _amd_text(board.get("product_name"))
            or f"AMD GPU {device_id or 'unknown'}"
        )
        index = entry.get("gpu", position)
        devices.append(
            Accelerator(
                vendor="rocm",
                index=int(index) if str(index).isdigit() else position,
                model=model,
                memory_mib=_amd_size_mib(vram.get("size", vram.get("vram_size"))),
                gfx_target=normalize_gfx_target(_amd_text(asic.get("target_graphics_version"))),
                uuid=_amd_text(entry.get("uuid")),
                driver_version=_amd_text(driver.get("version", driver.get("driver_version"))),
            )
        )
    return devices


def _lookup(card: dict[str, Any], *names: str) -> str | None:
    """Case-insensitive key lookup: rocm-smi renamed 'Card series' to 'Card Series' between releases."""
    folded = {str(key).strip().lower(): value for key, value in card.items()}
    for name in names:
        value = _amd_text(folded.get(name.lower()))
        if value is not None:
            return value
    return None


def parse_rocm_smi_json(text: str) -> list[Accelerator]:
    """Parse `rocm-smi --showproductname --showmeminfo vram --json` (keys 'card0', 'card1', ...)."""
    payload = _json_payload(text, "rocm-smi")
    if not isinstance(payload, dict):
        raise SmiOutputError("rocm-smi JSON is not an object keyed by card")
    cards = sorted(
        ((int(key[4:]), value) for key, value in payload.items() if re.fullmatch(r"card\d+", str(key))),
        key=lambda item: item[0],
    )
    devices: list[Accelerator] = []
    for index, card in cards:
        if not isinstance(card, dict):
            continue
        series = _lookup(card, "Card Series", "Card series")
        # Older releases print the PCI device id ('0x744c') as the series; the device name is better then.
        if series is None or re.fullmatch(r"0x[0-9a-fA-F]+", series):
            series = _lookup(card, "Device Name", "Card Model", "Card model") or series or "AMD GPU"
        total_bytes = _lookup(card, "VRAM Total Memory (B)")
        devices.append(
            Accelerator(
                vendor="rocm",
                index=index,
                model=series,
                memory_mib=int(total_bytes) // 1024**2 if total_bytes and total_bytes.isdigit() else None,
                gfx_target=normalize_gfx_target(_lookup(card, "GFX Version")),
                uuid=_lookup(card, "Unique ID"),
            )
        )
    return devices


# --------------------------------------------------------------------------------------------- detection


def _cpu_count() -> int:
    # Affinity, not os.cpu_count(): in a container or under taskset only these cores are ours.
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no output")


def _detect_nvidia(run: ToolRunner, warnings: list[str]) -> list[Accelerator]:
    def query(fields: Sequence[str]) -> ToolResult | None:
        return run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])

    fields: Sequence[str] = NVIDIA_QUERY_FIELDS
    result = query(fields)
    if result is None:
        return []
    if result.returncode != 0 and "not a valid field" in result.output:
        fields = tuple(field for field in NVIDIA_QUERY_FIELDS if field != "compute_cap")
        result = query(fields)
        if result is None:
            return []
    if result.returncode != 0:
        warnings.append(f"nvidia-smi failed (exit {result.returncode}): {_first_line(result.output)}")
        return []
    try:
        return parse_nvidia_smi_csv(result.stdout, fields)
    except SmiOutputError as exc:
        warnings.append(str(exc))
        return []


def _detect_amd(run: ToolRunner, warnings: list[str]) -> tuple[list[Accelerator], str]:
    attempts: tuple[tuple[str, list[str], Callable[[str], list[Accelerator]]], ...] = (
        ("amd-smi", ["amd-smi", "static", "--json"], parse_amd_smi_json),
        (
            "rocm-smi",
            ["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"],
            parse_rocm_smi_json,
        ),
    )
    for tool, argv, parse in attempts:
        result = run(argv)
        if result is None:
            continue
        if result.returncode != 0:
            warnings.append(f"{tool} failed (exit {result.returncode}): {_first_line(result.output)}")
            continue
        try:
            devices = parse(result.stdout)
        except SmiOutputError as exc:
            warnings.append(str(exc))
            continue
        if devices:
            return devices, tool
    return [], ""


def detect_node(run: ToolRunner = run_tool) -> NodeInventory:
    """Inventory this node: NVIDIA GPUs if nvidia-smi lists any, else AMD GPUs, else its CPUs.

    `run` is the seam to the vendor tools (tests pass a fake; the default looks them up on PATH).
    """
    warnings: list[str] = []
    cpu_count, memory_bytes = _cpu_count(), _memory_bytes()

    nvidia = _detect_nvidia(run, warnings)
    if nvidia:
        return NodeInventory(
            vendor="cuda",
            accelerators=nvidia,
            cpu_count=cpu_count,
            memory_bytes=memory_bytes,
            source="nvidia-smi",
            warnings=warnings + _stack_warnings(nvidia),
        )
    amd, tool = _detect_amd(run, warnings)
    if amd:
        return NodeInventory(
            vendor="rocm",
            accelerators=amd,
            cpu_count=cpu_count,
            memory_bytes=memory_bytes,
            source=tool,
            warnings=warnings + _stack_warnings(amd),
        )
    return NodeInventory(
        vendor="cpu", cpu_count=cpu_count, memory_bytes=memory_bytes, source="os", warnings=warnings
    )


def _stack_warnings(devices: Sequence[Accelerator]) -> list[str]:
    seen: list[str] = []
    for device in devices:
        warning = engine_stack_for(device).warning
        if warning and warning not in seen:
            seen.append(warning)
    return seen
