"""A batch through `nightshift serve` with the official `openai` client, nothing else: upload an input that expires,
create a batch whose output files expire, poll it, print its `model` and `usage` and each file's `expires_at`, and
download its results (and its error lines, if any).

    nightshift serve --port 8000 --api-keys-file keys &
    NIGHTSHIFT_API_KEY=... python examples/batch_api_client.py [--input examples/chat.jsonl] [--output results.jsonl]

Only the base URL and the key say it is nightshift: the same script runs against OpenAI's Batch API with
`--base-url https://api.openai.com/v1` and an input naming a model OpenAI serves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import openai

FINAL = ("completed", "failed", "cancelled", "expired")
HOUR = 3600
DAY = 24 * HOUR


def when(stamp: int | None) -> str:
    """A file's expires_at as the API gives it (Unix seconds) and as a date; null means kept until deleted."""
    if stamp is None:
        return "None (kept until deleted)"
    return f"{stamp} ({datetime.fromtimestamp(stamp, timezone.utc):%Y-%m-%d %H:%M:%S} UTC)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base-url",
        default=os.environ.get("NIGHTSHIFT_BASE_URL", "http://127.0.0.1:8000/v1"),
        help="the server's /v1 URL (default: $NIGHTSHIFT_BASE_URL or http://127.0.0.1:8000/v1)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("NIGHTSHIFT_API_KEY"),
        help="one of the server's API keys (default: $NIGHTSHIFT_API_KEY)",
    )
    parser.add_argument(
        "--input", type=Path, default=Path(__file__).with_name("chat.jsonl"), help="OpenAI Batch JSONL input"
    )
    parser.add_argument(
        "--output", type=Path, default=Path("results.jsonl"), help="where the result lines go"
    )
    parser.add_argument("--endpoint", default="/v1/chat/completions", help="the batch's endpoint")
    # OpenAI's bounds for both: one hour to 30 days, counted from each file's created_at.
    parser.add_argument("--expires-after", type=int, default=DAY, help="seconds the uploaded input is kept")
    parser.add_argument(
        "--output-expires-after",
        type=int,
        default=7 * DAY,
        help="seconds the output and error files are kept",
    )
    parser.add_argument("--poll-seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    if not args.api_key:
        parser.error("give an API key: --api-key or $NIGHTSHIFT_API_KEY")

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)

    with args.input.open("rb") as source:
        uploaded = client.files.create(
            file=source,
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": args.expires_after},
        )
    print(f"input file {uploaded.id}: {uploaded.filename}, {uploaded.bytes} bytes, status {uploaded.status}")
    if uploaded.status_details:
        print(f"  status_details: {uploaded.status_details}")
    print(f"  expires_at: {when(uploaded.expires_at)}")

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=args.endpoint,
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": args.output_expires_after},
    )
    print(f"batch {batch.id}: {batch.status}")
    shown = batch.status
    while batch.status not in FINAL:
        time.sleep(args.poll_seconds)
        batch = client.batches.retrieve(batch.id)
        counts = batch.request_counts  # live while the batch runs
        progress = batch.status
        if counts is not None and counts.total:
            progress += f" {counts.completed + counts.failed}/{counts.total}"
        if batch.status not in FINAL and progress != shown:
            print(f"batch {batch.id}: {progress}")
            shown = progress

    counts = batch.request_counts
    print(
        f"batch {batch.id}: {batch.status}, {counts.completed} completed, {counts.failed} failed of {counts.total}"
    )
    if batch.errors and batch.errors.data:
        for error in batch.errors.data:
            print(f"  error: {error.code} line {error.line}: {error.message}")
    print(f"model: {batch.model}")
    usage = batch.usage
    if usage is not None:
        print(
            f"usage: input_tokens={usage.input_tokens} "
            f"(cached {usage.input_tokens_details.cached_tokens}), output_tokens={usage.output_tokens} "
            f"(reasoning {usage.output_tokens_details.reasoning_tokens}), total_tokens={usage.total_tokens}"
        )
    else:
        print("usage: None")

    for label, file_id, path in (
        ("output", batch.output_file_id, args.output),
        ("error", batch.error_file_id, args.output.with_name(args.output.stem + ".errors.jsonl")),
    ):
        if file_id is None:
            continue
        info = client.files.retrieve(file_id)
        content = client.files.content(file_id).content
        path.write_bytes(content)
        lines = content.count(b"\n")
        print(f"{label} file {file_id}: {lines} lines -> {path}")
        print(f"  expires_at: {when(info.expires_at)}")
    return 0 if batch.status == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
