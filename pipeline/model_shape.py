"""A model's shape as the KV cache sees it: read from its `config.json` and its safetensors headers.

No tensor is loaded and neither torch nor vLLM is imported. The readers follow vLLM's: the text model of a
multimodal config, the serving dtype dtype=auto picks, the context limit (config keys, tokenizer limit, RoPE
scaling) and the sliding-window layers. Architectures whose cache is not plain attention (sparse MLA, hybrid
recurrent/state-space models) are refused with PlanError.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}

# Config keys vLLM reads for the model's context limit, in its order; the smallest present wins.
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already the scaled length (vLLM does not multiply by `factor`).
_ROPE_PRESCALED = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
# Markers of layers that keep recurrent state instead of a KV cache (Mamba, linear attention, ...).
_HYBRID_KEYS = (
    "hybrid_override_pattern",
    "layers_block_type",
    "attn_layer_indices",
    "linear_attn_config",
    "full_attention_interval",
    "mamba_d_state",
    "ssm_cfg",
)
_HYBRID_TYPES = (
    "mamba",
    "rwkv",
    "jamba",
    "zamba",
    "bamba",
    "falcon_h1",
    "nemotron_h",
    "lfm2",
    "hybrid",
    "qwen3_next",
)
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "chunked_attention"}
_SPARSE_MLA_TYPES = {"deepseek_v32", "deepseek_v4"}


class PlanError(ValueError):
    """The model or the budget cannot be planned; the message says why and what would work."""


class ModelShape(BaseModel):
    """What decides a model's KV-cache footprint, read from its config.json (and weight file headers)."""

    model_config = ConfigDict(frozen=True, protected_namespaces=())

    model_type: str = Field(
        description="config.json `model_type` (of the text model, for multimodal configs)."
    )
    layers: int = Field(description="Decoder layers that keep a KV cache.")
    attention_heads: int = Field(description="Query heads per layer.")
    kv_heads: int = Field(description="Key/value heads per layer (fewer than query heads under GQA/MQA).")
    mlp_sizes: tuple[int, ...] = Field(
        default=(),
        description="Widths of the MLPs (dense, and each expert's in a mixture of experts): tensor parallelism "
        "splits them, so it must divide each.",
    )
    head_dim: int = Field(
        description="Size of one cached head: explicit `head_dim`, else hidden / heads; for MLA the latent width "
        "(kv_lora_rank + qk_rope_head_dim)."
    )
    dtype: str = Field(
        description="Dtype vLLM serves the model in with dtype=auto (float32 is served 16-bit)."
    )
    dtype_bytes: int = Field(description="Bytes per element of `dtype`.")
    max_position_embeddings: int | None = Field(
        default=None, description="config.json `max_position_embeddings`, if present."
    )
    max_model_len_limit: int = Field(
        description="Longest context vLLM accepts for this model (config keys, tokenizer limit, RoPE scaling)."
    )
    sliding_window: int | None = Field(
        default=None, description="Attention window of the sliding-window layers, when the model uses one."
    )
    sliding_window_layers: int = Field(default=0, description="How many layers attend within the window.")
    is_mla: bool = Field(default=False, description="Multi-head latent attention (DeepSeek V2/V3 style).")
    kv_lora_rank: int | None = Field(default=None, description="MLA: width of the compressed KV latent.")
    qk_rope_head_dim: int | None = Field(
        default=None, description="MLA: width of the decoupled RoPE key stored next to the latent."
    )
    weights_bytes: int | None = Field(
        default=None,
        description="Bytes of the checkpoint's tensors (safetensors headers); None when unknown.",
    )
    hidden_size: int | None = Field(
        default=None, description="config.json `hidden_size` (the width LoRA slots are sized by), if present."
    )
    vocab_size: int | None = Field(default=None, description="config.json `vocab_size`, if present.")
    notes: list[str] = Field(default_factory=list, description="Assumptions made while reading the config.")


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json as a dict, plus the tokenizer's context limit when tokenizer_config.json sets one."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"{path} does not exist: point --model at a Hugging Face model directory") from None
    except ValueError as exc:
        raise PlanError(f"{path} is not valid JSON: {exc}") from None
    tokenizer_config = Path(model_dir) / "tokenizer_config.json"
    if tokenizer_config.is_file():
        try:
            limit = json.loads(tokenizer_config.read_text()).get("model_max_length")
        except ValueError:
            limit = None
        if isinstance(limit, int):  # vLLM caps the context at the tokenizer's limit too
            config.setdefault("_tokenizer_model_max_length", limit)
    sentence_config = Path(model_dir) / "sentence_bert_config.json"
    if sentence_config.is_file():
        try:
            limit = json.loads(sentence_config.read_text()).get("max_seq_length")
        except ValueError:
            limit = None
        if isinstance(
            limit, int
        ):  # a Sentence Transformers model: vLLM caps the context at its max_seq_length
            config.setdefault("_sentence_transformers_max_seq_length", limit)
    return config


def model_shape(model_dir: str | Path) -> ModelShape:
    """The KV-relevant shape of the model in `model_dir`, with its weight size from the safetensors headers."""
    shape = shape_from_config(read_config(model_dir))
    weights = weights_bytes(model_dir)
    return shape.model_copy(update={"weights_bytes": weights})


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """The KV-relevant shape from a config dict; refuses architectures whose cache is not plain attention."""
    text = config.get("text_config") or config.get("language_config") or config.get("llm_config")
    if isinstance(text, dict):
        # The KV cache belongs to the language model; the outer config describes the vision tower and wrapper.
        config = {**config, **text}
    model_type = str(config.get("model_type") or "unknown")
    _refuse_unplannable(config, model_type)
    notes: list[str] = []
    layers = _first_int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first_int(config, "num_attention_heads", "n_head", "num_heads")
    if layers is None or heads is None:
        raise PlanError(
            f"config.json ({model_type}) names no layer or head count (num_hidden_layers, num_attention_heads)"
        )
    kv_heads = _kv_heads(config, heads)
    head_dim = _head_dim(config, heads)
    dtype, dtype_bytes = _serving_dtype(config, notes)
    window, window_layers = _sliding_window(config, model_type, layers)
    is_mla = config.get("kv_lora_rank") is not None
    if is_mla:
        # vLLM caches MLA as one "head" per layer holding the latent and the RoPE key side by side.
        head_dim = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
    return ModelShape(
        model_type=model_type,
        layers=layers,
        attention_heads=heads,
        kv_heads=1 if is_mla else kv_heads,
        mlp_sizes=tuple(
            config[key]
            for key in ("intermediate_size", "moe_intermediate_size", "ffn_dim", "n_inner")
            if isinstance(config.get(key), int) and not isinstance(config.get(key), bool)
        ),
        head_dim=head_dim,
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        max_position_embeddings=_first_int(config, "max_position_embeddings"),
        max_model_len_limit=_max_model_len_limit(config, model_type, notes),
        sliding_window=window,
        sliding_window_layers=window_layers,
        is_mla=is_mla,
        kv_lora_rank=config.get("kv_lora_rank") if is_mla else None,
        qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0) if is_mla else None,
        hidden_size=_first_int(config, "hidden_size", "n_embd", "d_model"),
        vocab_size=_first_int(config, "vocab_size"),
        notes=notes,
    )


def _refuse_unplannable(config: dict[str, Any], model_type: str) -> None:
    if model_type in _SPARSE_MLA_TYPES or "index_topk" in config:
        raise PlanError(
            f"{model_type}: sparse MLA keeps an extra indexer cache next to the latent; its size is not modelled. "
            f"Start the engine and read 'KV cache size: N tokens' from its log instead."
        )
    layer_types = config.get("layer_types") or []
    odd = sorted({t for t in layer_types if isinstance(t, str) and t not in _ATTENTION_LAYER_TYPES})
    markers = [key for key in _HYBRID_KEYS if config.get(key) is not None]
    if odd or markers or any(kind in model_type for kind in _HYBRID_TYPES):
        what = ", ".join(odd) if odd else ", ".join(markers) or model_type
        raise PlanError(
            f"{model_type} mixes attention with recurrent/state-space layers ({what}); planning covers "
            f"attention-only models. Start the engine and read 'KV cache size: N tokens' from its log instead."
        )


def _first_int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _kv_heads(config: dict[str, Any], heads: int) -> int:
    kv = _first_int(config, "num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")
    if kv is not None:
        return kv
    if config.get("multi_query") is True:  # Falcon-7B style: one shared KV head
        return 1
    return heads  # plain multi-head attention


def _head_dim(config: dict[str, Any], heads: int) -> int:
    # Explicit head_dim wins: Gemma, Qwen3 and others use a head wider than hidden_size / heads.
    explicit = _first_int(config, "head_dim", "attention_head_dim")
    if explicit:
        return explicit
    hidden = _first_int(config, "hidden_size", "n_embd", "d_model")
    if hidden is None:
        raise PlanError("config.json names neither head_dim nor hidden_size")
    return hidden // heads


def _serving_dtype(config: dict[str, Any], notes: list[str]) -> tuple[str, int]:
    raw = config.get("dtype") or config.get("torch_dtype")
    name = str(raw).removeprefix("torch.") if raw else None
    if name not in _DTYPE_BYTES:
        notes.append(f"config.json names no known dtype ({raw!r}): assumed bfloat16 (2 bytes)")
        return "bfloat16", 2
    if _DTYPE_BYTES[name] == 4:
        # vLLM's dtype=auto downcasts float32 checkpoints to a 16-bit type; the cache follows.
        notes.append("float32 checkpoint: vLLM serves it in 16 bits with dtype=auto (KV at 2 bytes)")
        return "bfloat16", 2
    return name, _DTYPE_BYTES[name]


def _sliding_window(config: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, int]:
    window = config.get("sliding_window")
    if config.get("use_sliding_window") is False or not isinstance(window, int) or window <= 0:
        return None, 0  # e.g. Qwen2 ships a window but turns it off
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        sliding = sum(1 for t in layer_types if t == "sliding_attention")
    elif isinstance(config.get("sliding_window_pattern"), int) and config["sliding_window_pattern"] > 0:
        sliding = layers - layers // config["sliding_window_pattern"]  # Gemma 3: every Nth layer is global
    elif model_type == "gemma2":
        sliding = (layers + 1) // 2  # Gemma 2 alternates, starting with a sliding layer
    else:
        sliding = layers  # Mistral 7B v0.1: every layer slides
    return (window, sliding) if sliding else (None, 0)


def _max_model_len_limit(config: dict[str, Any], model_type: str, notes: list[str]) -> int:
    found = [
        config[k]
        for k in (*_MAX_LEN_KEYS, "_tokenizer_model_max_length", "_sentence_transformers_max_seq_length")
        if _is_num(config.get(k))
    ]
    if not found:
        notes.append("config.json names no context limit: assumed 2048, as vLLM does")
        return 2048
    limit = min(found)
    factor = _rope_factor(config, model_type)
    if factor != 1.0:
        notes.append(f"RoPE scaling ×{factor:g} extends the context limit, as vLLM applies it")
    return int(limit * factor)


def _is_num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _rope_factor(config: dict[str, Any], model_type: str) -> float:
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if not isinstance(rope, dict) or "gemma3" in model_type:  # Gemma 3's limit is already scaled
        return 1.0
    # transformers 5 may key rope_parameters by layer type; all layer types share one factor.
    entries = (
        [rope]
        if ("rope_type" in rope or "type" in rope)
        else [v for v in rope.values() if isinstance(v, dict)]
    )
    factor = 1.0
    for entry in entries:
        kind = entry.get("rope_type") or entry.get("type") or "default"
        if kind not in _ROPE_PRESCALED and _is_num(entry.get("factor")):
            factor = float(entry["factor"])
    return factor


def weights_bytes(model_dir: str | Path) -> int | None:
    """Bytes of the model's tensors: summed from safetensors headers (no tensor is read), else weight file sizes."""
    directory = Path(model_dir)
    files = _safetensors_files(directory)
    if files:
        return sum(safetensors_tensor_bytes(f) for f in files)
    legacy = [p for p in directory.glob("*.bin") if p.name.startswith(("pytorch_model", "model"))]
    return sum(p.stat().st_size for p in legacy) or None


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    # Mistral repos ship the same weights twice: consolidated.safetensors (their format) and model-*.safetensors.
    hf = [f for f in files if not f.name.startswith("consolidated")]
    return hf or files


def safetensors_tensor_bytes(path: str | Path) -> int:
    """Sum of tensor byte ranges in a safetensors file, from its JSON header alone."""
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise PlanError(f"{path} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > 100 * 2**20:  # headers are kilobytes; this is not a safetensors file
            raise PlanError(f"{path} is not a safetensors file (header length {length})")
        header = json.loads(fh.read(length))
    return sum(
        entry["data_offsets"][1] - entry["data_offsets"][0]
        for name, entry in header.items()
        if name != "__metadata__"
    )
