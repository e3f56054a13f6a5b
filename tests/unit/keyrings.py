"""A server's Keyring, loaded from a keys file's text and, for keys from the environment, $TEST_KEYS."""

from __future__ import annotations

from pipeline.server.auth import Keyring
from pipeline.server.settings import AuthSettings


def ring(tmp_path, text: str, monkeypatch, env: str = "") -> Keyring:
    keys = tmp_path / "keys"
    keys.write_text(text)
    monkeypatch.setenv("TEST_KEYS", env)
    return Keyring.load(AuthSettings(keys_file=keys, keys_env="TEST_KEYS"))
