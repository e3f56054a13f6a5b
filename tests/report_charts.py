"""A finished job's report: a synthetic job to render one from, and its charts read back from the page."""

from __future__ import annotations

import base64
import random
import re
import time

import pyarrow as pa

from pipeline.observe import usage
from pipeline.observe.timeline import Timeline


def chart_svgs(page: str) -> dict[str, str]:
    """chart id -> its SVG, decoded from the page's data: URI images."""
    found = re.findall(
        r'<figure class="chart" id="chart-([a-z-]+)"><img alt="[^"]*" src="data:image/svg\+xml;base64,([^"]+)"',
        page,
    )
    return {chart: base64.b64decode(data).decode() for chart, data in found}


def drawn(svg: str) -> bool:
    """The chart draws something from the data: a group the report marked `data` holding a non-empty path."""
    return bool(
        re.search(r'<g id="data[^"]*">(?:(?!</g>).)*?<path[^>]* d="M [0-9.-]+ [0-9.-]+\s*L', svg, re.S)
    )


def synthetic_job():
    t0 = time.time() - 100
    timeline = Timeline(runs=[t0])
    for name, (a, b) in {"ingest": (0, 5), "fit": (5, 6), "engines": (1, 80), "finalize": (80, 90)}.items():
        timeline.stage_started(name, now=t0 + a)
        timeline.stage_ended(name, now=t0 + b)
    for i in range(30):
        engines = {
            f"{pool}-{n}": {
                "pool": pool,
                "in_flight": 10 + i % 5,
                "kv_cache_usage": i / 30,
                "preemptions": i // 10,
            }
            for pool in ("cuda", "rocm")
            for n in (1, 2)
        }
        pools = {
            p: {"rows": 10 * i, "completion_tokens": 100 * i * (2 if p == "cuda" else 1)}
            for p in ("cuda", "rocm")
        }
        timeline.add({"t": t0 + 10 + 2 * i, "completion_tokens": 300 * i, "pools": pools, "engines": engines})
    histograms = {
        "prompt_tokens": usage.histogram(
            pa.array([random.Random(i).randint(5, 500) for i in range(400)]), 1.0
        ),
        "completion_tokens": usage.histogram(
            pa.array([random.Random(i).randint(1, 200) for i in range(400)]), 1.0
        ),
    }
    manifest = {
        "job_id": "job1",
        "created_at": "2026-12-01T00:00:00+00:00",
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(t0 + 90)),
        "nightshift_version": "0.1.0",
        "input": {"location": "in.jsonl"},
        "model": {"name": "m", "path": "/m"},
        "engine": {
            "backend": "vllm",
            "engines": 4,
            "args": {"max_num_seqs": 32},
            "sampling_defaults": {"temperature": 0.6},
            "fitted": None,
        },
        "counts": {
            "total": 410,
            "succeeded": 400,
            "failed": 10,
            "by_error_code": {"invalid_json": 4, "context_length_exceeded": 6},
        },
        "tokens": {"prompt": 1000, "completion": 2000},
        "wall_time_s": 90.0,
        "throughput": {"output_tokens_per_s": 22.2, "rows_per_s": 4.4},
        "preemptions": 2,
        "prefix_cache_hit_rate": 0.5,
        "stages": timeline.stages,
        "usage": {"prompt_tokens": usage.distribution(histograms["prompt_tokens"], 1.0)},
        "cost": None,
    }
    return manifest, timeline, histograms
