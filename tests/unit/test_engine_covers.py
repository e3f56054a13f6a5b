"""When a warm engine can serve the next job's plan as it is (engines.base.engine_covers), and when it must be
rebuilt; and what the registry says fitting can know of each backend (its fit strategy)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.engines.base import EngineSpec, engine_covers

BUILT = EngineSpec(
    "vllm", "/models/a", "a", {"max_model_len": 2048, "max_num_seqs": 32, "dtype": "bf16"}, cpus=2
)


def _with(**args) -> EngineSpec:
    return replace(BUILT, args={**BUILT.args, **args})


@pytest.mark.parametrize(
    ("wanted", "covers"),
    [
        (BUILT, True),
        (_with(max_model_len=1024), True),  # a shorter context fits in the longer one
        (
            _with(max_model_len=1024, max_num_seqs=64),
            True,
        ),  # fewer sequences than the plan allows: no preemption
        (_with(max_model_len=4096), False),  # a longer context than it holds
        (_with(max_num_seqs=16), False),  # more sequences than the plan's KV budget holds
        (_with(max_model_len=None), False),  # the model's own limit, longer than what was built
        (_with(dtype="fp16"), False),  # any other arg
        (replace(BUILT, model_path="/models/b"), False),
        (replace(BUILT, cpus=4), False),
        (replace(BUILT, backend="fake"), False),
    ],
)
def test_a_warm_engine_serves_a_plan_it_covers(wanted, covers):
    assert engine_covers(BUILT, wanted) is covers


def test_engines_left_to_size_themselves_cover_each_other():
    """On a GPU max_num_seqs is the engine's own choice (None) on both sides: the same engine."""
    gpu = replace(BUILT, args={"max_model_len": None, "max_num_seqs": None}, cpus=0)
    assert engine_covers(gpu, gpu)
    assert engine_covers(gpu, replace(gpu, args={"max_model_len": 512, "max_num_seqs": None}))
    assert not engine_covers(None, gpu)


def test_an_engine_filling_in_its_own_args_is_not_rebuilt():
    """vLLM on CPU sets enforce_eager in the args it was given as it starts: the worker keeps what it asked for, so
    the same plan, asked again (every chunk, every warm job), finds the same engine."""
    import asyncio

    from pipeline.runtime.engines.engine_actor import EngineWorker

    async def go():
        worker = EngineWorker(EngineSpec("fake", "m", "m", {"max_model_len": 64, "enforce_eager": None}))
        first = await worker._engine()
        first.args["enforce_eager"] = True  # what vLLM does to its spec's args
        assert worker.spec.args["enforce_eager"] is None
        assert await worker._engine() is first
        worker.spec = replace(worker.spec, args={**worker.spec.args, "max_model_len": 32})  # a shorter plan
        assert await worker._engine() is first
        worker.spec = replace(worker.spec, args={**worker.spec.args, "max_model_len": 128})  # a longer one
        assert await worker._engine() is not first

    asyncio.run(go())


# --- the registry names each backend's fit strategy (engines/fitting.py) --------------------------------------


def test_each_backend_names_its_fit_strategy_or_why_it_has_none():
    from pipeline.engines.base import BACKENDS, fit_strategy
    from pipeline.engines.fake import fit_target as fake_fit
    from pipeline.engines.vllm_engine import fit_target as vllm_fit

    assert fit_strategy("vllm") is vllm_fit and fit_strategy("fake") is fake_fit
    assert fit_strategy("http") is None and BACKENDS["http"].no_fit_reason
    assert [name for name, entry in BACKENDS.items() if entry.fits_max_num_seqs] == ["vllm"]
    with pytest.raises(ValueError, match="unknown engine backend"):
        fit_strategy("nope")


def test_fit_strategies_import_neither_ray_nor_vllm():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pipeline.engines.base import BACKENDS, fit_strategy\n"
        "[fit_strategy(name) for name in BACKENDS]\n"
        "heavy = {'ray', 'ray.data', 'vllm', 'torch', 'transformers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_fake_strategy_counts_as_the_fake_engine_and_skips_another_models_requests():
    from pipeline.engines.fake import FAKE_MAX_MODEL_LEN, fit_target
    from pipeline.models import ResolvedModel

    model = ResolvedModel(name="m", path="/nowhere", revision=None, source="local-dir")
    target = fit_target(model, {"output_tokens": 7}, 256)
    chat = {"messages": [{"role": "user", "content": "one two three"}]}
    counts = target.count(
        [("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "model": "other"})]
    )
    assert counts[0] and counts[1] == []  # another model's request starts no sequence of this one
    assert target.output_budget("/v1/chat/completions", chat) == (7, False)
    assert target.output_budget("/v1/chat/completions", {**chat, "max_tokens": 3}) == (3, False)
    assert target.model_limit == FAKE_MAX_MODEL_LEN and target.capacity({}, "cpu") is None
