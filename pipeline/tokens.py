"""Prompt tokens as the vLLM engine will count them: the model's tokenizer, its chat template applied.

Used wherever a number must agree with the engine before the engine runs: `validate` (token statistics),
`plan --input` (the context fitted to a batch) and `run` (fitting max_model_len and rejecting prompts that cannot
fit). transformers is imported when a counter is built, never at import time.

Fidelity: chat requests are rendered the way vLLM's OpenAI layer renders them — `add_generation_prompt` (default
true), `continue_final_message`, `tools`, `documents`, a request-level `chat_template` and `chat_template_kwargs` are
passed to the template, and the rendered text is tokenized without special tokens (the template writes them).
Content given as a list of parts is joined with newlines, as vLLM does for templates that expect a string; for
templates that iterate over parts themselves the count can differ by a few tokens. A completions prompt may be a
string, a list of token ids, or a list of either (one sequence each), and is tokenized with special tokens (BOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class PromptCounter:
    """Counts prompt tokens per sequence a request starts; a batch at a time, so the tokenizer works in bulk."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name  # what counted, for reports

    @classmethod
    def for_model(cls, model_dir: str) -> PromptCounter | None:
        """The counter of a model directory; None when transformers is not installed."""
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return None
        return cls(AutoTokenizer.from_pretrained(model_dir), f"{model_dir} (tokenizer + chat template)")

    def count(self, url: str, body: dict[str, Any]) -> list[int]:
        """Prompt tokens of each sequence the request starts; raises when the template rejects the request."""
        result = self.count_batch([(url, body)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def count_batch(self, requests: Sequence[tuple[str, dict[str, Any]]]) -> list[list[int] | Exception]:
        """`count` for many requests; a request the chat template rejects yields its exception, not a count."""
        texts: list[str] = []  # rendered prompts, tokenized together below
        special: list[bool] = []
        # Per request: a list of items, each an int (already a token count) or an index into `texts`.
        plans: list[list[int | tuple[int]] | Exception] = []
        for url, body in requests:
            try:
                items: list[int | tuple[int]] = []
                for prompt in self._prompts(url, body):
                    if isinstance(prompt, int):
                        items.append(prompt)
                    else:
                        items.append((len(texts),))
                        texts.append(prompt)
                        special.append(url != CHAT)
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

    def _encode_lengths(self, texts: list[str], special: list[bool]) -> list[int]:
        lengths = [0] * len(texts)
        for flag in (False, True):
            indexes = [i for i, s in enumerate(special) if s is flag]
            if not indexes:
                continue
            # verbose=False: no "sequence length is longer than the specified maximum" warning from transformers;
            # a prompt too long for the model is ours to report (context_length_exceeded), and it is.
            batch = [texts[i] for i in indexes]
            encoded = self.tokenizer(batch, add_special_tokens=flag, verbose=False)["input_ids"]
            for i, ids in zip(indexes, encoded, strict=True):
                lengths[i] = len(ids)
        return lengths

    def _prompts(self, url: str, body: dict[str, Any]) -> list[str | int]:
        """The text to tokenize (or the known token count) of each sequence."""
        if url == CHAT:
            return [self._render_chat(body)]
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            items: list[str | int] = [len(prompt)]
        elif isinstance(prompt, list) and prompt:
            items = [len(p) if isinstance(p, list) else str(p) for p in prompt]
        else:
            items = [prompt if isinstance(prompt, str) else str(prompt)]
        return items

    def _render_chat(self, body: dict[str, Any]) -> str:
        messages = [_flatten_content(m) for m in body.get("messages") or []]
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.update(
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
        )
        if body.get("documents") is not None:
            kwargs["documents"] = body["documents"]
        if body.get("chat_template"):
            kwargs["chat_template"] = body["chat_template"]
        return self.tokenizer.apply_chat_template(messages, tools=body.get("tools"), tokenize=False, **kwargs)


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        texts = [str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p]
        return {**message, "content": "\n".join(texts)}
    return message
