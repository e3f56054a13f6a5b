"""A batch's committed output, as a job's finalize leaves it, for the server tests that drive the runner by hand."""

from __future__ import annotations

import json
from pathlib import Path


def commit_output(out: Path, results: int = 3, errors: int = 1) -> list[Path]:
    """A committed job output as the job's finalize leaves it: shards, then manifest.json."""
    out.mkdir(parents=True, exist_ok=True)
    shards = {"results": [], "errors": []}
    written = []
    for kind, rows in (("results", results), ("errors", errors)):
        name = f"{kind}-00000-of-00001.jsonl"
        (out / name).write_text("".join(json.dumps({"custom_id": f"{kind}-{i}"}) + "\n" for i in range(rows)))
        shards[kind].append({"name": name, "rows": rows})
        written.append(out / name)
    (out / "manifest.json").write_text(json.dumps({"shards": shards}))
    return [*written, out / "manifest.json"]
