"""`/v1/score` (and `/score`) and `/v1/rerank` (and `/rerank`, `/v2/rerank`): relevance of texts to a query.

vLLM answers both with one serving object: an embedding model scores a pair by the cosine of the two texts'
embeddings (each text is its own sequence), a cross-encoder reads the pair as one sequence.
"""

from __future__ import annotations

from typing import Any

from pipeline.endpoints.base import (
    STREAM_FIELD,
    Endpoint,
    FakeAnswer,
    FakeContext,
    Prompt,
    Templated,
    Text,
    TextPair,
    VllmBinding,
    cosine,
    fake_list,
    fake_vector,
    lists,
    text_of,
)

# The pairs of fields a score request may name its two sides by (vLLM's ScoreRequest variants).
SCORE_FIELDS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
SCORING_TASKS = frozenset({"embed", "classify", "token_embed"})


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def pairs(first: Any, second: Any) -> tuple[list[Any], list[Any], list[tuple[Any, Any]]]:
    """(queries, documents, the scored pairs): one query against every document, or N against N."""
    queries, documents = _as_list(first), _as_list(second)
    if len(queries) == 1:
        return queries, documents, [(queries[0], d) for d in documents]
    return queries, documents, list(zip(queries, documents, strict=False))


def _prompts(first: Any, second: Any, pairwise: bool) -> list[Prompt]:
    queries, documents, scored = pairs(first, second)
    if pairwise:  # a cross-encoder: one sequence per pair
        return [TextPair(text_of(q), text_of(d)) for q, d in scored]
    return [Text(text_of(x)) for x in queries + documents]  # an embedding model: one per text


class Score(Endpoint):
    name = "score"
    urls = ("/v1/score", "/score")
    tasks = SCORING_TASKS
    generates = False
    vllm = VllmBinding(
        request="vllm.entrypoints.pooling.scoring.protocol:ScoreRequest",
        serving="serving_scores",
        response="vllm.entrypoints.pooling.scoring.protocol:ScoreResponse",
    )
    fields = STREAM_FIELD
    # vLLM's ScoreRequest (every variant): the fields it knows (see Endpoint.body_fields).
    body_fields = frozenset(
        (
            "cache_salt chat_template_kwargs data_1 data_2 documents instruction items max_tokens_per_doc "
            "max_tokens_per_query mm_processor_kwargs model padding priority queries request_id text_1 text_2 "
            "truncate_prompt_tokens truncation_side use_activation user"
        ).split()
    )

    @staticmethod
    def sides(body: dict[str, Any]) -> tuple[Any, Any] | None:
        for first, second in SCORE_FIELDS:
            if body.get(first) is not None and body.get(second) is not None:
                return body[first], body[second]
        return None

    templated = Templated(system=False, pair=True)

    def templated_body(self, prompt: str | None, system: str | None, pair: str | None) -> dict[str, Any]:
        return {"text_1": prompt, "text_2": pair}

    def check(self, body: dict[str, Any]) -> str | None:
        if self.sides(body) is None:
            names = ", ".join(f"{a} + {b}" for a, b in SCORE_FIELDS)
            return f"a score request names its two sides as one of: {names}"
        return None

    def prompts(self, body: dict[str, Any], pairwise: bool = False) -> list[Prompt]:
        sides = self.sides(body)
        return _prompts(*sides, pairwise) if sides else []

    def fake(self, body: dict[str, Any], ctx: FakeContext, prompt_tokens: list[int]) -> FakeAnswer:
        _, _, scored = pairs(*self.sides(body))
        data = [
            {"index": i, "object": "score", "score": _fake_score(q, d, ctx)}
            for i, (q, d) in enumerate(scored)
        ]
        return fake_list(f"score-{ctx.request_id}", ctx, data, prompt_tokens)

    def answers(self, body: dict[str, Any]) -> bool:
        return lists(body, "score", empty=False)

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        data = sorted(
            (d for d in body.get("data") or [] if isinstance(d, dict)), key=lambda d: d.get("index", 0)
        )
        return {"scores": [d.get("score") for d in data]}


class Rerank(Endpoint):
    name = "rerank"
    urls = ("/v1/rerank", "/rerank", "/v2/rerank")
    tasks = SCORING_TASKS
    generates = False
    vllm = VllmBinding(
        request="vllm.entrypoints.pooling.scoring.protocol:RerankRequest",
        serving="serving_scores",
        response="vllm.entrypoints.pooling.scoring.protocol:RerankResponse",
    )
    fields = STREAM_FIELD
    # vLLM's RerankRequest: the fields it knows (see Endpoint.body_fields).
    body_fields = frozenset(
        (
            "cache_salt chat_template_kwargs documents instruction max_tokens_per_doc max_tokens_per_query "
            "mm_processor_kwargs model padding priority query request_id top_n truncate_prompt_tokens truncation_side "
            "use_activation user"
        ).split()
    )

    def check(self, body: dict[str, Any]) -> str | None:
        if body.get("query") is None:
            return "body.query is required for rerank"
        documents = body.get("documents")
        if documents is None or documents == []:
            return "body.documents is required for rerank (a non-empty list)"
        return None

    def prompts(self, body: dict[str, Any], pairwise: bool = False) -> list[Prompt]:
        return _prompts(body.get("query"), body.get("documents"), pairwise)

    def fake(self, body: dict[str, Any], ctx: FakeContext, prompt_tokens: list[int]) -> FakeAnswer:
        documents = _as_list(body.get("documents"))
        results = [
            {
                "index": i,
                "document": {"text": d, "multi_modal": None}
                if isinstance(d, str)
                else {"text": None, "multi_modal": d.get("content", []) if isinstance(d, dict) else []},
                "relevance_score": _fake_score(body.get("query"), d, ctx),
            }
            for i, d in enumerate(documents)
        ]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        top_n = body.get("top_n") or 0
        if isinstance(top_n, int) and 0 < top_n < len(documents):
            results = results[:top_n]
        prompt = sum(prompt_tokens)
        response = {
            "id": f"score-{ctx.request_id}",
            "model": ctx.model,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            "results": results,
        }
        return FakeAnswer(response, prompt, 0)

    def answers(self, body: dict[str, Any]) -> bool:
        return isinstance(body.get("results"), list) and "usage" in body

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        results = [r for r in body.get("results") or [] if isinstance(r, dict)]
        return {
            "scores": [r.get("relevance_score") for r in results],
            "ranking": [r.get("index") for r in results],
        }


def _fake_score(query: Any, document: Any, ctx: FakeContext) -> float:
    dims = ctx.embedding_dimensions
    return cosine(fake_vector(text_of(query), dims), fake_vector(text_of(document), dims))
