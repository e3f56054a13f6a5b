"""An actor class for tests of code that waits on a restarting Ray actor (importable by Ray workers)."""

from __future__ import annotations

import os
import time
from pathlib import Path


class GatedRestart:
    """An actor whose restart waits for a gate file: a restart as slow as an engine actor's on a loaded node."""

    def __init__(self, gate: str, started: str) -> None:
        if os.path.exists(started):
            while not os.path.exists(gate):
                time.sleep(0.05)
        Path(started).write_text("up")

    def ready(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()
