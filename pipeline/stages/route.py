"""Prefix keys: which requests share a long leading prompt, so the runtime can send them to the same engine.

An engine's prefix cache only pays when requests with the same leading tokens (a system prompt, a few-shot block)
run on the same engine. The key is computed once per request at ingest and stored with the work list; the work
queue then routes by it (see runtime/work_queue.py). Pure: no Ray, no vLLM, no tokenizer — characters stand in for
tokens, which is all a grouping needs.

What a key covers:
- a chat: `tools` if given (chat templates render them ahead of the messages) and every message but the last
  (system prompt, few-shot turns, earlier turns);
- otherwise (a one-message chat, a completion's string prompt), only a prompt longer than `PREFIX_CHARS`: its
  first `PREFIX_CHARS` characters (a long prompt whose head may be a shared preamble).
The covered text is cut at `PREFIX_CHARS`: requests that agree that far share at least that much of the KV cache,
so grouping them is right even if their prompts part later. Shorter than `MIN_PREFIX_CHARS`, a shared part saves
too little prefill to be worth steering work by (and on CPU engines, with 128-token KV blocks, it saves nothing):
such a request gets no key and may run anywhere.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

PREFIX_CHARS = 1024  # about 250 tokens of English: a couple of KV blocks on CPU, dozens on GPU
MIN_PREFIX_CHARS = 256


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text as is, anything else (images, audio) by its JSON
        return "".join(
            str(p.get("text", "")) if isinstance(p, dict) and p.get("type") == "text" else _canonical(p)
            for p in content
        )
    return "" if content is None else _canonical(content)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def _render(message: Any) -> str:
    if not isinstance(message, dict):
        return _canonical(message)
    return f"{message.get('role')}\x1f{_content_text(message.get('content'))}\x1e"


def _key(url: str, text: str) -> str:
    return hashlib.blake2b(f"{url}\n{text[:PREFIX_CHARS]}".encode(), digest_size=8).hexdigest()


def prefix_key(url: str, body: dict[str, Any]) -> str | None:
    """A short hash naming the request's shareable prefix, or None when it has none worth routing by."""
    if url == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        # The separate leading part: tools and every message but the last.
        tools = _canonical(body["tools"]) if body.get("tools") else ""
        leading = tools + "".join(_render(m) for m in messages[:-1])
        if len(leading) >= MIN_PREFIX_CHARS:
            return _key(url, leading)
        whole = leading + _render(messages[-1])  # rendered only when the leading part is too short to key by
    else:
        prompt = body.get("prompt")
        whole = prompt if isinstance(prompt, str) else ""
    # One long prompt: its head may be a shared preamble. Shorter, the key would cover the whole prompt, and
    # nothing marks a shared part in it.
    return _key(url, whole) if len(whole) > PREFIX_CHARS else None
