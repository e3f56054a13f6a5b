"""Seeded random LoRA adapters of a small causal LM, made with peft at test time, in the form vLLM loads.

    make_adapter(base_model_dir, out_dir, seed, rank=8, ...) -> out_dir

Writes out_dir/adapter_config.json + adapter_model.safetensors (PeftModel.save_pretrained). lora_B is NOT zero
(peft's default leaves it zero: a no-op adapter): A and B are drawn from a generator seeded with `seed`, and B is
scaled so each adapted projection's update is `strength` times the base weight's RMS. At 0.1-0.15 the greedy
answers of SmolLM2-135M-Instruct change clearly and stay text (0.2 and more turn to noise).

The base model is built on the meta device (only config.json is read): about 1 s per adapter after the imports.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _weight_rms(base_model_dir: str, names: list[str]) -> dict[str, float]:
    """RMS of the named base weights (suffix match, e.g. 'layers.3.self_attn.q_proj.weight'), read lazily."""
    from safetensors import safe_open

    out: dict[str, float] = {}
    files = sorted(Path(base_model_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            keys = list(st.keys())
            for name in names:
                for k in keys:
                    if k.endswith(name):
                        t = st.get_tensor(k).float()
                        out[name] = float(t.pow(2).mean().sqrt())
                        break
    return out


def make_adapter(
    base_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    seed: int,
    rank: int = 8,
    target_modules=DEFAULT_TARGETS,
    lora_alpha: int | None = None,
    strength: float = 0.12,
    relative: bool = True,
    dtype: str = "auto",
) -> Path:
    """Create a seeded random LoRA adapter for the model in base_model_dir; save it to out_dir; return out_dir.

    strength: size of each update delta W relative to the base weight's RMS (relative=True) or its absolute
    per-element RMS (relative=False).
    dtype: dtype of the saved A/B tensors; "auto" = the model config's dtype (bfloat16 for SmolLM2), else e.g.
    "float32".
    """
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base_model_dir = str(base_model_dir)
    out = Path(out_dir)
    lora_alpha = lora_alpha or rank  # scaling alpha/r = 1

    config = AutoConfig.from_pretrained(base_model_dir)
    config_dtype = getattr(config, "dtype", None) or getattr(
        config, "torch_dtype", None
    )  # before from_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lcfg = peft.LoraConfig(
        r=rank,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    pm = peft.get_peft_model(model, lcfg)
    pm.peft_config["default"].base_model_name_or_path = base_model_dir

    gen = torch.Generator().manual_seed(int(seed))
    lora_layers = [(n, m) for n, m in pm.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    base_names = [n.split("base_model.model.", 1)[-1] + ".weight" for n, _ in lora_layers]
    rms = _weight_rms(base_model_dir, base_names) if relative else {}
    scaling = lora_alpha / rank
    if dtype == "auto":
        save_dtype = config_dtype or torch.float32
        save_dtype = getattr(torch, save_dtype) if isinstance(save_dtype, str) else save_dtype
    else:
        save_dtype = getattr(torch, dtype)
    for (_name, m), bname in zip(lora_layers, base_names, strict=True):
        a_mod, b_mod = m.lora_A["default"], m.lora_B["default"]
        in_f, out_f = a_mod.in_features, b_mod.out_features
        # A rows orthonormal-ish (N(0, 1/in)), B N(0, s) with s chosen so that rms(scaling * B @ A) == target.
        a = torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f)
        target = strength * (rms.get(bname, 0.02) if relative else 1.0)
        # rms(B@A) ~= std_B * sqrt(rank) * rms_row(A) = std_B * sqrt(rank / in_f) * sqrt(in_f) / sqrt(in_f)...
        # computed exactly below instead: draw B, measure, rescale.
        b = torch.randn(out_f, rank, generator=gen)
        delta_rms = float((scaling * b @ a).pow(2).mean().sqrt())
        b = b * (target / delta_rms)
        a_mod.weight = torch.nn.Parameter(a.to(save_dtype), requires_grad=False)
        b_mod.weight = torch.nn.Parameter(b.to(save_dtype), requires_grad=False)

    out.mkdir(parents=True, exist_ok=True)
    pm.save_pretrained(str(out), safe_serialization=True)
    # Record how it was made (vLLM ignores unknown files).
    (out / "nightshift-adapter.json").write_text(
        json.dumps(
            {
                "seed": seed,
                "rank": rank,
                "strength": strength,
                "relative": relative,
                "target_modules": list(target_modules),
                "base": base_model_dir,
            },
            indent=1,
        )
    )
    return out
