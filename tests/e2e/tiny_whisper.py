"""A tiny Whisper with random weights, made at test time: a 2-layer encoder and a 2-layer decoder of width 64 over
Whisper's 80-bin log-mel features, on the embedded model's tokenizer (its vocabulary and merges) with Whisper's
special tokens added (start of transcript, the language tokens, transcribe/translate, no timestamps, the timestamps).
Seeded, so its (meaningless) answers are the same on every run; about 5 MB of safetensors, a few seconds to build.
Its answers are nonsense; what the tests compare is that two paths give the same ones for the same audio."""

from __future__ import annotations

import io
import json
import math
import struct
import wave
from pathlib import Path

LANGUAGES = ("en", "de", "fr", "es", "it", "ja", "zh")
SAMPLE_RATE = 16_000
# Whisper's positions: 1,500 encoder frames (30 s of audio); a short decoder context is enough for a test.
DECODER_POSITIONS = 448


def make_tiny_whisper(directory: Path, embedded_model_dir: Path, seed: int = 0) -> Path:
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    source = json.loads((embedded_model_dir / "tokenizer.json").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in source["model"]["merges"]]
    specials = ["<|endoftext|>", "<|startoftranscript|>"]
    specials += [f"<|{language}|>" for language in LANGUAGES]
    specials += ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>"]
    specials += ["<|notimestamps|>"] + [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    vocab = dict(source["model"]["vocab"])
    vocab.setdefault("<|endoftext|>", len(vocab))
    tokenizer = WhisperTokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in specials}
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=80,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=DECODER_POSITIONS,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        begin_suppress_tokens=[],
        suppress_tokens=[],
    )
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    WhisperProcessor(WhisperFeatureExtractor(feature_size=80), tokenizer).save_pretrained(directory)
    generation = GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        no_timestamps_token_id=ids["<|notimestamps|>"],
        lang_to_id={f"<|{language}|>": ids[f"<|{language}|>"] for language in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        is_multilingual=True,
        max_length=DECODER_POSITIONS,
    )
    generation.save_pretrained(directory)
    return directory


def wav(seconds: float = 1.0, frequency: float = 440.0) -> bytes:
    """A mono 16 kHz 16-bit WAV of a sine tone: an audio file any decoder reads."""
    frames = int(seconds * SAMPLE_RATE)
    samples = (int(12_000 * math.sin(2 * math.pi * frequency * i / SAMPLE_RATE)) for i in range(frames))
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(struct.pack(f"<{frames}h", *samples))
    return buffer.getvalue()
