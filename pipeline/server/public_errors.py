"""What a batch's `errors` may tell its owner: the one-line reason, without the server's insides.

A job that fails says why in one line (`error: …`, what `nightshift run` prints last), and the runner's own
failures are exceptions. Either may name the server's files (the data dir, the Python install, a home directory)
or carry a traceback and exception class names: the operator's business, not the tenant's. The owner gets the
reason with every path under the data dir made relative to it (the batch's own ids, nothing more), every other
server path replaced by `<path>`, and no traceback or class name; the full text stays in the batch's `job.log`.

A path is a server path when its first directory exists on this machine: `/v1/chat/completions` (an endpoint) or a
URL's path is left alone, `/home/…` or `/usr/lib/python3/…` is not."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

MAX_MESSAGE_CHARS = 500
HIDDEN_PATH = "<path>"

# `ValueError: `, `ray.exceptions.RayTaskError(ValueError): `, repeated: the class names in front of a message.
_CLASS_PREFIX = re.compile(
    r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Failure)(?:\([\w.]*\))?:\s*)+"
)
# An absolute path: a slash not inside a word, a URL or a relative path, up to a separator a message puts after it.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\"`,;:()\[\]{}<>|]*")
_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


def public_message(text: str, data_dir: Path) -> str:
    """`text` fit for a batch's `errors`: one line, no tracebacks, no class names, no server paths."""
    message = _CLASS_PREFIX.sub("", _reason_line(text)).strip()
    for prefix in _data_dir_prefixes(data_dir):
        message = message.replace(prefix + os.sep, "").replace(prefix, "the data dir")
    message = _ABSOLUTE_PATH.sub(_hide_server_path, message)
    message = _OBJECT_REPR.sub("<object>", message)
    message = " ".join(message.split()) or "the batch failed; the server's operator has the details"
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 1] + "…"


def _reason_line(text: str) -> str:
    """A traceback's last line (the exception and its message), else the first line."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        unindented = [line for line in lines if not line[0].isspace() and not line.startswith("Traceback")]
        return unindented[-1] if unindented else ""
    return lines[0]


def _data_dir_prefixes(data_dir: Path) -> list[str]:
    found = {str(data_dir.resolve())}
    if data_dir.is_absolute():
        found.add(str(data_dir))
    return sorted((p.rstrip(os.sep) for p in found if p.rstrip(os.sep)), key=len, reverse=True)


def _hide_server_path(match: re.Match) -> str:
    path = match.group(0)
    return HIDDEN_PATH if _is_server_path(path) else path


def _is_server_path(path: str) -> bool:
    top = path.lstrip("/").split("/", 1)[0]
    return top != "" and _top_directory_exists(top)


@functools.lru_cache(maxsize=256)
def _top_directory_exists(name: str) -> bool:
    return os.path.isdir("/" + name)
