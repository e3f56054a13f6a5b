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
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.endpoints import Chat, Text, TextPair, endpoint_for

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


class PromptCounter:
    """Counts prompt tokens per sequence a request starts; a batch at a time, so the tokenizer works in bulk."""

    def __init__(
        self, tokenizer: Any, name: str, chat_template: str | None = None, pairwise: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.name = name  # what counted, for reports
        self.chat_template = chat_template  # the job's template (text), None for the model's own
        self.pairwise = pairwise  # the model scores a (query, document) pair as one sequence: a cross-encoder

    @classmethod
    def for_model(
        cls, model_dir: str, chat_template: str | None = None, task: str | None = None
    ) -> PromptCounter | None:
        """The counter of a model directory; None when transformers is not installed. `chat_template`: the job's
        --chat-template as given; `task`: the model's (see pipeline.models.model_task)."""
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return None
        template = load_chat_template(chat_template)
        what = "tokenizer + " + ("the job's chat template" if template else "chat template")
        return cls(
            AutoTokenizer.from_pretrained(model_dir), f"{model_dir} ({what})", template, task == "classify"
        )

    def count(self, url: str, body: dict[str, Any]) -> list[int]:
        """Prompt tokens of each sequence the request starts; raises when the template rejects the request."""
        result = self.count_batch([(url, body)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def count_batch(self, requests: Sequence[tuple[str, dict[str, Any]]]) -> list[list[int] | Exception]:
        """`count` for many requests; a request the chat template rejects yields its exception, not a count."""
        texts: list[str | tuple[str, str]] = []  # rendered prompts (or pairs), tokenized together below
        special: list[bool] = []
        # Per request: a list of items, each an int (already a token count) or an index into `texts`.
        plans: list[list[int | tuple[int]] | Exception] = []
        for url, body in requests:
            try:
                endpoint = endpoint_for(url)
                if endpoint is None:
                    raise ValueError(f"url {url!r} is not a route nightshift serves")
                items: list[int | tuple[int]] = []
                for prompt in endpoint.prompts(body, self.pairwise):
                    if isinstance(prompt, int):
                        items.append(prompt)
                        continue
                    items.append((len(texts),))
                    if isinstance(prompt, Chat):
                        texts.append(self._render_chat(prompt))
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
            counts = [item if isinstance(item, int) else lengths[item[0]] for item in plan]
            truncate = body.get("truncate_prompt_tokens")
            if isinstance(truncate, int) and not isinstance(truncate, bool) and truncate > 0:
                counts = [min(n, truncate) for n in counts]  # vLLM keeps only the last `truncate` tokens
            out.append(counts)
        return out

    def _encode_lengths(self, texts: list[str | tuple[str, str]], special: list[bool]) -> list[int]:
        lengths = [0] * len(texts)
        for flag, pairs in ((False, False), (True, False), (True, True)):
            indexes = [i for i, s in enumerate(special) if s is flag and isinstance(texts[i], tuple) is pairs]
            if not indexes:
                continue
            # verbose=False: no "sequence length is longer than the specified maximum" warning from transformers;
            # a prompt too long for the model is ours to report (context_length_exceeded), and it is.
            if pairs:
                firsts = [texts[i][0] for i in indexes]  # type: ignore[index]
                seconds = [texts[i][1] for i in indexes]  # type: ignore[index]
                encoded = self.tokenizer(firsts, seconds, add_special_tokens=True, verbose=False)["input_ids"]
            else:
                batch = [texts[i] for i in indexes]
                encoded = self.tokenizer(batch, add_special_tokens=flag, verbose=False)["input_ids"]
            for i, ids in zip(indexes, encoded, strict=True):
                lengths[i] = len(ids)
        return lengths

    def _render_chat(self, chat: Chat) -> str:
        messages = [_flatten_content(m) for m in chat.messages]
        kwargs = dict(chat.options)
        if "chat_template" not in kwargs and self.chat_template:
            kwargs["chat_template"] = self.chat_template  # the request's own template wins, as in vLLM
        return self.tokenizer.apply_chat_template(messages, tools=chat.tools, tokenize=False, **kwargs)


def _flatten_content(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, list):
        texts = [str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p]
        return {**message, "content": "\n".join(texts)}
    return message
