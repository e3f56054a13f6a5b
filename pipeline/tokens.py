"""Prompt tokens as the vLLM engine will count them: the model's tokenizer, its chat template applied.

Used wherever a number must agree with the engine before the engine runs: `validate` (token statistics),
`plan --input` (the context fitted to a batch) and `run` (fitting max_model_len and rejecting prompts that cannot
fit). transformers is imported when a counter is built, never at import time.

What a request tokenizes comes from its route's registry entry (`Endpoint.prompts`, one item per sequence):
- a conversation (chat, responses, chat-style embeddings) is rendered the way vLLM's OpenAI layer renders it —
  `add_generation_prompt` (default true), `continue_final_message`, `tools`, `documents`, the job's chat template
  (`--chat-template`) unless the request brings its own, `chat_template_kwargs` — and the text is tokenized
  without special tokens (the template writes them). Content given as a list of parts is joined with newlines,
  as vLLM does for templates that expect a string; for templates that iterate over parts themselves the count
  can differ by a few tokens;
- a text (a completions prompt, an embedding input, one side of a score pair) is tokenized with special tokens;
- a text pair (a cross-encoder's query + document) is tokenized as the pair;
- token ids count as themselves.
"""

from __future__ import annotations

import codecs
import importlib
import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.endpoints import Chat, Text, TextPair, endpoint_for

# A chat's content parts that carry media, and their modality (vLLM's chat parser reads these part types).
MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "video_url": "video",
}

# What vLLM takes for a template's text rather than a file name or a built-in template's name.
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """The text of vLLM's --chat-template, found as vLLM finds it: a file, else (no Jinja in it) one of the
    templates vLLM ships, else the value itself with its escapes decoded. Raises ValueError when a value that
    looks like a file name is neither."""
    if value is None:
        return None
    try:
        return Path(value).read_text()
    except OSError:
        pass
    if not any(c in value for c in _JINJA_CHARS):
        builtin = _vllm_template_dir()
        if builtin is not None and (builtin / value).is_file():
            return (builtin / value).read_text()
        raise ValueError(
            f"chat template {value!r} looks like a file name, but there is no such file (nor a template of that "
            f"name shipped with vLLM)"
        )
    return codecs.decode(value, "unicode_escape")


def _vllm_template_dir() -> Path | None:
    # Located without importing vLLM (seconds): the package's own directory of chat templates.
    spec = importlib.util.find_spec("vllm")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "transformers_utils" / "chat_templates"
        if candidate.is_dir():
            return candidate
    return None


# AutoTokenizer's choice of class, remembered per model directory (in NIGHTSHIFT_HOME): importing AutoTokenizer
# imports torch and most of transformers, 4 s of a core on a small box, where the class it chose imports in under one.
# Every ingest worker loads a tokenizer, at the start of a job, while the engines import vLLM on the same cores.
TOKENIZER_CLASSES = "tokenizer-classes.json"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx")


def load_tokenizer(model_dir: str) -> Any:
    """The model's tokenizer, as `AutoTokenizer.from_pretrained(model_dir)` loads it: the class AutoTokenizer chose
    for this directory the last time (while none of its files but the weights changed) loads it directly; else
    AutoTokenizer chooses, and its choice is remembered. Classes of remote code are never remembered."""
    directory = Path(model_dir)
    stamp = directory_stamp(directory)
    remembered = _remembered_classes().get(str(directory.resolve())) if stamp else None
    if isinstance(remembered, dict) and remembered.get("stamp") == stamp:
        module, _, name = str(remembered.get("class", "")).partition(":")
        if module.startswith("transformers."):
            try:
                return getattr(importlib.import_module(module), name).from_pretrained(model_dir)
            except Exception:  # noqa: BLE001 - a class that moved or broke: AutoTokenizer chooses again
                pass
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chosen = type(tokenizer)
    if stamp and chosen.__module__.startswith("transformers."):
        _remember_class(str(directory.resolve()), stamp, f"{chosen.__module__}:{chosen.__qualname__}")
    return tokenizer


def directory_stamp(directory: Path) -> list[list[Any]] | None:
    """Name, size and mtime of each file of a model directory but its weights, after what else AutoTokenizer's
    choice depends on (the transformers version; whether mistral-common is installed); None when it is not a
    directory."""
    from importlib import metadata

    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
        chooser = [
            "transformers",
            metadata.version("transformers"),
            importlib.util.find_spec("mistral_common") is not None,
        ]
    except (OSError, metadata.PackageNotFoundError):
        return None
    stamp: list[list[Any]] = [chooser]
    for entry in entries:
        if entry.is_file() and not entry.name.endswith(_WEIGHTS):
            info = entry.stat()
            stamp.append([entry.name, info.st_size, info.st_mtime_ns])
    return stamp


def _remembered_classes() -> dict[str, Any]:
    from pipeline.local_files import nightshift_home

    try:
        known = json.loads((nightshift_home() / TOKENIZER_CLASSES).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _remember_class(directory: str, stamp: list[list[Any]], name: str) -> None:
    from pipeline.local_files import atomic_write_json, exclusive_lock, nightshift_home

    path = nightshift_home() / TOKENIZER_CLASSES
    try:
        # Every ingest worker of a job's first run chooses at once: read, add and write under one lock, so no
        # worker's write drops another's entry.
        with exclusive_lock(path.with_suffix(".lock")):
            known = _remembered_classes()
            known[directory] = {"stamp": stamp, "class": name}
            atomic_write_json(path, known)
    except OSError:  # a home that cannot be written: AutoTokenizer chooses every time
        pass


class PromptCounter:
    """Counts prompt tokens per sequence a request starts; a batch at a time, so the tokenizer works in bulk."""

    def __init__(
        self,
        tokenizer: Any,
        name: str,
        chat_template: str | None = None,
        pairwise: bool = False,
        media_tokens: dict[str, int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.name = name  # what counted, for reports
        self.chat_template = chat_template  # the job's template (text), None for the model's own
        self.pairwise = pairwise  # the model scores a (query, document) pair as one sequence: a cross-encoder
        # Prompt tokens one image / audio / video item takes (its placeholder: the item's tokens and the markers
        # around them), by modality: counted for each media part of a chat, on top of its text.
        self.media_tokens = dict(media_tokens or {})

    @classmethod
    def for_model(
        cls,
        model_dir: str,
        chat_template: str | None = None,
        task: str | None = None,
        media_tokens: dict[str, int] | None = None,
    ) -> PromptCounter | None:
        """The counter of a model directory; None when transformers is not installed. `chat_template`: the job's
        --chat-template as given; `task`: the model's (see pipeline.models.model_task); `media_tokens`: what one
        media item costs, by modality (the vLLM backend's `media_tokens`)."""
        if importlib.util.find_spec("transformers") is None:
            return None
        template = load_chat_template(chat_template)
        what = "tokenizer + " + ("the job's chat template" if template else "chat template")
        try:
            tokenizer = load_tokenizer(model_dir)
        except (
            ImportError
        ):  # transformers there but not importable (a dependency clash): no counter, as without it
            return None
        if media_tokens:
            what += " + " + ", ".join(
                f"{n} tokens per {modality}" for modality, n in sorted(media_tokens.items())
            )
        return cls(tokenizer, f"{model_dir} ({what})", template, task == "classify", media_tokens)

    def count(self, url: str, body: dict[str, Any]) -> list[int]:
        """Prompt tokens of each sequence the request starts; raises when the template rejects the request."""
        result = self.count_batch([(url, body)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def count_batch(self, requests: Sequence[tuple[str, dict[str, Any]]]) -> list[list[int] | Exception]:
        """`count` for many requests; a request the chat template rejects yields its exception, not a count."""
        prompts = [self._prompts(url, body) for url, body in requests]
        plain = self._render_plain_chats(prompts)
        texts: list[str | tuple[str, str]] = []  # rendered prompts (or pairs), tokenized together below
        special: list[bool] = []
        # Per request: a list of items, each an int (already a token count) or (an index into `texts`, the tokens
        # its media items add).
        plans: list[list[int | tuple[int, int]] | Exception] = []
        for r, request_prompts in enumerate(prompts):
            if isinstance(request_prompts, Exception):
                plans.append(request_prompts)
                continue
            try:
                items: list[int | tuple[int, int]] = []
                for prompt in request_prompts:
                    if isinstance(prompt, int):
                        items.append(prompt)
                        continue
                    items.append((len(texts), self._media_cost(prompt) if isinstance(prompt, Chat) else 0))
                    if isinstance(prompt, Chat):
                        texts.append(plain[r] if r in plain else self._render_chat(prompt))
                        special.append(False)
                    elif isinstance(prompt, TextPair):
                        texts.append((prompt.first, prompt.second))
                        special.append(True)
                    else:
                        assert isinstance(prompt, Text)
                        texts.append(prompt.text)
                        special.append(True)
                plans.append(items)
            except Exception as exc:  # noqa: BLE001 - a template error belongs to this request alone
                plans.append(exc)
        lengths = self._encode_lengths(texts, special)
        out: list[list[int] | Exception] = []
        for (_, body), plan in zip(requests, plans, strict=True):
            if isinstance(plan, Exception):
                out.append(plan)
                continue
            counts = [item if isinstance(item, int) else lengths[item[0]] + item[1] for item in plan]
            truncate = body.get("truncate_prompt_tokens")
            if isinstance(truncate, int) and not isinstance(truncate, bool) and truncate > 0:
                counts = [min(n, truncate) for n in counts]  # vLLM keeps only the last `truncate` tokens
            out.append(counts)
        return out

    def _prompts(self, url: str, body: dict[str, Any]) -> list[Any] | Exception:
        """What the request tokenizes (its route's `Endpoint.prompts`), or why it cannot be counted."""
        try:
            endpoint = endpoint_for(url)
            if endpoint is None:
                raise ValueError(f"url {url!r} is not a route nightshift serves")
            return list(endpoint.prompts(body, self.pairwise))
        except Exception as exc:  # noqa: BLE001 - belongs to this request alone
            return exc

    def _render_plain_chats(self, prompts: list[list[Any] | Exception]) -> dict[int, str]:
        """The rendered prompt of every request that is one chat without tools, by request index: chats with the
        same template options (the common case: all of them) are rendered in one call of the template, which costs
        less per chat than a call each. Should the template reject any chat of a call, that call's chats are
        rendered one by one instead (each its own error)."""
        groups: dict[tuple, dict[int, list[Any]]] = {}
        for r, request_prompts in enumerate(prompts):
            if isinstance(request_prompts, Exception) or len(request_prompts) != 1:
                continue
            chat = request_prompts[0]
            # `tools: []` renders otherwise than no tools (a template tests `tools is not none`), and `tools` among
            # the options clashes with the argument: both are rendered alone, as any option that is not a scalar.
            if not isinstance(chat, Chat) or chat.tools is not None or "tools" in chat.options:
                continue
            if not all(map(_is_scalar, chat.options.values())):
                continue
            # Typed: 0, False and 0.0 are equal keys, but a template tells them apart (`is false`).
            key = tuple(sorted((k, type(v).__name__, v) for k, v in chat.options.items()))
            groups.setdefault(key, {})[r] = [_flatten_content(m) for m in chat.messages]
        rendered: dict[int, str] = {}
        for key, chats in groups.items():
            if len(chats) < 2:
                continue
            kwargs = {k: v for k, _, v in key}
            if "chat_template" not in kwargs and self.chat_template:
                kwargs["chat_template"] = self.chat_template  # the request's own template wins, as in vLLM
            try:
                texts = self.tokenizer.apply_chat_template(list(chats.values()), tokenize=False, **kwargs)
            except Exception:  # noqa: BLE001 - a chat the template rejects: these are rendered (and fail) alone
                continue
            if isinstance(texts, list) and len(texts) == len(chats):
                rendered.update(zip(chats, texts, strict=True))
        return rendered

    def _encode_lengths(self, texts: list[str | tuple[str, str]], special: list[bool]) -> list[int]:
        lengths = [0] * len(texts)
        for flag, pairs in ((False, False), (True, False), (True, True)):
            indexes = [i for i, s in enumerate(special) if s is flag and isinstance(texts[i], tuple) is pairs]
            if not indexes:
                continue
            batch = [texts[i] for i in indexes]
            for i, n in zip(indexes, self._lengths(batch, flag, pairs), strict=True):
                lengths[i] = n
        return lengths

    def _lengths(self, batch: list[Any], add_special_tokens: bool, pairs: bool) -> list[int]:
        """Tokens of each text (or pair) of `batch`. A fast tokenizer whose Rust backend neither truncates nor pads
        and splits special tokens as the tokenizer would is asked directly: the same encodings as calling the
        tokenizer (which sets exactly that, then encodes the batch with it), without building every row's ids as
        Python lists (half of the counting's time). Any other tokenizer is called."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if (
            backend is not None
            and backend.truncation is None
            and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(self.tokenizer, "split_special_tokens", False))
        ):
            return [
                len(encoding)
                for encoding in backend.encode_batch(batch, add_special_tokens=add_special_tokens)
            ]
        # verbose=False: no "sequence length is longer than the specified maximum" warning from transformers;
        # a prompt too long for the model is ours to report (context_length_exceeded), and it is. Nothing else is
        # passed: some tokenizers (mistral-common's) refuse any argument they do not know.
        if pairs:
            firsts, seconds = [first for first, _ in batch], [second for _, second in batch]
            encoded = self.tokenizer(firsts, seconds, add_special_tokens=True, verbose=False)["input_ids"]
        else:
            encoded = self.tokenizer(batch, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]
        return [len(ids) for ids in encoded]

    def _media_cost(self, chat: Chat) -> int:
        """The tokens a chat's media parts add to its text (which the chat template renders without them)."""
        if not self.media_tokens:
            return 0
        cost = 0
        for message in chat.messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else None
                    modality = MEDIA_PARTS.get(kind) if isinstance(kind, str) else None
                    cost += self.media_tokens.get(modality, 0) if modality else 0
        return cost

    def _render_chat(self, chat: Chat) -> str:
        messages = [_flatten_content(m) for m in chat.messages]
        kwargs = dict(chat.options)
        if "chat_template" not in kwargs and self.chat_template:
            kwargs["chat_template"] = self.chat_template  # the request's own template wins, as in vLLM
        return self.tokenizer.apply_chat_template(messages, tools=chat.tools, tokenize=False, **kwargs)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _flatten_content(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, list):
        texts = [str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p]
        return {**message, "content": "\n".join(texts)}
    return message
