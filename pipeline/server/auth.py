"""API keys: read once at start from a file and/or the environment; a request's bearer key maps to an owner.

The owner stored with each file and batch is a hash of the key, never the key: the database on disk holds no
secret, and an object is visible only to the key that made it."""

from __future__ import annotations

import hashlib
import hmac
import os

from pipeline.config import ConfigError
from pipeline.server.settings import AuthSettings

# The owner of every object when the server runs with --no-auth.
ANONYMOUS = "anonymous"


class Keyring:
    def __init__(self, keys: list[str], disabled: bool) -> None:
        self._keys = [k.encode() for k in keys]
        self.disabled = disabled

    @classmethod
    def load(cls, auth: AuthSettings) -> Keyring:
        if auth.disabled:
            return cls([], disabled=True)
        keys: list[str] = []
        if auth.keys_file is not None:
            try:
                text = auth.keys_file.read_text()
            except OSError as exc:
                raise ConfigError(
                    f"API keys file {auth.keys_file} cannot be read ({exc.strerror or exc})"
                ) from exc
            keys += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        keys += [k.strip() for k in os.environ.get(auth.keys_env, "").split(",") if k.strip()]
        if not keys:
            raise ConfigError(
                f"no API keys: put them in a file (--api-keys-file) or ${auth.keys_env} (comma-separated), "
                "or pass --no-auth to listen on loopback without keys"
            )
        short = [k for k in keys if len(k) < 16]
        if short:
            raise ConfigError(f"{len(short)} API key(s) shorter than 16 characters: use long random keys")
        return cls(keys, disabled=False)

    def owner(self, authorization: str | None) -> str | None:
        """The owner for an `Authorization` header, or None when it carries no known key."""
        if self.disabled:
            return ANONYMOUS
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[len("Bearer ") :].strip().encode()
        # Compare against every key in constant time each, so timing tells nothing about which key is close.
        match = None
        for key in self._keys:
            if hmac.compare_digest(given, key):
                match = key
        return hashlib.sha256(match).hexdigest()[:32] if match else None
