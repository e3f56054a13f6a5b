"""Models for the planner's tests: the config.json of real models, model directories with safetensors files of
given tensor sizes (whole, or a header alone), and the `plan` command mounted on an app as the real CLI mounts it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import typer

from pipeline.plan_cli import plan_command

# SmolLM2-135M-Instruct, the embedded model, as its converted config.json states it.
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "dtype": "bfloat16",
    "head_dim": 64,
    "hidden_size": 576,
    "max_position_embeddings": 8192,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}
LLAMA3_8B = {
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "max_position_embeddings": 8192,
    "rope_scaling": None,
}
MISTRAL_7B_V01 = {
    "model_type": "mistral",
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "torch_dtype": "bfloat16",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
    },
}
QWEN3_06B = {  # explicit head_dim (128) differs from hidden_size / heads (64)
    "model_type": "qwen3",
    "torch_dtype": "bfloat16",
    "hidden_size": 1024,
    "head_dim": 128,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 28,
    "max_position_embeddings": 40960,
    "sliding_window": None,
    "use_sliding_window": False,
}
# Llama-3-70B as its config.json states it.
LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 80,
    "max_position_embeddings": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}

BF16 = 2  # bytes per weight of a bf16 checkpoint


def make_model(tmp_path: Path, config: dict, tensors: dict[str, int] | None = None, name: str = "m") -> Path:
    """A model directory: config.json plus a safetensors file whose tensors hold the given byte counts."""
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    if tensors:
        write_safetensors(directory / "model.safetensors", tensors)
    return directory


def write_safetensors(path: Path, tensors: dict[str, int]) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for tensor, size in tensors.items():
        header[tensor] = {"dtype": "BF16", "shape": [size // 2], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def llama_tensors(config: dict) -> dict[str, int]:
    """Bytes of every tensor of a Llama checkpoint of this shape (bf16): embeddings, per-layer attention and MLP
    projections and norms, the final norm and an untied LM head."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv_width = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    tensors = {"model.embed_tokens.weight": vocab * hidden * BF16, "lm_head.weight": vocab * hidden * BF16}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for name, size in {
            "self_attn.q_proj": hidden * hidden,
            "self_attn.k_proj": kv_width * hidden,
            "self_attn.v_proj": kv_width * hidden,
            "self_attn.o_proj": hidden * hidden,
            "mlp.gate_proj": inter * hidden,
            "mlp.up_proj": inter * hidden,
            "mlp.down_proj": hidden * inter,
            "input_layernorm": hidden,
            "post_attention_layernorm": hidden,
        }.items():
            tensors[f"{prefix}.{name}.weight"] = size * BF16
    tensors["model.norm.weight"] = hidden * BF16
    return tensors


def write_header_only(path: Path, tensors: dict[str, int]) -> None:
    """A safetensors file holding only its header: the planner reads sizes from the header, never the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, size in tensors.items():
        header[name] = {"dtype": "BF16", "shape": [size // BF16], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def plan_app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def main() -> None:
        """A host app, mounted the way the real CLI mounts the command."""

    app.command("plan")(plan_command)
    return app
