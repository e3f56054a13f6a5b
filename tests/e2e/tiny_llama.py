"""A tiny Llama with random weights, made at test time: 4 attention heads and 2 key/value heads, so tensor
parallelism can split it two ways (the embedded SmolLM2's 9 heads cannot be), with the embedded model's tokenizer
and chat template. Seeded, so its (meaningless) answers are the same on every run; a few MB of safetensors."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_tiny_llama(directory: Path, embedded_model_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaConfig.from_pretrained(embedded_model_dir)
    config = LlamaConfig(
        vocab_size=base.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (embedded_model_dir / name).is_file():
            shutil.copy(embedded_model_dir / name, directory / name)
    return directory
