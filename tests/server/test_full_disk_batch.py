"""Two tenants, a quota filled and a disk filled mid-run: the server's data dir is a 32 MiB tmpfs the test mounts
and fills (tests/disks.py).

Key B (labelled, a low storage quota) uploads until its quota refuses it — the refusal names the limit and keeps
nothing — and submits a small batch. Key A submits a big batch once the disk is nearly full: its job stops at the
disk's ENOSPC with its finished rows staged (exit 75); the batch stays in progress, not failed, counted on A's
`/metrics` as waiting for disk (`min_free_bytes`), and B's batch waits its turn. Once space returns, A's batch resumes
from its checkpoint and both complete: every accepted line of either key exactly once."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.disks import MiB, fill, make_room, small_filesystem
from tests.lines import chat_line, write_lines
from tests.server.batches import lines_of, until, wait_for
from tests.server.harness import KEY_A, KEY_B, Server

pytestmark = [pytest.mark.timeout(600), pytest.mark.long]

ROWS = 1500
# Long answers and no time model: the job writes ~8 MiB of shards and a few MiB of checkpoint in seconds.
JOB = {
    "engine": {"backend": "fake", "fake": {"output_tokens": 512, "max_concurrency": 64}},
    "resources": {"num_engines": 1, "cpus_per_engine": 0.5},
}
MIN_FREE = 2 * MiB
B_QUOTA = 256 * 1024


def waiting_for_disk(server: Server, key: str) -> float:
    text = httpx.get(
        server.base_url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {key}"}
    ).text
    for family in text_string_to_metric_families(text):
        if family.name == "nightshift_server_batches_waiting_for_disk":
            return family.samples[0].value
    raise AssertionError("no nightshift_server_batches_waiting_for_disk in /metrics")


def test_a_full_quota_and_a_full_disk_lose_no_accepted_line_of_either_key(tmp_path):
    import openai

    root = tmp_path / "server"
    root.mkdir()
    with small_filesystem(root / "data", 32 * MiB) as data:
        server = Server(
            root,
            JOB,
            extra={
                "min_free_bytes": MIN_FREE,
                "limits": {"max_file_bytes": 4 * MiB},
                "quotas": {"keys": {"tenant-b": {"max_stored_bytes": B_QUOTA}}},
            },
            keys=f"{KEY_A}\n{KEY_B} tenant-b\n",
        )
        server.start()
        try:
            a = openai.OpenAI(base_url=server.base_url, api_key=KEY_A, max_retries=0)
            b = openai.OpenAI(base_url=server.base_url, api_key=KEY_B, max_retries=0)

            # B fills its quota: each refusal names the limit and keeps nothing.
            b_ids = [f"b-{i:04d}" for i in range(600)]
            b_file = write_lines(tmp_path / "b.jsonl", [chat_line(i, f"b {i}", max_tokens=8) for i in b_ids])
            accepted = []
            while True:
                try:
                    accepted.append(b.files.create(file=b_file.open("rb"), purpose="batch").id)
                except openai.BadRequestError as refused:
                    assert refused.body["code"] == "storage_limit_exceeded" and str(B_QUOTA) in str(refused)
                    break
                assert len(accepted) < 20, "the quota never refused an upload"
            assert accepted and len(b.files.list().data) == len(accepted)
            b_batch = b.batches.create(
                input_file_id=accepted[0], endpoint="/v1/chat/completions", completion_window="24h"
            )

            # A's big batch meets a full disk.
            a_ids = [f"row-{i:05d}" for i in range(ROWS)]
            source = write_lines(tmp_path / "a.jsonl", [chat_line(i, f"question {i}") for i in a_ids])
            uploaded = a.files.create(file=source.open("rb"), purpose="batch")
            fill(data, leave_bytes=MIN_FREE + 512 * 1024)  # room to start, not to finish
            a_batch = a.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            job_log = data / "batches" / a_batch.id / "job.log"
            until(
                lambda: job_log.exists() and "error: no space left on the disk" in job_log.read_text(),
                timeout=180,
                what="A's job stopped by the full disk",
            )
            until(
                lambda: waiting_for_disk(server, KEY_A) == 1, what="A's batch waiting for room (its /metrics)"
            )
            waiting = a.batches.retrieve(a_batch.id)
            assert waiting.status in ("in_progress", "finalizing"), waiting
            assert not waiting.errors and waiting.output_file_id is None
            assert waiting_for_disk(server, KEY_B) == 0  # A's wait is A's to see
            assert b.batches.retrieve(b_batch.id).status not in ("failed", "cancelled", "expired")

            make_room(data)
            until(lambda: waiting_for_disk(server, KEY_A) == 0, what="A's batch resumed")
            for client, batch, ids in ((a, a_batch, a_ids), (b, b_batch, b_ids)):
                done = wait_for(client, batch.id, lambda x: x.status == "completed", timeout=240)
                results = lines_of(client, done.output_file_id)
                assert sorted(r["custom_id"] for r in results) == ids  # each accepted line once
                assert done.error_file_id is None and done.request_counts.failed == 0
        finally:
            server.stop()
