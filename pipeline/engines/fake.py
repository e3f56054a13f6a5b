"""The fake engine: deterministic answers in the real OpenAI body shapes, with a token-time model.

For data-plane tests and for simulating scale (a million rows, many engines) — never the evidence that a feature
works with a real model. Time model: a request holds one of `max_concurrency` slots (its KV budget) for
prefill_seconds_per_token x prompt tokens + decode_seconds_per_token x output tokens.

LoRA adapters (`lora_modules`) are modelled as vLLM holds them: at most `max_loras` at once; a request for another
adapter waits until one is idle, swaps it out and loads its own (`adapter_load_seconds`). `adapter_loads` counts the
loads, as the real engine's stats do.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pipeline.endpoints import Endpoint, FakeContext, endpoint_for
from pipeline.endpoints.base import prompt_words
from pipeline.engines.base import (
    Engine,
    EngineRequest,
    EngineResult,
    EngineSpec,
    EngineStats,
    unexpected_error_result,
)
from pipeline.engines.fitting import FitTarget, own_requests, per_sequence
from pipeline.max_tokens import requested_max_tokens
from pipeline.models import ResolvedModel
from pipeline.protocol import ErrorCode
from pipeline.topology import Topology

# The fake's context when none is given: its stand-in for a model's limit.
FAKE_MAX_MODEL_LEN = 8192


def _endpoint(url: str) -> Endpoint:
    endpoint = endpoint_for(url)
    if endpoint is None:
        raise ValueError(f"url {url!r} is not a route nightshift serves")
    return endpoint


def sequence_tokens(url: str, body: dict[str, Any]) -> list[int]:
    """The fake's prompt tokens per sequence the request starts (whitespace words of each rendered prompt): what
    fitting measures it by."""
    return [prompt_words(p) for p in _endpoint(url).prompts(body)]


def prompt_tokens(url: str, body: dict[str, Any]) -> int:
    """The fake's prompt token count of a whole request."""
    return sum(sequence_tokens(url, body))


class FakeEngine(Engine):
    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.args = spec.args
        self.max_model_len = int(self.args.get("max_model_len") or FAKE_MAX_MODEL_LEN)
        # Sequences at once: its KV model's answer (decided here, as vLLM decides after measuring memory), or
        # max_concurrency.
        kv_tokens = self.args.get("kv_cache_tokens")
        self.max_num_seqs = (
            max(1, int(kv_tokens) // self.max_model_len)
            if kv_tokens
            else int(self.args.get("max_concurrency", 256))
        )
        self._slots = asyncio.Semaphore(self.max_num_seqs)
        self._inside = 0
        self.peak_inside = 0  # most requests inside the engine at once (running or waiting for a slot)
        # Fixed, so fake outputs are byte-for-byte reproducible (real engines stamp the wall clock).
        self._created = 1_700_000_000
        self._ranks: list[Any] = []  # a sharded engine's stand-in ranks (engines/fake_ranks.py)
        self._rank_info: list[dict[str, Any]] = []
        # LoRA slots: the adapters held (least recently used first), each with its requests in flight.
        self._adapters = set(self.args.get("lora_modules") or {})
        self._held: OrderedDict[str, int] = OrderedDict()
        self._slot_freed: asyncio.Condition | None = None  # made in the engine's event loop
        self.adapter_loads = 0

    @classmethod
    def rows_per_second(cls, spec: EngineSpec) -> float | None:
        # Instant answers: as fast as the data plane goes. Under the time model a request's cost follows its own
        # max_tokens, unknown before it is read — so, like a real engine, only running tells. (A guess from a
        # typical length was 11x off for a batch asking ~175 tokens a request: chunks of ~20 s of work, and the
        # engines that drew the last ones ran on long after the others were dry.)
        if not spec.args.get("prefill_seconds_per_token") and not spec.args.get("decode_seconds_per_token"):
            return float("inf")
        return None

    async def start(self) -> None:
        await asyncio.sleep(float(self.args.get("start_seconds") or 0.0))
        topology = Topology.of(self.args)
        if topology.sharded:
            from pipeline.engines import fake_ranks

            self._ranks = await fake_ranks.start_ranks(
                topology.tensor_parallel_size, topology.pipeline_parallel_size
            )
            self._rank_info = await fake_ranks.describe(self._ranks)

    @classmethod
    def is_engine_dead(cls, exc: BaseException) -> bool:
        from pipeline.engines.fake_ranks import RankLost

        return isinstance(exc, RankLost)

    @property
    def instant(self) -> bool:
        """Every request costs no time under the time model (the data-plane benchmark's setting), and no rank
        stands between it and its answer."""
        return (
            not self.args.get("prefill_seconds_per_token")
            and not self.args.get("decode_seconds_per_token")
            and not self.args.get("adapter_load_seconds")
            and not self.args.get("hold_while")
            and not self._ranks
        )

    async def generate_all(
        self, requests: list[EngineRequest], slots: asyncio.Semaphore | None = None
    ) -> list[EngineResult]:
        if not self.instant:
            return await super().generate_all(requests, slots)
        # Every answer is ready at once: nothing to schedule, so one pass and no task per request (at a million
        # rows the tasks alone cost seconds). A chunk is at most a few thousand rows, a few ms of loop time.
        return [self._answer_now(request) for request in requests]

    def _answer_now(self, request: EngineRequest) -> EngineResult:
        try:
            adapter = self._adapter_of(request)
            if adapter is not None:  # one at a time: a slot is taken and given back at once
                self._take_slot(adapter)
                self._held[adapter] -= 1
            return self._answer(request)[0]
        except Exception as exc:  # noqa: BLE001 - as Engine.answer: one request never fails the chunk
            return unexpected_error_result(request.custom_id, exc)

    def _adapter_of(self, request: EngineRequest) -> str | None:
        model = request.body.get("model")
        return model if model in self._adapters else None

    def _take_slot(self, adapter: str) -> bool:
        """Hold `adapter` (loading it, in place of the least recently used idle one, when it is not held); False
        when every slot is busy with other adapters' requests."""
        if adapter not in self._held:
            max_loras = int(self.args.get("max_loras") or 1)
            if len(self._held) >= max_loras:
                idle = next((name for name, users in self._held.items() if users == 0), None)
                if idle is None:
                    return False
                del self._held[idle]
            self._held[adapter] = 0
            self.adapter_loads += 1
        self._held.move_to_end(adapter)
        self._held[adapter] += 1
        return True

    async def _hold_adapter(self, adapter: str) -> None:
        if self._slot_freed is None:
            self._slot_freed = asyncio.Condition()
        async with self._slot_freed:
            while True:
                loads = self.adapter_loads
                if self._take_slot(adapter):
                    break
                await self._slot_freed.wait()
            if self.adapter_loads > loads:  # the load holds the lock: vLLM loads one adapter at a time
                await asyncio.sleep(float(self.args.get("adapter_load_seconds") or 0.0))

    async def _release_adapter(self, adapter: str) -> None:
        assert self._slot_freed is not None
        async with self._slot_freed:
            self._held[adapter] -= 1
            self._slot_freed.notify_all()

    async def generate(self, request: EngineRequest) -> EngineResult:
        adapter = self._adapter_of(request)
        if adapter is None:
            return await self._generate(request)
        await self._hold_adapter(adapter)
        try:
            return await self._generate(request)
        finally:
            await self._release_adapter(adapter)

    async def _generate(self, request: EngineRequest) -> EngineResult:
        await self._unless_held()
        result, cost = self._answer(request)
        if self._ranks:
            from pipeline.engines.fake_ranks import through_every_stage

            await through_every_stage(self._ranks, 1)
        if cost > 0:  # a request that costs no time holds no slot: nothing could wait for it
            self._inside += 1
            self.peak_inside = max(self.peak_inside, self._inside)
            try:
                async with self._slots:
                    await self._unless_held()  # a request that waited for its slot starts no sooner
                    await asyncio.sleep(cost)
            finally:
                self._inside -= 1
        return result

    async def _unless_held(self) -> None:
        """Waits while the `hold_while` file exists: no request starts meanwhile (see FakeEngineArgs)."""
        hold = self.args.get("hold_while")
        while hold and os.path.exists(hold):
            await asyncio.sleep(0.05)

    def _answer(self, request: EngineRequest) -> tuple[EngineResult, float]:
        """The response and the seconds it costs under the time model."""
        if self.args.get("call_log"):
            # "{pid}" in the path gives each engine process its own log (which engine ran which request).
            path = self.args["call_log"].replace("{pid}", str(os.getpid()))
            with open(path, "a") as fh:  # O_APPEND: whole short lines, safe across processes
                fh.write(request.custom_id + "\n")
        if any(marker in request.custom_id for marker in self.args.get("crash_on") or ()):
            os._exit(1)  # simulate the engine process dying (segfault, OOM kill) on this request
        endpoint = _endpoint(request.url)
        body = request.body
        sequences = [prompt_words(p) for p in endpoint.prompts(body)]
        output = self._output_tokens(endpoint, body)
        longest = max(sequences, default=0)
        # Like vLLM: a generating route needs room for its prompt and its max_tokens; a pooling route for its
        # prompt alone.
        if longest + output > self.max_model_len:
            return self._too_long(request.custom_id, longest, output), 0.0
        rid = hashlib.sha256(request.custom_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        ctx = FakeContext(
            # Like vLLM's serving layer: an adapter's answers name the adapter.
            model=body.get("model") if body.get("model") in self._adapters else self.spec.served_model_name,
            request_id=rid,
            created=self._created,
            output_tokens=int(self.args.get("output_tokens", 16)),
            embedding_dimensions=int(self.args.get("embedding_dimensions", 384)),
        )
        answer = endpoint.fake(body, ctx, sequences)
        cost = (
            self.args.get("prefill_seconds_per_token", 0.0) * answer.prompt_tokens
            + self.args.get("decode_seconds_per_token", 0.0) * answer.completion_tokens
        )
        result = EngineResult(
            request.custom_id, 200, answer.body, None, answer.prompt_tokens, answer.completion_tokens
        )
        return result, cost

    def _output_tokens(self, endpoint: Endpoint, body: dict[str, Any]) -> int:
        if not endpoint.generates:
            return 0
        limit = requested_max_tokens(body)
        return int(limit or self.args.get("output_tokens", 16))

    def _too_long(self, custom_id: str, prompt: int, output: int) -> EngineResult:
        message = (
            f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
            f"{prompt + output} tokens ({prompt} in the messages, {output} in the completion). Please reduce the "
            "length of the messages or completion."
        )
        error = {
            "error": {
                "message": message,
                "type": "BadRequestError",
                "code": ErrorCode.CONTEXT_LENGTH_EXCEEDED.value,
            }
        }
        return EngineResult(custom_id, 400, error, ErrorCode.CONTEXT_LENGTH_EXCEEDED)

    def effective_args(self) -> dict[str, Any]:
        ranks = {"ranks": self._rank_info} if self._rank_info else {}
        return {**self.args, "max_num_seqs": self.max_num_seqs, **ranks}

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_cache_tokens=int(self.args.get("kv_cache_tokens") or self.max_model_len * self.max_num_seqs),
            extra={"peak_requests_inside": self.peak_inside},
            adapter_loads=self.adapter_loads if self._adapters else None,
        )


def fit_target(model: ResolvedModel, args: dict[str, Any], default_max_tokens: int) -> FitTarget:
    """The fake's fit strategy: prompts counted as it counts them (`sequence_tokens`), its output budget
    max_tokens or output_tokens (`args`: the job's engine.fake), and the stand-in model limit. Its concurrency is
    max_concurrency, so max_num_seqs is not fitted; `default_max_tokens` (a real chat's open-ended budget) does not
    apply: the fake never runs past output_tokens."""
    default_output = args.get("output_tokens", 16)

    def count(requests: Sequence[tuple[str, dict]]) -> list[list[int] | Exception]:
        return [sequence_tokens(url, body) for url, body in requests]

    def output(url: str, body: dict) -> tuple[int, bool]:
        endpoint = endpoint_for(url)
        if endpoint is None or not endpoint.generates:
            return 0, False  # pooling routes generate nothing
        return int(requested_max_tokens(body) or default_output), False

    return FitTarget(
        counted_by="the fake engine's word count",
        count=per_sequence(own_requests(model, args, count)),
        output_budget=output,
        model_limit=FAKE_MAX_MODEL_LEN,
        block_size=lambda args, device: 16,
        capacity=lambda args, device: None,
        notes=["fake engine: its concurrency is engine.fake.max_concurrency; max_num_seqs is not fitted"],
    )
