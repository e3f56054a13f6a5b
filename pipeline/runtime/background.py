"""A thread for driver-side work that overlaps something slower (Ray's start-up, the engines' start)."""

from __future__ import annotations

import threading
from typing import Any


class InBackground:
    """Run a function on a daemon thread (a Ctrl-C must not wait for it); `result()` joins and re-raises."""

    def __init__(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def target() -> None:
            try:
                self._value = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
                self._error = exc

        self._thread = threading.Thread(
            target=target, name=getattr(fn, "__name__", "background"), daemon=True
        )
        self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Whether it has finished, waiting at most `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
