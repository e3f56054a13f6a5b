"""`/v1/responses`: OpenAI's Responses API (instructions + input items in, output items out)."""

from __future__ import annotations

from typing import Any

from pipeline.endpoints.base import (
    INT,
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
    content_text,
    conversation_prefix,
    fake_text,
    open_ended_budget,
)
from pipeline.endpoints.chat import chat_options, requested_max_tokens


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation vLLM renders for a Responses request: instructions as the system message, then the input
    (a string is one user message; message items keep their role, their text parts joined; other items, such as
    function calls and their outputs, by their JSON)."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            if isinstance(item, dict) and isinstance(item.get("role"), str):
                messages.append({"role": item["role"], "content": content_text(item.get("content"))})
            else:
                messages.append({"role": "user", "content": canonical(item)})
    return messages


class Responses(Endpoint):
    name = "responses"
    urls = ("/v1/responses",)
    tasks = frozenset({"generate"})
    generates = True
    vllm = VllmBinding(
        request="vllm.entrypoints.openai.responses.protocol:ResponsesRequest",
        serving="openai_serving_responses",
        method="create_responses",
        response="vllm.entrypoints.openai.responses.protocol:ResponsesResponse",
    )
    fields = {**STREAM_FIELD, **SAMPLING_FIELDS, "max_output_tokens": FieldSpec(INT, 1)}
    # vLLM's ResponsesRequest: the fields it knows (see Endpoint.body_fields).
    body_fields = frozenset(
        (
            "background cache_salt chat_template_kwargs ec_transfer_params enable_response_messages frequency_penalty "
            "ignore_eos include include_reasoning include_stop_str_in_output input instructions kv_transfer_params "
            "logit_bias max_output_tokens max_tool_calls media_io_kwargs metadata min_p mm_payload "
            "mm_processor_kwargs model parallel_tool_calls presence_penalty previous_input_messages "
            "previous_response_id priority prompt prompt_cache_key reasoning repetition_penalty request_id "
            "return_mm_kwargs seed service_tier session_id skip_special_tokens stop stop_token_ids store stream "
            "structured_outputs temperature text tool_choice tools top_k top_logprobs top_p truncation user "
            "vllm_xargs watermarking"
        ).split()
    )

    templated = Templated(system=True, pair=False)

    def templated_body(self, prompt: str | None, system: str | None, pair: str | None) -> dict[str, Any]:
        return {"input": prompt, **({"instructions": system} if system is not None else {})}

    def check(self, body: dict[str, Any]) -> str | None:
        given = body.get("input")
        if not (isinstance(given, str) and given) and not (isinstance(given, list) and given):
            return "body.input is required for /v1/responses (a string or a non-empty list of input items)"
        return None

    def prompts(self, body: dict[str, Any], pairwise: bool = False) -> list[Prompt]:
        return [Chat(input_messages(body), body.get("tools") or None, chat_options(body))]

    def output_budget(self, body: dict[str, Any], budget: Budget) -> tuple[int, bool]:
        return open_ended_budget(requested_max_tokens(body, ("max_output_tokens",)), budget)

    def prefix(self, body: dict[str, Any]) -> tuple[str, str] | None:
        return conversation_prefix(input_messages(body), body.get("tools"))

    def fake(self, body: dict[str, Any], ctx: FakeContext, prompt_tokens: list[int]) -> FakeAnswer:
        prompt = sum(prompt_tokens)
        tokens = requested_max_tokens(body, ("max_output_tokens",)) or ctx.output_tokens
        text = fake_text(canonical(input_messages(body)), tokens)
        response = {
            "id": f"resp_{ctx.request_id}",
            "created_at": ctx.created,
            "incomplete_details": {"reason": "max_output_tokens"},
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": ctx.model,
            "object": "response",
            "output": [
                {
                    "id": f"msg_{ctx.request_id}",
                    "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
                    "role": ctx.response_role,
                    "status": "completed",
                    "type": "message",
                    "phase": None,
                }
            ],
            "parallel_tool_calls": True,
            "temperature": body.get("temperature", 1.0),
            "tool_choice": "none",
            "tools": [],
            "top_p": body.get("top_p", 1.0),
            "background": False,
            "max_output_tokens": tokens,
            "max_tool_calls": None,
            "previous_response_id": None,
            "prompt": None,
            "reasoning": None,
            "service_tier": "auto",
            "status": "incomplete",
            "text": None,
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": {
                "input_tokens": prompt,
                "input_tokens_details": {
                    "cached_tokens": 0,
                    "cache_write_tokens": 0,
                    "input_tokens_per_turn": [],
                    "cached_tokens_per_turn": [],
                },
                "output_tokens": tokens,
                "output_tokens_details": {
                    "reasoning_tokens": 0,
                    "tool_output_tokens": 0,
                    "output_tokens_per_turn": [],
                    "tool_output_tokens_per_turn": [],
                },
                "total_tokens": prompt + tokens,
            },
            "user": None,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }
        return FakeAnswer(response, prompt, tokens)

    def usage(self, body: dict[str, Any]) -> tuple[int, int]:
        usage = body.get("usage")
        if not isinstance(usage, dict):
            return 0, 0
        prompt, output = usage.get("input_tokens"), usage.get("output_tokens")
        return (prompt if isinstance(prompt, int) else 0), (output if isinstance(output, int) else 0)

    def answers(self, body: dict[str, Any]) -> bool:
        return body.get("object") == "response"

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        texts = []
        for item in body.get("output") or []:
            if isinstance(item, dict) and item.get("type") == "message":
                for part in item.get("content") or []:
                    if isinstance(part, dict) and part.get("type") == "output_text":
                        texts.append(str(part.get("text", "")))
        details = body.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        # finish_reason in chat's words: a response cut at max_output_tokens stopped for "length".
        finish = "length" if reason == "max_output_tokens" else reason or body.get("status")
        return {"content": "".join(texts) if texts else None, "finish_reason": finish}

    def asks_json(self, body: dict[str, Any]) -> bool:
        # The Responses API names its format under text.format: {"type": "json_schema", "name", "schema", ...}.
        text = body.get("text")
        return asks_json_output(
            text.get("format") if isinstance(text, dict) else None, body.get("structured_outputs")
        )

    def output_texts(self, body: dict[str, Any]) -> list[str]:
        content = self.flatten(body).get("content")
        return [] if content is None else [content]
