"""LoRA adapters on the real engine: two adapters made at test time with peft from the embedded model (non-zero B,
so their answers differ from the base model's), served with the base model in one job.

- One engine, one sequence at a time (bit-stable greedy decoding): every answer equals vLLM's own run-batch with
  --lora-modules on the same lines, model by model; a line naming no served model or adapter is model_not_found,
  listing what is served; the manifest counts rows per adapter and the engine's adapter loads.
- Many sequences at once, so base-model rows share batches with adapter rows: they still get the base model's answers
  (vLLM 0.32's CPU ops gave them the last slot's adapter: without the fix in pipeline/engines/vllm_lora_worker.py,
  two of the three base rows here came back with sql-lora's answers)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cli import run_cli
from tests.e2e.run_batch import bodies, run_batch
from tests.lines import read_job_output, write_lines

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
ADAPTERS = {"sql-lora": 1, "poet-lora": 2}  # name -> seed
QUESTIONS = ["What is the capital of France?", "Name a colour.", "What is 2+2?"]
CONTEXT = 512


def line(custom_id: str, model: str, text: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 12,
        "temperature": 0,
    }
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


# Interleaved, so the models' rows meet in the engine's batches.
LINES = [
    line(f"{model}-{i}", model, question)
    for i, question in enumerate(QUESTIONS)
    for model in (MODEL, *ADAPTERS)
]
UNSERVED = line("unserved", "no-such-lora", QUESTIONS[0])


@pytest.fixture(scope="module")
def adapters(e2e_dir, embedded_model):
    from tests.e2e.lora_adapters import make_adapter

    return {
        name: str(make_adapter(embedded_model.path, e2e_dir / "adapters" / name, seed=seed))
        for name, seed in ADAPTERS.items()
    }


def lora_flags(adapters: dict[str, str]) -> list[str]:
    flags = ["--max-loras", "1", "--max-lora-rank", "8"]
    for name, path in adapters.items():
        flags += ["--lora-modules", f"{name}={path}"]
    return flags


def run_job(e2e_dir, adapters, name: str, *flags: str):
    path = write_lines(e2e_dir / f"{name}.jsonl", [*LINES, UNSERVED])
    output = e2e_dir / f"{name}-out"
    proc = run_cli(
        "run", str(path), str(output), "--num-engines", "1", "--cpus-per-engine", "1",
        "--max-model-len", str(CONTEXT), *lora_flags(adapters), *flags, "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_job_output(output)


@pytest.fixture(scope="module")
def one_at_a_time(e2e_dir, adapters):
    return run_job(e2e_dir, adapters, "lora-serial", "--max-num-seqs", "1")


@pytest.fixture(scope="module")
def batched(e2e_dir, adapters):
    return run_job(e2e_dir, adapters, "lora-batched", "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def oracle(e2e_dir, embedded_model, adapters):
    """vLLM's own run-batch with --lora-modules on the same lines, the same engine args."""
    modules = [f"{name}={path}" for name, path in adapters.items()]
    records = run_batch(
        e2e_dir, "lora", LINES, "--model", embedded_model.path, "--served-model-name", MODEL, "--max-model-len",
        str(CONTEXT), "--max-num-seqs", "1", "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
        "--lora-modules", *modules, env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
    )  # fmt: skip
    return bodies(records)


def text(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def texts(results: dict) -> dict[str, str]:
    return {custom_id: text(r["response"]["body"]) for custom_id, r in results.items()}


def test_every_answer_equals_vllms_run_batch_with_the_same_adapters(one_at_a_time, oracle):
    results, _, _ = one_at_a_time
    assert set(results) == set(oracle)
    for custom_id, theirs in oracle.items():
        ours = results[custom_id]["response"]["body"]
        assert ours["model"] == theirs["model"] == custom_id.rsplit("-", 1)[0]
        assert text(ours) == text(theirs), custom_id
        assert ours["usage"] == theirs["usage"], custom_id


def test_the_adapters_change_the_answers(one_at_a_time):
    """Each adapter answers most questions otherwise than the base model, and the two otherwise than each other
    (a short answer may agree: "The capital of France is Paris." is what one adapter keeps)."""
    answers = texts(one_at_a_time[0])

    def differ(a: str, b: str) -> int:
        return sum(answers[f"{a}-{i}"] != answers[f"{b}-{i}"] for i in range(len(QUESTIONS)))

    first, second = ADAPTERS
    assert differ(first, MODEL) >= 2 and differ(second, MODEL) >= 2
    assert differ(first, second) >= 2


def test_a_line_naming_no_served_model_is_its_own_error_listing_what_is_served(one_at_a_time):
    results, errors, manifest = one_at_a_time
    assert len(results) + len(errors) == len(LINES) + 1
    assert set(errors) == {"unserved"}
    error = errors["unserved"]["error"]
    assert error["code"] == "model_not_found"
    assert all(f"'{name}'" in error["message"] for name in (MODEL, *ADAPTERS))


def test_the_manifest_counts_rows_per_adapter_and_the_engines_loads(one_at_a_time, adapters):
    _, _, manifest = one_at_a_time
    served = manifest["models"][MODEL]
    assert served["rows"] == len(LINES)
    for name, path in adapters.items():
        counted = served["adapters"][name]
        assert counted["path"] == path and counted["rows"] == len(QUESTIONS)
        assert counted["completion_tokens"] > 0
    # One slot, two adapters: each was loaded into it at least once, counted by the engine's worker.
    assert manifest["adapter_loads"] >= len(ADAPTERS)
    args = manifest["engine"]["args"]
    assert (args["max_loras"], args["max_lora_rank"]) == (1, 8)
    assert args["lora_modules"] == adapters


def test_base_rows_batched_with_adapter_rows_get_the_base_models_answers(one_at_a_time, batched):
    one, _, _ = one_at_a_time
    together, errors, manifest = batched
    assert set(together) == set(one) and set(errors) == {"unserved"}
    assert manifest["engine"]["args"]["max_num_seqs"] == 16
    alone, mixed = texts(one), texts(together)
    for i in range(len(QUESTIONS)):
        base = f"{MODEL}-{i}"
        assert mixed[base] == alone[base], base
