"""Local objects called the way Ray actor handles are, for unit tests of code that talks to actors."""

from __future__ import annotations

from typing import Any


class as_actor:  # noqa: N801 - reads as a function at the call site
    """A local object called the way a Ray actor handle is (`handle.method.remote(...)`), for unit tests of code
    that talks to actors: the call runs in place (an async method's coroutine is what the caller awaits)."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._target, name)
        return type("Method", (), {"remote": staticmethod(method)})
