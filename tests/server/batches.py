"""Batches of the server tests through the official `openai` client: an input file (with a bad line and a duplicate
custom_id by default), polling a batch or any condition, a file's lines, and what a key has stored on disk."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.lines import chat_line, completion_line
from tests.server.harness import Server

FINAL = ("completed", "failed", "cancelled", "expired")


def write_input(path: Path, rows: int, bad: bool = True, **body) -> Path:
    lines = [chat_line(f"req-{i:04d}", f"question {i}", **body) for i in range(rows)]
    if bad:
        lines += ["{not json", completion_line("req-0001", "a duplicate custom_id")]
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_for(client, batch_id: str, until, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} stuck at {batch.status} {batch.request_counts}")


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def stored(server: Server, key: str) -> dict[str, tuple[float, float]]:
    """The caller's (files, bytes) on disk per purpose, from GET /metrics."""
    text = httpx.get(
        server.base_url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {key}"}
    )
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text.text):
        if family.name in ("nightshift_server_stored_files", "nightshift_server_stored_bytes"):
            for sample in family.samples:
                slot = 0 if family.name.endswith("files") else 1
                found.setdefault(sample.labels["purpose"], [0.0, 0.0])[slot] = sample.value
    return {purpose: (files, size) for purpose, (files, size) in found.items()}


def until(check, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.3)
    raise AssertionError(f"{what} not reached within {timeout} s")
