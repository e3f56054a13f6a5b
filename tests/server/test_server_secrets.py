"""What a batch's job process sees of the server: a `nightshift serve` started with secrets in its environment (its API
keys, cloud credentials, a canary) runs a batch on the http engine against a stub that requires a bearer token given
only in the server config (`engine.http.api_key`). The job's own process is read from /proc while it runs: its
environment holds the engine's key and none of the server's secrets; its command line and job file hold no key; the
stub saw every request with the key and none without it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import openai
import pytest

from tests.lines import chat_line
from tests.openai_stub import OpenAIStub
from tests.server.batches import FINAL, wait_for
from tests.server.harness import Server

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="/proc"),
]

ENGINE_KEY = "sk-engine-only-" + "7" * 24
SERVER_KEY = "key-from-the-servers-own-variable-" + "2" * 8
KEYS_ENV = "NS_TEST_SERVER_KEYS"  # auth.keys_env: a name the job's allowlist knows nothing of
CANARIES = {
    KEYS_ENV: SERVER_KEY,
    "NIGHTSHIFT_TEST_CANARY": "canary-" + "3" * 24,
    "AWS_ACCESS_KEY_ID": "AKIA" + "4" * 16,
    "AWS_SECRET_ACCESS_KEY": "aws-canary-" + "5" * 24,
}
ROWS = 12


@pytest.fixture(scope="module")
def stub():
    # One request at a time, 0.4 s each: the job lives for seconds, long enough to be read from /proc.
    with OpenAIStub(api_key=ENGINE_KEY, delay_s=0.4) as server:
        yield server


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, stub):
    job = {
        "engine": {
            "backend": "http",
            "http": {"endpoints": [stub.url], "api_key": ENGINE_KEY, "concurrency": 1},
        },
        "resources": {"num_engines": 1},
    }
    srv = Server(
        tmp_path_factory.mktemp("guarded"),
        job,
        extra={"auth": {"keys_env": KEYS_ENV}, "engine_idle_seconds": 0},
        env=CANARIES,
    )
    srv.start()
    yield srv
    srv.stop()


def job_process(batch_dir: Path, timeout: float = 120) -> int:
    """The pid of the batch's job (`python -m pipeline run --config BATCH_DIR/job.yaml`), once it runs."""
    wanted = str(batch_dir / "job.yaml")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if wanted.encode() in argv and b"pipeline" in argv:
                return int(proc.name)
        time.sleep(0.1)
    raise AssertionError(f"no job process for {batch_dir} within {timeout} s")


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_a_job_gets_the_engine_key_and_none_of_the_servers_secrets(guarded, stub, tmp_path):
    client = openai.OpenAI(base_url=guarded.base_url, api_key=SERVER_KEY, max_retries=0)
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(chat_line(f"req-{i:02d}", f"question {i}") + "\n" for i in range(ROWS)))
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")  # the server's own variable's key
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch_dir = guarded.root / "data" / "batches" / batch.id
    pid = job_process(batch_dir)
    env = environ_of(pid)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode()

    leaked = {name for name, value in CANARIES.items() if name in env or value in env.values()}
    assert leaked == set(), f"the job sees the server's {sorted(leaked)}"
    assert env["NIGHTSHIFT_API_KEY"] == ENGINE_KEY  # the job's http engine reads its key there
    assert env.get("RAY_AUTH_MODE") == "token"  # and it joins the server's cluster with token auth
    assert ENGINE_KEY not in argv and ENGINE_KEY not in (batch_dir / "job.yaml").read_text()

    done = wait_for(client, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed", done.errors
    assert (done.request_counts.completed, done.request_counts.failed) == (ROWS, 0)
    assert stub.state.unauthorized == 0 and sum(stub.state.answered.values()) == ROWS


def session_processes(leader: int) -> dict[int, str]:
    """pid -> command line of every process of the server's session (it starts as a session leader): its Ray (GCS,
    raylet, workers, the Serve replica), the batches' jobs and their engines."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == leader:
            continue
        try:
            if os.getsid(int(proc.name)) != leader:
                continue
            found[int(proc.name)] = (
                (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except (OSError, ProcessLookupError):
            continue
    return found


def test_no_process_of_the_server_and_no_file_it_or_a_job_writes_holds_a_key(guarded, stub, tmp_path):
    """The server reads its keys, hands its Serve replica their SHA-256 digests and removes the keys' variable
    before Ray starts: no process of its Ray — raylet, workers, replica, engines — holds a key in its environment. No
    file under the server's root or its Ray session's logs holds the API key or the engine's key (the server config
    the operator wrote, which holds the engine's key, aside)."""
    client = openai.OpenAI(base_url=guarded.base_url, api_key=SERVER_KEY, max_retries=0)
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(chat_line(f"grep-{i:02d}", f"question {i}") + "\n" for i in range(ROWS)))
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    job_process(
        guarded.root / "data" / "batches" / batch.id
    )  # while its job runs: every kind of process is up
    processes = session_processes(guarded.proc.pid)
    assert any("raylet" in argv for argv in processes.values()), processes
    for pid, argv in processes.items():
        try:
            env = environ_of(pid)
        except OSError:
            continue  # ended meanwhile
        assert KEYS_ENV not in env and SERVER_KEY not in "\0".join(env.values()), argv
        assert SERVER_KEY not in argv
    sessions = {
        Path(arg.split("=", 1)[1])
        for argv in processes.values()
        for arg in argv.split()
        if arg.startswith("--session-dir=")
    }
    assert sessions, "the server's Ray session directory was not found"
    done = wait_for(client, batch.id, lambda b: b.status in FINAL)
    assert done.status == "completed", done.errors

    secrets = [SERVER_KEY.encode(), ENGINE_KEY.encode()]
    written = [guarded.root, *sessions]
    checked = 0
    for top in written:
        for path in top.rglob("*"):
            if not path.is_file() or path.is_symlink() or path == guarded.config:
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue  # a socket, or gone meanwhile
            checked += 1
            assert not any(secret in data for secret in secrets), f"a key in {path}"
    assert checked > 20  # the database, the upload, the batch's job file, log and output, Ray's logs
