"""Typed results of accelerator detection: one `Accelerator` per device, one `NodeInventory` per node."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Vendor = Literal["cuda", "rocm", "cpu"]


class Accelerator(BaseModel):
    """One GPU as its vendor tool reports it."""

    model_config = ConfigDict(frozen=True)

    vendor: Literal["cuda", "rocm"] = Field(
        description="Software stack the device speaks: NVIDIA CUDA or AMD ROCm."
    )
    index: int = Field(
        ge=0, description="Device index as the vendor tool numbers it (nvidia-smi / amd-smi order)."
    )
    model: str = Field(
        description="Product name as reported, e.g. 'NVIDIA H100 80GB HBM3' or 'AMD Instinct MI300X'."
    )
    memory_mib: int | None = Field(
        default=None,
        ge=0,
        description="Device memory in MiB (nvidia-smi memory.total; amd-smi/rocm-smi VRAM size).",
    )
    compute_capability: str | None = Field(
        default=None,
        description="CUDA compute capability 'major.minor' (NVIDIA only; None if the driver cannot say).",
    )
    gfx_target: str | None = Field(
        default=None,
        description="AMD LLVM target, e.g. 'gfx942' (MI300X), 'gfx90a' (MI250), 'gfx1100' (RX 7900).",
    )
    uuid: str | None = Field(default=None, description="Stable device id, when the tool reports one.")
    driver_version: str | None = Field(
        default=None, description="Kernel driver version reported with the device."
    )

    @property
    def memory_gib(self) -> int | None:
        """Memory rounded to whole GiB: 81559 MiB (H100 80GB) -> 80, 196592 MiB (MI300X) -> 192."""
        if self.memory_mib is None:
            return None
        return round(self.memory_mib / 1024)


class NodeInventory(BaseModel):
    """What one node offers: its GPUs (all of one vendor) or, failing that, its CPUs."""

    vendor: Vendor = Field(description="'cuda' or 'rocm' when GPUs were found, else 'cpu'.")
    accelerators: list[Accelerator] = Field(
        default_factory=list,
        description="Every GPU the vendor tool listed, in its order; empty on CPU nodes.",
    )
    cpu_count: int = Field(ge=1, description="CPU cores this process may use (scheduler affinity).")
    memory_bytes: int | None = Field(default=None, ge=0, description="Physical system memory in bytes.")
    source: str = Field(description="Which tool produced the inventory: nvidia-smi, amd-smi, rocm-smi or os.")
    warnings: list[str] = Field(
        default_factory=list,
        description="Things the operator should know (tool failures, unknown devices...).",
    )
