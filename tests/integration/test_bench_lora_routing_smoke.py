"""`bench/lora_routing.py --smoke`: the LoRA routing bench's code paths with the fake engine (its own Ray per path,
two jobs of 128 rows; about a minute on 2 cores). The JSON must show every row answered on both paths, the adapter
accounting equal (each adapter's rows as generated, per-engine loads adding up to the total), equal engines, and
routing loading adapters no more often than no routing."""

from __future__ import annotations

import json
from pathlib import Path

from tests.runs import run_bench_smoke


def test_lora_routing_smoke_reports_fewer_or_equal_loads_routed(tmp_path: Path) -> None:
    proc = run_bench_smoke("lora_routing.py", "--smoke", "--out-dir", str(tmp_path))
    summary = json.loads((tmp_path / "lora_routing-smoke.json").read_text())
    assert "refused" not in summary
    runs = {run["path"]: run for run in summary["runs"]}
    assert set(runs) == {"routed", "unrouted"}
    rows = summary["setup"]["rows"]
    for run in runs.values():
        assert run["accounting"] == {"rows_ok": True, "adapter_rows": True, "loads_add_up": True, "ok": True}
        assert run["rows_ok"] == rows and run["rows_failed"] == 0
        assert sum(run["adapter_rows"].values()) == rows
        assert sum(run["loads_by_engine"].values()) == run["adapter_loads"] > 0
        assert run["results"] == rows and run["fixed_s"] > 0 and run["steady_rows_per_s"] > 0
    routed, unrouted = runs["routed"], runs["unrouted"]
    assert routed["adapter_rows"] == unrouted["adapter_rows"]
    assert routed["engine_args"] == unrouted["engine_args"]
    assert routed["routing"]["used"] and not unrouted["routing"]["used"]
    assert routed["adapter_loads"] <= unrouted["adapter_loads"]
    assert summary["comparison"]["routed_loads_not_more"]
    assert "FAKE engine" in proc.stdout and "unrouted / routed: loads" in proc.stdout
