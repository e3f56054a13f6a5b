"""The fake engine through the engine seam: deterministic OpenAI-shaped bodies, context limit, slot limit."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from pipeline.engines import fake as fake_module
from pipeline.engines.base import EngineRequest, EngineResult, EngineSpec, build_engine
from pipeline.engines.fake import FakeEngine
from pipeline.protocol import ErrorCode

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def make_engine(**args: Any) -> FakeEngine:
    engine = build_engine(EngineSpec("fake", "/models/fake", MODEL, args))
    assert isinstance(engine, FakeEngine)
    return engine


def chat_request(custom_id: str = "c1", content: str = "tell me a story", **body: Any) -> EngineRequest:
    return EngineRequest(
        custom_id, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": content}], **body}
    )


def completion_request(custom_id: str = "p1", prompt: str = "once upon a time", **body: Any) -> EngineRequest:
    return EngineRequest(custom_id, COMPLETIONS, {"model": MODEL, "prompt": prompt, **body})


def run(engine: FakeEngine, *requests: EngineRequest) -> list[EngineResult]:
    async def main() -> list[EngineResult]:
        await engine.start()
        try:
            return list(await asyncio.gather(*(engine.generate(r) for r in requests)))
        finally:
            await engine.stop()

    return asyncio.run(main())


class SleepRecorder:
    """Replaces the fake engine's `asyncio.sleep`: records who is 'running' and yields instead of waiting."""

    def __init__(self, steps: int = 5) -> None:
        self.steps = steps
        self.active = 0
        self.max_active = 0
        self.events: list[tuple[str, str, float]] = []
        self.current: dict[int, str] = {}

    def namespace(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(Semaphore=asyncio.Semaphore, sleep=self.sleep)

    async def sleep(self, seconds: float) -> None:
        task = asyncio.current_task()
        name = task.get_name() if task else "?"
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.events.append(("start", name, seconds))
        for _ in range(self.steps):  # let every other ready coroutine run: whoever can take a slot does
            await asyncio.sleep(0)
        self.active -= 1
        self.events.append(("end", name, seconds))


def run_named(engine: FakeEngine, requests: list[EngineRequest]) -> list[EngineResult]:
    async def main() -> list[EngineResult]:
        tasks = [asyncio.create_task(engine.generate(r), name=r.custom_id) for r in requests]
        return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


def test_build_engine_unknown_backend():
    with pytest.raises(ValueError, match="unknown engine backend 'nope'"):
        build_engine(EngineSpec("nope", "", MODEL, {}))


def test_chat_body_shape():
    [result] = run(make_engine(), chat_request(max_tokens=5))
    assert result.ok and result.status_code == 200 and result.error_code is None
    body = result.body
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] in {"stop", "length"}
    assert "logprobs" in choice
    prompt_tokens = len("user: tell me a story".split())
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
    }
    assert (result.prompt_tokens, result.completion_tokens) == (prompt_tokens, 5)


def test_completion_body_shape():
    [result] = run(make_engine(), completion_request(max_tokens=3))
    assert result.ok
    body = result.body
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str) and "message" not in choice
    assert len(choice["text"].split()) == 3
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_default_output_tokens_and_max_completion_tokens():
    engine = make_engine(output_tokens=7)
    default, explicit = run(engine, completion_request("a"), completion_request("b", max_completion_tokens=2))
    assert default.completion_tokens == 7
    assert explicit.completion_tokens == 2


def test_deterministic_bodies():
    request = chat_request("same", "what is the capital of France?", max_tokens=12)
    first = run(make_engine(), request)[0]
    second = run(make_engine(), request)[0]
    again = run(make_engine(), request, request)
    contents = {r.body["choices"][0]["message"]["content"] for r in [first, second, *again]}
    assert len(contents) == 1
    assert first.body["id"] == second.body["id"]  # the id derives from custom_id, not from randomness
    assert {k: v for k, v in first.body.items() if k != "created"} == {
        k: v for k, v in second.body.items() if k != "created"
    }
    other = run(make_engine(), chat_request("same", "what is the capital of Spain?", max_tokens=12))[0]
    assert other.body["choices"][0]["message"]["content"] != first.body["choices"][0]["message"]["content"]


def test_content_parts_are_read():
    request = EngineRequest(
        "parts",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "one two three"}]}]},
    )
    [result] = run(make_engine(), request)
    assert result.prompt_tokens == len("user: one two three".split())


@pytest.mark.parametrize("max_tokens, ok", [(6, True), (7, False)])
def test_context_length_exceeded(max_tokens: int, ok: bool):
    engine = make_engine(max_model_len=10)
    [result] = run(engine, completion_request("long", "a b c d", max_tokens=max_tokens))  # 4 prompt tokens
    assert result.ok is ok
    if ok:
        return
    assert result.status_code == 400
    assert result.error_code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    error = result.body["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "BadRequestError"
    assert "maximum context length is 10 tokens" in error["message"]
    assert "11 tokens" in error["message"]


def test_context_error_does_not_hold_a_slot(monkeypatch):
    # A rejected request returns before taking a slot, so it never waits behind running ones.
    recorder = SleepRecorder()
    monkeypatch.setattr(fake_module, "asyncio", recorder.namespace())
    engine = make_engine(max_model_len=10, max_concurrency=1, decode_seconds_per_token=0.01)
    results = run_named(
        engine,
        [completion_request("big", "a b c", max_tokens=50), completion_request("ok", "a", max_tokens=2)],
    )
    assert [r.ok for r in results] == [False, True]
    assert [cid for kind, cid, _ in recorder.events if kind == "start"] == ["ok"]


def test_concurrency_slot_limit(monkeypatch):
    recorder = SleepRecorder()
    monkeypatch.setattr(fake_module, "asyncio", recorder.namespace())
    engine = make_engine(max_concurrency=2, decode_seconds_per_token=0.01)
    requests = [completion_request(f"r{i}", "x", max_tokens=10) for i in range(4)]
    results = run_named(engine, requests)

    assert all(r.ok for r in results)
    assert [r.custom_id for r in results] == ["r0", "r1", "r2", "r3"]
    # never more than max_concurrency at once, and both slots are used in parallel
    assert recorder.max_active == 2
    kinds = [kind for kind, _, _ in recorder.events]
    assert kinds.count("start") == kinds.count("end") == 4
    # Two rounds: the third request starts only after one of the first two finished.
    third_start = [i for i, k in enumerate(kinds) if k == "start"][2]
    assert "end" in kinds[:third_start]
    assert kinds[:2] == ["start", "start"]
    # The time model: decode cost x output tokens (+ prefill, here 0) is what a request holds its slot for.
    assert [seconds for _, _, seconds in recorder.events] == pytest.approx([0.1] * 8)


def test_prefill_cost_in_time_model(monkeypatch):
    recorder = SleepRecorder()
    monkeypatch.setattr(fake_module, "asyncio", recorder.namespace())
    engine = make_engine(prefill_seconds_per_token=0.5, decode_seconds_per_token=0.25)
    run_named(engine, [completion_request("p", "a b c d", max_tokens=2)])
    assert recorder.events[0][2] == pytest.approx(4 * 0.5 + 2 * 0.25)


def test_no_cost_no_sleep(monkeypatch):
    recorder = SleepRecorder()
    monkeypatch.setattr(fake_module, "asyncio", recorder.namespace())
    results = run_named(make_engine(), [completion_request(f"r{i}") for i in range(3)])
    assert all(r.ok for r in results)
    assert recorder.events == []


@pytest.mark.parametrize("limit, n, expected_max", [(1, 3, 1), (3, 3, 3), (4, 10, 4)])
def test_concurrency_never_exceeds_limit(monkeypatch, limit: int, n: int, expected_max: int):
    recorder = SleepRecorder()
    monkeypatch.setattr(fake_module, "asyncio", recorder.namespace())
    engine = make_engine(max_concurrency=limit, decode_seconds_per_token=0.001)
    run_named(engine, [chat_request(f"c{i}", max_tokens=3) for i in range(n)])
    assert recorder.max_active == expected_max


def test_stats_and_effective_args():
    engine = make_engine(max_model_len=100, max_concurrency=4)
    assert engine.stats().kv_cache_tokens == 400
    assert engine.effective_args() == {"max_model_len": 100, "max_concurrency": 4, "max_num_seqs": 4}


def test_a_kv_model_decides_max_num_seqs_as_the_engine_starts():
    engine = make_engine(max_model_len=100, kv_cache_tokens=1_050)
    assert engine.effective_args()["max_num_seqs"] == 10 and engine.stats().kv_cache_tokens == 1_050
    assert engine.sampling_defaults() == {}


# -- the seam's safety net: one request's exception is that request's error --------------------------------------


class _Dead(Exception):
    """Stands for a backend's own engine-death exception."""


class _Brittle(FakeEngine):
    """Raises for some requests the way a backend bug would; `_Dead` means the engine itself is gone."""

    @classmethod
    def is_engine_dead(cls, exc: BaseException) -> bool:
        return isinstance(exc, _Dead)

    async def generate(self, request: EngineRequest) -> EngineResult:
        if request.custom_id.startswith("boom"):
            raise AttributeError("'async_generator' object has no attribute 'model_dump_json'")
        if request.custom_id == "dead":
            raise _Dead("engine core died")
        return await super().generate(request)


def _brittle(**args: Any) -> _Brittle:
    return _Brittle(EngineSpec("fake", "/models/fake", MODEL, {"decode_seconds_per_token": 0.001, **args}))


def test_unexpected_exception_becomes_that_requests_engine_error():
    engine = _brittle()
    results = asyncio.run(engine.generate_all([chat_request("a"), chat_request("boom-1"), chat_request("b")]))
    assert [r.custom_id for r in results] == ["a", "boom-1", "b"]
    assert results[0].ok and results[2].ok
    bad = results[1]
    assert bad.status_code == 500 and bad.error_code == ErrorCode.ENGINE_ERROR
    assert bad.body["error"]["code"] == "engine_error"
    assert (
        "AttributeError" in bad.body["error"]["message"] and "model_dump_json" in bad.body["error"]["message"]
    )


def test_engine_death_still_propagates():
    engine = _brittle()
    with pytest.raises(_Dead):
        asyncio.run(engine.generate_all([chat_request("a"), chat_request("dead")]))
    with pytest.raises(_Dead):
        asyncio.run(engine.answer(chat_request("dead")))


def test_instant_fake_chunk_keeps_going_past_a_failing_request(monkeypatch):
    engine = make_engine()
    real = engine._answer

    def flaky(request: EngineRequest):
        if request.custom_id == "boom":
            raise ValueError("bad body")
        return real(request)

    monkeypatch.setattr(engine, "_answer", flaky)
    results = asyncio.run(engine.generate_all([chat_request("a"), chat_request("boom"), chat_request("b")]))
    assert [r.status_code for r in results] == [200, 500, 200]
    assert "ValueError: bad body" in results[1].body["error"]["message"]


def test_no_request_starts_while_the_hold_file_exists(tmp_path):
    """`hold_while`: a test stops the work at a point of its choosing; requests wait, and run once it is removed."""
    hold = tmp_path / "hold"
    hold.touch()
    engine = make_engine(hold_while=str(hold))

    async def main() -> list[EngineResult]:
        await engine.start()
        waiting = asyncio.ensure_future(engine.generate(chat_request()))
        for _ in range(10):  # ten turns of the loop: the request is still held
            await asyncio.sleep(0.06)
        assert not waiting.done()
        hold.unlink()
        return [await asyncio.wait_for(waiting, timeout=30)]

    (result,) = asyncio.run(main())
    assert result.status_code == 200


def test_the_hold_holds_an_engine_with_no_time_model_too(tmp_path):
    hold = tmp_path / "hold"
    engine = make_engine(hold_while=str(hold))
    assert not engine.instant  # the instant path would answer without waiting
