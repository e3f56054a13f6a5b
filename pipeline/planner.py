"""The KV-cache budget: how many tokens of context an engine can hold, and the engine args that follow from it.

Everything here is arithmetic on a model's shape (pipeline.model_shape reads it from `config.json` and the sizes
in its safetensors headers) — no tensor is loaded and neither torch nor vLLM is imported, so a plan for a 70B
model takes milliseconds on a laptop. A batch's output budgets come from pipeline.max_tokens, memory sizes are
parsed and printed by pipeline.units.

The rules mirror how vLLM sizes its cache:
- KV bytes per token = 2 (K and V) × layers × KV heads × head_dim × bytes per element. MLA models (DeepSeek V2/V3)
  store one compressed latent per layer instead: layers × (kv_lora_rank + qk_rope_head_dim) × bytes.
- The cache is carved into blocks of `block_size` tokens; capacity = floor(budget / (block_size × bytes per token))
  blocks. On CPU the budget is exactly VLLM_CPU_KVCACHE_SPACE GiB; on GPUs it is what remains of
  memory × utilization after the weights and an activation reserve.
- A sequence of `max_model_len` tokens may need that many tokens of cache, so max_model_len / block_size blocks per
  sequence is the worst case the scheduler must be able to hold without preempting.
- A sharded engine (tensor_parallel_size × pipeline_parallel_size ranks, pipeline.topology) is planned per device:
  each rank holds its share of the weights and the KV of its own stage's layers and its own KV heads, in its own
  budget; vLLM gives every rank the same number of blocks, the smallest any rank can hold, so the engine holds
  that many tokens.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.model_shape import ModelShape, PlanError
from pipeline.topology import (
    MAX_TENSOR_PARALLEL,
    Topology,
    TopologyError,
    check_topology,
    kv_heads_per_rank,
    stage_layers,
    tensor_parallel_sizes,
)
from pipeline.units import GiB, fmt_bytes

# What `nightshift run` gives a CPU engine when nothing is set (VllmEngineArgs.cpu_kvcache_space_gib).
DEFAULT_CPU_KV_SPACE_GIB = 2
# vLLM's default max_num_seqs on most devices (it allows 1024 on 70+ GiB GPUs); past it, a bigger batch rarely
# buys throughput and costs latency.
MAX_NUM_SEQS_CAP = 256
# How many GPUs a node is assumed to have when the budget does not say: the usual 8-GPU server.
DEFAULT_DEVICES_PER_NODE = 8

# Block size vLLM picks when none is given, by device and attention kind. CPU: 128 (observed: the engine logs
# 364 blocks of 128 tokens at 1 GiB for the embedded model); its MLA kernel only compiles for 16. CUDA/ROCm: 16
# (CacheConfig.DEFAULT_BLOCK_SIZE); FlashMLA, the usual CUDA MLA backend, requires 64.
BLOCK_SIZES: dict[tuple[str, bool], int] = {
    ("cpu", False): 128,
    ("cpu", True): 16,
    ("gpu", False): 16,
    ("gpu", True): 64,
}

# Bytes per KV element for an explicit --kv-cache-dtype ("auto" follows the model's serving dtype). vLLM's
# quantized layouts with per-token scales (fp8_ds_mla, int8_per_token_head, ...) are not modelled and refused.
_KV_DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, protected_namespaces=())


class DeviceBudget(_Frozen):
    """The memory an engine may use, on one accelerator (gpu) or on the host (cpu)."""

    device: Literal["cpu", "gpu"] = Field(description="Where the engine runs.")
    memory_bytes: int | None = Field(
        default=None,
        description="GPU: device memory. CPU: host memory, used only to warn when weights + KV do not fit.",
    )
    utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="GPU: share of device memory vLLM may use (gpu_memory_utilization).",
    )
    cpu_kv_space_bytes: int | None = Field(
        default=None, description="CPU: the KV cache size, VLLM_CPU_KVCACHE_SPACE (whole GiB) in bytes."
    )
    activation_reserve_bytes: int | None = Field(
        default=None,
        description="GPU: memory kept for activations, CUDA graphs and runtime buffers; default see "
        "activation_reserve().",
    )
    devices_per_node: int | None = Field(
        default=None,
        ge=1,
        description="GPU: devices one node has, the most tensor_parallel_size ranks a suggestion puts on one "
        f"node; None: unknown ({DEFAULT_DEVICES_PER_NODE} assumed).",
    )

    @classmethod
    def cpu(cls, kv_space_gib: int = DEFAULT_CPU_KV_SPACE_GIB, host_memory_bytes: int | None = None):
        return cls(device="cpu", cpu_kv_space_bytes=kv_space_gib * GiB, memory_bytes=host_memory_bytes)

    @classmethod
    def gpu(
        cls,
        memory_bytes: int,
        utilization: float = 0.9,
        activation_reserve_bytes: int | None = None,
        devices_per_node: int | None = None,
    ):
        return cls(
            device="gpu",
            memory_bytes=memory_bytes,
            utilization=utilization,
            activation_reserve_bytes=activation_reserve_bytes,
            devices_per_node=devices_per_node,
        )


class StagePlan(_Frozen):
    """One pipeline stage of a sharded engine, per device: each of its tensor-parallel ranks holds the same."""

    stage: int = Field(description="Pipeline stage (0: the first, which holds the embeddings).")
    ranks: list[int] = Field(description="The stage's ranks, numbered stage-major as vLLM numbers them.")
    layers: int = Field(description="Decoder layers on this stage (vLLM's get_pp_indices split).")
    kv_heads: int = Field(description="KV heads each rank caches (replicated when ranks outnumber KV heads).")
    weights_bytes: int | None = Field(
        description="Weights on one device of the stage (≈ weights / ranks); None when unknown."
    )
    kv_budget_bytes: int = Field(description="Memory left for the KV cache on one device of the stage.")
    kv_bytes_per_token: int = Field(
        description="KV bytes one token occupies on one rank (its layers, heads)."
    )
    kv_blocks: int = Field(description="Blocks one rank's budget holds.")
    kv_capacity_tokens: int = Field(description="kv_blocks × block_size: tokens one rank's cache holds.")


class PoolPlan(_Frozen):
    """The KV budget of one accelerator pool and the engine args it supports."""

    pool: str = Field(description="Pool name (cpu, gpu, ...).")
    device: Literal["cpu", "gpu"] = Field(description="Where the pool's engines run.")
    weights_bytes: int | None = Field(
        description="Model weights in bytes; None when no weight files were found."
    )
    kv_budget_bytes: int = Field(
        description="Memory left for the KV cache (of a sharded engine: on each device; see stages)."
    )
    kv_cache_dtype: str = Field(description="KV cache dtype as given (auto = the model's dtype).")
    kv_bytes_per_token: int = Field(
        description="KV cache bytes one token occupies across all layers (of the whole model, unsharded)."
    )
    block_size: int = Field(description="Tokens per KV cache block.")
    kv_blocks: int = Field(
        description="Blocks that fit in the KV budget (of a sharded engine: the fewest any rank holds, as "
        "vLLM gives every rank that many)."
    )
    kv_capacity_tokens: int = Field(description="kv_blocks × block_size: tokens the cache holds at once.")
    context: int = Field(description="The max_model_len this plan was computed for.")
    max_concurrent_seqs: int = Field(
        description="Sequences that fit at once when every one grows to `context` tokens (0: not even one)."
    )
    recommended_max_model_len: int | None = Field(
        description="max_model_len to run with: `context`, or the largest that fits one sequence when it does "
        "not; None when not even one block fits."
    )
    recommended_max_num_seqs: int | None = Field(
        description=f"floor(capacity / recommended_max_model_len), between 1 and {MAX_NUM_SEQS_CAP}."
    )
    notes: list[str] = Field(default_factory=list, description="Assumptions behind the numbers.")
    warnings: list[str] = Field(default_factory=list, description="Things that will fail or waste memory.")
    tensor_parallel_size: int = Field(default=1, description="Ranks that split every layer of one engine.")
    pipeline_parallel_size: int = Field(default=1, description="Stages one engine's layers are split into.")
    weights_per_device_bytes: int | None = Field(
        default=None, description="Sharded engines: weights on one device (≈ weights / ranks)."
    )
    stages: list[StagePlan] = Field(
        default_factory=list, description="Sharded engines: what each pipeline stage's devices hold."
    )
    suggested_tensor_parallel_size: int | None = Field(
        default=None,
        description="When the weights leave no room for a KV cache: the tensor_parallel_size of the smallest "
        "engine that holds them and one sequence of `context` (None: no suggestion, or none found).",
    )
    suggested_pipeline_parallel_size: int | None = Field(
        default=None, description="The pipeline_parallel_size that goes with suggested_tensor_parallel_size."
    )

    @property
    def sharded(self) -> bool:
        return self.tensor_parallel_size * self.pipeline_parallel_size > 1


# PoolPlan fields that only a sharded engine, or one that does not fit its device, sets; a plain plan leaves them
# at their defaults (and `nightshift plan --json` leaves them out, so its output for one device is unchanged).
SHARDING_FIELDS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "weights_per_device_bytes",
    "stages",
    "suggested_tensor_parallel_size",
    "suggested_pipeline_parallel_size",
)


class ContextFit(_Frozen):
    """The context a batch needs: its longest request (prompt + output budget), rounded up to whole blocks."""

    requests: int = Field(description="Requests measured.")
    longest: int = Field(description="Largest prompt tokens + max_tokens over the requests.")
    mean: float = Field(description="Mean prompt tokens + max_tokens.")
    block_size: int = Field(description="Block size the context was rounded to.")
    model_limit: int = Field(description="The model's own context limit.")
    context: int = Field(
        description="Fitted max_model_len: longest rounded up to a block, capped at model_limit."
    )
    over_limit: int = Field(
        description="Requests needing more than model_limit (their output gets cut short)."
    )


class HistogramBucket(_Frozen):
    """Requests whose value lies in [low, high]."""

    low: int = Field(description="Smallest value in the bucket.")
    high: int = Field(description="Largest value in the bucket.")
    count: int = Field(description="Requests in the bucket.")


# --- the budget ------------------------------------------------------------------------------------------------


def kv_element_bytes(shape: ModelShape, kv_cache_dtype: str = "auto") -> int:
    """Bytes per cached element: the model's dtype for auto, else the named cache dtype."""
    if kv_cache_dtype == "auto":
        return shape.dtype_bytes
    try:
        return _KV_DTYPE_BYTES[kv_cache_dtype]
    except KeyError:
        known = ", ".join(["auto", *_KV_DTYPE_BYTES])
        raise PlanError(f"kv_cache_dtype {kv_cache_dtype!r} is not planned; use one of: {known}") from None


def kv_bytes_per_token(
    shape: ModelShape, kv_cache_dtype: str = "auto", layers: int | None = None, kv_heads: int | None = None
) -> int:
    """KV cache bytes one token occupies across all layers (full-attention accounting); with `layers` and
    `kv_heads`, on one rank of a sharded engine that holds that many of each."""
    element = kv_element_bytes(shape, kv_cache_dtype)
    layers = shape.layers if layers is None else layers
    if shape.is_mla:
        # One latent per layer, no separate K and V, no per-head copies (every tensor-parallel rank keeps it whole).
        return layers * ((shape.kv_lora_rank or 0) + (shape.qk_rope_head_dim or 0)) * element
    return 2 * layers * (shape.kv_heads if kv_heads is None else kv_heads) * shape.head_dim * element


def lora_slot_bytes(shape: ModelShape, max_loras: int, max_lora_rank: int) -> int:
    """Memory vLLM allocates for LoRA adapters as an engine with LoRA on starts, whichever adapters are loaded:
    per layer, a stack of `max_loras` slots of rank `max_lora_rank` for each linear module it wraps — qkv_proj
    (A: 3 slices of hidden in; B: q, k and v out), o_proj, gate_up_proj (2 slices) and down_proj — and once for the
    embeddings and the LM head (vocab and hidden each), in the model's dtype (vllm/lora/layers:
    `create_lora_weights`). Each slot holds A (rank × in) and B (out × rank). (Its index buffers, a few hundred KB,
    are left out.) Checked against a live vLLM 0.32 worker for SmolLM2-135M: 6,541,504 bytes at 1 × rank 8."""
    hidden = shape.hidden_size or shape.attention_heads * shape.head_dim
    q, kv = shape.attention_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    inter = shape.mlp_sizes[0] if shape.mlp_sizes else 4 * hidden
    per_rank_unit = (
        (3 * hidden + q + 2 * kv)  # qkv_proj: A per slice, B out
        + (q + hidden)  # o_proj
        + (2 * hidden + 2 * inter)  # gate_up_proj
        + (inter + hidden)  # down_proj
    )
    vocab = 2 * (
        (shape.vocab_size or 0) + hidden
    )  # embed_tokens (A: vocab × r, B: hidden) + lm_head (the reverse)
    return max_loras * max_lora_rank * (shape.layers * per_rank_unit + vocab) * shape.dtype_bytes


def weights_per_device(weights: int | None, ranks: int) -> int | None:
    """Weights one device of an engine of `ranks` ranks holds: weights / ranks, rounded up.

    An approximation of vLLM's sharding: tensor parallelism splits every linear layer and the vocab-parallel
    embedding and LM head evenly (the vocab padded to a multiple of 64 per rank, a few MB more), but keeps the
    norms whole on every rank; pipeline parallelism puts the embeddings on the first stage and the LM head on the
    last only, so those two stages hold somewhat more than the average (for Llama-3-70B, up to one 2.1 GB
    embedding matrix / tensor_parallel_size) and the middle stages less.
    """
    if weights is None:
        return None
    return -(-weights // ranks)


def activation_reserve(budget: DeviceBudget) -> int:
    """GPU memory held back from the KV cache for everything that is not weights.

    vLLM measures this by profiling a forward pass (activations, sampler logits) plus CUDA graphs and runtime
    buffers. Without a GPU we assume max(1 GiB, 5% of memory × utilization): enough for the small models,
    proportionally more on big cards where batches and graphs are bigger. It errs towards a smaller cache.
    """
    if budget.activation_reserve_bytes is not None:
        return budget.activation_reserve_bytes
    usable = int((budget.memory_bytes or 0) * budget.utilization)
    return max(GiB, usable // 20)


def kv_budget(budget: DeviceBudget, weights: int | None, ranks: int = 1) -> tuple[int, list[str], list[str]]:
    """Bytes for the KV cache on this device (on each device of an engine of `ranks` ranks), with the notes and
    warnings that explain them."""
    if budget.device == "cpu":
        return _cpu_kv_budget(budget, weights, ranks)
    if budget.memory_bytes is None:
        raise PlanError("a GPU plan needs the device memory (--gpu-memory, e.g. 80GiB)")
    if weights is None:
        raise PlanError(
            "no weight files (*.safetensors, *.bin) in the model directory: cannot subtract the weights from "
            "GPU memory"
        )
    usable = int(budget.memory_bytes * budget.utilization)
    # Every rank profiles and reserves its own activations and graphs, so each device keeps the whole reserve.
    reserve = activation_reserve(budget)
    if ranks > 1:
        return _sharded_gpu_kv_budget(budget, weights, ranks, usable, reserve)
    notes = [
        f"KV budget = {fmt_bytes(budget.memory_bytes)} × {budget.utilization:g} − weights {fmt_bytes(weights)} "
        f"− activation reserve {fmt_bytes(reserve)} (assumed max(1 GiB, 5% of memory × utilization))"
    ]
    left = usable - weights - reserve
    if left <= 0:
        return (
            0,
            notes,
            [
                f"weights ({fmt_bytes(weights)}) + reserve ({fmt_bytes(reserve)}) exceed memory × utilization "
                f"({fmt_bytes(usable)}): no room for a KV cache; use more GPUs (tensor parallel), a quantized "
                f"checkpoint or a higher gpu_memory_utilization"
            ],
        )
    return left, notes, []


def _sharded_gpu_kv_budget(
    budget: DeviceBudget, weights: int, ranks: int, usable: int, reserve: int
) -> tuple[int, list[str], list[str]]:
    on_device = weights_per_device(weights, ranks) or 0
    notes = [
        f"KV budget per device = {fmt_bytes(budget.memory_bytes or 0)} × {budget.utilization:g} − weights per "
        f"device {fmt_bytes(on_device)} (≈ {fmt_bytes(weights)} / {ranks} ranks; approximate: norms sit whole "
        f"on every rank, and under pipeline parallelism the embeddings on the first stage, the LM head on the "
        f"last) − activation reserve {fmt_bytes(reserve)} (assumed max(1 GiB, 5% of memory × utilization), on "
        f"every device)"
    ]
    left = usable - on_device - reserve
    if left <= 0:
        return (
            0,
            notes,
            [
                f"weights per device ({fmt_bytes(on_device)}) + reserve ({fmt_bytes(reserve)}) exceed memory × "
                f"utilization ({fmt_bytes(usable)}): no room for a KV cache on {ranks} devices"
            ],
        )
    return left, notes, []


def _cpu_kv_budget(
    budget: DeviceBudget, weights: int | None, ranks: int = 1
) -> tuple[int, list[str], list[str]]:
    space = (
        budget.cpu_kv_space_bytes if budget.cpu_kv_space_bytes is not None else DEFAULT_CPU_KV_SPACE_GIB * GiB
    )
    if ranks == 1:
        notes = [f"KV budget = VLLM_CPU_KVCACHE_SPACE={space // GiB} GiB (set with --cpu-kvcache-space)"]
    else:
        # vLLM's CPU worker sizes its cache from VLLM_CPU_KVCACHE_SPACE in each worker process: every rank
        # allocates the whole space for its own layers and KV heads, so the engine takes ranks × the space.
        notes = [
            f"KV budget per rank = VLLM_CPU_KVCACHE_SPACE={space // GiB} GiB (set with --cpu-kvcache-space): each "
            f"of the engine's {ranks} ranks allocates its own, {fmt_bytes(ranks * space)} in all"
        ]
    warnings = []
    if budget.memory_bytes and ranks * space + (weights or 0) > budget.memory_bytes:
        cache = fmt_bytes(space) if ranks == 1 else f"{ranks} ranks × {fmt_bytes(space)}"
        warnings.append(
            f"weights ({fmt_bytes(weights or 0)}) + KV cache ({cache}) exceed host memory "
            f"({fmt_bytes(budget.memory_bytes)}): vLLM refuses to allocate the cache; lower --cpu-kvcache-space"
        )
    return space, notes, warnings


def default_block_size(device: str, is_mla: bool) -> int:
    return BLOCK_SIZES[(device, is_mla)]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _layer_blocks_per_sequence(shape: ModelShape, context: int, block_size: int) -> int:
    """Per-layer blocks one sequence of `context` tokens holds (sliding layers keep only their window)."""
    blocks = -(-context // block_size)
    full_layers = shape.layers - shape.sliding_window_layers
    window_blocks = blocks
    if shape.sliding_window:
        # vLLM frees blocks that fell out of the window; one extra block covers a window not block-aligned.
        window_blocks = min(blocks, -(-shape.sliding_window // block_size) + 1)
    return full_layers * blocks + shape.sliding_window_layers * window_blocks


def max_sequences(shape: ModelShape, kv_blocks: int, context: int, block_size: int) -> int:
    """Sequences of `context` tokens that fit in `kv_blocks` blocks at once."""
    if context <= 0:
        return 0
    return kv_blocks * shape.layers // _layer_blocks_per_sequence(shape, context, block_size)


def _largest_fitting_context(shape: ModelShape, kv_blocks: int, block_size: int, limit: int) -> int | None:
    """The longest context (whole blocks, ≤ limit) of which one sequence fits; None if not even one block does."""
    low, high = 0, -(-limit // block_size)
    while low < high:  # fits(n blocks) is monotone: binary search the largest n that fits
        mid = (low + high + 1) // 2
        if max_sequences(shape, kv_blocks, mid * block_size, block_size) >= 1:
            low = mid
        else:
            high = mid - 1
    return min(low * block_size, limit) if low else None


def stage_plans(
    shape: ModelShape,
    budget: DeviceBudget,
    topology: Topology,
    block_size: int,
    kv_cache_dtype: str = "auto",
    lora_bytes: int = 0,
) -> tuple[list[StagePlan], list[str], list[str]]:
    """What each pipeline stage's devices hold (weights, KV budget, blocks), with the budget's notes and warnings.
    `lora_bytes`: the engine's LoRA slots (`lora_slot_bytes`), held beside the weights and sharded like them.

    Every tensor-parallel rank of a stage holds the stage's layers and kv_heads_per_rank KV heads of each; its
    blocks are its own budget over its own bytes per token. vLLM gives every rank the fewest blocks any rank can
    hold (kv_cache_utils `get_kv_cache_configs`), so the engine holds min(stage blocks) × block_size tokens.

    On CPU each rank has the whole VLLM_CPU_KVCACHE_SPACE: an engine of TP ranks that divide the KV heads and
    PP stages holds about TP × PP times the tokens of one unsharded engine (exactly so when the layers divide
    too) in TP × PP times the memory; past the KV heads, tensor ranks replicate heads and add memory, not tokens.
    """
    tp = topology.tensor_parallel_size
    held = shape.weights_bytes + lora_bytes if shape.weights_bytes is not None else None
    kv_bytes, notes, warnings = kv_budget(budget, held, topology.world)
    on_device = weights_per_device(held, topology.world)
    heads = kv_heads_per_rank(shape, tp)
    stages = []
    for stage, layers in enumerate(stage_layers(shape.layers, topology.pipeline_parallel_size)):
        per_token = kv_bytes_per_token(shape, kv_cache_dtype, layers=layers, kv_heads=heads)
        blocks = kv_bytes // (block_size * per_token)
        stages.append(
            StagePlan(
                stage=stage,
                ranks=list(range(stage * tp, (stage + 1) * tp)),
                layers=layers,
                kv_heads=heads,
                weights_bytes=on_device,
                kv_budget_bytes=kv_bytes,
                kv_bytes_per_token=per_token,
                kv_blocks=blocks,
                kv_capacity_tokens=blocks * block_size,
            )
        )
    return stages, notes, warnings


def plan_pool(
    shape: ModelShape,
    budget: DeviceBudget,
    context: int | None = None,
    block_size: int | None = None,
    kv_cache_dtype: str = "auto",
    pool: str | None = None,
    topology: Topology | None = None,
    lora: tuple[int, int] | None = None,
) -> PoolPlan:
    """The KV plan of one pool: capacity, sequences at `context` (default: the model's limit), recommended args.

    `topology`: how each engine is sharded (Topology.of(engine args)); default one device. When the weights leave
    a GPU no room for a KV cache, the plan names the smallest engine that holds them. `lora`: (max_loras,
    max_lora_rank) when the engines serve LoRA adapters: their slots are held beside the weights (on a GPU they
    come out of the KV budget; on CPU, whose cache has a fixed size, out of host memory)."""
    topology = topology or Topology()
    try:
        check_topology(shape, topology, f"this {shape.model_type} model")
    except TopologyError as exc:
        raise PlanError(str(exc)) from None
    block = block_size or default_block_size(budget.device, shape.is_mla)
    per_token = kv_bytes_per_token(shape, kv_cache_dtype)
    lora_bytes = lora_slot_bytes(shape, *lora) if lora else 0
    stages, notes, warnings = stage_plans(shape, budget, topology, block, kv_cache_dtype, lora_bytes)
    if lora:
        notes.append(
            f"LoRA: {lora[0]} adapter slot(s) of rank {lora[1]} take {fmt_bytes(lora_bytes)}, counted with the "
            "weights (vLLM allocates them as the engine starts, whichever adapters load)"
        )
    kv_bytes = stages[0].kv_budget_bytes
    blocks = min(stage.kv_blocks for stage in stages)
    limit = shape.max_model_len_limit
    ctx = context or limit
    suggested = None
    if budget.device == "gpu" and kv_bytes == 0:
        suggested, advice = _topology_advice(shape, budget, topology, min(ctx, limit), block, kv_cache_dtype)
        warnings.append(advice)
    notes.append(_per_token_note(shape, kv_cache_dtype))
    if topology.sharded:
        notes.append(_sharded_note(shape, topology, stages))
    notes.extend(shape.notes)
    if shape.sliding_window:
        notes.append(_sliding_note(shape))
    if ctx > limit:
        warnings.append(
            f"max_model_len {ctx:,} exceeds the model's limit of {limit:,}: vLLM refuses to start; "
            f"use {limit:,} or less"
        )
    fits = max_sequences(shape, blocks, ctx, block)
    recommended_len = min(ctx, limit)
    if max_sequences(shape, blocks, recommended_len, block) < 1:
        recommended_len = _largest_fitting_context(shape, blocks, block, limit)
        warnings.append(_no_fit_warning(ctx, blocks * block, recommended_len))
    recommended_seqs = None
    if recommended_len:
        at_len = max_sequences(shape, blocks, recommended_len, block)
        recommended_seqs = max(1, min(MAX_NUM_SEQS_CAP, at_len))
        if at_len > MAX_NUM_SEQS_CAP:
            notes.append(
                f"{at_len:,} sequences fit; max_num_seqs capped at {MAX_NUM_SEQS_CAP} (vLLM's default on most devices)"
            )
    return PoolPlan(
        pool=pool or budget.device,
        device=budget.device,
        weights_bytes=shape.weights_bytes,
        kv_budget_bytes=kv_bytes,
        kv_cache_dtype=kv_cache_dtype,
        kv_bytes_per_token=per_token,
        block_size=block,
        kv_blocks=blocks,
        kv_capacity_tokens=blocks * block,
        context=ctx,
        max_concurrent_seqs=fits,
        recommended_max_model_len=recommended_len,
        recommended_max_num_seqs=recommended_seqs,
        notes=notes,
        warnings=warnings,
        tensor_parallel_size=topology.tensor_parallel_size,
        pipeline_parallel_size=topology.pipeline_parallel_size,
        weights_per_device_bytes=stages[0].weights_bytes if topology.sharded else None,
        stages=stages if topology.sharded else [],
        suggested_tensor_parallel_size=suggested.tensor_parallel_size if suggested else None,
        suggested_pipeline_parallel_size=suggested.pipeline_parallel_size if suggested else None,
    )


def smallest_fitting_topology(
    shape: ModelShape, budget: DeviceBudget, context: int, block_size: int, kv_cache_dtype: str = "auto"
) -> tuple[Topology, list[StagePlan]] | None:
    """The smallest engine that holds the weights and one sequence of `context` tokens, and what its stages hold.

    Tensor parallelism first, within one node (budget.devices_per_node, else 8): the smallest tensor_parallel_size
    the model takes (pipeline.topology) that fits. If none does, the fewest devices tensor × pipeline parallel
    (the most tensor ranks for a given count: they stay on one node), up to MAX_TENSOR_PARALLEL devices. None:
    nothing that size fits."""
    per_node = budget.devices_per_node or DEFAULT_DEVICES_PER_NODE
    candidates = sorted(
        (
            Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp)
            for tp in tensor_parallel_sizes(shape, per_node)
            for pp in range(1, min(shape.layers, MAX_TENSOR_PARALLEL // tp) + 1)
        ),
        key=lambda t: (t.pipeline_parallel_size > 1, t.world, t.pipeline_parallel_size),
    )
    for topology in candidates:
        stages, _, _ = stage_plans(shape, budget, topology, block_size, kv_cache_dtype)
        if max_sequences(shape, min(stage.kv_blocks for stage in stages), context, block_size) >= 1:
            return topology, stages
    return None


def _topology_advice(
    shape: ModelShape,
    budget: DeviceBudget,
    topology: Topology,
    context: int,
    block_size: int,
    kv_cache_dtype: str,
) -> tuple[Topology | None, str]:
    """The smallest engine that fits, as a topology and a sentence that says why with the numbers."""
    weights = shape.weights_bytes or 0
    memory = fmt_bytes(budget.memory_bytes or 0)
    devices = (
        f"one {memory} device" if topology.world == 1 else f"{topology.world} {memory} devices ({topology})"
    )
    lead = (
        f"the checkpoint's {fmt_bytes(weights)} ({weights / 1e9:.3g} GB) of weights leave no room for a KV "
        f"cache on {devices} at {budget.utilization:g} utilization"
    )
    per_node = budget.devices_per_node or DEFAULT_DEVICES_PER_NODE
    node = f"one node of {per_node} devices" + ("" if budget.devices_per_node else " (assumed)")
    holds = f"holds them and one {context:,}-token sequence"
    found = smallest_fitting_topology(shape, budget, context, block_size, kv_cache_dtype)
    if found is None:
        return None, (
            f"{lead}; no engine of up to {MAX_TENSOR_PARALLEL} devices (tensor_parallel_size within {node}) "
            f"{holds}: use a quantized checkpoint or devices with more memory"
        )
    best, stages = found
    tokens = min(stage.kv_capacity_tokens for stage in stages)
    sizes = (
        f"{fmt_bytes(stages[0].weights_bytes or 0)} of weights per device, a KV cache of {tokens:,} tokens"
    )
    if best.pipeline_parallel_size == 1:
        return best, (
            f"{lead}; the smallest tensor_parallel_size that {holds} is {best.tensor_parallel_size} ({sizes})"
        )
    return best, (
        f"{lead}; no tensor_parallel_size within {node} {holds}; the smallest engine that does is "
        f"tensor_parallel_size {best.tensor_parallel_size} × pipeline_parallel_size "
        f"{best.pipeline_parallel_size} ({best.world} devices, {sizes})"
    )


def _sharded_note(shape: ModelShape, topology: Topology, stages: list[StagePlan]) -> str:
    tp = topology.tensor_parallel_size
    split = ", ".join(str(stage.layers) for stage in stages)
    layers = (
        f"its stage's layers ({shape.layers} split {split}, as vLLM splits them)"
        if len(stages) > 1
        else f"all {shape.layers} layers"
    )
    if shape.is_mla:
        heads = "the whole MLA latent (vLLM keeps it on every tensor rank)"
    elif tp > shape.kv_heads:
        heads = (
            f"1 of the {shape.kv_heads} KV heads, each replicated on {tp // shape.kv_heads} ranks "
            f"(tensor_parallel_size {tp} > {shape.kv_heads} KV heads; vLLM keeps at least one per rank)"
        )
    else:
        heads = f"{stages[0].kv_heads} of the {shape.kv_heads} KV heads"
    tightest = min(stages, key=lambda stage: stage.kv_blocks)
    per_token = ", ".join(f"{stage.kv_bytes_per_token:,}" for stage in stages)
    return (
        f"{topology} ({topology.world} ranks per engine): each rank caches {layers} × {heads}; KV bytes/token "
        f"per rank {per_token}{' by stage' if len(stages) > 1 else ''}; vLLM gives every rank the blocks of the "
        f"tightest (stage {tightest.stage}: {tightest.kv_blocks:,})"
    )


def _per_token_note(shape: ModelShape, kv_cache_dtype: str) -> str:
    element = kv_element_bytes(shape, kv_cache_dtype)
    dtype = shape.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if shape.is_mla:
        return (
            f"KV bytes/token = {shape.layers} layers × (kv_lora_rank {shape.kv_lora_rank} + qk_rope_head_dim "
            f"{shape.qk_rope_head_dim}) × {element} B ({dtype}): MLA caches one latent per layer"
        )
    return (
        f"KV bytes/token = 2 × {shape.layers} layers × {shape.kv_heads} KV heads × head_dim {shape.head_dim} "
        f"× {element} B ({dtype})"
    )


def _sliding_note(shape: ModelShape) -> str:
    return (
        f"{shape.sliding_window_layers} of {shape.layers} layers use a {shape.sliding_window:,}-token sliding "
        f"window: capacity in tokens is the full-attention figure vLLM reports, but a sequence holds only its "
        f"window in those layers, so more sequences fit than the full-attention estimate (assumes vLLM's "
        f"hybrid KV cache manager, its default, which frees blocks outside the window)"
    )


def _no_fit_warning(context: int, capacity: int, recommended: int | None) -> str:
    if recommended is None:
        return f"the KV cache ({capacity:,} tokens) holds not even one block: no context fits"
    return (
        f"max_model_len {context:,} does not fit even one sequence in the KV cache ({capacity:,} tokens): "
        f"vLLM refuses to start; use max_model_len {recommended:,} or a larger KV budget"
    )


# --- fitting the context to the data ---------------------------------------------------------------------------


def fit_context(needs: list[int], block_size: int, model_limit: int) -> ContextFit:
    """The smallest whole-block max_model_len that holds every request's prompt + max_tokens (≤ model_limit)."""
    if not needs:
        raise PlanError("no requests to fit the context to")
    longest = max(needs)
    return ContextFit(
        requests=len(needs),
        longest=longest,
        mean=sum(needs) / len(needs),
        block_size=block_size,
        model_limit=model_limit,
        context=min(round_up(longest, block_size), model_limit),
        over_limit=sum(1 for n in needs if n > model_limit),
    )


def length_histogram(lengths: list[int]) -> list[HistogramBucket]:
    """Counts in power-of-two buckets ([0,31], [32,63], [64,127], ...), from the shortest to the longest value."""
    if not lengths:
        return []
    counts: dict[int, int] = {}
    for value in lengths:
        counts[_bucket(value)] = counts.get(_bucket(value), 0) + 1
    first, last = _bucket(min(lengths)), _bucket(max(lengths))
    buckets = []
    for exponent in range(first, last + 1):
        low = 0 if exponent == 4 else 2**exponent
        buckets.append(HistogramBucket(low=low, high=2 ** (exponent + 1) - 1, count=counts.get(exponent, 0)))
    return buckets


def _bucket(value: int) -> int:
    return max(4, int(math.log2(value)) if value > 0 else 4)
