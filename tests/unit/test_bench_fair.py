"""bench/fair.py: what makes the engine benches compare equals (layouts, core checks, fixed cost vs steady state)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import fair  # noqa: E402


def test_layouts_cover_the_whole_box() -> None:
    cores = [0, 1, 2, 3]
    assert fair.Layout.all_cores(cores).expected(cores) == [[0, 1, 2, 3]]
    assert fair.Layout.core_each(cores).expected(cores) == [[0], [1], [2], [3]]
    assert fair.Layout.all_cores(cores).label == "1x4"
    assert fair.bind_string([0, 1]) == "0-1"
    assert fair.bind_string([0, 2, 5]) == "0,2,5"
    assert fair.bind_string([3]) == "3"


def test_cores_are_read_from_vllms_log_and_checked() -> None:
    log = (
        "(EngineCore pid=1) INFO 12-01 14:46:22 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[1]\n"
        "(EngineCore pid=2) INFO 12-01 14:46:22 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]\n"
    )
    found = fair.bound_cores([log])
    assert found == [[1], [0]]
    assert fair.check_cores(found, [[0], [1]]) is None
    assert "only 1 of 2" in fair.check_cores([[0]], [[0], [1]])
    assert "expected [[0, 1]]" in fair.check_cores([[0]], [[0, 1]])
    assert "nothing logged" in fair.check_cores([], [[0, 1]])


def test_fixed_cost_and_steady_state_from_the_token_clocks(tmp_path: Path) -> None:
    env = fair.trace_env({"PYTHONPATH": "/x"}, tmp_path)
    assert env["PYTHONPATH"].split(":")[0] == str(fair.TRACE_DIR) and env["NSBENCH_TRACE_DIR"] == str(
        tmp_path
    )
    for pid, first, last, tokens in ((1, 110.0, 150.0, 4000), (2, 112.0, 151.0, 3900)):
        record = {"pid": pid, "first_token_at": first, "last_token_at": last, "tokens": tokens}
        (tmp_path / f"engine-{pid}.json").write_text(
            json.dumps({**record, "prefix_queries": 1000, "prefix_hits": 800})
        )
    (tmp_path / "engine-3.json").write_text(json.dumps({"pid": 3, "first_token_at": None, "tokens": 0}))
    timing = fair.token_timing(fair.read_traces(tmp_path), started=100.0, ended=155.0)
    assert timing["engines_traced"] == 2
    assert timing["fixed_s"] == 10.0
    assert timing["generation_s"] == 41.0
    assert timing["steady_tok_per_s"] == round(7900 / 41.0, 2)
    assert timing["tail_s"] == 4.0
    assert timing["first_token_spread_s"] == 2.0
    assert timing["prefix_cache_hit_rate"] == 0.8
    assert fair.token_timing([], 0.0, 1.0) == {"engines_traced": 0}


def test_cores_beside_the_engines_compute_count_only_the_generation_samples() -> None:
    import os

    import engines as eb

    hz = os.sysconf("SC_CLK_TCK")
    watcher = eb.LoadWatcher(period_s=2.0)
    # Samples end at 102..120 s; generation runs from 105 to 115 s: the samples ending at 108..114 s lie inside.
    for at in range(102, 122, 2):
        busy = 105 + 2 <= at <= 115
        ticks = {"VLLM::Worker": int(3.6 * hz), "ray::Driver": int(0.2 * hz)}
        ticks["ray::JobMonitor"] = int((0.1 if busy else 1.5) * hz)  # busy start-up outside the window only
        watcher.own_samples.append((float(at), ticks))
    traces = [{"first_token_at": 105.0, "last_token_at": 115.0}]
    beside = fair.cores_beside_compute(watcher, traces)
    assert beside["engine_compute_cores"] == 1.8
    assert beside["beside_compute_cores"] == 0.15
    assert list(beside["beside_compute_top"]) == ["ray::Driver", "ray::JobMonitor"]
    assert fair.cores_beside_compute(watcher, []) == {}
