"""Request lines as users write them (the embedded model's name by default), and the JSONL a job reads and writes."""

from __future__ import annotations

import json
from pathlib import Path

MODEL_NAME = "smollm2-135m-instruct"


def chat_line(custom_id: str, content: str, **body) -> str:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def completion_line(custom_id: str, prompt: str, **body) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def read_jsonl(paths) -> list[dict]:
    rows = []
    for path in sorted(paths):
        # "\n" only: str.splitlines() also breaks at U+2028, U+0085 and friends, which JSON leaves unescaped.
        rows.extend(json.loads(line) for line in Path(path).read_text().split("\n") if line)
    return rows


def read_job_output(output: Path) -> tuple[dict[str, dict], dict[str, dict], dict]:
    """A finished job's OUTPUT: its result and error lines by custom_id, and its manifest."""
    results = {r["custom_id"]: r for r in read_jsonl(output.glob("results-*.jsonl"))}
    errors = {r["custom_id"]: r for r in read_jsonl(output.glob("errors-*.jsonl"))}
    return results, errors, json.loads((output / "manifest.json").read_text())
