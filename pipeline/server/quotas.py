"""Quotas per key: what each key holds (stored bytes, files) and has unfinished (batches), against its limits.

A key's limits are the server config's `quotas` with the fields its label overrides (settings.QuotaSettings; the
label comes from the keys file, server/auth.py). What a key holds is read from the store when a request would add
to it — `stored_usage` is the one place that says what counts: the rows of the files table not deleted, uploads
and batch output and error files alike, so anything that deletes a file (a client's DELETE, a retention sweep)
frees its bytes for the next check. An output file is counted once its batch has ended and registered it. What a
key holds on disk beyond its files' rows comes as `pending` bytes (server/disk_use.py): its uploads still arriving
(their declared size) and its batches' checkpoints and leftovers (running, paused, failed: everything under a batch
folder that no file row counts), until the batch's folder is purged.

Over a limit, a request is refused with OpenAI's error body and an error that names the limit: 400 for what a key
stores (as OpenAI refuses an upload past its file storage limit), 429 for batches enqueued (a limit that frees as
batches end). The running-batches limit refuses nothing: the scheduler holds a key's extra batches back
(server/scheduling.py).

The checks run in the API's event loop with no await between a check and the insert it guards, so two requests of
one key cannot both pass a check that only one of them fits."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import ConfigError
from pipeline.server.schemas import FINAL_STATUSES
from pipeline.server.settings import Quota, QuotaSettings
from pipeline.server.store import Store


class QuotaExceeded(Exception):
    """A request over one of its key's limits: the HTTP status and OpenAI error fields to answer with."""

    def __init__(self, status: int, message: str, code: str, param: str | None, type: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type


@dataclass(frozen=True)
class Usage:
    files: int
    bytes: int


def stored_usage(store: Store, owner: str, pending: int = 0) -> Usage:
    """What a key holds: its files not deleted (uploads and batch outputs), counted and summed, and `pending`
    bytes it holds outside them (uploads in progress, batches' checkpoints)."""
    files, size = store.owner_files_usage(owner)
    return Usage(files=files, bytes=size + pending)


def unfinished_batches(store: Store, owner: str) -> int:
    """A key's batches not in a final status: waiting, running, paused, finalizing or cancelling."""
    return sum(n for status, n in store.batch_status_counts(owner).items() if status not in FINAL_STATUSES)


class Quotas:
    """Each owner's limits, resolved once at start from the config and the keys' labels."""

    def __init__(self, settings: QuotaSettings, labels: dict[str, str]) -> None:
        """`labels`: owner -> label, the keys that carry one (Keyring.labels). Every label the config names must
        be one of them: a typo would silently leave a key on the defaults."""
        known = set(labels.values())
        unknown = sorted(set(settings.keys) - known)
        if unknown:
            have = f"the keys' labels are {', '.join(sorted(known))}" if known else "no key carries a label"
            raise ConfigError(
                f"quotas.keys.{unknown[0]}: no API key carries the label {unknown[0]!r} ({have}); write the key's "
                f"line in the keys file as `KEY {unknown[0]}`, or fix the name under quotas.keys"
            )
        self.default = settings.for_label(None)
        self._by_owner = {owner: settings.for_label(label) for owner, label in labels.items()}

    def of(self, owner: str) -> Quota:
        return self._by_owner.get(owner, self.default)

    # -- the checks -------------------------------------------------------------------------------------------
    def check_upload(self, store: Store, owner: str, size: int, pending: int = 0) -> None:
        """Before an upload of `size` bytes is kept (0: before its body is read, only what it cannot pass);
        `pending`: what the key holds outside its files' rows (stored_usage)."""
        quota = self.of(owner)
        if quota.max_files is None and quota.max_stored_bytes is None:
            return
        held = stored_usage(store, owner, pending)
        if quota.max_files is not None and held.files + 1 > quota.max_files:
            raise QuotaExceeded(
                400,
                f"This key has reached its file count limit (max_files: {quota.max_files}); it holds {held.files} "
                "files, batch output files included. Delete files it no longer needs.",
                "file_count_limit_exceeded",
                "file",
                "invalid_request_error",
            )
        if quota.max_stored_bytes is not None and (
            held.bytes + size > quota.max_stored_bytes or held.bytes >= quota.max_stored_bytes
        ):
            raise QuotaExceeded(
                400,
                f"This key has exceeded its file storage limit (max_stored_bytes: {quota.max_stored_bytes} bytes); "
                f"it holds {held.bytes} bytes, batch output files, running batches' checkpoints and uploads in "
                "progress included"
                + (f", and this file is {size} more" if size else "")
                + ". Delete files it no longer needs or upload a smaller file.",
                "storage_limit_exceeded",
                "file",
                "invalid_request_error",
            )

    def check_batch(self, store: Store, owner: str, pending: int = 0) -> None:
        """Before a batch is created: room in the key's queue, and room for its output files; `pending`: what the
        key holds outside its files' rows (stored_usage)."""
        quota = self.of(owner)
        if quota.max_queued_batches is not None:
            enqueued = unfinished_batches(store, owner)
            if enqueued >= quota.max_queued_batches:
                raise QuotaExceeded(
                    429,
                    f"This key has reached its limit of enqueued batches (max_queued_batches: "
                    f"{quota.max_queued_batches}); it has {enqueued} batches not yet finished. Try again once "
                    "some of them have completed.",
                    "queued_batches_limit_exceeded",
                    None,
                    "requests",
                )
        if quota.max_stored_bytes is not None:
            held = stored_usage(store, owner, pending)
            if held.bytes >= quota.max_stored_bytes:
                raise QuotaExceeded(
                    400,
                    f"This key is at its file storage limit (max_stored_bytes: {quota.max_stored_bytes} bytes; it "
                    f"holds {held.bytes}), and a batch's output files need room. Delete files it no longer needs.",
                    "storage_limit_exceeded",
                    "input_file_id",
                    "invalid_request_error",
                )
