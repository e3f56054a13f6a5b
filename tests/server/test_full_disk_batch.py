"""A batch whose job meets a full disk: the server's data dir is a 32 MiB tmpfs the test mounts and fills
(tests/disks.py). The job stops at the disk's ENOSPC with its finished rows staged (exit 75); the batch stays in
progress, not failed, and waits for room (`min_free_bytes`); once space returns it resumes from its checkpoint and
completes with every line exactly once, the rows finished before the disk filled kept as they were staged."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.disks import MiB, fill, make_room, small_filesystem
from tests.lines import chat_line, write_lines
from tests.server.batches import lines_of, until, wait_for
from tests.server.harness import KEY_A, Server

pytestmark = [pytest.mark.timeout(600), pytest.mark.long]

ROWS = 1500
# Long answers and no time model: the job writes ~8 MiB of shards and a few MiB of checkpoint in seconds.
JOB = {
    "engine": {"backend": "fake", "fake": {"output_tokens": 512, "max_concurrency": 64}},
    "resources": {"num_engines": 1, "cpus_per_engine": 0.5},
}
MIN_FREE = 2 * MiB


def waiting_for_disk(server: Server) -> float:
    text = httpx.get(
        server.base_url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {KEY_A}"}
    ).text
    for family in text_string_to_metric_families(text):
        if family.name == "nightshift_server_batches_waiting_for_disk":
            return family.samples[0].value
    raise AssertionError("no nightshift_server_batches_waiting_for_disk in /metrics")


def test_a_batch_stopped_by_a_full_disk_waits_for_room_then_completes(tmp_path):
    import openai

    root = tmp_path / "server"
    root.mkdir()
    with small_filesystem(root / "data", 32 * MiB) as data:
        server = Server(root, JOB, extra={"min_free_bytes": MIN_FREE, "limits": {"max_file_bytes": 4 * MiB}})
        server.start()
        try:
            client = openai.OpenAI(base_url=server.base_url, api_key=KEY_A, max_retries=0)
            ids = [f"row-{i:05d}" for i in range(ROWS)]
            source = write_lines(tmp_path / "in.jsonl", [chat_line(i, f"question {i}") for i in ids])
            uploaded = client.files.create(file=source.open("rb"), purpose="batch")
            fill(data, leave_bytes=MIN_FREE + 512 * 1024)  # room to start, not to finish
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )

            job_log = data / "batches" / batch.id / "job.log"
            until(
                lambda: job_log.exists() and "error: no space left on the disk" in job_log.read_text(),
                timeout=180,
                what="the job stopped by the full disk",
            )
            until(
                lambda: waiting_for_disk(server) == 1,
                what="the batch waiting for room (its owner's /metrics)",
            )
            waiting = client.batches.retrieve(batch.id)
            assert waiting.status in ("in_progress", "finalizing"), waiting
            assert not waiting.errors and waiting.output_file_id is None

            make_room(data)
            until(lambda: waiting_for_disk(server) == 0, what="the batch resumed")
            done = wait_for(client, batch.id, lambda b: b.status == "completed", timeout=240)
            results = lines_of(client, done.output_file_id)
            assert sorted(r["custom_id"] for r in results) == ids  # each line once
            assert done.error_file_id is None and done.request_counts.completed == ROWS
            assert done.request_counts.failed == 0
        finally:
            server.stop()
