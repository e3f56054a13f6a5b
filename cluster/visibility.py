"""Device-visibility environment for `ray start`: which GPUs Ray may hand to engine actors.

Ray assigns GPUs to workers by rewriting one visibility variable per vendor, so the raylet must start with that
variable describing exactly the devices the node advertises:

- NVIDIA: `CUDA_VISIBLE_DEVICES`. nvidia-smi numbers devices in PCI bus order while CUDA's default order is
  "fastest first", so whenever we write indices we also pin `CUDA_DEVICE_ORDER=PCI_BUS_ID` to make them agree.
- AMD: `HIP_VISIBLE_DEVICES`. Ray >= 2.45 (ray-project/ray#51104) uses HIP_VISIBLE_DEVICES and refuses a lone
  ROCR_VISIBLE_DEVICES; the rule in `ray/_private/accelerators/amd_gpu.py`
  (`AMDGPUAcceleratorManager.get_visible_accelerator_ids_env_var`) is:

      if HIP_VISIBLE_DEVICES not in os.environ and "ROCR_VISIBLE_DEVICES" in os.environ:
          raise RuntimeError("Please use HIP_VISIBLE_DEVICES instead of ROCR_VISIBLE_DEVICES")

  Having both set is accepted since ray-project/ray#53757. ROCR masks devices below HIP, and HIP then numbers the
  survivors 0..n-1, so a user's `ROCR_VISIBLE_DEVICES=2,3` is translated by *adding* `HIP_VISIBLE_DEVICES=0,1`
  (keeping ROCR as is) — never by copying the ROCR ids into HIP, which would address the wrong devices.

Entries may be indices or UUIDs. HIP indices are positions in amd-smi's order; on nodes mixing GPU architectures
the HIP runtime may enumerate in another order, so such nodes should name devices by UUID.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cluster.inventory import Accelerator, NodeInventory

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
HIP_VISIBLE_DEVICES = "HIP_VISIBLE_DEVICES"
ROCR_VISIBLE_DEVICES = "ROCR_VISIBLE_DEVICES"


class VisibilityError(ValueError):
    """A visibility variable names devices this node does not have."""


def _entries(spec: str) -> list[str]:
    return [entry.strip() for entry in spec.split(",") if entry.strip()]


def _select(devices: Sequence[Accelerator], spec: str, variable: str, by_position: bool) -> list[Accelerator]:
    """The devices `spec` names, in its order; indices are positions in `devices` or device indices."""
    chosen: list[Accelerator] = []
    for entry in _entries(spec):
        if entry.isdigit():
            position = int(entry)
            if by_position:
                match = devices[position] if position < len(devices) else None
            else:
                match = next((device for device in devices if device.index == position), None)
        else:
            match = next(
                (device for device in devices if device.uuid and device.uuid.lower() == entry.lower()), None
            )
        if match is None:
            raise VisibilityError(
                f"{variable}={spec!r} names device {entry!r}, but this node has "
                f"{len(devices)} visible device(s) (give indices 0..{len(devices) - 1} or UUIDs)"
            )
        chosen.append(match)
    return chosen


def _rocr_base(inventory: NodeInventory, env: Mapping[str, str]) -> list[Accelerator]:
    """AMD devices left after ROCR_VISIBLE_DEVICES, which is applied below HIP and uses physical indices."""
    if ROCR_VISIBLE_DEVICES in env:
        return _select(
            inventory.accelerators, env[ROCR_VISIBLE_DEVICES], ROCR_VISIBLE_DEVICES, by_position=False
        )
    return list(inventory.accelerators)


def visible_devices(inventory: NodeInventory, env: Mapping[str, str]) -> list[Accelerator]:
    """The GPUs the user's environment already lets this node use (all of them when nothing is set)."""
    if inventory.vendor == "cuda":
        if CUDA_VISIBLE_DEVICES in env:
            return _select(
                inventory.accelerators, env[CUDA_VISIBLE_DEVICES], CUDA_VISIBLE_DEVICES, by_position=False
            )
        return list(inventory.accelerators)
    if inventory.vendor == "rocm":
        base = _rocr_base(inventory, env)
        if HIP_VISIBLE_DEVICES in env:
            return _select(base, env[HIP_VISIBLE_DEVICES], HIP_VISIBLE_DEVICES, by_position=True)
        return base
    return []


def visibility_env(
    inventory: NodeInventory, env: Mapping[str, str], usable: Sequence[Accelerator], *, always: bool = False
) -> tuple[dict[str, str], list[str]]:
    """Variables to set for `ray start` so Ray sees exactly `usable`, and a note per change made.

    Returns ({}, []) when the environment already matches (nothing set and every device usable), unless `always`:
    then the variables are written even so (a benchmark pins every run to named devices, and records them).
    """
    notes: list[str] = []
    if inventory.vendor == "cuda":
        if not always and CUDA_VISIBLE_DEVICES not in env and len(usable) == len(inventory.accelerators):
            return {}, notes
        overrides = {CUDA_VISIBLE_DEVICES: ",".join(str(device.index) for device in usable)}
        if env.get(CUDA_DEVICE_ORDER, "PCI_BUS_ID") != "PCI_BUS_ID":
            notes.append(
                f"{CUDA_DEVICE_ORDER}={env[CUDA_DEVICE_ORDER]} replaced by PCI_BUS_ID: the device indices "
                "written to CUDA_VISIBLE_DEVICES are nvidia-smi's, which follow PCI bus order"
            )
        if env.get(CUDA_DEVICE_ORDER) != "PCI_BUS_ID":
            overrides[CUDA_DEVICE_ORDER] = "PCI_BUS_ID"
        return overrides, notes
    if inventory.vendor == "rocm":
        base = _rocr_base(inventory, env)
        rocr_alone = ROCR_VISIBLE_DEVICES in env and HIP_VISIBLE_DEVICES not in env
        if not always and not rocr_alone and HIP_VISIBLE_DEVICES not in env and len(usable) == len(base):
            return {}, notes
        positions = [str(base.index(device)) for device in usable]
        if rocr_alone:
            notes.append(
                f"{ROCR_VISIBLE_DEVICES}={env[ROCR_VISIBLE_DEVICES]} alone is refused by Ray >= 2.45; "
                f"adding {HIP_VISIBLE_DEVICES}={','.join(positions)} (HIP numbers the ROCR-visible devices from 0)"
            )
        return {HIP_VISIBLE_DEVICES: ",".join(positions)}, notes
    return {}, notes
