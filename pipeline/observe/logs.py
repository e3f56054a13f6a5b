"""structlog setup: readable lines on a terminal, one JSON object per line with --log-format json."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator

import structlog


def configure_logging(log_format: str = "console", level: str = "info") -> None:
    numeric = getattr(logging, level.upper(), logging.INFO)
    renderer: structlog.typing.Processor
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # Logs go to stderr so stdout stays the summary a script can parse.
        # Looked up per call, not bound once: whoever swaps sys.stderr (test runners, wrappers) gets the logs.
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )


# sys.stderr's stand-in while fd 2 is quieted: opened once per process, kept open for good.
_PYTHON_STDERR: io.TextIOWrapper | None = None


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Send what native code writes to file descriptor 2 to /dev/null for the block; Python's `sys.stderr` (our logs,
    warnings, tracebacks, other threads included) keeps writing to the terminal.

    For Ray's start in the driver: its C++ core announces a RAY_BACKEND_LOG_LEVEL it finds in the environment on
    stderr (a `logging.cc` line), with no way to turn just that announcement off.
    """
    global _PYTHON_STDERR
    try:
        python_on_fd2 = sys.stderr is not None and sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # replaced by a test runner or wrapper: not on fd 2
        python_on_fd2 = False
    saved_fd2 = os.dup(2)
    original = sys.stderr
    if python_on_fd2:
        if _PYTHON_STDERR is None:
            # Never closed: a thread may still hold it after the block (one descriptor per process, reused).
            _PYTHON_STDERR = open(  # noqa: SIM115
                os.dup(saved_fd2), "w", buffering=1, encoding=original.encoding, errors="backslashreplace"
            )
        original.flush()
        sys.stderr = _PYTHON_STDERR
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved_fd2, 2)
        os.close(saved_fd2)
        if python_on_fd2:
            sys.stderr.flush()
            sys.stderr = original
