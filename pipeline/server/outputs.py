"""A batch's output file (result lines) and error file (error lines), each served as one file.

A finished job's are its shards, concatenated in shard order (results stay sorted by custom_id). A batch cut short
(cancelled, expired) never finalized: its files are the rows its checkpoint holds, part after part — what finished,
nothing invented. Both are streamed in bounded pieces; nothing is loaded whole."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from pipeline.io.staging import StagingArea

KINDS = ("results", "errors")
CHUNK_BYTES = 1 << 20


def committed(out_dir: Path) -> bool:
    return (out_dir / "manifest.json").is_file()


def shards(out_dir: Path, kind: str) -> list[Path]:
    """A committed output's shard files of `kind`, in order."""
    manifest = json.loads((out_dir / "manifest.json").read_text())
    return [out_dir / shard["name"] for shard in manifest["shards"][kind]]


def output_rows(out_dir: Path, kind: str) -> int:
    """Rows in a batch's file of `kind`, committed or not."""
    if committed(out_dir):
        manifest = json.loads((out_dir / "manifest.json").read_text())
        return sum(shard["rows"] for shard in manifest["shards"][kind])
    staging = StagingArea(out_dir)
    return staging.count(kind) if staging.exists() else 0


def output_bytes(out_dir: Path, kind: str) -> int:
    return sum(len(piece) for piece in iter_output(out_dir, kind))


def iter_output(out_dir: Path, kind: str) -> Iterator[bytes]:
    assert kind in KINDS
    if committed(out_dir):
        for shard in shards(out_dir, kind):
            with open(shard, "rb") as f:
                while piece := f.read(CHUNK_BYTES):
                    yield piece
        return
    staging = StagingArea(out_dir)
    if not staging.exists():
        return
    for part in staging.parts(kind):
        records = staging.read_part(part, ["record"]).column("record").to_pylist()
        yield "".join(r + "\n" for r in records).encode()
