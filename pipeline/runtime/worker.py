"""The engine actor: a Ray Data callable class that hosts one engine and runs batches of requests through it.

Ray Data calls `__call__` with a batch of rows; several calls overlap on one actor (actor `max_concurrency` and
`max_tasks_in_flight_per_actor`), so the engine always has about 2 x max_num_seqs requests in flight and its
continuous batching stays full across batch boundaries. Each call returns its rows as finished output lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from pipeline.engines.base import Engine, EngineRequest, EngineResult, EngineSpec, build_engine
from pipeline.protocol import dumps, result_record

OUTPUT_COLUMNS = (
    "custom_id",
    "line",
    "source",
    "error_code",
    "prompt_tokens",
    "completion_tokens",
    "pool",
    "record",
)


def result_columns(results: list[EngineResult], rows: list[dict[str, Any]], pool: str) -> dict[str, list]:
    """Shape finished results as staged-row columns (see io.staging.STAGED_SCHEMA)."""
    out: dict[str, list] = {name: [] for name in OUTPUT_COLUMNS}
    for result, row in zip(results, rows, strict=True):
        out["custom_id"].append(result.custom_id)
        out["line"].append(int(row["line"]))
        out["source"].append(str(row["source"]))
        out["error_code"].append(result.error_code.value if result.error_code else None)
        out["prompt_tokens"].append(result.prompt_tokens)
        out["completion_tokens"].append(result.completion_tokens)
        out["pool"].append(pool)
        out["record"].append(dumps(result_record(result.custom_id, result.body, result.status_code)))
    return out


class EngineWorker:
    """One engine per actor, started lazily inside the actor's event loop (vLLM binds its tasks to that loop)."""

    def __init__(self, spec: EngineSpec, pool: str = "default", monitor: Any = None) -> None:
        self.spec = spec
        self.pool = pool
        self.monitor = monitor  # optional Ray actor handle that collects engine stats for the driver
        self.engine: Engine | None = None
        self._starting: asyncio.Lock | None = None
        self._last_report = 0.0
        self.actor_id = f"{pool}-{os.getpid()}"

    async def _engine(self) -> Engine:
        if self.engine is None:
            if self._starting is None:
                self._starting = asyncio.Lock()
            async with self._starting:
                if self.engine is None:
                    engine = build_engine(self.spec)
                    await engine.start()
                    self.engine = engine
                    self._report(force=True)
        return self.engine

    def _report(self, force: bool = False) -> None:
        if self.monitor is None or self.engine is None:
            return
        now = time.monotonic()
        if force or now - self._last_report > 2.0:
            self._last_report = now
            stats = self.engine.stats()
            info = {
                "pool": self.pool,
                "stats": stats.__dict__,
                "effective_args": self.engine.effective_args(),
                "sampling_defaults": self.engine.sampling_defaults(),
            }
            self.monitor.report.remote(self.actor_id, info)

    def __del__(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        engine = await self._engine()
        rows = [dict(zip(batch.keys(), values, strict=True)) for values in zip(*batch.values(), strict=True)]
        requests = [EngineRequest(str(r["custom_id"]), str(r["url"]), json.loads(r["body"])) for r in rows]
        results = await asyncio.gather(*(engine.generate(req) for req in requests))
        self._report()
        return result_columns(list(results), rows, self.pool)
