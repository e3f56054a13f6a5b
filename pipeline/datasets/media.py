"""A dataset row's image or audio cell as the URLs a request carries.

    media_urls(b"\\x89PNG...", "photo", root=None)            # ["data:image/png;base64,iVBOR..."]
    media_urls("shots/cat.png", "photo", root="/data/shop")   # ["file:///data/shop/shots/cat.png"]
    media_urls(["https://x/a.png", "b.png"], "photo", root)   # a list column: several, in order

A cell holds bytes (the file itself: sent inline as a `data:` URL, so the row carries it through the work queue),
a URL (`http(s)://`, `data:`, `file://`: as it is; the engine fetches it under the job's media policy), or a local
path (absolute, or under `root`: the input's directory unless `dataset.media_root` says otherwise), a Hugging Face
datasets Image or Audio cell (`{bytes, path}`), or a list of those. Anything else — null, an empty list, a number — is the row's error, never the job's.

Pure: no Ray, no vLLM.
"""

from __future__ import annotations

import base64
import posixpath
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import quote

_URL_PREFIXES = ("http://", "https://", "data:", "file://")
# Media types by their files' first bytes (what a `data:` URL names; vLLM's decoders read the bytes themselves).
_MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", 0, "image/png"),
    (b"\xff\xd8\xff", 0, "image/jpeg"),
    (b"GIF8", 0, "image/gif"),
    (b"WEBP", 8, "image/webp"),
    (b"BM", 0, "image/bmp"),
    (b"WAVE", 8, "audio/wav"),
    (b"fLaC", 0, "audio/flac"),
    (b"OggS", 0, "audio/ogg"),
    (b"ID3", 0, "audio/mpeg"),
    (b"\xff\xfb", 0, "audio/mpeg"),
)


class MediaCellError(ValueError):
    """A row's media cell that makes no URL: the row's error."""


def media_urls(value: Any, column: str, root: str | None) -> list[str]:
    """The URLs of one row's media cell (see the module's docstring)."""
    items = list(value) if isinstance(value, list | tuple) else [value]
    if not items:
        raise MediaCellError(f"column {column!r} is an empty list in this row: it holds no media")
    return [_url(item, column, root) for item in items]


def _url(item: Any, column: str, root: str | None) -> str:
    if isinstance(item, dict) and ("bytes" in item or "path" in item):
        # A Hugging Face datasets Image or Audio column: {bytes, path}, the bytes when it holds them.
        item = item.get("bytes") or item.get("path")
    if isinstance(item, bytes | bytearray | memoryview):
        data = bytes(item)
        if not data:
            raise MediaCellError(f"column {column!r} holds empty bytes in this row")
        return f"data:{media_type(data)};base64,{base64.b64encode(data).decode('ascii')}"
    if isinstance(item, str) and item.strip():
        text = item.strip()
        if text[:8].lower().startswith(_URL_PREFIXES):
            return text
        if "://" in text[:16]:
            raise MediaCellError(
                f"column {column!r} holds {text[:60]!r} in this row: a media URL is http(s)://, data: or file://"
            )
        return _file_url(text, column, root)
    if item is None:
        raise MediaCellError(f"column {column!r} is null in this row: it holds no media")
    raise MediaCellError(
        f"column {column!r} holds a {type(item).__name__} in this row: media is bytes, a path or a URL"
    )


def _file_url(path: str, column: str, root: str | None) -> str:
    given = PurePosixPath(path)
    if not given.is_absolute():
        if root is None:
            raise MediaCellError(
                f"column {column!r} holds the relative path {path!r}, and the input is not on local disk: give "
                "dataset.media_root (--media-root), the directory the paths are under, or absolute paths"
            )
        given = PurePosixPath(root) / given
    return "file://" + quote(posixpath.normpath(str(given)))


def media_type(data: bytes) -> str:
    for magic, offset, kind in _MAGIC:
        if data[offset : offset + len(magic)] == magic:
            return kind
    return "application/octet-stream"


def input_media_root(input_location: str | None) -> str | None:
    """Where relative media paths are by default: the directory of a local input (the directory itself, a file's
    directory, a glob's directory before its first wildcard); None for an input on S3 or HTTP."""
    import os

    from pipeline.io.locations import GLOB_CHARS, LocationError, parse_location

    if not input_location:
        return None
    try:
        location = parse_location(input_location)
    except LocationError:
        return None
    if location.kind != "local":
        return None
    path = os.path.abspath(location.path)
    if location.has_glob():
        cut = min(path.index(c) for c in GLOB_CHARS if c in path)
        return os.path.dirname(path[:cut]) or "/"
    return path if os.path.isdir(path) else os.path.dirname(path)
