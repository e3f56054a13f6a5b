"""The private Ray a job starts for itself (pipeline/runtime/hosting/session.py): its settings, and its end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

_SCRIPT = """
import json
from ray._private import worker
from pipeline.runtime.hosting.session import IDLE_TASK_WORKERS_KEPT_MS, end_ray, start_ray

start_ray(None, keep_idle_workers=True)
node = worker._global_node
config = dict(node._config)
started = {kind: [info.process.pid for info in infos] for kind, infos in node.all_processes.items()}
end_ray()
print(json.dumps({"config": config, "kept_ms": IDLE_TASK_WORKERS_KEPT_MS, "started": started}))
"""


def test_a_private_instance_keeps_idle_task_workers_and_ends_with_nothing_left():
    """Ingest's task workers stay for finalize (Ray's default would end them a second after ingest, and finalize would
    wait for fresh ones), and `end_ray` leaves none of the instance's own processes running, its autoscaler monitor
    killed rather than waited for."""
    import tempfile

    import psutil

    ray_tmp = tempfile.mkdtemp(prefix="ns-ray-")  # short: Ray's socket paths live under it
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT],
            capture_output=True,
            text=True,
            timeout=300,
            env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": ray_tmp},
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["config"]["idle_worker_killing_time_threshold_ms"] == report["kept_ms"] > 1000
    assert "monitor" in report["started"] and "raylet" in report["started"]
    alive = [
        (kind, pid)
        for kind, pids in report["started"].items()
        for pid in pids
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert alive == []
    assert "autoscaler" not in done.stderr
