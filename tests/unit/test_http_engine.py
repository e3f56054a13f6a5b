"""The http engine against a small loopback server with scripted faults: retried what may pass, answered at once
what is the request's own fault, nothing lost, nothing answered twice."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.config import ConfigError, JobConfig
from pipeline.engines.base import EngineRequest, EngineSpec, build_engine, engine_class
from pipeline.engines.http_client import RetryPolicy, ServerUnreachable, retry_after_seconds
from pipeline.engines.http_probe import probe_server
from pipeline.job_plan import JobPlan
from pipeline.protocol import ErrorCode
from tests.openai_stub import MODEL, OpenAIStub, free_port

pytestmark = pytest.mark.timeout(60)

FAST = {"backoff_s": 0.01, "backoff_max_s": 0.05, "max_retries": 3}


def _engine(url: str, **args):
    spec = EngineSpec("http", url, MODEL, {"endpoints": [url], "timeout_s": 0.5, **FAST, **args})
    return build_engine(spec)


def _chat(custom_id: str, content: str) -> EngineRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 3}
    return EngineRequest(custom_id, "/v1/chat/completions", body)


async def _run(engine, requests):
    await engine.start()
    try:
        return await engine.generate_all(requests)
    finally:
        await engine.stop()


def test_retry_after_is_seconds_or_an_http_date():
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None


def test_backoff_doubles_with_jitter_and_retry_after_wins():
    policy = RetryPolicy(backoff_s=1.0, backoff_max_s=8.0)
    for retry, step in ((1, 1.0), (2, 2.0), (3, 4.0), (6, 8.0)):
        delays = [policy.delay(retry, None) for _ in range(50)]
        assert all(step / 2 <= d <= step for d in delays)
        assert len(set(delays)) > 1  # jittered: clients that failed together do not come back together
    assert policy.delay(1, 5.0) == 5.0


def test_transient_faults_are_retried_and_each_request_answered_once():
    contents = [f"q{i} [429x2]" for i in range(3)] + [f"q{i} [500x1]" for i in range(3, 6)]
    contents += [f"q{i} [dropx1]" for i in range(6, 9)] + [f"q{i} [slowx1]" for i in range(9, 11)]
    contents += [f"q{i} plain" for i in range(11, 40)]
    with OpenAIStub(slow_s=1.0) as stub:
        engine = _engine(stub.url, concurrency=4)
        results = asyncio.run(_run(engine, [_chat(f"id-{i}", c) for i, c in enumerate(contents)]))
    assert [r.custom_id for r in results] == [f"id-{i}" for i in range(len(contents))]
    assert all(r.status_code == 200 for r in results), [r.body for r in results if not r.ok]
    assert all(stub.state.answered[c] == 1 for c in contents)  # nothing lost, nothing answered twice
    assert stub.state.attempts["q0 [429x2]"] == 3 and stub.state.attempts["q11 plain"] == 1
    assert stub.state.peak_inside <= 4
    retried = engine.stats().extra["retries"]
    assert retried["429"] == 6 and retried["500"] == 3
    assert retried["RemoteProtocolError"] == 3 and retried["ReadTimeout"] == 2
    assert (results[0].prompt_tokens, results[0].completion_tokens) == (2, 2)  # the server's own usage


def test_retry_after_is_honoured():
    with OpenAIStub() as stub:
        stub.state.retry_after = "0.3"
        asyncio.run(_run(_engine(stub.url), [_chat("a", "x [429x1]")]))
        first, second = stub.state.attempt_times["x [429x1]"]
    assert second - first >= 0.29  # the backoff alone would have waited at most 0.01 s


def test_the_requests_own_fault_is_an_error_record_and_not_retried():
    with OpenAIStub() as stub:
        bad, long = asyncio.run(_run(_engine(stub.url), [_chat("bad", "[400]"), _chat("long", "[long]")]))
        assert stub.state.attempts["[400]"] == 1 and stub.state.attempts["[long]"] == 1
    assert (bad.status_code, bad.error_code) == (400, ErrorCode.INVALID_REQUEST)
    assert bad.body["error"] == {
        "message": "temperature must be >= 0",
        "type": "BadRequestError",
        "param": "temperature",
        "code": "invalid_request",
    }
    # vLLM's older error shape ({"object": "error", "message": ...}) is understood too
    assert (long.status_code, long.error_code) == (400, ErrorCode.CONTEXT_LENGTH_EXCEEDED)


def test_a_fault_that_outlasts_the_retries_is_the_requests_error_record():
    with OpenAIStub() as stub:
        (result,) = asyncio.run(_run(_engine(stub.url), [_chat("a", "x [500x99]")]))
        assert stub.state.attempts["x [500x99]"] == 1 + FAST["max_retries"]
    assert (result.status_code, result.error_code) == (500, ErrorCode.ENGINE_ERROR)
    assert "after 4 attempts" in result.body["error"]["message"]


def test_a_server_that_goes_away_is_the_engines_death_not_an_error_record():
    with OpenAIStub() as stub:
        engine = _engine(stub.url)
        asyncio.run(engine.start())
    # the server is gone now: connections are refused through every retry
    with pytest.raises(ServerUnreachable) as info:
        asyncio.run(engine.answer(_chat("a", "x")))
    assert engine_class("http").is_engine_dead(info.value)


def test_the_api_key_is_sent_and_never_in_the_args():
    with OpenAIStub(api_key="sekrit") as stub:
        spec = EngineSpec("http", stub.url, MODEL, {"endpoints": [stub.url], **FAST}, api_key="sekrit")
        engine = build_engine(spec)
        (result,) = asyncio.run(_run(engine, [_chat("a", "x")]))
        assert result.ok and stub.state.unauthorized == 0
        assert "sekrit" not in repr(spec) and "sekrit" not in str(engine.effective_args())
        with pytest.raises(ValueError, match="API key"):
            probe_server(stub.url)  # no key: refused, and the message names the flag


def test_probe_names_the_server_and_its_traps():
    with OpenAIStub(kind="llama.cpp", slots=2) as stub:
        info = probe_server(stub.url + "/v1/", concurrency=16)
        engine = _engine(stub.url)
        asyncio.run(engine.start())
        asyncio.run(engine.stop())
    assert (info.kind, info.slots, info.models) == ("llama.cpp", 2, [MODEL])
    assert any("--concurrency 2" in w for w in info.warnings)
    assert engine.effective_args()["concurrency"] == 2  # the server's slots, when not given
    with OpenAIStub(kind="ollama") as stub:
        info = probe_server(stub.url)
    assert info.kind == "ollama" and any("OLLAMA_NUM_PARALLEL" in w for w in info.warnings)
    with OpenAIStub(kind="vllm") as stub:
        info = probe_server(stub.url)
    assert (info.kind, info.version, info.warnings) == ("vllm", "0.0-stub", [])


def test_probe_of_a_closed_port_says_what_to_check():
    with pytest.raises(ValueError, match="cannot be reached.*--endpoint"):
        probe_server(f"http://127.0.0.1:{free_port()}", timeout_s=2)


def test_each_endpoint_is_a_pool_and_bad_endpoint_flags_fail_early():
    config = JobConfig.model_validate(
        {"engine": {"backend": "http", "http": {"endpoints": ["http://a:1", "http://b:2/v1"]}}}
    )
    pools = JobPlan.of(config).pool_configs
    assert [(p.name, p.engine_overrides["endpoints"]) for p in pools] == [
        ("endpoint-0", ["http://a:1"]),
        ("endpoint-1", ["http://b:2/v1"]),
    ]
    with pytest.raises(ValueError, match="--endpoint"):
        JobConfig.model_validate({"engine": {"backend": "http"}})
    with pytest.raises(ValueError, match="not an http"):
        JobConfig.model_validate({"engine": {"backend": "http", "http": {"endpoints": ["a:1"]}}})
    two = {
        "engine": {"backend": "http", "http": {"endpoints": ["http://a:1", "http://b:2"]}},
        "pools": [{"name": "p"}],
    }
    with pytest.raises(ConfigError, match="one server"):
        JobPlan.of(JobConfig.model_validate(two))


def test_the_api_key_is_never_written_with_the_job_spec():
    config = JobConfig.model_validate(
        {"engine": {"backend": "http", "http": {"endpoints": ["http://a:1"], "api_key": "sekrit"}}}
    )
    assert "sekrit" not in config.model_dump_json()
    assert config.engine.http.api_key.get_secret_value() == "sekrit"


def test_concurrency_bounds_requests_in_flight():
    with OpenAIStub(delay_s=0.05) as stub:
        started = time.monotonic()
        asyncio.run(_run(_engine(stub.url, concurrency=3), [_chat(f"{i}", f"c{i}") for i in range(12)]))
        assert stub.state.peak_inside == 3
    assert time.monotonic() - started >= 4 * 0.05
