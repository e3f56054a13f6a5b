"""One `nightshift serve` (fake engine, two API keys) shared by the server tests: Ray and Serve start once."""

from __future__ import annotations

import pytest

from tests.server.harness import JOB, KEY_A, KEY_B, Server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("server"), JOB)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client_a(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key=KEY_A, max_retries=0)


@pytest.fixture(scope="session")
def client_b(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key=KEY_B, max_retries=0)
