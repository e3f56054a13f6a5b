"""`/v1/chat/completions`: a conversation in, a generated message out."""

from __future__ import annotations

from typing import Any

from pipeline.endpoints.base import (
    BOOL,
    SAMPLING_FIELDS,
    STREAM_FIELD,
    Budget,
    Chat,
    Endpoint,
    FakeAnswer,
    FakeContext,
    FieldSpec,
    Prompt,
    VllmBinding,
    canonical,
    fake_text,
    render_message,
)


def requested_max_tokens(
    body: dict[str, Any], keys: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
):
    """The output limit a request sets itself, as vLLM reads it: the first of `keys` that is a positive int."""
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def chat_options(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-template arguments a request carries, as vLLM's renderer passes them."""
    options = dict(body.get("chat_template_kwargs") or {})
    options.update(
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
    )
    if body.get("documents") is not None:
        options["documents"] = body["documents"]
    if body.get("chat_template"):
        options["chat_template"] = body["chat_template"]
    return options


class ChatCompletions(Endpoint):
    name = "chat"
    urls = ("/v1/chat/completions",)
    tasks = frozenset({"generate"})
    generates = True
    vllm = VllmBinding(
        request="vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
        serving="openai_serving_chat",
        method="create_chat_completion",
        response="vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionResponse",
    )
    # Chat's logprobs is a switch (completions' is a count).
    fields = {**STREAM_FIELD, **SAMPLING_FIELDS, "logprobs": FieldSpec(BOOL)}

    def check(self, body: dict[str, Any]) -> str | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "body.messages must be a non-empty list of chat messages"
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return f"body.messages[{i}] must be an object with a string 'role'"
        return None

    def prompts(self, body: dict[str, Any], pairwise: bool = False) -> list[Prompt]:
        return [Chat(list(body.get("messages") or []), body.get("tools"), chat_options(body))]

    def output_budget(self, body: dict[str, Any], budget: Budget) -> tuple[int, bool]:
        # Without a limit vLLM lets the answer run to the end of the context, which cannot be planned for: the
        # model's generation_config max_new_tokens when it sets one, else the job's default, flagged as assumed.
        requested = requested_max_tokens(body)
        if requested is not None:
            return requested, False
        if budget.generation_default:
            return budget.generation_default, False
        return budget.chat_default, True

    def prefix(self, body: dict[str, Any]) -> tuple[str, str] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        # Chat templates render tools ahead of the messages: they belong to the shared leading part.
        tools = canonical(body["tools"]) if body.get("tools") else ""
        leading = tools + "".join(render_message(m) for m in messages[:-1])
        return leading, leading + render_message(messages[-1])

    def fake(self, body: dict[str, Any], ctx: FakeContext, prompt_tokens: list[int]) -> FakeAnswer:
        prompt = sum(prompt_tokens)
        tokens = requested_max_tokens(body) or ctx.output_tokens
        text = fake_text(canonical(body.get("messages")), tokens)
        response = {
            "id": f"chatcmpl-{ctx.request_id}",
            "object": "chat.completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": ctx.response_role, "content": text},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens},
        }
        return FakeAnswer(response, prompt, tokens)

    def answers(self, body: dict[str, Any]) -> bool:
        return body.get("object") == "chat.completion"

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = first_choice(body)
        message = choice.get("message")
        content = message.get("content") if isinstance(message, dict) else None
        return {"content": content, "finish_reason": choice.get("finish_reason")}


def first_choice(body: dict[str, Any]) -> dict[str, Any]:
    choices = body.get("choices")
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
