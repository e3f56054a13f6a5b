"""`/v1/completions`: a prompt (text, token ids, or a list of either) in, generated text out."""

from __future__ import annotations

from typing import Any

from pipeline.endpoints.base import (
    INT,
    SAMPLING_FIELDS,
    STREAM_FIELD,
    Budget,
    Endpoint,
    FakeAnswer,
    FakeContext,
    FieldSpec,
    Prompt,
    Text,
    VllmBinding,
    fake_choice,
    fake_text,
    text_of,
)
from pipeline.endpoints.chat import first_choice, requested_max_tokens

# /v1/completions without max_tokens: vLLM (like OpenAI) generates 16 tokens.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def prompt_items(prompt: Any) -> list[Prompt]:
    """A completions-style prompt as sequences: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [len(prompt)]
    if isinstance(prompt, list) and prompt:
        return [len(p) if isinstance(p, list) else Text(p if isinstance(p, str) else str(p)) for p in prompt]
    return [Text(prompt if isinstance(prompt, str) else str(prompt))]


class Completions(Endpoint):
    name = "completions"
    urls = ("/v1/completions",)
    tasks = frozenset({"generate"})
    generates = True
    vllm = VllmBinding(
        request="vllm.entrypoints.openai.completion.protocol:CompletionRequest",
        serving="openai_serving_completion",
        method="create_completion",
        response="vllm.entrypoints.openai.completion.protocol:CompletionResponse",
    )
    fields = {**STREAM_FIELD, **SAMPLING_FIELDS, "logprobs": FieldSpec(INT, 0)}

    def check(self, body: dict[str, Any]) -> str | None:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            return "body.prompt is required for /v1/completions"
        return None

    def prompts(self, body: dict[str, Any], pairwise: bool = False) -> list[Prompt]:
        return prompt_items(body.get("prompt"))

    def output_budget(self, body: dict[str, Any], budget: Budget) -> tuple[int, bool]:
        return requested_max_tokens(body) or COMPLETIONS_DEFAULT_MAX_TOKENS, False

    def prefix(self, body: dict[str, Any]) -> tuple[str, str] | None:
        prompt = body.get("prompt")
        return ("", prompt) if isinstance(prompt, str) else None

    def fake(self, body: dict[str, Any], ctx: FakeContext, prompt_tokens: list[int]) -> FakeAnswer:
        tokens = requested_max_tokens(body) or ctx.output_tokens
        text = fake_text(text_of(body.get("prompt")), tokens)
        return fake_choice(
            "text_completion", f"cmpl-{ctx.request_id}", ctx, {"text": text}, prompt_tokens, tokens
        )

    def answers(self, body: dict[str, Any]) -> bool:
        return body.get("object") == "text_completion"

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = first_choice(body)
        return {"content": choice.get("text"), "finish_reason": choice.get("finish_reason")}
