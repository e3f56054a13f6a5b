"""What one route (an OpenAI Batch `url`) is: the contract every entry of the registry fills in.

An `Endpoint` answers, for its URL family, every question the pipeline asks about a request, so that no other
module branches on the URL:

- validation: `check` (the body problems decidable without the model), `fields` (body fields read with vLLM's
  types before the engine runs) and `body_fields` (every body field vLLM's request model knows: any other is the
  line's error, as OpenAI answers it, rather than a field vLLM would ignore);
- which models serve it: `tasks` (vLLM's model tasks: "generate", "embed", "classify", "token_embed");
- its cost: `prompts` (what the engine tokenizes, one item per prompt), `samples` (sequences each prompt starts:
  `n`), `output_budget` (tokens one sequence may generate; 0 for pooling routes), `prefix` (the leading text prefix
  routing groups requests by);
- the real engine: `vllm` (vLLM's request model and the serving object of its OpenAI layer that answers it);
- the fake engine: `fake` (a deterministic body of the real shape);
- the output: `usage` (prompt and completion tokens of a response body), `answers` (whether a response body is one
  of this route's), `flatten` (its Parquet columns), `asks_json` and `output_texts` (whether a request asked for
  JSON output, and the generated texts of its answer: the report counts how many of those parse).

Pure: no Ray, no vLLM (the `vllm` binding names import paths; only the vLLM engine imports them).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from pydantic import TypeAdapter

# --- body fields, as vLLM's request models read them ---------------------------------------------------------------


class FieldType(NamedTuple):
    """A field type as vLLM's request models read it (pydantic, lax), and the exact Python types that need no
    reading: the fast path of a million-row input (`type()` is exact, so True is not taken for an int)."""

    adapter: TypeAdapter
    plain: tuple[type, ...]


FLOAT = FieldType(TypeAdapter(float), (float, int))
INT = FieldType(TypeAdapter(int), (int,))
BOOL = FieldType(TypeAdapter(bool), (bool,))
INT64 = (-(2**63), 2**63 - 1)


class FieldSpec(NamedTuple):
    """How vLLM's request models read one body field: its type, and the range vLLM accepts (None: unbounded)."""

    type: FieldType
    low: float | None = None
    high: float | None = None
    low_exclusive: bool = False


# The sampling fields every generating route shares (SamplingParams' bounds).
SAMPLING_FIELDS: dict[str, FieldSpec] = {
    "temperature": FieldSpec(FLOAT, 0.0),
    "top_p": FieldSpec(FLOAT, 0.0, 1.0, low_exclusive=True),
    "max_tokens": FieldSpec(INT, 1),
    "max_completion_tokens": FieldSpec(INT, 1),
    "n": FieldSpec(INT, 1),
    "presence_penalty": FieldSpec(FLOAT, -2.0, 2.0),
    "frequency_penalty": FieldSpec(FLOAT, -2.0, 2.0),
    "repetition_penalty": FieldSpec(FLOAT, 0.0, low_exclusive=True),
    "top_logprobs": FieldSpec(INT, 0),
    "top_k": FieldSpec(INT, -1),
    "min_p": FieldSpec(FLOAT, 0.0, 1.0),
    "seed": FieldSpec(INT, *INT64),
}
STREAM_FIELD = {"stream": FieldSpec(BOOL)}

# Body fields of OpenAI's API that vLLM's request models do not know and that change nothing in an answer: request
# bookkeeping OpenAI keeps on its side (tags, storage, billing tier, abuse monitoring ids). Lines copied from OpenAI's
# Batch docs carry them, so they are accepted on every route and, like vLLM, ignored. Any other field a route's vLLM
# request model does not know (OpenAI-only fields that would change the answer, such as `audio`, `prediction` or
# `functions`; vLLM's removed `guided_*` fields; typos) is the line's error: vLLM would ignore it silently.
OPENAI_BOOKKEEPING_FIELDS = frozenset(
    {"metadata", "store", "service_tier", "user", "prompt_cache_key", "safety_identifier"}
)


# --- what the engine tokenizes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """A prompt tokenized as it is, with the tokenizer's special tokens (BOS, or CLS/SEP)."""

    text: str


@dataclass(frozen=True)
class Chat:
    """A conversation rendered with the chat template, then tokenized without special tokens (the template
    writes them)."""

    messages: list[Any]
    tools: Any = None
    options: dict[str, Any] = field(default_factory=dict)  # template kwargs: add_generation_prompt, ...


@dataclass(frozen=True)
class TextPair:
    """Two texts a cross-encoder reads as one sequence (tokenizer(first, second))."""

    first: str
    second: str


# One sequence the engine runs: a prompt to tokenize, or an int when the token count is known (token-id prompts).
Prompt = Text | Chat | TextPair | int


@dataclass(frozen=True)
class Budget:
    """What an output budget depends on besides the request: the model's and the job's defaults."""

    generation_default: int | None = None  # generation_config max_new_tokens (after overrides), if any
    chat_default: int = 256  # budgeted for a request that may run to the end of the context


@dataclass(frozen=True)
class FakeContext:
    """What the fake engine tells a route's fake answer."""

    model: str
    request_id: str  # derived from the custom_id: the same request always gets the same ids
    created: int
    output_tokens: int  # tokens "generated" when the request sets no limit
    embedding_dimensions: int
    response_role: str = "assistant"


class FakeAnswer(NamedTuple):
    body: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class VllmBinding:
    """How vLLM's OpenAI layer answers the route in-process: its request model ("module:name", validated with a
    pydantic TypeAdapter, so unions such as EmbeddingRequest work), the attribute of the app state that
    `init_app_state` fills with the serving object (None when the model cannot serve the route), and the method
    to call on it (None: the object itself is called, as vLLM's pooling servings are)."""

    request: str
    serving: str
    method: str | None = None
    response: str | None = None  # vLLM's response model ("module:name"), for tests that parse bodies with it
    # For a line that names its file by `file_url` (run-batch's speech-to-text lines): the request model the serving
    # method takes beside the file's bytes. The engine fetches the file under the job's media policy first.
    file_url: str | None = None


class Templated(NamedTuple):
    """What a route takes from a dataset job's templates (pipeline/datasets/spec.py checks a job against it)."""

    system: bool  # a system prompt (--system)
    pair: bool  # a second text (--pair-template): score's text_2
    media: frozenset[str] = (
        frozenset()
    )  # the media kinds a row may carry ("image", "audio"): --image-column, ...
    needs_text: bool = (
        True  # whether the route needs the prompt template (speech-to-text: the audio is the input)
    )
    needs_media: str | None = None  # the media kind every row must carry (speech-to-text: "audio")


class Endpoint:
    """One URL family. Subclasses set the class attributes and override what differs from the defaults."""

    name: ClassVar[str]  # short name: "chat", "embeddings", ...
    urls: ClassVar[tuple[str, ...]]  # every URL it answers; the first is the canonical one
    tasks: ClassVar[frozenset[str]]  # vLLM model tasks that serve it
    generates: ClassVar[bool]  # whether it generates tokens (pooling routes do not)
    vllm: ClassVar[VllmBinding]
    fields: ClassVar[dict[str, FieldSpec]] = STREAM_FIELD  # body fields read before the engine runs
    # Every body field (name or alias) vLLM's request model for the route knows: written out from vLLM's models
    # (validation runs without vLLM); tests/unit/test_endpoint_fields.py compares them with the installed vLLM.
    body_fields: ClassVar[frozenset[str]]

    def check(self, body: dict[str, Any]) -> str | None:
        """The body's problem that needs no model (a missing prompt...), or None. vLLM checks the rest."""
        return None

    def prompts(self, body: dict[str, Any], pairwise: bool = False) -> list[Prompt]:
        """One item per sequence the request starts. `pairwise`: the model scores a pair as one sequence (a
        cross-encoder), not each text alone (an embedding model)."""
        raise NotImplementedError

    def samples(self, body: dict[str, Any]) -> int:
        """Sequences each prompt starts (`n`): each holds KV blocks of its own for its output, and counts against
        the engine's max_num_seqs (vLLM runs the samples of a request as requests of their own)."""
        return 1

    def output_budget(self, body: dict[str, Any], budget: Budget) -> tuple[int, bool]:
        """Output tokens one sequence may generate, and whether that number is assumed (no limit anywhere)."""
        return 0, False

    def prefix(self, body: dict[str, Any]) -> tuple[str, str] | None:
        """(the separate leading part, the whole prompt) as text, for prefix routing; None: never keyed."""
        return None

    def fake(self, body: dict[str, Any], ctx: FakeContext, prompt_tokens: list[int]) -> FakeAnswer:
        """A deterministic body of the real shape; `prompt_tokens` per sequence, as the fake engine counted."""
        raise NotImplementedError

    def usage(self, body: dict[str, Any]) -> tuple[int, int]:
        """(prompt tokens, completion tokens) of one of this route's response bodies."""
        usage = body.get("usage")
        if not isinstance(usage, dict):
            return 0, 0
        return _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))

    def answers(self, body: dict[str, Any]) -> bool:
        """Whether a response body is one of this route's (results hold bodies, not URLs)."""
        raise NotImplementedError

    def flatten(self, body: dict[str, Any]) -> dict[str, Any]:
        """This route's Parquet columns (see pipeline.io.writers.PARQUET_OUTPUT_SCHEMA) from a response body."""
        return {}

    def asks_json(self, body: dict[str, Any]) -> bool:
        """Whether a request asks for JSON output (a JSON object, or one of a JSON schema)."""
        return False

    def output_texts(self, body: dict[str, Any]) -> list[str]:
        """The generated texts of one of this route's response bodies (one per choice)."""
        return []

    # A dataset job (pipeline/datasets/) renders templates over a table's row; the route says where the texts go.
    templated: ClassVar[Templated | None] = None

    def templated_body(self, prompt: str | None, system: str | None, pair: str | None) -> dict[str, Any]:
        """The body of a dataset row's request from its rendered templates (the user prompt, the system prompt, the
        second text of a pair); `templated` says which this route takes."""
        raise NotImplementedError

    def with_media(self, body: dict[str, Any], kind: str, urls: list[str]) -> dict[str, Any] | str:
        """A dataset row's body with its media added (`kind` one of `templated.media`, as URLs: http(s), data:,
        file://), or why this row's media cannot go in it."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<endpoint {self.name} {', '.join(self.urls)}>"


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def positive_int(value: Any, default: int = 1) -> int:
    """A count field as validation left it (an int, read as vLLM reads it), else `default`."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def asks_json_output(response_format: Any, structured_outputs: Any) -> bool:
    """Whether chat/completions-style fields ask for JSON: `response_format` of type json_object or json_schema,
    or vLLM's `structured_outputs` with `json` (a schema) or `json_object`."""
    if isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema"):
        return True
    return isinstance(structured_outputs, dict) and (
        structured_outputs.get("json") is not None or bool(structured_outputs.get("json_object"))
    )


def parses_as_json(text: Any) -> bool:
    """Whether a generated text is one JSON value (what a JSON-constrained answer must be)."""
    if not isinstance(text, str):
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# --- helpers the entries share ---------------------------------------------------------------------------------


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def content_text(content: Any) -> str:
    """A message's content as text: text parts as is, anything else (images, audio) by its JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) if isinstance(p, dict) and "text" in p else canonical(p) for p in content
        )
    return "" if content is None else canonical(content)


def render_message(message: Any) -> str:
    if not isinstance(message, dict):
        return canonical(message)
    return f"{message.get('role')}\x1f{content_text(message.get('content'))}\x1e"


def words(text: str) -> int:
    """The fake engine's token count: whitespace words, at least one."""
    return max(1, len(text.split()))


def prompt_words(prompt: Prompt) -> int:
    """The fake engine's count of one sequence."""
    if isinstance(prompt, int):
        return prompt
    if isinstance(prompt, Text):
        return words(prompt.text)
    if isinstance(prompt, TextPair):
        return words(prompt.first) + words(prompt.second)
    lines = [
        f"{m.get('role')}: {content_text(m.get('content'))}" for m in prompt.messages if isinstance(m, dict)
    ]
    return words("\n".join(lines))


def text_of(value: Any) -> str:
    """An input item (text, token ids, a content part) as the text a fake answer is derived from."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return content_text(value.get("content", value.get("text", value)))
    return canonical(value)


_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
_WORD_OF_BYTE = [_WORDS[byte % len(_WORDS)] for byte in range(256)]


def fake_text(seed_text: str, tokens: int) -> str:
    """`tokens` words cycling through 32 chosen by the prompt's digest (built once per call, then repeated)."""
    digest = hashlib.sha256(seed_text.encode("utf-8", "surrogatepass")).digest()
    cycle = [_WORD_OF_BYTE[byte] for byte in digest]
    return " ".join((cycle * (tokens // len(cycle) + 1))[:tokens])


def fake_vector(seed_text: str, dimensions: int) -> list[float]:
    """A unit vector of `dimensions` float32 values drawn from the text's digest: equal texts, equal vectors."""
    values: list[float] = []
    counter = 0
    while len(values) < dimensions:
        block = hashlib.sha256(f"{counter}\x00{seed_text}".encode("utf-8", "surrogatepass")).digest()
        values.extend((b - 127.5) / 127.5 for b in block)
        counter += 1
    values = values[:dimensions]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    # Rounded to float32, as an engine's pooler output is: the Parquet column stores float32 losslessly.
    return [struct.unpack("<f", struct.pack("<f", v / norm))[0] for v in values]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=False))
    na = math.sqrt(sum(x * x for x in a)) or 1.0
    nb = math.sqrt(sum(y * y for y in b)) or 1.0
    return dot / (na * nb)


def pooling_usage(prompt_tokens: int) -> dict[str, Any]:
    """The usage object of vLLM's pooling responses (UsageInfo, dumped whole)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


# --- what the routes' answers share ----------------------------------------------------------------------------


def open_ended_budget(requested: int | None, budget: Budget) -> tuple[int, bool]:
    """The output budget of a route that, without a limit, lets the answer run to the end of the context (chat,
    responses), which cannot be planned for: the request's own limit, else the model's generation_config
    max_new_tokens when it sets one, else the job's default, flagged as assumed."""
    if requested is not None:
        return requested, False
    if budget.generation_default:
        return budget.generation_default, False
    return budget.chat_default, True


def conversation_prefix(messages: list[Any], tools: Any) -> tuple[str, str] | None:
    """A conversation's prefix key (see `Endpoint.prefix`): every message but the last is the leading part. Chat
    templates render tools ahead of the messages: they belong to it too."""
    if not messages:
        return None
    leading = (canonical(tools) if tools else "") + "".join(render_message(m) for m in messages[:-1])
    return leading, leading + render_message(messages[-1])


def fake_choice(
    kind: str,
    answer_id: str,
    ctx: FakeContext,
    content: dict[str, Any],
    prompt_tokens: list[int],
    tokens: int,
    samples: int = 1,
) -> FakeAnswer:
    """A fake generated answer of the shape chat and completions share: `samples` choices (the request's `n`),
    each cut at `tokens` ("length") and holding `content` (its message, or its text); `kind` is the body's
    `object`. As in vLLM's usage, the prompt counts once and the completion tokens of every choice add up."""
    prompt = sum(prompt_tokens)
    completion = tokens * samples
    response = {
        "id": answer_id,
        "object": kind,
        "created": ctx.created,
        "model": ctx.model,
        "choices": [
            {"index": i, **content, "logprobs": None, "finish_reason": "length"} for i in range(samples)
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    return FakeAnswer(response, prompt, completion)


def fake_list(
    answer_id: str, ctx: FakeContext, data: list[dict[str, Any]], prompt_tokens: list[int]
) -> FakeAnswer:
    """A fake pooling answer of the shape embeddings and score share: a list of `data` items, and pooling usage."""
    prompt = sum(prompt_tokens)
    response = {
        "id": answer_id,
        "object": "list",
        "created": ctx.created,
        "model": ctx.model,
        "data": data,
        "usage": pooling_usage(prompt),
    }
    return FakeAnswer(response, prompt, 0)


def lists(body: dict[str, Any], item: str, empty: bool) -> bool:
    """Whether a response body is a list of `item` objects (`object: "list"`, each `data` item's `object` is
    `item`, as far as the first one tells); `empty`: whether an empty list is one."""
    data = body.get("data")
    if body.get("object") != "list" or not isinstance(data, list):
        return False
    if not data:
        return empty
    return isinstance(data[0], dict) and data[0].get("object") == item
