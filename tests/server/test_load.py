"""A bounded load on the Batch API (loopback, fake engine): several clients each upload and submit small batches
while pollers hammer `GET /v1/batches/{id}` and `GET /v1/batches`. Nothing is lost — every batch completes with every
row once, in its own output file — and the latency of the GETs is reported (not asserted: speed targets live in
bench/)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.failure_figures import note
from tests.lines import chat_line
from tests.server.harness import KEY_A, KEY_B

pytestmark = [pytest.mark.timeout(600), pytest.mark.long]

CLIENTS = 3
BATCHES_PER_CLIENT = 2
ROWS = 6
POLLERS = 4


def test_many_small_batches_and_concurrent_polls_lose_nothing(server, tmp_path):
    keys = [KEY_A, KEY_B, KEY_A]
    clients = [openai.OpenAI(base_url=server.base_url, api_key=k, max_retries=0) for k in keys[:CLIENTS]]
    submitted: list[tuple[openai.OpenAI, str, list[str]]] = []
    lock = threading.Lock()

    def submit(n: int) -> None:
        client = clients[n]
        for b in range(BATCHES_PER_CLIENT):
            ids = [f"c{n}-b{b}-r{r}" for r in range(ROWS)]
            path = tmp_path / f"c{n}-b{b}.jsonl"
            path.write_text("".join(chat_line(i, f"question {i}") + "\n" for i in ids))
            uploaded = client.files.create(file=path.open("rb"), purpose="batch")
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            with lock:
                submitted.append((client, batch.id, ids))

    latencies: list[float] = []
    stop = threading.Event()

    def poll(n: int) -> None:
        client = clients[n % len(clients)]
        while not stop.is_set():
            with lock:
                mine = [b for c, b, _ in submitted if c is client]
            t0 = time.perf_counter()
            if mine and n % 2 == 0:
                client.batches.retrieve(mine[-1])
            else:
                client.batches.list(limit=20)
            with lock:
                latencies.append(time.perf_counter() - t0)

    pollers = [threading.Thread(target=poll, args=(n,), daemon=True) for n in range(POLLERS)]
    for p in pollers:
        p.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(submit, range(CLIENTS)))
    try:
        deadline = time.monotonic() + 480
        pending = {b for _, b, _ in submitted}
        while pending and time.monotonic() < deadline:
            for client, batch_id, _ in submitted:
                if batch_id in pending and client.batches.retrieve(batch_id).status in (
                    "completed",
                    "failed",
                    "cancelled",
                    "expired",
                ):
                    pending.discard(batch_id)
            time.sleep(0.5)
        assert not pending, f"batches not finished: {sorted(pending)}"
    finally:
        stop.set()
        for p in pollers:
            p.join(timeout=30)
    took = time.monotonic() - t0

    assert len(submitted) == CLIENTS * BATCHES_PER_CLIENT
    for client, batch_id, ids in submitted:
        batch = client.batches.retrieve(batch_id)
        assert batch.status == "completed", batch.errors
        assert (batch.request_counts.total, batch.request_counts.completed) == (ROWS, ROWS)
        rows = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in rows) == sorted(ids)  # its own rows, each once
        assert batch.error_file_id is None

    ordered = sorted(latencies)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    note(
        f"Batch API load: {len(submitted)} batches x {ROWS} rows from {CLIENTS} clients in {took:.1f} s; "
        f"{len(ordered)} GETs by {POLLERS} pollers meanwhile: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
    )
    assert len(ordered) > 10 * POLLERS  # the polls really ran alongside
