"""API keys: read once at start from a file and/or the environment; a request's bearer key maps to an owner.

The owner stored with each file and batch is a hash of the key, never the key: the database on disk holds no
secret, and an object is visible only to the key that made it.

A key may carry a label (`KEY LABEL` on its line, or in the variable's comma-separated list): the name the server
config uses for it (quotas.keys), so the config holds no secret. The label is not the owner: relabelling a key keeps
its files and batches."""

from __future__ import annotations

import hashlib
import hmac
import os
import re

from pipeline.config import ConfigError
from pipeline.server.settings import LABEL_PATTERN, AuthSettings, KeyDigest

# The owner of every object when the server runs with --no-auth.
ANONYMOUS = "anonymous"


def owner_of(key: str | bytes) -> str:
    """The owner a key maps to: what the store keeps instead of the key."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()[:32]


def parse_key(entry: str, where: str) -> tuple[str, str | None]:
    """`KEY` or `KEY LABEL` → (key, label or None). `where` names the entry in a message, which never quotes the
    entry itself: it holds a secret."""
    parts = entry.split()
    if len(parts) > 2:
        raise ConfigError(
            f"{where}: expected `KEY` or `KEY LABEL`, found {len(parts)} words (a key holds no spaces)"
        )
    if len(parts) == 2 and not re.match(LABEL_PATTERN, parts[1]):
        raise ConfigError(
            f"{where}: the label after the key must be 1-64 letters, digits, '.', '_' or '-' (starting with a "
            "letter or digit)"
        )
    return parts[0], parts[1] if len(parts) == 2 else None


def digest_of(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class Keyring:
    """The keys a server accepts, held as their SHA-256 digests only: a request's key is hashed and compared."""

    def __init__(self, keys: list[str], disabled: bool, labels: dict[str, str] | None = None) -> None:
        self._digests = [digest_of(k) for k in keys]
        self.disabled = disabled
        self.labels = labels or {}  # owner -> label, for the keys that carry one

    @property
    def count(self) -> int:
        return len(self._digests)

    def as_digests(self) -> list[KeyDigest]:
        """The keyring as configuration that holds no key (AuthSettings.key_digests)."""
        return [KeyDigest(sha256=d.hex(), label=self.labels.get(_owner_of_digest(d))) for d in self._digests]

    @classmethod
    def load(cls, auth: AuthSettings) -> Keyring:
        if auth.disabled:
            return cls([], disabled=True)
        entries: list[tuple[str, str | None]] = []
        if auth.keys_file is not None:
            try:
                text = auth.keys_file.read_text()
            except OSError as exc:
                raise ConfigError(
                    f"API keys file {auth.keys_file} cannot be read ({exc.strerror or exc})"
                ) from exc
            for number, line in enumerate(text.splitlines(), 1):
                if line.strip() and not line.strip().startswith("#"):
                    entries.append(parse_key(line, f"API keys file {auth.keys_file}, line {number}"))
        listed = [k for k in os.environ.get(auth.keys_env, "").split(",") if k.strip()]
        entries += [parse_key(k, f"${auth.keys_env}, entry {i}") for i, k in enumerate(listed, 1)]
        if not entries and auth.key_digests:
            return cls._from_digests(auth.key_digests)
        if not entries:
            raise ConfigError(
                f"no API keys: put them in a file (--api-keys-file) or ${auth.keys_env} (comma-separated), "
                "or pass --no-auth to listen on loopback without keys"
            )
        short = [k for k, _ in entries if len(k) < 16]
        if short:
            raise ConfigError(f"{len(short)} API key(s) shorter than 16 characters: use long random keys")
        keyring = cls([k for k, _ in entries], disabled=False, labels=_labels(entries))
        if auth.key_digests:
            given = cls._from_digests(auth.key_digests)
            keyring._digests += [d for d in given._digests if d not in keyring._digests]
            for owner, label in given.labels.items():
                if keyring.labels.setdefault(owner, label) != label:
                    raise ConfigError(
                        f"one API key carries two labels, {keyring.labels[owner]!r} and {label!r}: keep one"
                    )
        return keyring

    @classmethod
    def _from_digests(cls, digests: list[KeyDigest]) -> Keyring:
        keyring = cls([], disabled=False)
        keyring._digests = [bytes.fromhex(d.sha256) for d in digests]
        keyring.labels = {_owner_of_digest(bytes.fromhex(d.sha256)): d.label for d in digests if d.label}
        return keyring

    def owner(self, authorization: str | None) -> str | None:
        """The owner for an `Authorization` header, or None when it carries no known key."""
        if self.disabled:
            return ANONYMOUS
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = digest_of(authorization[len("Bearer ") :].strip())
        # Compare against every key in constant time each, so timing tells nothing about which key is close.
        match = None
        for digest in self._digests:
            if hmac.compare_digest(given, digest):
                match = digest
        return _owner_of_digest(match) if match else None


def _owner_of_digest(digest: bytes) -> str:
    """owner_of(key), from the key's digest."""
    return digest.hex()[:32]


def _labels(entries: list[tuple[str, str | None]]) -> dict[str, str]:
    """owner -> label; one label names one key, and a key listed twice carries one label."""
    labels: dict[str, str] = {}
    keys_of: dict[str, str] = {}
    for key, label in entries:
        if label is None:
            continue
        owner = owner_of(key)
        if keys_of.setdefault(label, owner) != owner:
            raise ConfigError(
                f"the label {label!r} is given to two different API keys: give each key its own"
            )
        if labels.setdefault(owner, label) != label:
            raise ConfigError(
                f"one API key carries two labels, {labels[owner]!r} and {label!r}: keep one (quotas.keys names it)"
            )
    return labels
