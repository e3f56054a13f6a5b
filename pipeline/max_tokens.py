"""Output tokens: what a request may generate, as vLLM decides it, for budgeting its context.

A request's own limit (max_completion_tokens, else max_tokens, or max_output_tokens) is read the way its route's
registry entry reads it (pipeline/endpoints); without one, the model's generation config or a budgeted default
stands in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.endpoints import Budget, endpoint_for
from pipeline.endpoints.chat import requested_max_tokens as requested_limit

# /v1/completions without max_tokens: vLLM (like OpenAI) generates 16 tokens (COMPLETIONS_DEFAULT_MAX_TOKENS).
# /v1/chat/completions without max_tokens: vLLM lets the answer run to the end of the context, which cannot be
# planned for. This is the output we budget instead (and say so); requests should set max_tokens.
DEFAULT_CHAT_MAX_TOKENS = 256


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    """The output limit a request sets itself, as vLLM reads it: max_completion_tokens, else max_tokens (chat,
    completions), or max_output_tokens (responses)."""
    return requested_limit(body, ("max_completion_tokens", "max_tokens", "max_output_tokens"))


def output_budget(
    url: str,
    body: dict[str, Any],
    generation_default: int | None = None,
    chat_default: int = DEFAULT_CHAT_MAX_TOKENS,
) -> tuple[int, bool]:
    """Output tokens a request may generate, and whether that number is an assumption (no limit in the request).

    The route's registry entry decides (pipeline/endpoints), mirroring vLLM: max_completion_tokens, else
    max_tokens. Without either, /v1/completions generates 16 (the request field's default); chat and responses
    fall back to the model's generation_config `max_new_tokens` when it sets one, else they have no limit but the
    context, so `chat_default` is budgeted and flagged as assumed. Pooling routes (embeddings, score, rerank)
    generate nothing: 0.
    """
    endpoint = endpoint_for(url)
    if endpoint is None:
        return 0, False
    return endpoint.output_budget(body, Budget(generation_default, chat_default))


def generation_max_tokens(
    model_dir: str | Path, generation_config: str = "auto", override: dict[str, Any] | None = None
) -> int | None:
    """The output limit vLLM applies by default: `max_new_tokens` of the generation config it reads (the model's
    generation_config.json with --generation-config auto, none with vllm, the given directory's otherwise), with
    --override-generation-config over it."""
    if override and isinstance(override.get("max_new_tokens"), int) and override["max_new_tokens"] > 0:
        return override["max_new_tokens"]
    if generation_config == "vllm":
        return None
    folder = Path(model_dir) if generation_config == "auto" else Path(generation_config)
    try:
        value = json.loads((folder / "generation_config.json").read_text()).get("max_new_tokens")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None
