"""`/healthz` and `/readyz` on the running server: no key needed, ready once the state database takes a write and
its Ray answers (the checks' failures are in tests/unit/test_server_security.py)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.timeout(60)


def test_health_and_readiness_answer_without_a_key(server):
    root = server.base_url.removesuffix("/v1")
    assert httpx.get(f"{server.base_url}/batches", timeout=10).status_code == 401
    live = httpx.get(f"{root}/healthz", timeout=10)
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    ready = httpx.get(f"{root}/readyz", timeout=10)
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "checks": {"database": "ok", "ray": "ok"}}
