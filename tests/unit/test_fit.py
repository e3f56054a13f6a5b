"""Fitting engine args to the data (runtime/ingest/fit.py, measuring in runtime/ingest/measure.py, the fit record
in fit_record.py) and the prompt counter it uses (tokens.py): pure, no Ray."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.config import DEFAULT_MAX_NUM_SEQS, JobConfig
from pipeline.engines.fitting import FitTarget, KvCapacity
from pipeline.fit_record import FitDecision, FitOff, Lengths
from pipeline.io.staging import StagingArea
from pipeline.max_tokens import output_budget
from pipeline.models import ResolvedModel
from pipeline.runtime.ingest.fit import apply_fit, choose_max_num_seqs, fit_job, fit_max_model_len
from pipeline.runtime.ingest.measure import measure
from pipeline.state import JobInput, JobState
from pipeline.tokens import PromptCounter
from tests.plans import plan_of
from tests.staged_rows import staged_rows

MODEL = ResolvedModel(name="m", path="/nowhere", revision=None, source="local-dir")


def chat(custom_id: str, words: int, line: int, **body) -> dict:
    body = {"messages": [{"role": "user", "content": " ".join(["w"] * words)}], **body}
    return {
        "custom_id": custom_id,
        "url": "/v1/chat/completions",
        "body": json.dumps(body),
        "line": line,
        "source": "in",
    }


def word_target(limit: int = 100, block: int = 16, capacity: KvCapacity | None = None) -> FitTarget:
    """A target whose 'tokenizer' counts words; a message content of 'BAD' makes the template fail."""

    def count(requests):
        out = []
        for _, body in requests:
            text = body["messages"][0]["content"]
            out.append(ValueError("template error") if text == "BAD" else [len(text.split())])
        return out

    return FitTarget(
        counted_by="words",
        count=count,
        output_budget=lambda url, body: output_budget(url, body, None, 50),
        model_limit=limit,
        block_size=lambda args, device: block,
        capacity=lambda args, device: capacity,
    )


def staged(tmp_path: Path, parts: list[list[dict]]) -> StagingArea:
    staging = StagingArea(tmp_path / "out")
    staging.create()
    for rows in parts:
        staging.write_requests(rows)
    return staging


def request_ids(staging: StagingArea) -> list[str]:
    ids = []
    for part in staging.request_files():
        ids += pq.read_table(part, columns=["custom_id"]).column("custom_id").to_pylist()
    return sorted(ids)


def error_records(staging: StagingArea) -> list[dict]:
    return [json.loads(row.record) for row in staged_rows(staging, "errors")]


# --- deciding ----------------------------------------------------------------------------------------------------


def test_context_is_the_longest_need_rounded_up_to_a_block():
    lengths = Lengths()
    lengths.add("a", [30], 10, False, 1000)
    lengths.add("b", [90], 40, False, 1000)  # 130: the longest
    lengths.add("c", [120], 5, False, 1000)  # the longest prompt, but not the longest need
    context, why = fit_max_model_len(lengths, 128, 1000)
    assert context == 256
    assert "'b'" in why and "90 prompt + 40 output tokens = 130" in why and "128-token" in why


def test_context_is_capped_at_the_model_limit():
    lengths = Lengths()
    lengths.add("a", [900], 500, False, 1000)
    context, why = fit_max_model_len(lengths, 128, 1000)
    assert context == 1000 and "capped at the model's limit of 1000" in why
    assert lengths.output_capped == 1


def test_nothing_measured_keeps_the_model_limit():
    assert fit_max_model_len(Lengths(), 128, 1000)[0] is None


def capacity(blocks: int, block: int = 16) -> KvCapacity:
    return KvCapacity(blocks, block, lambda context: blocks // -(-context // block))


def test_max_num_seqs_is_what_the_cache_holds_at_the_context():
    value, source, why, warning = choose_max_num_seqs(None, capacity(100), 160)  # 10 blocks per sequence
    assert (value, source, warning) == (10, "fitted", None)
    assert "holds 10 sequences of 160 tokens" in why


def test_max_num_seqs_is_capped_at_256():
    value, _, why, _ = choose_max_num_seqs(None, capacity(10_000), 16)
    assert value == 256 and "capped at 256" in why


def test_a_given_max_num_seqs_above_capacity_is_kept_with_a_warning_naming_the_number():
    value, source, _, warning = choose_max_num_seqs(256, capacity(100), 160)
    assert (value, source) == (256, "given")
    assert "max_num_seqs 256 is more than the KV cache (1,600 tokens) holds 10 sequences" in warning
    assert "lower --max-num-seqs to 10" in warning
    assert choose_max_num_seqs(8, capacity(100), 160)[3] is None


def test_unknown_capacity_keeps_the_default_on_cpu_and_leaves_a_gpu_to_the_engine():
    assert choose_max_num_seqs(None, None, 4096)[:2] == (DEFAULT_MAX_NUM_SEQS, "default")
    value, source, why, _ = choose_max_num_seqs(None, None, 4096, "gpu")
    assert (value, source) == (None, "engine") and "vLLM decides" in why


def test_a_gpu_with_known_capacity_is_not_capped():
    value, _, why, _ = choose_max_num_seqs(None, capacity(10_000), 16, "gpu")
    assert value == 10_000 and "capped" not in why


def test_a_gpu_pool_left_unfitted_gets_no_cpu_default():
    gpu = JobConfig.model_validate({"pools": [{"name": "a100", "gpus_per_engine": 1}]})
    assert (
        apply_fit(plan_of(gpu), FitOff(enabled=False, reason="off")).config.engine.vllm.max_num_seqs is None
    )
    record = vllm_record(a100=(None, "engine"))
    fitted = apply_fit(plan_of(gpu), record).config
    assert fitted.engine.vllm.max_num_seqs is None and "max_num_seqs" not in fitted.pools[0].engine_overrides


def test_a_context_that_fits_no_sequence_is_warned():
    value, _, _, warning = choose_max_num_seqs(None, capacity(4), 160)
    assert value == 1 and "does not fit one sequence" in warning


# --- measuring ---------------------------------------------------------------------------------------------------


def test_measure_rejects_prompts_at_the_limit_and_drops_them_from_the_work_list(tmp_path):
    untokenizable = {**chat("bad", 1, 5), "body": json.dumps({"messages": [{"content": "BAD"}]})}
    staging = staged(
        tmp_path,
        [
            [chat("ok-1", 10, 1, max_tokens=5), chat("long-1", 100, 2, max_tokens=5), chat("ok-2", 20, 3)],
            [chat("long-2", 150, 4), untokenizable],  # this part keeps only the untokenizable request
            [chat("long-3", 99, 6, max_tokens=1), chat("ok-3", 49, 7)],  # 99 + 1 and 49 + 50 (assumed) fit
        ],
    )

    lengths = measure(staging, word_target(limit=100), 100, job_id="job")
    assert lengths.too_long == 2  # long-1 (100 = the limit: no room for output) and long-2
    assert lengths.untokenizable == 1
    assert lengths.requests == 4 and lengths.assumed_output == 2  # ok-2 and ok-3 set no max_tokens
    assert (lengths.longest_need, lengths.longest_id) == (100, "long-3")
    assert lengths.output_capped == 0
    assert request_ids(staging) == ["bad", "long-3", "ok-1", "ok-2", "ok-3"]

    errors = error_records(staging)
    assert [e["custom_id"] for e in errors] == ["long-1", "long-2"]
    for record in errors:
        assert record["error"] is None and record["response"]["status_code"] == 400
        body = record["response"]["body"]["error"]
        assert (
            body["code"] == "context_length_exceeded" and "maximum context length is 100" in body["message"]
        )
    rows = list(staged_rows(staging, "errors"))
    assert [(r.line, r.source, r.error_code) for r in rows] == [
        (2, "in", "context_length_exceeded"),
        (4, "in", "context_length_exceeded"),
    ]
    assert not set(staging.finished_ids())  # rejected before the engines: not "finished by an engine"

    # A pass redone (resume after a crash) finds nothing new to reject and duplicates nothing.
    again = measure(staging, word_target(limit=100), 100, job_id="job")
    assert again.too_long == 2 and len(error_records(staging)) == 2
    assert request_ids(staging) == ["bad", "long-3", "ok-1", "ok-2", "ok-3"]


def fake_job(tmp_path: Path, **engine) -> JobConfig:
    return JobConfig.model_validate(
        {
            "input": str(tmp_path / "in.jsonl"),
            "output": str(tmp_path / "out"),
            "engine": {"backend": "fake", "fake": {"output_tokens": 4}, **engine},
        }
    )


def fake_state(lines: int, valid: int) -> JobState:
    counts = JobInput(fingerprint="sha256:00", lines=lines, valid=valid, invalid=lines - valid)
    return JobState(job_id="j", config=JobConfig(), input=counts, ingested=True)


def test_fit_job_with_the_fake_engine_fits_the_context_and_rejects_too_long_rows(tmp_path):
    rows = [chat("a", 3, 1, max_tokens=20), chat("b", 40, 2), chat("huge", 9000, 3)]
    staging = staged(tmp_path, [rows])
    state = fake_state(4, 3)
    config = fit_job(plan_of(fake_job(tmp_path), MODEL), staging, state).config
    record = state.fit
    # The fake counts words of "user: w w ...": 41 for b, + 4 output tokens (its output_tokens default).
    assert record.max_model_len.source == "fitted"
    assert record.max_model_len.value == 48 == config.engine.vllm.max_model_len
    assert record.measured.prompt_plus_max_tokens.max == 45
    assert record.context_length_exceeded == 1
    assert state.input.valid == 2 and state.input.invalid == 2
    assert staging.read_job().fit == record  # kept for resume
    assert request_ids(staging) == ["a", "b"]

    # Resume: the stored decision is applied as is, nothing is measured again.
    again = fit_job(plan_of(fake_job(tmp_path), MODEL), staging, staging.read_job()).config
    assert again.engine.vllm.max_model_len == 48


def test_a_given_max_model_len_wins_and_is_checked_against_the_data(tmp_path):
    staging = staged(
        tmp_path, [[chat("a", 3, 1, max_tokens=4), chat("b", 60, 2, max_tokens=4), chat("huge", 9000, 3)]]
    )
    state = fake_state(3, 3)
    config = fit_job(plan_of(fake_job(tmp_path, vllm={"max_model_len": 32}), MODEL), staging, state).config
    assert config.engine.vllm.max_model_len == 32
    record = state.fit
    assert record.max_model_len.source == "given" and record.max_model_len.needed == 80
    assert record.context_length_exceeded == 1  # over the model's own limit: rejected whatever was given
    assert any("max_model_len 32 is less than these requests need (80" in w for w in record.warnings)
    assert request_ids(staging) == ["a", "b"]


def test_max_num_seqs_is_sized_for_what_the_requests_need_under_a_given_max_model_len(tmp_path, monkeypatch):
    from pipeline.engines import vllm_engine

    target = word_target(limit=8192, block=16, capacity=capacity(100))  # 1,600 tokens of KV
    monkeypatch.setattr(vllm_engine, "fit_target", lambda model, args, default_max_tokens: target)
    rows = [chat("a", 10, 1, max_tokens=20), chat("b", 70, 2, max_tokens=10)]  # b grows to 80 tokens
    staging = staged(tmp_path, [rows])
    config = JobConfig.model_validate({"engine": {"vllm": {"max_model_len": 4096, "max_num_seqs": 64}}})
    state = fake_state(2, 2)
    fitted = fit_job(plan_of(config, MODEL), staging, state).config
    seqs = state.fit.max_num_seqs["default"]
    assert state.fit.longest_sequence == 80
    assert (seqs.sized_for_tokens, seqs.fits, seqs.source) == (80, 20, "given")
    assert fitted.engine.vllm.max_num_seqs == 64  # given: kept, with a warning naming the number that fits
    assert any(
        "max_num_seqs 64 is more than" in w and "lower --max-num-seqs to 20" in w for w in state.fit.warnings
    )

    # Without max_num_seqs it is fitted; a chat without max_tokens could grow to the whole context instead.
    open_ended = staged(tmp_path / "2", [[*rows, chat("c", 10, 3)]])
    state = fake_state(3, 3)
    config = JobConfig.model_validate({"engine": {"vllm": {"max_model_len": 160}}})
    fitted = fit_job(plan_of(config, MODEL), open_ended, state).config
    assert state.fit.longest_sequence is None
    assert fitted.engine.vllm.max_num_seqs == 10  # 100 blocks / 10 blocks of 160 tokens


def test_no_fit_turns_it_off(tmp_path):
    staging = staged(tmp_path, [[chat("a", 3, 1), chat("huge", 9000, 2)]])
    state = fake_state(2, 2)
    config = fit_job(plan_of(fake_job(tmp_path, fit={"enabled": False}), MODEL), staging, state).config
    assert config.engine.vllm.max_model_len is None
    assert state.fit == FitOff(enabled=False, reason="turned off (--no-fit / engine.fit.enabled: false)")
    assert state.fit.model_dump() == {
        "enabled": False,
        "reason": "turned off (--no-fit / engine.fit.enabled: false)",
    }
    assert request_ids(staging) == ["a", "huge"]


def vllm_record(**seqs) -> FitDecision:
    return FitDecision.model_validate(
        {
            "enabled": True,
            "counted_by": "words",
            "max_model_len": {"value": 512, "source": "fitted", "model_limit": 8192, "block_size": 16},
            "max_num_seqs": {name: {"value": v, "source": s, "why": ""} for name, (v, s) in seqs.items()},
        }
    )


def test_apply_fit_sets_only_what_was_not_given():
    config = JobConfig()
    fitted = apply_fit(plan_of(config), vllm_record(default=(22, "fitted"))).config
    assert (fitted.engine.vllm.max_model_len, fitted.engine.vllm.max_num_seqs) == (512, 22)
    given = JobConfig.model_validate({"engine": {"vllm": {"max_num_seqs": 8}}})
    kept = apply_fit(plan_of(given), vllm_record(default=(8, "given"))).config
    assert kept.engine.vllm.max_num_seqs == 8
    unfitted = apply_fit(plan_of(config), FitOff(enabled=False, reason="off")).config
    assert (unfitted.engine.vllm.max_model_len, unfitted.engine.vllm.max_num_seqs) == (
        None,
        DEFAULT_MAX_NUM_SEQS,
    )


def test_apply_fit_puts_per_pool_values_in_pool_overrides_and_keeps_given_ones():
    config = JobConfig.model_validate(
        {"pools": [{"name": "big"}, {"name": "small", "engine_overrides": {"max_num_seqs": 2}}]}
    )
    fitted = apply_fit(plan_of(config), vllm_record(big=(40, "fitted"), small=(2, "given"))).config
    overrides = {p.name: p.engine_overrides for p in fitted.pools}
    assert overrides == {"big": {"max_num_seqs": 40}, "small": {"max_num_seqs": 2}}


# --- the prompt counter ----------------------------------------------------------------------------------------


class CharTokenizer:
    """One token per character; the 'template' wraps each message as <role>content and may add a prompt."""

    def apply_chat_template(
        self, messages, tools=None, tokenize=False, add_generation_prompt=False, **kwargs
    ):
        assert tokenize is False
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        if tools:
            text += json.dumps(tools)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(
        self, texts, add_special_tokens=False, verbose=True
    ):  # as strict as mistral-common's: no **kwargs
        return {"input_ids": [[0] * (len(t) + (1 if add_special_tokens else 0)) for t in texts]}


def test_counter_renders_chat_like_vllm():
    counter = PromptCounter(CharTokenizer(), "chars")
    user = {"role": "user", "content": "hello"}
    assert counter.count("/v1/chat/completions", {"messages": [user]}) == [len("<user>hello<assistant>")]
    # Content parts are joined with newlines; add_generation_prompt=false is honoured.
    parts = {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}
    body = {"messages": [parts], "add_generation_prompt": False}
    assert counter.count("/v1/chat/completions", body) == [len("<user>ab\ncd")]
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = counter.count("/v1/chat/completions", {"messages": [user], "tools": tools})
    assert with_tools[0] > counter.count("/v1/chat/completions", {"messages": [user]})[0]


def test_a_chats_media_parts_count_what_the_model_makes_of_them():
    """An image part is not text: the chat template renders the text, and each media item adds the tokens the
    model's processor makes of it (`media_tokens`, the vLLM backend's), by modality; a modality the model does not
    take adds nothing (the engine refuses that line)."""
    counter = PromptCounter(CharTokenizer(), "chars", media_tokens={"image": 7, "audio": 50})
    text = {"type": "text", "text": "ab"}
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    video = {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}
    plain = counter.count("/v1/chat/completions", {"messages": [{"role": "user", "content": [text]}]})[0]
    assert plain == len("<user>ab<assistant>")

    def count(*parts):
        return counter.count(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": [text, *parts]}]}
        )

    assert count(image) == [plain + 7]
    assert count(image, image, audio) == [plain + 7 + 7 + 50]
    assert count(video) == [plain]
    assert count({"type": {"not": "a type"}}, image) == [plain + 7]  # a part no parser reads costs nothing
    system = {
        "role": "system",
        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}],
    }
    body = {"messages": [system, {"role": "user", "content": [text, image]}]}
    assert counter.count("/v1/chat/completions", body)[0] == len("<system><user>ab<assistant>") + 14
    # Many chats at once (rendered in one template call) count the same.
    batch = [("/v1/chat/completions", {"messages": [{"role": "user", "content": [text, image]}]})] * 3
    assert counter.count_batch(batch) == [[plain + 7]] * 3
    assert PromptCounter(CharTokenizer(), "chars").count(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": [text, image]}]}
    ) == [plain]  # a model that takes no media: nothing to add


def test_counter_handles_completion_prompt_shapes_and_truncation():
    counter = PromptCounter(CharTokenizer(), "chars")
    assert counter.count("/v1/completions", {"prompt": "abc"}) == [4]  # + BOS: special tokens on
    assert counter.count("/v1/completions", {"prompt": [7, 8, 9]}) == [3]
    assert counter.count("/v1/completions", {"prompt": ["ab", [1, 2, 3, 4]]}) == [3, 4]
    assert counter.count("/v1/completions", {"prompt": "abcdef", "truncate_prompt_tokens": 2}) == [2]


def test_a_template_error_is_the_requests_alone():
    counter = PromptCounter(CharTokenizer(), "chars")
    results = counter.count_batch(
        [("/v1/chat/completions", {"messages": "not a list"}), ("/v1/completions", {"prompt": "ab"})]
    )
    assert isinstance(results[0], Exception) and results[1] == [3]


def test_a_batch_counts_as_each_request_rendered_and_tokenized_alone(embedded_model):
    """count_batch renders chats of the same options in one call of the template and asks a fast tokenizer's Rust
    backend for lengths only: every count must still be what the model's tokenizer gives each request alone, its
    own template call and its own tokenization, whatever the options, tools, content parts or errors in the batch."""
    from transformers import AutoTokenizer

    counter = PromptCounter.for_model(str(embedded_model.path))
    tok = AutoTokenizer.from_pretrained(str(embedded_model.path))
    user = {"role": "user", "content": "What is the capital of France? Answer in one word."}
    system = {"role": "system", "content": "You are terse."}
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}],
    }
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    chats = [
        {"messages": [system, user]},
        {"messages": [user], "add_generation_prompt": False},
        {"messages": [user, {"role": "assistant", "content": "Par"}], "continue_final_message": True,
         "add_generation_prompt": False},
        {"messages": [parts]},
        {"messages": [user], "tools": tools},
        {"messages": [user], "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": [system, user]},
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": "ü ß 漢字 🙂 \u0000"}]},
    ]  # fmt: skip
    requests = [("/v1/chat/completions", body) for body in chats]
    requests += [
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/completions", {"prompt": ["a", "b c"]}),
    ]

    def alone(url, body):
        if url == "/v1/completions":
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            return [len(tok(p, add_special_tokens=True)["input_ids"]) for p in prompts]
        messages = [
            {**m, "content": "\n".join(p["text"] for p in m["content"])}
            if isinstance(m["content"], list)
            else m
            for m in body["messages"]
        ]
        options = {
            **body.get("chat_template_kwargs", {}),
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
        }
        text = tok.apply_chat_template(messages, tools=body.get("tools"), tokenize=False, **options)
        return [len(tok(text, add_special_tokens=False)["input_ids"])]

    counted = counter.count_batch(requests)
    for (url, body), result in zip(requests, counted, strict=True):
        if body.get("messages") == "not a list":
            assert isinstance(result, Exception)
            continue
        assert result == alone(url, body), body
    assert counted[0] == counted[6]


def test_embedded_model_capacity_leaves_out_the_null_block(embedded_model):
    from pipeline.engines.vllm_engine import fit_target

    target = fit_target(embedded_model, JobConfig().engine.vllm.model_dump(), 256)
    assert not isinstance(target, str), target
    kv = target.capacity({"cpu_kvcache_space_gib": 2, "extra": {}}, "cpu")
    # 2 GiB / (128 tokens x 23,040 B) = 728 blocks, one of which vLLM keeps as its null block.
    assert (kv.blocks, kv.block_size) == (727, 128)
    assert kv.sequences(512) == 181 and target.model_limit == 8192
    starved = target.capacity({"cpu_kvcache_space_gib": 2, "extra": {"num_gpu_blocks_override": 60}}, "cpu")
    assert starved.tokens == 59 * 128


def test_a_max_tokens_the_context_cannot_hold_is_that_requests_error_not_the_jobs_context(tmp_path):
    """max_tokens 1e30 (as an integer) or merely more than the prompt leaves: refused as OpenAI refuses it, and the
    context is fitted to the requests that can run."""
    staging = staged(
        tmp_path,
        [
            [
                chat("ok", 10, 1, max_tokens=20),
                chat("astronomic", 5, 2, max_tokens=10**30),
                chat("just-over", 50, 3, max_tokens=51),
                chat("just-fits", 50, 4, max_tokens=50),
            ]
        ],
    )
    lengths = measure(staging, word_target(limit=100), 100, job_id="job")
    assert lengths.too_long == 2
    assert request_ids(staging) == ["just-fits", "ok"]
    assert (lengths.longest_need, lengths.longest_id) == (100, "just-fits")
    errors = {e["custom_id"]: e["response"]["body"]["error"] for e in error_records(staging)}
    assert set(errors) == {"astronomic", "just-over"}
    assert errors["just-over"]["code"] == "context_length_exceeded"
    assert (
        "you requested 101 tokens (50 in the messages, 51 in the completion)"
        in errors["just-over"]["message"]
    )

    small = staged(
        tmp_path / "b", [[chat("ok", 10, 1, max_tokens=20), chat("huge", 5, 2, max_tokens=10**30)]]
    )
    lengths = measure(small, word_target(limit=1000), 1000)
    context, _ = fit_max_model_len(lengths, 16, 1000)
    assert context == 32  # sized for "ok" (10 + 20), not the model's limit


# --- Lengths from many tasks -------------------------------------------------------------------------------------


def test_lengths_merged_in_any_order_equal_one_pass_in_input_order():
    import random

    rng = random.Random(11)
    requests = [
        (
            f"r{i}",
            [rng.randint(1, 60) for _ in range(rng.choice([0, 1, 1, 1, 2]))],
            rng.choice([5, 40]),
            rng.random() < 0.3,
        )
        for i in range(300)
    ]
    one_pass = Lengths()
    for line, (custom_id, prompts, output, assumed) in enumerate(requests, 1):
        one_pass.add(custom_id, prompts, output, assumed, 90, at=(0, line))
    one_pass.untokenizable, one_pass.too_long, one_pass.seconds = 3, 2, 1.5

    for seed in range(5):
        cuts = sorted(random.Random(seed).sample(range(1, len(requests)), 6))
        chunks = []
        for start, end in zip([0, *cuts], [*cuts, len(requests)], strict=True):
            chunk = Lengths()
            for line in range(start, end):
                custom_id, prompts, output, assumed = requests[line]
                chunk.add(custom_id, prompts, output, assumed, 90, at=(0, line + 1))
            chunks.append(chunk)
        chunks[0].untokenizable, chunks[-1].too_long, chunks[1].too_long = 3, 1, 1
        chunks[2].seconds, chunks[3].seconds = 1.0, 0.5
        random.Random(seed).shuffle(chunks)
        merged = Lengths()
        for chunk in chunks:
            merged.merge(chunk)
        assert merged == one_pass
    assert Lengths.model_validate_json(one_pass.model_dump_json()) == one_pass
    assert Lengths.model_validate(json.loads(json.dumps(one_pass.model_dump(mode="json")))) == one_pass


def test_fit_job_decides_from_the_lengths_ingest_measured_without_measuring_again(tmp_path):
    rows = [
        chat("a", 3, 1, max_tokens=20),
        chat("huge", 9000, 3),
    ]  # "huge" would be rejected by a measuring pass
    staging = staged(tmp_path, [rows])
    lengths = Lengths()
    lengths.add("a", [4], 20, False, 8192, at=(0, 1))
    lengths.too_long = 1
    state = fake_state(3, 2)
    state.lengths = lengths
    config = fit_job(plan_of(fake_job(tmp_path), MODEL), staging, state).config
    record = state.fit
    assert record.max_model_len.value == 32 == config.engine.vllm.max_model_len
    assert record.context_length_exceeded == 1 and record.measured.longest_request == "a"
    assert any("1 request(s) cannot run within the model's limit" in w for w in record.warnings)
    assert (state.input.valid, state.input.invalid) == (2, 1)  # ingest counted the rejection already
    assert request_ids(staging) == ["a", "huge"]  # nothing measured or dropped here


def test_each_sample_of_n_is_a_sequence_of_its_own(tmp_path):
    """n=3 starts three sequences of the same prompt, each with its own output budget: they count as three."""
    from pipeline.engines.fake import fit_target as fake_fit_target
    from pipeline.engines.fitting import sequence_prompts

    assert sequence_prompts("/v1/chat/completions", {"n": 3}, [7]) == [7, 7, 7]
    assert sequence_prompts("/v1/completions", {"n": 2}, [3, 4]) == [3, 4, 3, 4]
    assert sequence_prompts("/v1/embeddings", {"n": 2}, [3]) == [3]
    target = fake_fit_target(MODEL, {"output_tokens": 4}, 256)
    bodies = [json.loads(row["body"]) for row in (chat("a", 3, 1, n=3, max_tokens=10), chat("b", 3, 2))]
    assert target.count([("/v1/chat/completions", body) for body in bodies]) == [[4, 4, 4], [4]]

    staging = staged(tmp_path, [[chat("a", 3, 1, n=3, max_tokens=10), chat("b", 3, 2, max_tokens=10)]])
    lengths = measure(staging, target, 100)
    assert (lengths.requests, lengths.sequences) == (2, 4)
    assert lengths.prompt_sum == 16 and lengths.need_sum == 16 + 4 * 10
    assert lengths.longest_need == 14  # one sequence's context is its prompt + its output, whatever n is


_LOAD = """
import json, sys
from pipeline.tokens import PromptCounter
from tests.plans import plan_of
counter = PromptCounter.for_model(sys.argv[1])
tok = counter.tokenizer
chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers ü 漢字"}]
print(json.dumps({
    "class": f"{type(tok).__module__}.{type(tok).__qualname__}",
    "auto": "transformers.models.auto.tokenization_auto" in sys.modules,
    "torch": "torch" in sys.modules,
    "chat": tok.apply_chat_template(chat, tokenize=False),
    "ids": tok("Once upon a time, in 2024: naïve café")["input_ids"],
}))
"""


def test_chats_rendered_together_render_as_each_alone_whatever_their_options(embedded_model):
    """Chats are rendered in one template call only with the very same options: `tools: []` is not "no tools" (a
    template tests `tools is not none`), and an option False is not 0 (`is false`), though the two are equal keys."""
    template = (
        "{% if tools is not none %}[tools]{% endif %}"
        "{% if flag is false %}[false]{% elif flag == 0 %}[zero, a longer marker]{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    counter = PromptCounter.for_model(str(embedded_model.path), chat_template=template)
    user = {"role": "user", "content": "hello there"}
    bodies = [
        {"messages": [user]},
        {"messages": [user], "tools": []},
        {"messages": [user], "chat_template_kwargs": {"flag": False}},
        {"messages": [user], "chat_template_kwargs": {"flag": 0}},
        {"messages": [user]},
        {"messages": [user], "tools": []},
        {"messages": [user], "chat_template_kwargs": {"flag": 0}},
        {"messages": [user], "chat_template_kwargs": {"flag": False}},
        {"messages": [user], "chat_template_kwargs": {"tools": None}},
    ]
    requests = [("/v1/chat/completions", body) for body in bodies]
    together = counter.count_batch(requests)
    alone = [counter.count_batch([request])[0] for request in requests]
    assert [str(c) for c in together] == [str(c) for c in alone]
    assert together[0] != together[1] and together[2] != together[3]


def test_a_tokenizer_loads_without_autotokenizer_once_its_class_is_known(embedded_model, tmp_path):
    """AutoTokenizer's choice of class is remembered per model directory (pipeline/tokens.py: load_tokenizer): the
    next process loads that class directly, without AutoTokenizer's imports (torch among them), and tokenizes and
    renders exactly as AutoTokenizer's tokenizer; a directory whose files changed is chosen for again."""
    import shutil
    import subprocess
    import sys

    env = {**os.environ, "NIGHTSHIFT_HOME": str(tmp_path / "home")}

    def load(model_dir) -> dict:
        done = subprocess.run(
            [sys.executable, "-c", _LOAD, str(model_dir)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = load(embedded_model.path), load(embedded_model.path)
    assert first["auto"] and not second["auto"] and not second["torch"]
    assert {k: v for k, v in first.items() if k not in ("auto", "torch")} == {
        k: v for k, v in second.items() if k not in ("auto", "torch")
    }
    # A copy whose tokenizer config is rewritten is not the directory that was remembered.
    copy = tmp_path / "model"
    shutil.copytree(embedded_model.path, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    assert load(copy)["auto"]
    config = copy / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    assert load(copy)["auto"]


def test_tokenizer_classes_chosen_at_once_are_all_remembered(tmp_path, monkeypatch):
    """Every ingest worker of a first run chooses a class at about the same moment: each adds its directory to the
    remembered classes under a lock, so none of them writes over another's entry (a read made slow here, so that
    writers without the lock would all read the empty file)."""
    import threading
    import time

    from pipeline import tokens

    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path))
    read = tokens._remembered_classes

    def slow_read():
        known = read()
        time.sleep(0.05)
        return known

    monkeypatch.setattr(tokens, "_remembered_classes", slow_read)
    writers = [
        threading.Thread(
            target=tokens._remember_class, args=(f"/models/m{i}", [["stamp", i]], f"transformers.x:T{i}")
        )
        for i in range(6)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    known = json.loads((tmp_path / tokens.TOKENIZER_CLASSES).read_text())
    assert sorted(known) == [f"/models/m{i}" for i in range(6)]
    assert known["/models/m3"] == {"stamp": [["stamp", 3]], "class": "transformers.x:T3"}


def test_a_line_naming_an_adapter_is_measured_on_its_base_models_engines():
    """An adapter's request runs in its base model's context: fitting counts it, a line for another model's pool
    starts no sequence here."""
    from pipeline.engines.fake import fit_target

    target = fit_target(MODEL, {"lora_modules": {"sql": "/adapters/sql"}}, 256)
    bodies = [
        {"model": name, "messages": [{"role": "user", "content": "w w w"}]} for name in ("m", "sql", "other")
    ]
    counted = target.count([("/v1/chat/completions", body) for body in bodies])
    assert counted[0] == counted[1] != [] and counted[2] == []
