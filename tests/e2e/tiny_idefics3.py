"""A tiny Idefics3 (the SmolVLM layout) with random weights, made at test time: a 2-layer vision tower over 256-pixel
images (patch 8, pixel shuffle 2: 256 image tokens per image, more than a 128-token KV block, so a fit that ignored
images would cut the context short of every image row) and a 2-layer Llama text model, on the embedded model's
tokenizer with Idefics3's special tokens added. Seeded, so its (meaningless) answers are the same on every run;
about 13 MB of safetensors, a few seconds to build. Its answers are nonsense; what the tests compare is that two
paths give the same ones for the same image."""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_SIZE = 256
PATCH = 8
SCALE = 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2  # 256
# What an image costs in the prompt: its tokens between <fake_token_around_image><global-img> and a closing marker.
IMAGE_PROMPT_TOKENS = IMAGE_TOKENS + 3

# Idefics3's chat template: a message's parts in order, an image part as <image> (the processor expands it).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]


def make_tiny_idefics3(directory: Path, embedded_model_dir: Path, seed: int = 0) -> Path:
    import torch
    import transformers
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
    )

    # The PIL image processor where transformers has one: the default wants torchvision, which is not installed.
    image_processor = (
        getattr(transformers, "Idefics3ImageProcessorPil", None) or transformers.Idefics3ImageProcessor
    )

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL + grid})
    base = LlamaConfig.from_pretrained(embedded_model_dir)
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention takes 32 and up
        max_position_embeddings=2048,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        tie_word_embeddings=True,
    )
    config = Idefics3Config(
        text_config=text.to_dict(),
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH,
        },
        scale_factor=SCALE,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=base.pad_token_id,
        tie_word_embeddings=True,
    )
    config.torch_dtype = "bfloat16"
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    images = image_processor(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_TOKENS, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    generation = {"bos_token_id": base.bos_token_id, "eos_token_id": base.eos_token_id}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory
