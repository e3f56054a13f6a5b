"""`nightshift serve` as a child process for the server tests: its API keys, its job (the fake engine with a time
model) and its limits, on a loopback port, restartable on the same data dir."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

KEY_A = "key-a-" + "0" * 20
KEY_B = "key-b-" + "1" * 20
MAX_FILE_BYTES = 256 * 1024

# The fake engine with a time model: 4 sequences at once, 0.05 s per generated token, so a few hundred lines take
# long enough for a cancel or a restart to land mid-batch; it takes 2 s to start, which warm engines save.
JOB = {
    "engine": {
        "backend": "fake",
        "fake": {
            "output_tokens": 4,
            "decode_seconds_per_token": 0.05,
            "max_concurrency": 4,
            "start_seconds": 2.0,
            # A LoRA adapter batches may name as their lines' model (the fake engine reads nothing from the path).
            "lora_modules": {"support-lora": "/adapters/support-lora"},
        },
    },
    "resources": {"num_engines": 1, "cpus_per_engine": 0.5},
}


# What Ray raises when its raylet did not register within its fixed 30 s.
RAY_START_TIMED_OUT = "The current node timed out during startup"
# What Serve's proxy says when the port chosen for the server was taken (by another test's process) between
# free_port() finding it free and the proxy binding it.
PORT_TAKEN = "Failed to bind to address"


class RayStartTimedOut(RuntimeError):
    pass


class PortTaken(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`nightshift serve` as a child process on a loopback port; restartable on the same data dir."""

    def __init__(
        self,
        root: Path,
        job: dict,
        extra: dict | None = None,
        env: dict | None = None,
        keys: str | None = None,
    ) -> None:
        """`keys`: the keys file's text (default: KEY_A and KEY_B, unlabelled)."""
        self.root = root
        self.port = free_port()
        self.config = root / "server.yaml"
        config = {
            "job": job,
            "limits": {"max_file_bytes": MAX_FILE_BYTES},
            "poll_seconds": 0.5,
            **(extra or {}),
        }
        self.config.write_text(yaml.safe_dump(config))
        self.env = env or {}
        self.keys = root / "keys"
        self.keys.write_text(keys if keys is not None else f"# test keys\n{KEY_A}\n{KEY_B}\n")
        self.proc: subprocess.Popen | None = None
        self.starts: list[float] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        """Start the server and wait until it answers. A server whose Ray timed out while starting (Ray waits 30 s
        for its raylet, which a box running another worker's engine starts can exceed) is started once more, and so
        is one whose port another process took before it bound it (on a new port)."""
        try:
            self._start_once()
        except RayStartTimedOut:
            self._start_once()
        except PortTaken:
            self.port = free_port()
            self._start_once()

    def _start_once(self) -> None:
        log = open(self.root / "serve.log", "ab")  # noqa: SIM115 - the child owns it
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **self.env}
        env.pop("NIGHTSHIFT_API_KEYS", None)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "serve", "--port", str(self.port), "--data-dir",
             str(self.root / "data"), "--config", str(self.config), "--api-keys-file", str(self.keys)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        import httpx

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.root / "serve.log").read_text()[-3000:]
                self.proc = None
                if RAY_START_TIMED_OUT in tail:
                    raise RayStartTimedOut(tail)
                if PORT_TAKEN in tail:
                    raise PortTaken(tail)
                raise RuntimeError(f"server exited: {tail}")
            try:
                if httpx.get(f"{self.base_url}/batches", timeout=2).status_code == 401:
                    self.starts.append(time.monotonic() - t0)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not answer within 90 s")

    def kill(self) -> None:
        """SIGKILL the server process alone, as a crash would: no shutdown runs; its Ray and its jobs go with it."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        # Its Ray (and the Serve proxy on our port) ends with it, a moment later: a server started before then
        # would find the old proxy answering.
        import httpx

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.base_url}/batches", timeout=1)
            except httpx.HTTPError:
                return
            time.sleep(0.5)
        raise RuntimeError("the killed server's port still answers after 60 s")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
