"""What fitting can know of a backend before any engine starts: the `FitTarget` its fit strategy builds.

A backend's registry entry (engines/base.py `Backend.fitting`) names its strategy, a function beside its engine:
`fit_target(model, args, default_max_tokens) -> FitTarget | str` (a string says why it cannot be fitted). The vllm
strategy counts with the model's tokenizer and chat template and knows the KV cache of a CPU pool; the fake's counts
its own words; the http backend has none (its servers' engine args are their own). The runtime decides the fitted
args from the target (runtime/ingest/fit.py) and measures requests with it (runtime/ingest/measure.py).

Strategies run wherever requests are measured: on the driver, and in each ingest task's worker process. So the
tokenizer a strategy counts with is loaded once per process (`prompt_counter`), on its first count: the driver,
which only decides, never loads it. Nothing here imports Ray; transformers is imported only when a counter loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.endpoints import endpoint_for
from pipeline.models import ResolvedModel

# Prompt tokens per sequence of each (url, body) (a prompt once per sample: `per_sequence`), or the exception that
# made a request uncountable.
Counter = Callable[[Sequence[tuple[str, dict]]], list[list[int] | Exception]]


@dataclass(frozen=True)
class KvCapacity:
    """One pool's KV cache: usable blocks and how many sequences of a given length they hold."""

    blocks: int  # blocks a scheduler can hand out (vLLM keeps one more as its null block)
    block_size: int
    sequences: Callable[[int], int]  # sequences that fit at once when each grows to `context` tokens

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


@dataclass(frozen=True)
class FitTarget:
    """What fitting needs from an engine backend."""

    counted_by: str  # how prompts are counted, for the record
    count: Counter  # prompt tokens per sequence
    output_budget: Callable[[str, dict], tuple[int, bool]]  # (output tokens, whether that is an assumption)
    model_limit: int  # the longest context the engine accepts
    block_size: Callable[[dict, str], int]  # (pool args, device) -> KV block size
    # (pool args, device) -> KV capacity, None when unknown
    capacity: Callable[[dict, str], KvCapacity | None]
    notes: list[str] = field(default_factory=list)


# A backend's fit strategy: (the job's model, the backend's engine args, engine.fit.default_max_tokens).
FitStrategy = Callable[[ResolvedModel, dict[str, Any], int], FitTarget | str]


def own_requests(model: ResolvedModel, args: dict[str, Any], count: Counter) -> Counter:
    """`count` for the requests of the model fitting is for: those naming it, or one of the LoRA adapters its
    engines serve (`args`' lora_modules: an adapter's request runs on the model's engines, in their context). A
    request for another model of the job (a pool of its own) starts no sequence here: that pool runs with its
    model's own limits (runtime/engines/launch.py pool_spec)."""
    names = {None, model.name, *(args.get("lora_modules") or {})}

    def counted(requests: Sequence[tuple[str, dict]]) -> list[list[int] | Exception]:
        own = [i for i, (_, body) in enumerate(requests) if body.get("model") in names]
        if len(own) == len(requests):
            return count(requests)
        out: list[list[int] | Exception] = [[] for _ in requests]
        for i, result in zip(own, count([requests[i] for i in own]), strict=True):
            out[i] = result
        return out

    return counted


def sequence_prompts(url: str, body: dict, prompts: list[int]) -> list[int]:
    """The prompt tokens of every sequence a request starts, from those of its prompts: each prompt once per sample
    (`n`, the route's `Endpoint.samples`). vLLM runs each sample as a sequence of its own: it takes a max_num_seqs
    slot and KV blocks for its own output. With prefix caching the samples share their prompt's full blocks, so
    counting the prompt once per sample is the safe side: fitted for it, the engine never has to preempt."""
    endpoint = endpoint_for(url)
    samples = endpoint.samples(body) if endpoint is not None else 1
    return prompts * samples if samples > 1 else prompts


def per_sequence(count: Counter) -> Counter:
    """`count` by sequence rather than by prompt (see `sequence_prompts`): what fitting measures requests by."""

    def counted(requests: Sequence[tuple[str, dict]]) -> list[list[int] | Exception]:
        return [
            result if isinstance(result, Exception) else sequence_prompts(url, body, result)
            for (url, body), result in zip(requests, count(requests), strict=True)
        ]

    return counted


# Per process: a tokenizer takes a second to load, and one worker runs many ingest tasks (and, in the Batch API
# server, many jobs' tasks): each model's counter is loaded once.
_PROMPT_COUNTERS: dict[str, Any] = {}


def prompt_counter(
    model_dir: str,
    chat_template: str | None = None,
    task: str | None = None,
    media_tokens: dict[str, int] | None = None,
):
    """The model's PromptCounter (pipeline/tokens.py, PromptCounter.for_model), loaded once per process."""
    from pipeline.tokens import PromptCounter

    key = f"{model_dir}\0{chat_template}\0{task}\0{sorted((media_tokens or {}).items())}"
    counter = _PROMPT_COUNTERS.get(key)
    if counter is None:
        counter = _PROMPT_COUNTERS[key] = PromptCounter.for_model(
            model_dir, chat_template, task, media_tokens
        )
    return counter


def tokenizers_loaded() -> int:
    """Tokenizers this process has loaded (an ingest task reports how many it had to load itself)."""
    return len(_PROMPT_COUNTERS)
