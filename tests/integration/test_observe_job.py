"""Watching a real job (local Ray, the fake engine with a time model, a few seconds of generation): Prometheus
scraped while it runs, then the report, the manifest's usage and cost, the Parquet latency columns and `status`,
all consistent with the manifest."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig
from pipeline.observe.report import CHARTS
from pipeline.observe.status import job_status
from pipeline.runtime.job import run_job
from tests.integration.storage_fixtures import free_port
from tests.lines import chat_line
from tests.report_charts import chart_svgs, drawn

pytestmark = pytest.mark.usefixtures("local_ray")


def _value(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observe")
    lines = [chat_line(f"id-{i:04d}", "word " * (i % 9 + 1), max_tokens=10 + i % 30) for i in range(400)]
    lines.append("{not json")
    (tmp / "in.jsonl").write_text("\n".join(lines) + "\n")
    port = free_port()
    config = JobConfig.model_validate(
        {
            "input": str(tmp / "in.jsonl"),
            "output": str(tmp / "out"),
            "engine": {"backend": "fake", "fake": {"decode_seconds_per_token": 0.02, "max_concurrency": 16}},
            "resources": {"num_engines": 2, "cpus_per_engine": 0.5},
            "output_options": {"format": "parquet"},
            "observe": {"metrics_port": port, "gpu_hour_price": {"*": 1.0}, "hosted_price": "0.5/1.5"},
        }
    )
    scrapes: list[str] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            try:
                scrapes.append(
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                )
            except OSError:
                pass
            time.sleep(0.5)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        outcome = run_job(config, show_progress=False)
    finally:
        done.set()
        scraper.join()
    return tmp / "out", outcome.manifest, scrapes, port


def test_metrics_move_while_the_job_runs_and_end_at_the_manifest(watched):
    output, manifest, scrapes, port = watched
    engines_running = [s for s in scrapes if 'nightshift_stage_active{stage="engines"} 1.0' in s]
    assert engines_running, "no scrape saw the engines at work"
    done = [_value(s, "nightshift_rows_done_total") for s in scrapes if "nightshift_rows_done_total" in s]
    assert len(set(done)) >= 2 and done == sorted(done), done  # moving, never backwards
    assert max(_value(s, "nightshift_engine_requests_in_flight") for s in scrapes) > 0
    last = scrapes[-1]
    assert _value(last, "nightshift_rows_done_total") == manifest["counts"]["total"]
    assert _value(last, "nightshift_rows_failed_total") == manifest["counts"]["failed"]
    assert _value(last, "nightshift_input_rows") == manifest["input"]["lines"]
    assert _value(last, "nightshift_pool_completion_tokens_total") == manifest["tokens"]["completion"]
    assert _value(last, "nightshift_engine_completion_tokens_total") == manifest["tokens"]["completion"]
    with pytest.raises(OSError):  # the endpoint went away with the job
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_usage_latency_and_cost_in_the_manifest_and_the_parquet_output(watched):
    output, manifest, _, _ = watched
    table = pq.read_table(sorted(output.glob("results-*.parquet")))
    assert manifest["usage"]["completion_tokens"]["count"] == table.num_rows == 400
    assert manifest["usage"]["completion_tokens"]["max"] == max(table.column("completion_tokens").to_pylist())
    engine_s = table.column("engine_s").to_pylist()
    # A request of n tokens holds its slot n x 20 ms under the time model.
    tokens = table.column("completion_tokens").to_pylist()
    assert all(s >= 0.02 * n * 0.9 for s, n in zip(engine_s, tokens, strict=True))
    assert all(w is not None and w >= 0 for w in table.column("queue_wait_s").to_pylist())
    cost = manifest["cost"]
    assert cost["tokens"] == manifest["tokens"]["prompt"] + manifest["tokens"]["completion"]
    assert cost["hosted_cost"] == pytest.approx(
        (manifest["tokens"]["prompt"] * 0.5 + manifest["tokens"]["completion"] * 1.5) / 1e6, abs=1e-6
    )
    assert 0 < cost["startup_s"] < manifest["wall_time_s"]
    assert set(manifest["stages"]) == {"ingest", "fit", "engines", "finalize"}


def test_report_has_every_chart_drawn(watched):
    output, manifest, _, _ = watched
    assert manifest["report"] == "report.html"
    page = (output / "report.html").read_text()
    svgs = chart_svgs(page)
    # The fake engine reports no KV usage: that chart is a sentence; every other one is drawn.
    assert sorted(svgs) == sorted(set(CHARTS) - {"kv-cache"})
    assert all(drawn(svg) for svg in svgs.values())


def test_status_of_the_finished_job(watched):
    output, manifest, _, _ = watched
    status = job_status(str(output))
    assert status["state"] == "finished"
    assert status["rows"] == {"total": 401, "done": 401, "failed": 1}
    assert status["errors_by_code"] == {"invalid_json": 1}
    assert status["pools"]["default"]["rows"] == 400


def test_headless_chromium_renders_the_report(watched, tmp_path):
    output, _, _, _ = watched
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (make test installs Debian's chromium where apt-get can)")
    shot = tmp_path / "report.png"
    done = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--screenshot={shot}",
            "--window-size=1200,2600",
            (output / "report.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    from PIL import Image

    image = Image.open(shot).convert("L")
    # Not a blank page: a good share of the pixels are ink (text, bars, lines).
    dark = sum(1 for p in image.getdata() if p < 200)
    assert dark > 0.01 * image.width * image.height
    json.dumps({"screenshot": str(shot)})
