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
    Templated,
    VllmBinding,
    asks_json_output,
    canonical,
    conversation_prefix,
    fake_choice,
    fake_text,
    open_ended_budget,
    positive_int,
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


# A dataset row's media as a chat content part of vLLM's: the part's type, which is also the key of its URL.
MEDIA_PART = {"image": "image_url", "audio": "audio_url"}


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
    # vLLM's ChatCompletionRequest: the fields it knows (see Endpoint.body_fields).
    body_fields = frozenset(
        (
            "add_generation_prompt add_special_tokens allowed_token_ids bad_words cache_salt chat_template "
            "chat_template_kwargs continue_final_message documents ec_transfer_params echo frequency_penalty "
            "ignore_eos include_reasoning include_stop_str_in_output kv_transfer_params length_penalty logit_bias "
            "logprob_token_ids logprobs max_completion_tokens max_tokens media_io_kwargs messages min_p min_tokens "
            "mm_payload mm_processor_kwargs model n parallel_tool_calls presence_penalty priority prompt_logprobs "
            "reasoning_effort repetition_detection repetition_penalty request_id response_format return_mm_kwargs "
            "return_prompt_text return_token_ids return_token_offsets return_tokens_as_token_ids "
            "routed_experts_prompt_start seed session_id skip_special_tokens spaces_between_special_tokens stop "
            "stop_token_ids stream stream_interval stream_options structured_outputs temperature "
            "thinking_token_budget tool_choice tools top_k top_logprobs top_p truncate_prompt_tokens truncation_side "
            "use_beam_search user vllm_xargs watermarking"
        ).split()
    )

    templated = Templated(system=True, pair=False, media=frozenset(MEDIA_PART))

    def templated_body(self, prompt: str | None, system: str | None, pair: str | None) -> dict[str, Any]:
        head = [{"role": "system", "content": system}] if system is not None else []
        return {"messages": [*head, {"role": "user", "content": prompt}]}

    def with_media(self, body: dict[str, Any], kind: str, urls: list[str]) -> dict[str, Any] | str:
        # The user message becomes its text followed by the media parts, as vLLM's chat renderer takes them.
        *head, user = body["messages"]
        parts = (
            user["content"]
            if isinstance(user["content"], list)
            else [{"type": "text", "text": user["content"]}]
        )
        part = MEDIA_PART[kind]
        parts = [*parts, *({"type": part, part: {"url": url}} for url in urls)]
        return {**body, "messages": [*head, {**user, "content": parts}]}

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

    def samples(self, body: dict[str, Any]) -> int:
        return positive_int(body.get("n"))

    def output_budget(self, body: dict[str, Any], budget: Budget) -> tuple[int, bool]:
        return open_ended_budget(requested_max_tokens(body), budget)

    def prefix(self, body: dict[str, Any]) -> tuple[str, str] | None:
        messages = body.get("messages")
        return conversation_prefix(messages, body.get("tools")) if isinstance(messages, list) else None

    def fake(self, body: dict[str, Any], ctx: FakeContext, prompt_tokens: list[int]) -> FakeAnswer:
        tokens = requested_max_tokens(body) or ctx.output_tokens
        text = fake_text(canonical(body.get("messages")), tokens)
        message = {"role": ctx.response_role, "content": text}
        return fake_choice(
            "chat.completion",
            f"chatcmpl-{ctx.request_id}",
            ctx,
            {"message": message},
            prompt_tokens,
            tokens,
            self.samples(body),
        )

    def answers(self, body: dict[str, Any]) -> bool:
        return body.get("object") == "chat.completion"

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = first_choice(body)
        message = choice.get("message")
        content = message.get("content") if isinstance(message, dict) else None
        return {"content": content, "finish_reason": choice.get("finish_reason")}

    def asks_json(self, body: dict[str, Any]) -> bool:
        return asks_json_output(body.get("response_format"), body.get("structured_outputs"))

    def output_texts(self, body: dict[str, Any]) -> list[str]:
        return [c["message"].get("content") for c in choices(body) if isinstance(c.get("message"), dict)]


def choices(body: dict[str, Any]) -> list[dict[str, Any]]:
    given = body.get("choices")
    return [c for c in given if isinstance(c, dict)] if isinstance(given, list) else []


def first_choice(body: dict[str, Any]) -> dict[str, Any]:
    given = choices(body)
    return given[0] if given else {}
