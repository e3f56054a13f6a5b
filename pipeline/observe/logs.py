"""structlog setup: readable lines on a terminal, one JSON object per line with --log-format json."""

from __future__ import annotations

import logging
import sys

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
