"""Images on the real engine: a job mixing text rows, image rows (an http URL and a data: URL), a broken image and URLs
the fetch policy refuses, on a tiny random-weight Idefics3 (tests/e2e/tiny_idefics3.py), under the policy a server
runs with (private networks off; the test's loopback image server's address listed in `allowed_networks`).

Each image row's body equals vLLM's own run-batch on the same line (vLLM fetching the URL itself); the broken image
and each refused URL is its own error record and the job goes on; the refused URLs were never fetched, and the
allowed one was fetched once, by the engine that ran its row."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.cli import run_cli
from tests.e2e.run_batch import bodies, run_batch
from tests.e2e.tiny_idefics3 import IMAGE_PROMPT_TOKENS
from tests.lines import read_job_output, write_lines
from tests.media_server import PNG, MediaServer, png

CONTEXT = 512


def chat(custom_id: str, *parts: dict, max_tokens: int = 6) -> str:
    content = [{"type": "text", "text": "Describe the picture."}, *parts]
    body = {"model": "vlm", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, embedded_model) -> Path:
    from tests.e2e.tiny_idefics3 import make_tiny_idefics3

    return make_tiny_idefics3(tmp_path_factory.mktemp("models") / "tiny-idefics3", Path(embedded_model.path))


@pytest.fixture(scope="module")
def images():
    server = MediaServer(png(20))
    yield server
    server.close()


@pytest.fixture(scope="module")
def lines(images) -> dict[str, str]:
    data_url = "data:image/png;base64," + base64.b64encode(png(33)).decode()
    return {
        "text-0": json.dumps(
            {
                "custom_id": "text-0",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "vlm",
                    "messages": [{"role": "user", "content": "Hello there."}],
                    "max_tokens": 6,
                    "temperature": 0,
                },
            }
        ),
        "image-url": chat("image-url", image(images.url("/cat.png"))),
        "image-data": chat("image-data", image(data_url)),
        "image-broken": chat(
            "image-broken", image("data:image/png;base64," + base64.b64encode(PNG).decode())
        ),
        "refused-metadata": chat(
            "refused-metadata", image("http://169.254.169.254/latest/meta-data/cat.png")
        ),
        "refused-file": chat("refused-file", image("file:///etc/passwd")),
        "refused-private": chat("refused-private", image("http://10.255.255.1/cat.png")),
    }


ANSWERED = ("text-0", "image-url", "image-data")


@pytest.fixture(scope="module")
def job(e2e_dir, vlm, images, lines):
    config = e2e_dir / "media-job.json"
    policy = {"allow_private_networks": False, "allowed_networks": ["127.0.0.1/32"]}  # as a server runs
    config.write_text(json.dumps({"media": policy}))
    path = write_lines(e2e_dir / "media.jsonl", list(lines.values()))
    output = e2e_dir / "media-out"
    # No --max-model-len: it is fitted, so the image's tokens must be counted for its rows to fit.
    proc = run_cli(
        "run", str(path), str(output), "-c", str(config), "--model", str(vlm), "--served-model-name", "vlm",
        "--num-engines", "1", "--cpus-per-engine", "1", "--limit-mm-per-prompt", '{"image": 1}', "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits = Counter(path for path, _ in images.hits)
    images.hits.clear()
    return (*read_job_output(output), hits)


@pytest.fixture(scope="module")
def oracle(e2e_dir, vlm, lines):
    """vLLM's own run-batch on the lines it answers, with the same engine args (it fetches the URL itself)."""
    records = run_batch(
        e2e_dir, "media", [lines[name] for name in ANSWERED], "--model", str(vlm), "--served-model-name", "vlm",
        "--max-model-len", str(CONTEXT), "--limit-mm-per-prompt", '{"image": 1}', kv_cache_gib=1,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
    )  # fmt: skip
    return bodies(records)


def test_every_line_is_answered_or_its_own_error_and_the_job_goes_on(job, lines):
    results, errors, manifest = job[:3]
    assert set(results) | set(errors) == set(lines)
    assert not set(results) & set(errors)
    assert set(results) == set(ANSWERED)
    assert manifest["counts"]["total"] == len(lines)
    codes = {custom_id: record["response"]["body"]["error"]["code"] if record.get("response") else
             record["error"]["code"] for custom_id, record in errors.items()}  # fmt: skip
    assert codes == {
        "image-broken": "invalid_request",
        "refused-metadata": "media_refused",
        "refused-file": "media_refused",
        "refused-private": "media_refused",
    }, codes


def test_refused_urls_are_never_fetched_and_the_allowed_one_once(job):
    hits = job[3]
    assert hits == Counter({"/cat.png": 1})


def test_the_refusals_name_the_rule(job):
    errors = job[1]

    def message(custom_id: str) -> str:
        record = errors[custom_id]
        return (record["response"]["body"] if record.get("response") else record)["error"]["message"]

    assert "media URL refused by the fetch policy" in message("refused-metadata")
    assert "link-local" in message("refused-metadata")
    assert "allowed_local_media_path" in message("refused-file")
    assert "private or loopback" in message("refused-private")


def test_fitting_and_validate_count_an_images_tokens_as_the_engine_does(job, e2e_dir, vlm):
    """The image's placeholder (256 image tokens and the markers around them) is counted by fitting and `validate` as
    the engine counts it: the longest prompt measured is the image row's, token for token."""
    results, _, manifest = job[:3]
    engine_counts = {custom_id: results[custom_id]["response"]["body"]["usage"]["prompt_tokens"] for custom_id in
                     ANSWERED}  # fmt: skip
    fitted = manifest["engine"]["fitted"]
    assert f"{IMAGE_PROMPT_TOKENS} tokens per image" in fitted["counted_by"], fitted["counted_by"]
    assert (
        fitted["measured"]["prompt_tokens"]["max"]
        == engine_counts["image-url"]
        == engine_counts["image-data"]
    )
    assert engine_counts["image-url"] > engine_counts["text-0"]
    validated = run_cli(
        "validate", str(e2e_dir / "media.jsonl"), "--model", str(vlm), "--served-model-name", "vlm"
    )
    assert validated.returncode == 0, validated.stderr[-3000:]
    summary = next(line for line in validated.stderr.splitlines() + validated.stdout.splitlines()
                   if line.startswith("prompt     tokens"))  # fmt: skip
    assert f"max {engine_counts['image-url']}," in summary, summary
    assert f"{IMAGE_PROMPT_TOKENS} tokens per image" in summary, summary


def test_image_rows_give_vllms_own_run_batch_bodies(job, oracle):
    results = job[0]
    for custom_id in ANSWERED:
        ours, theirs = results[custom_id]["response"]["body"], oracle[custom_id]
        assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"], (
            custom_id
        )
        assert ours["usage"] == theirs["usage"], custom_id
    # The image's tokens are the prompt's: 256 image tokens and the markers around them, on top of the text.
    text_only = results["text-0"]["response"]["body"]["usage"]["prompt_tokens"]
    assert results["image-url"]["response"]["body"]["usage"]["prompt_tokens"] > text_only


@pytest.fixture(scope="module")
def image_table(e2e_dir, vlm):
    """A dataset job over a Parquet table whose `photo` column holds each row's images as bytes (a list column: one
    image, two, none, null): the table back, an answer or an error per row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {"id": [1, 2, 3, 4], "photo": [[png(33)], [png(33), png(20)], [], None]},
        schema=pa.schema([("id", pa.int64()), ("photo", pa.list_(pa.binary()))]),
    )
    source = e2e_dir / "products.parquet"
    pq.write_table(table, source)
    output = e2e_dir / "image-table-out"
    proc = run_cli(
        "run", str(source), str(output), "--template", "Describe the picture.", "--image-column", "photo",
        "--id-column", "id", "--max-tokens", "6", "--temperature", "0", "--model", str(vlm), "--served-model-name",
        "vlm", "--num-engines", "1", "--cpus-per-engine", "1", "--limit-mm-per-prompt", '{"image": 2}',
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["dataset"]["media_columns"] == {"image": "photo"}
    assert manifest["counts"]["succeeded"] == 2 and manifest["counts"]["failed"] == 2
    return {row["id"]: row for row in pq.read_table(sorted(output.glob("results-*.parquet"))).to_pylist()}


def test_an_image_column_of_bytes_is_answered_as_the_same_image_in_a_line(image_table, job):
    results = job[0]
    same = results["image-data"]["response"]["body"]  # the same prompt and image, written as a request line
    one, two = image_table[1], image_table[2]
    assert one["error"] is None and one["content"] == same["choices"][0]["message"]["content"]
    assert one["prompt_tokens"] == same["usage"]["prompt_tokens"]
    assert (
        two["error"] is None and two["prompt_tokens"] > one["prompt_tokens"]
    )  # the second image's tokens too
    for row_id, says in ((3, "empty list"), (4, "is null")):
        error = image_table[row_id]["error"]
        assert error["code"] == "template_error" and says in error["message"], error
    assert list(image_table) == [1, 2, 3, 4] and bytes(one["photo"][0]) == png(
        33
    )  # every row, its columns kept
