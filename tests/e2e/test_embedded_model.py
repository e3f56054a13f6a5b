"""The real conversion of the embedded GGUF into a Hugging Face directory (about 20 s on a laptop CPU)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from pipeline.models import EMBEDDED_MODEL_NAME, prepare_embedded_model, resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("nightshift-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NIGHTSHIFT_HOME", str(home))
        return prepare_embedded_model()


def test_directory_layout(model_dir: Path) -> None:
    assert model_dir.parent.name == "models"
    assert model_dir.name.startswith(f"{EMBEDDED_MODEL_NAME}-")
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "nightshift-model.json"} <= names
    assert not any(n.endswith(".gguf") for n in names)
    marker = json.loads((model_dir / "nightshift-model.json").read_text())
    assert model_dir.name.endswith(marker["gguf_sha256"][:12])
    assert [p.name for p in model_dir.parent.iterdir() if p.name.startswith(".tmp-")] == []


def test_config_is_plain_bf16_llama(model_dir: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert getattr(config, "quantization_config", None) is None  # vLLM would try to load it as GGUF
    assert config.eos_token_id == 2


def test_weights_are_dense_bf16(model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
    assert len(keys) > 200
    assert str(embed.dtype) == "torch.bfloat16"
    assert tuple(embed.shape) == (49152, 576)


def test_tokenizer_has_chat_template_and_eos(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_weights_survived_conversion(model_dir: Path) -> None:
    """A language-model sanity check: scrambled weights would score ~ln(vocab) = 10.8 nats per token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert math.isfinite(loss) and loss < 2.5, loss


def test_second_prepare_is_instant_and_resolves(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(model_dir.parent.parent))
    started = time.monotonic()
    resolved = resolve_model(None)
    assert time.monotonic() - started < 2  # hashing the 98 MB GGUF, no conversion
    assert resolved.path == str(model_dir)
    assert resolved.name == EMBEDDED_MODEL_NAME and resolved.source == "embedded"
    assert model_dir.name.endswith(resolved.revision)
