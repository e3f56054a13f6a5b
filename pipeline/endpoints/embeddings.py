"""`/v1/embeddings`: texts (or token ids, or a conversation) in, one vector per input out."""

from __future__ import annotations

import base64
import struct
from typing import Any

from pipeline.endpoints.base import (
    STREAM_FIELD,
    Chat,
    Endpoint,
    FakeAnswer,
    FakeContext,
    Prompt,
    Templated,
    VllmBinding,
    canonical,
    fake_list,
    fake_vector,
    lists,
    text_of,
)
from pipeline.endpoints.completions import prompt_items

# Encodings whose body is JSON: "bytes" and "bytes_only" answer with a binary stream, which a batch line cannot hold.
JSON_ENCODINGS = ("float", "base64")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def embedding_inputs(body: dict[str, Any]) -> list[Any]:
    """The inputs a request embeds, one vector each: its `input` (a string, token ids, or a list of either), or
    one conversation (`messages`, or chat messages given as `input`), or several conversations."""
    messages = body.get("messages")
    given = body.get("input") if messages is None else messages
    if _is_messages(given):
        return [given]
    if isinstance(given, list) and given and all(_is_messages(m) for m in given):
        return list(given)
    if isinstance(given, list) and given and all(isinstance(t, int) for t in given):
        return [given]
    if isinstance(given, list):
        return list(given)
    return [given]


class Embeddings(Endpoint):
    name = "embeddings"
    urls = ("/v1/embeddings",)
    tasks = frozenset({"embed"})
    generates = False
    vllm = VllmBinding(
        request="vllm.entrypoints.pooling.embed.protocol:EmbeddingRequest",
        serving="serving_embedding",
        response="vllm.entrypoints.pooling.embed.protocol:EmbeddingResponse",
    )

    fields = STREAM_FIELD
    # vLLM's EmbeddingRequest (every variant): the fields it knows (see Endpoint.body_fields).
    body_fields = frozenset(
        (
            "add_generation_prompt add_special_tokens cache_salt chat_template chat_template_kwargs "
            "continue_final_message dimensions embed_dtype encoding_format endianness input media_io_kwargs messages "
            "mm_processor_kwargs model padding priority request_id truncate_prompt_tokens truncation_side "
            "use_activation user"
        ).split()
    )

    templated = Templated(system=False, pair=False)

    def templated_body(self, prompt: str | None, system: str | None, pair: str | None) -> dict[str, Any]:
        return {"input": prompt}

    def check(self, body: dict[str, Any]) -> str | None:
        given = body.get("input") if body.get("messages") is None else body.get("messages")
        if given is None or given == "" or given == []:
            return "body.input is required for /v1/embeddings (a string, token ids, or a non-empty list)"
        encoding = body.get("encoding_format", "float")
        if encoding not in JSON_ENCODINGS:
            return f"body.encoding_format must be one of {', '.join(JSON_ENCODINGS)} in a batch, got {encoding!r}"
        return None

    def prompts(self, body: dict[str, Any], pairwise: bool = False) -> list[Prompt]:
        items: list[Prompt] = []
        for item in embedding_inputs(body):
            if _is_messages(item):
                items.append(Chat(list(item), None, {"add_generation_prompt": False}))
            else:
                items.extend(prompt_items(item))
        return items

    def fake(self, body: dict[str, Any], ctx: FakeContext, prompt_tokens: list[int]) -> FakeAnswer:
        dimensions = body.get("dimensions") or ctx.embedding_dimensions
        data = []
        for index, item in enumerate(embedding_inputs(body)):
            vector = fake_vector(
                text_of(item) if not _is_messages(item) else canonical(item), int(dimensions)
            )
            if body.get("encoding_format") == "base64":
                packed = struct.pack(f"<{len(vector)}f", *vector)
                data.append(
                    {"index": index, "object": "embedding", "embedding": base64.b64encode(packed).decode()}
                )
            else:
                data.append({"index": index, "object": "embedding", "embedding": vector})
        return fake_list(f"embd-{ctx.request_id}", ctx, data, prompt_tokens)

    def answers(self, body: dict[str, Any]) -> bool:
        return lists(body, "embedding", empty=True) and str(body.get("id", "")).startswith("embd")

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        vectors = []
        for item in sorted(
            (d for d in body.get("data") or [] if isinstance(d, dict)), key=lambda d: d.get("index", 0)
        ):
            vector = item.get("embedding")
            if not isinstance(vector, list):  # base64: left in `response`, where its encoding is known
                return {}
            vectors.append(vector)
        return {"embeddings": vectors}
