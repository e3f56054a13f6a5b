"""Pure helpers of bench/shared_prefix.py: the P2 workload (the prefix-heavy job), its cache sizing, its preset and its
target."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import fair  # noqa: E402
import shared_prefix as sp  # noqa: E402

SPECS = sp.path_specs([0, 1])


def test_p2_prompts_are_long_distinct_and_interleaved() -> None:
    lines = sp.shared_prefix_requests(4, 3, 16, "m", prompt_words=sp.P2["prompt_words"])
    systems = [line["body"]["messages"][0]["content"] for line in lines]
    assert len(lines) == 12 and len(set(systems)) == 4
    assert systems[:4] == systems[4:8]  # prompt i % 4: a row's prompt never follows its own
    assert all(len(s.split()) >= sp.P2["prompt_words"] for s in systems)
    short = sp.shared_prefix_requests(4, 3, 16, "m")[0]["body"]["messages"][0]["content"]
    assert len(short.split()) < sp.P2["prompt_words"] / 3


def test_each_engine_holds_its_share_of_the_prompts_and_a_block_per_running_sequence() -> None:
    # 64 prompts of 1,500 tokens, a quarter held: 16 prompts of 12 blocks (1,536 tokens) + 64 running sequences.
    assert sp.blocks_for_share(64, 0.25, 1500, 64) == 16 * 12 + 64
    assert sp.blocks_for_share(64, 0.25, 1536, 64) == 16 * 12 + 64
    assert sp.blocks_for_share(64, 0.25, 1537, 64) == 16 * 13 + 64
    assert sp.blocks_for_share(2, 0.1, 100, 8) == 1 + 8  # at least one prompt is held


def test_the_p2_preset_fills_in_what_the_command_line_left_at_its_default() -> None:
    ns = sp.parse_args(["--p2"], [s.name for s in SPECS])
    assert (ns.prompts, ns.rows_per_prompt, ns.prompt_words, ns.kv_share, ns.max_tokens) == (
        64,
        32,
        1360,
        0.25,
        16,
    )
    assert ns.workloads == "p2"
    mine = sp.parse_args(["--p2", "--rows-per-prompt", "8", "--workloads", "shared"], [s.name for s in SPECS])
    assert (mine.rows_per_prompt, mine.prompts, mine.workloads) == (8, 64, "shared")
    plain = sp.parse_args([], [s.name for s in SPECS])
    assert plain.kv_share is None and plain.workloads == "shared,plain" and plain.prompt_words == 360


def _run(path: str, steady: float, fixed: float = 30.0) -> dict:
    return {
        "workload": "p2",
        "path": path,
        "wall_s": 100.0,
        "tok_per_s": steady,
        "fixed_s": fixed,
        "generation_s": 50.0,
        "steady_tok_per_s": steady,
        "tail_s": 2.0,
        "beside_compute_cores": 0.1,
        "output_tokens": 100,
        "rows_ok": 10,
        "foreign_cores": 0.0,
        "prefix_cache_hit_rate": 0.5,
        "engine_cores": [[0, 1]],
        "cores_wrong": None,
    }


def test_the_p2_target_is_one_and_a_third_times_the_best_peer() -> None:
    runs = [
        _run("nightshift-2x1", 130.0),
        _run("nightshift-1x2", 129.0),
        _run("run-batch-1x2", 100.0),
        _run("ray-data-llm-1x2", 90.0),
    ]
    checks = sp.summarize(runs, SPECS)["checks"]
    routed = checks["p2: nightshift-2x1"]["p2_steady_vs_best_peer"]
    assert routed == {"peer": "run-batch-1x2", "ratio": 1.3, "ok": True}
    assert checks["p2: nightshift-1x2"]["p2_steady_vs_best_peer"]["ok"] is False
    text = sp.format_summary(sp.summarize(runs, SPECS))
    assert "P2 target 1.3x: 1.290x run-batch-1x2 (BELOW 1.3x)" in text
    # Other workloads keep their own target only.
    shared = sp.summarize([{**r, "workload": "shared"} for r in runs], SPECS)["checks"]
    assert "p2_steady_vs_best_peer" not in shared["shared: nightshift-2x1"]
    assert fair.Layout.core_each([0, 1]).label == "2x1"
