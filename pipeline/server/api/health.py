"""`GET /healthz` and `GET /readyz`, without a key: probes carry none (the checks and what they mean are
server/health.py's)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from pipeline.server import health
from pipeline.server.api.deps import Service

router = APIRouter()


@router.get("/healthz", include_in_schema=False)
def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/readyz", include_in_schema=False)
def readyz(service: Service) -> JSONResponse:
    problems = {"database": health.database_readiness(service.data.database), "ray": health.ray_problem()}
    checks = {name: problem or "ok" for name, problem in problems.items()}
    if any(problems.values()):
        return JSONResponse({"status": "unavailable", "checks": checks}, status_code=503)
    return JSONResponse({"status": "ok", "checks": checks})
