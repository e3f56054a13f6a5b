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
    Templated,
    Text,
    VllmBinding,
    asks_json_output,
    fake_choice,
    fake_text,
    positive_int,
    text_of,
)
from pipeline.endpoints.chat import choices, first_choice, requested_max_tokens

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
    # vLLM's CompletionRequest: the fields it knows (see Endpoint.body_fields).
    body_fields = frozenset(
        (
            "add_special_tokens allowed_token_ids bad_words cache_salt ec_transfer_params echo frequency_penalty "
            "ignore_eos include_stop_str_in_output kv_transfer_params length_penalty logit_bias logprob_token_ids "
            "logprobs max_tokens min_p min_tokens mm_payload model n presence_penalty priority prompt prompt_embeds "
            "prompt_logprobs repetition_detection repetition_penalty request_id response_format return_mm_kwargs "
            "return_token_ids return_token_offsets return_tokens_as_token_ids routed_experts_prompt_start seed "
            "session_id skip_special_tokens spaces_between_special_tokens stop stop_token_ids stream stream_interval "
            "stream_options structured_outputs suffix temperature thinking_token_budget top_k top_p "
            "truncate_prompt_tokens truncation_side use_beam_search user vllm_xargs watermarking"
        ).split()
    )

    templated = Templated(system=False, pair=False)

    def templated_body(self, prompt: str | None, system: str | None, pair: str | None) -> dict[str, Any]:
        return {"prompt": prompt}

    def check(self, body: dict[str, Any]) -> str | None:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            return "body.prompt is required for /v1/completions"
        return None

    def prompts(self, body: dict[str, Any], pairwise: bool = False) -> list[Prompt]:
        return prompt_items(body.get("prompt"))

    def samples(self, body: dict[str, Any]) -> int:
        # vLLM 0.32's CompletionRequest has no best_of (it is an unknown field, refused by validation).
        return positive_int(body.get("n"))

    def output_budget(self, body: dict[str, Any], budget: Budget) -> tuple[int, bool]:
        return requested_max_tokens(body) or COMPLETIONS_DEFAULT_MAX_TOKENS, False

    def prefix(self, body: dict[str, Any]) -> tuple[str, str] | None:
        prompt = body.get("prompt")
        return ("", prompt) if isinstance(prompt, str) else None

    def fake(self, body: dict[str, Any], ctx: FakeContext, prompt_tokens: list[int]) -> FakeAnswer:
        tokens = requested_max_tokens(body) or ctx.output_tokens
        text = fake_text(text_of(body.get("prompt")), tokens)
        return fake_choice(
            "text_completion",
            f"cmpl-{ctx.request_id}",
            ctx,
            {"text": text},
            prompt_tokens,
            tokens,
            self.samples(body),
        )

    def answers(self, body: dict[str, Any]) -> bool:
        return body.get("object") == "text_completion"

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = first_choice(body)
        return {"content": choice.get("text"), "finish_reason": choice.get("finish_reason")}

    def asks_json(self, body: dict[str, Any]) -> bool:
        return asks_json_output(body.get("response_format"), body.get("structured_outputs"))

    def output_texts(self, body: dict[str, Any]) -> list[str]:
        return [c.get("text") for c in choices(body)]
