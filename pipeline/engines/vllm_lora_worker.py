"""What the vLLM engine asks of its worker processes when it serves LoRA adapters: counting adapter loads, and (on
CPU) vLLM 0.32's base-row fix. Runs inside vLLM's worker processes (not the engine actor), as vLLM's
`worker_extension_cls`: vLLM mixes this class into its Worker, and the engine calls its methods by name with
`collective_rpc` (vllm/v1/worker/worker_base.py; vllm/v1/serial_utils.py `run_method`), once per rank.

Counting. vLLM reports no adapter loads (its one LoRA metric, `vllm:lora_requests_info`, names the adapters running
and waiting; loads are logged at DEBUG only). An adapter swapped into a slot, and one read from disk into the
worker's CPU cache, are what adapter-aware routing saves, so they are counted where they happen: the worker's
LoRA manager's `activate_adapter` (a slot filled) and `_load_adapter` (read from disk).

The CPU fix. vLLM 0.32's CPU LoRA ops gather `lora_weights[lora_indices]`, and a base-model token's index -1 then
picks the LAST slot: base-model requests batched with adapter requests silently get an adapter applied (upstream:
vllm-project/vllm PRs 48421 and 49656, unmerged in 0.32; the GPU's Triton kernels skip -1). Patched in this
process: rows whose index is -1 get a zero input and index 0, so their LoRA delta is exactly zero; other rows are
unchanged. tests/e2e/test_lora_real_engine.py shows base rows of a mixed job equal to a job without LoRA.

This module imports vLLM only inside its methods: it is named (not imported) by the engine actor.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

EXTENSION = "pipeline.engines.vllm_lora_worker.LoraWorkerExtension"


class LoraWorkerExtension:
    """Mixed into vLLM's Worker (so `self` is the worker)."""

    def nightshift_lora_install(self, fix_cpu_base_rows: bool) -> bool:
        """Start counting this worker's adapter loads; on CPU, fix base rows in mixed batches. Idempotent."""
        if getattr(self, "_nightshift_lora", None) is not None:
            return False
        manager = self.model_runner.lora_manager  # the worker's LRUCacheWorkerLoRAManager
        slots = manager._adapter_manager  # its LRUCacheLoRAModelManager: the max_loras slots
        counts: dict[str, Any] = {"slot_loads": Counter(), "disk_loads": Counter(), "load_seconds": 0.0}
        self._nightshift_lora = counts

        read_from_disk = manager._load_adapter

        def _load_adapter(lora_request):
            started = time.perf_counter()
            try:
                return read_from_disk(lora_request)
            finally:
                counts["disk_loads"][lora_request.lora_name] += 1
                counts["load_seconds"] += time.perf_counter() - started

        fill_slot = slots.activate_adapter

        def activate_adapter(lora_id):
            held = set(slots.lora_index_to_id)
            started = time.perf_counter()
            filled = fill_slot(lora_id)
            if filled or lora_id not in held:
                counts["slot_loads"][lora_id] += 1
                counts["load_seconds"] += time.perf_counter() - started
            return filled

        manager._load_adapter = _load_adapter
        slots.activate_adapter = activate_adapter
        if fix_cpu_base_rows:
            _fix_cpu_base_rows()
        return True

    def nightshift_lora_stats(self) -> dict[str, Any]:
        counts = getattr(self, "_nightshift_lora", None)
        if counts is None:
            return {}
        return {
            "slot_loads": sum(counts["slot_loads"].values()),
            "disk_loads": sum(counts["disk_loads"].values()),
            "disk_loads_by_adapter": dict(counts["disk_loads"]),
            "load_seconds": round(counts["load_seconds"], 4),
        }


def _fix_cpu_base_rows() -> None:
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    if getattr(ops, "_nightshift_base_rows_fixed", False):
        return

    def without_base_rows(inputs, indices):
        if indices.dim() != 1 or inputs.shape[0] != indices.shape[0]:
            return inputs, indices
        base = indices < 0
        if not bool(base.any()):
            return inputs, indices
        return inputs.masked_fill(base.unsqueeze(-1), 0), indices.clamp(min=0)

    shrink, expand, expand_slice = ops.bgmv_shrink, ops.bgmv_expand, ops.bgmv_expand_slice

    def bgmv_shrink(inputs, weights, out, indices, scaling=1.0):
        inputs, indices = without_base_rows(inputs, indices)
        return shrink(inputs, weights, out, indices, scaling)

    def bgmv_expand(inputs, weights, out, indices, add_inputs=True):
        inputs, indices = without_base_rows(inputs, indices)
        return expand(inputs, weights, out, indices, add_inputs)

    def bgmv_expand_slice(inputs, weights, out, indices, slice_offset, slice_size, add_inputs=True):
        inputs, indices = without_base_rows(inputs, indices)
        return expand_slice(inputs, weights, out, indices, slice_offset, slice_size, add_inputs)

    # The sgmv_* ops call the module's globals; the CPU punica wrapper imported the bgmv names itself.
    for module in (ops, punica_cpu):
        module.bgmv_shrink, module.bgmv_expand, module.bgmv_expand_slice = (
            bgmv_shrink,
            bgmv_expand,
            bgmv_expand_slice,
        )
    ops._nightshift_base_rows_fixed = True
