"""`BatchService`: what the API's requests act on — the state, the runner, the sweeper and who may call — for the
life of one server (one Serve replica, or a test's app)."""

from __future__ import annotations

import structlog

from pipeline.server.auth import Keyring
from pipeline.server.datadir import DataDirLock, make_private, private_umask
from pipeline.server.disk_use import BatchFolders, UploadsInFlight
from pipeline.server.quotas import Quotas
from pipeline.server.retention import Sweeper
from pipeline.server.runner import BatchRunner, DataDir
from pipeline.server.settings import Quota, ServerConfig
from pipeline.server.store import Store

log = structlog.get_logger(__name__)


def unlimited_shared_quotas(config: ServerConfig, keys: int) -> list[str]:
    """The quotas no key has while several keys share the server (none when one key, or none, is configured)."""
    if keys < 2:
        return []
    every = [config.quotas, *config.quotas.keys.values()]
    limits = [name for name in Quota.model_fields if name != "weight"]
    return [name for name in limits if all(getattr(quota, name, None) is None for quota in every)]


class BatchService:
    """Everything a request needs: the state, the runner and who may call.

    It holds the data dir's lock from before the database opens until `stop` (or its process's end): a second
    service on the same dir is refused (server/datadir.py), after waiting `lock_wait` seconds for the holder to go —
    a Serve replica's predecessor may still be in its graceful shutdown."""

    def __init__(self, config: ServerConfig, ray_address: str | None, lock_wait: float = 0.0) -> None:
        self.config = config
        self.keyring = Keyring.load(config.auth)
        self.quotas = Quotas(config.quotas, self.keyring.labels)
        self.uploads = UploadsInFlight(config.limits.max_concurrent_uploads_per_key)
        if unlimited := unlimited_shared_quotas(config, self.keyring.count):
            log.warning(
                f"{self.keyring.count} API keys share this server with no limit on {', '.join(unlimited)} for any "
                "of them: "
                "one key's uploads and batches can take the disk and the engines from the others; set them under "
                "`quotas` in the server config"
            )
        self.lock = DataDirLock.acquire(config.data_dir, lock_wait)
        try:
            self.data = DataDir(config.data_dir)
            self.data.create()
            self.store = Store(self.data.database)
            # Data dirs of servers that kept it world-readable, and files made before the umask below applied.
            if changed := make_private(config.data_dir):
                log.info("data dir made private", data_dir=str(config.data_dir), entries=changed)
            self.runner = BatchRunner(config, self.store, self.data, ray_address, self.quotas)
            self.batch_folders = BatchFolders(self.store, self.data.batch)
            self.sweeper = Sweeper(self.store, self.data, config.retention.sweep_seconds)
            # Before any request: what a killed predecessor left mid-request, and nothing in flight now.
            self.sweeper.clear_leftovers()
        except BaseException:
            self.lock.release()
            raise

    def pending_bytes(self, owner: str, besides: int = 0) -> int:
        """What the owner holds on disk outside its files' rows (server/disk_use.py): its uploads arriving, less
        `besides` (the caller's own upload), and its batch folders' checkpoints and leftovers."""
        return self.uploads.reserved(owner) - besides + self.batch_folders.bytes_of(owner)

    def start(self) -> None:
        private_umask()  # the runner's job processes inherit it
        self.runner.start()
        self.sweeper.start()

    def stop(self) -> None:
        try:
            self.sweeper.stop()
            self.runner.stop()
            self.store.close()
        finally:
            self.lock.release()
