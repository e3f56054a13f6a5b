"""Pure helpers of bench/lora_routing.py (workload, manifest facts, accounting, the equal-engines check) and
bench/fair.py's clock by results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import fair  # noqa: E402
import lora_routing as lr  # noqa: E402

SETUP = lr.Setup(engine="fake", adapters=3, max_loras=1, engines=2, rows=10, max_tokens=4)


def test_rows_name_the_adapters_round_robin() -> None:
    lines = lr.adapter_requests(SETUP)
    assert [line["body"]["model"] for line in lines[:4]] == ["lora-0", "lora-1", "lora-2", "lora-0"]
    assert len({line["custom_id"] for line in lines}) == 10
    assert all(line["body"]["max_tokens"] == 4 and line["body"]["ignore_eos"] for line in lines)
    assert lr.expected_adapter_rows(SETUP) == {"lora-0": 4, "lora-1": 3, "lora-2": 3}


def test_flags_switch_routing_off_and_name_every_adapter() -> None:
    vllm = lr.Setup(engine="vllm", adapters=2, max_loras=1, engines=2, rows=4, max_tokens=4)
    flags = lr.nightshift_flags(vllm, {"lora-0": "/a", "lora-1": "/b"}, routed=False, job_file=None)
    assert flags.count("--lora-modules") == 2 and "lora-1=/b" in flags
    assert "--no-prefix-routing" in flags and flags[flags.index("--max-loras") + 1] == "1"
    fake = lr.nightshift_flags(SETUP, {}, routed=True, job_file=Path("/j.yaml"))
    assert "--no-prefix-routing" not in fake and fake[fake.index("--engine") + 1] == "fake"
    assert lr.fake_job(SETUP)["engine"]["fake"]["lora_modules"].keys() == {"lora-0", "lora-1", "lora-2"}


def _manifest(loads: dict[str, int], total: int, adapter_rows: dict[str, int]) -> dict:
    return {
        "adapter_loads": total,
        "counts": {"succeeded": 10, "failed": 0},
        "routing": {"rows_stolen": 1},
        "engine": {
            "args": {"max_loras": 1},
            "cpu_cores": [[1], [0]],
            "engines": 2,
            "per_engine": {actor: {"adapter_loads": n, "rows": 5} for actor, n in loads.items()},
        },
        "models": {"base": {"adapters": {name: {"rows": rows} for name, rows in adapter_rows.items()}}},
    }


def test_accounting_checks_rows_adapters_and_loads() -> None:
    rows = {"lora-0": 4, "lora-1": 3, "lora-2": 3}
    facts = lr.manifest_facts(_manifest({"e-1": 2, "e-2": 3}, 5, rows))
    assert facts["loads_by_engine"] == {"e-1": 2, "e-2": 3} and facts["rows_stolen"] == 1
    assert lr.accounting(facts, SETUP)["ok"]
    bad = lr.accounting(lr.manifest_facts(_manifest({"e-1": 2, "e-2": 2}, 5, {**rows, "lora-2": 2})), SETUP)
    assert not bad["ok"] and not bad["loads_add_up"] and not bad["adapter_rows"] and bad["rows_ok"]


def test_engines_must_match_to_report() -> None:
    rows = {"lora-0": 4, "lora-1": 3, "lora-2": 3}
    routed = {"path": "routed", **lr.manifest_facts(_manifest({"e-1": 1}, 1, rows))}
    unrouted = {"path": "unrouted", **lr.manifest_facts(_manifest({"e-2": 6}, 6, rows))}
    assert lr.engines_differ(routed, unrouted) == []
    unrouted["cpu_cores"] = [[0, 1]]
    unrouted["engine_args"] = {"max_loras": 2}
    problems = lr.engines_differ(routed, unrouted)
    assert "max_loras: 1 vs 2" in problems[0] and "cores differ" in problems[1]
    routed["wall_s"], unrouted["wall_s"] = 10.0, 15.0
    routed["adapter_loads"], unrouted["adapter_loads"] = 2, 8
    comparison = lr.compare(routed, unrouted)
    assert comparison["loads_unrouted_over_routed"] == 4.0 and comparison["wall_unrouted_over_routed"] == 1.5
    assert comparison["routed_loads_not_more"] and comparison["steady_routed_over_unrouted"] is None


def test_result_timing_counts_rows_after_the_first_result(tmp_path: Path) -> None:
    for pid, first, n_first, last, results in ((1, 110.0, 3, 150.0, 40), (2, 112.0, 1, 151.0, 42)):
        record = {"pid": pid, "first_token_at": first - 1, "last_token_at": last, "tokens": 100}
        record |= {
            "first_result_at": first,
            "first_results": n_first,
            "last_result_at": last,
            "results": results,
        }
        (tmp_path / f"engine-{pid}.json").write_text(json.dumps(record))
    timing = fair.result_timing(fair.read_traces(tmp_path), started=100.0, ended=155.0)
    assert timing["fixed_s"] == 10.0 and timing["results_s"] == 41.0 and timing["tail_s"] == 4.0
    assert timing["results"] == 82 and timing["steady_rows_per_s"] == round(79 / 41.0, 2)
    assert timing["first_result_spread_s"] == 2.0
    assert fair.result_timing([], 0.0, 1.0) == {"engines_with_results": 0}


def test_startup_loads_are_the_serving_layers_log_lines() -> None:
    line = "(MainProcess pid=1) INFO 12-03 06:45:29 [serving.py:226] Loaded new LoRA adapter: name 'lora-{}', path '/a'\n"
    texts = ["".join(line.format(k) for k in range(4)), "".join(line.format(k) for k in range(4)) + "other\n"]
    assert lr.startup_loads(texts) == 8
    assert lr.startup_loads(["nothing here"]) == 0
