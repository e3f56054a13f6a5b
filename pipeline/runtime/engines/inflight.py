"""An engine's in-flight window: how many requests are inside it at once, and how many leased rows it has yet to run.

The feeder (EngineWorker.serve) leases more work by the second number, not by rows leased: a chunk is staged only
when its slowest request ends, and with a realistic spread of output lengths most of a chunk's rows sit finished,
waiting for that one. Counting them as work to do starved the engine's continuous batch (the simulated cluster ran
its engines ~60% full), and counting them not at all would let them pile up without bound behind one long request:
rows held (leased, not yet staged) keep a ceiling of their own."""

from __future__ import annotations

import asyncio


class EngineWindow:
    def __init__(self, size: int | None) -> None:
        """`size`: requests inside the engine at once (None: no limit but the engine's own)."""
        self._slots = asyncio.Semaphore(size) if size else None
        self.to_run = 0  # rows leased that the engine has not finished
        self._wake_below: int | None = None
        self._changed = asyncio.Event()

    def leased(self, rows: int) -> None:
        self.to_run += rows

    def finished(self, rows: int) -> None:
        self.to_run -= rows
        if self._wake_below is not None and self.to_run < self._wake_below:
            self._changed.set()

    def for_chunk(self) -> ChunkSlots:
        return ChunkSlots(self)

    async def drops_below(self, rows: int) -> None:
        """Returns once fewer than `rows` leased rows are left to run."""
        while self.to_run >= rows:
            self._wake_below = rows
            self._changed.clear()
            try:
                await self._changed.wait()
            finally:
                self._wake_below = None


class ChunkSlots:
    """One chunk's way into the window, held per request by Engine.generate_all (`async with slots`): counts the
    chunk's requests as each one leaves the engine. `settle` counts the rest (requests that never went through a
    slot: run alone, isolated, or answered at once) when the chunk is done."""

    def __init__(self, window: EngineWindow) -> None:
        self._window = window
        self.finished = 0

    async def __aenter__(self) -> None:
        if self._window._slots is not None:
            await self._window._slots.acquire()

    async def __aexit__(self, *exc: object) -> None:
        if self._window._slots is not None:
            self._window._slots.release()
        self.finished += 1
        self._window.finished(1)

    def settle(self, rows: int) -> None:
        self._window.finished(rows - self.finished)
        self.finished = rows
