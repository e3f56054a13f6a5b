"""A soak of the Batch API with two tenants, quotas, retention and a crash (loopback, fake engine, a server of its
own: uploads and outputs kept 10 s unless a request asks for longer, a sweep every few seconds, turns of 8 s).

Two tenants upload and submit batches at once while pollers call the API in a loop. Tenant B's labelled key has
low quotas and hits them: the errors name the limit, and the refused requests leave nothing behind. Files expire
and are swept while batches run. Then tenant A uploads a burst of small files, and when they start to expire the
server is SIGKILLed — it and the API replica that sweeps, at once — while a sweep is freeing them (seen in the
database: burst files the sweep has marked deleted whose bytes are still on disk, next to others already freed),
with uploads in flight (a slow client's among them, half sent) and a batch running. Started again on the same
data dir, nothing is lost that had not expired — every batch completes with every row once, unexpired files
download whole — and nothing is kept that had: every expired file is 404, absent from the lists, its bytes gone;
no file, batch folder or scratch part on disk that the database does not account for. Latencies are printed, not
asserted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from tests.failure_figures import note
from tests.lines import chat_line
from tests.server.batches import FINAL, stored, until
from tests.server.harness import JOB, KEY_A, KEY_B, MAX_FILE_BYTES, Server

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]

SHORT = 10  # seconds uploads and outputs live unless a request asks for longer
# A sweep every 4 s gathers a few seconds of the burst's expired uploads (tens to a couple of hundred): a sweep with
# plenty to do, long enough to be caught in the middle.
SWEEP = 4.0
HOUR = {"anchor": "created_at", "seconds": 3600}  # OpenAI's shortest policy: outlives the test
B_STORED = 64 * 1024  # tenant B's max_stored_bytes: its batches' files fit, a 100 KiB upload does not
B_QUEUED = 2  # tenant B's max_queued_batches
MIN_PENDING = 20  # burst files a sweep has marked expired and not yet freed when the server is killed
POLLERS = 4
POLL_PAUSE = 0.02  # between one poller's calls: a busy client, not a spin loop starving the 2-core box's jobs
TURN = 8.0  # limits.fair_share_seconds: the tenants' batches take turns, each turn a pause and a resume


@pytest.fixture
def soak(tmp_path_factory):
    server = Server(
        tmp_path_factory.mktemp("soak"),
        JOB,
        extra={
            "retention": {"upload_seconds": SHORT, "output_seconds": SHORT, "sweep_seconds": SWEEP},
            "limits": {"max_file_bytes": MAX_FILE_BYTES, "fair_share_seconds": TURN},
            "quotas": {
                "keys": {"team-b": {"max_stored_bytes": B_STORED, "max_queued_batches": B_QUEUED}},
            },
        },
        keys=f"{KEY_A} team-a\n{KEY_B} team-b\n",
    )
    server.start()
    yield server
    server.stop()


@dataclass
class Batch:
    client: openai.OpenAI
    id: str
    input_id: str
    ids: list[str]
    output_kept: bool  # created with output_expires_after (an hour), else its files live SHORT seconds
    output: bytes | None = None  # its output file's content, read as soon as it completed
    output_id: str | None = None


@dataclass
class Ledger:
    """What the tenants made, and what each file's fate must be."""

    batches: list[Batch] = field(default_factory=list)
    kept: dict[str, tuple[openai.OpenAI, bytes]] = field(default_factory=dict)  # unexpired uploads: content
    lonely: list[str] = field(default_factory=list)  # uploads no batch reads, expiring during the traffic
    expired: dict[str, openai.OpenAI] = field(default_factory=dict)  # files that expire during the test
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_batch(self, batch: Batch) -> None:
        with self.lock:
            self.batches.append(batch)
            self.expired[batch.input_id] = batch.client  # inputs get the server's short default

    def latest(self, client: openai.OpenAI) -> str | None:
        with self.lock:
            mine = [b.id for b in self.batches if b.client is client]
        return mine[-1] if mine else None


def lines(rows: int, prefix: str, max_tokens: int = 4) -> bytes:
    return "".join(
        chat_line(f"{prefix}-{i:04d}", f"question {i}", max_tokens=max_tokens) + "\n" for i in range(rows)
    ).encode()


def upload(client: openai.OpenAI, name: str, content: bytes, **kwargs) -> str:
    return client.files.create(file=(name, content), purpose="batch", **kwargs).id


def submit(ledger: Ledger, client, prefix: str, rows: int, output_kept: bool, max_tokens: int = 4) -> Batch:
    input_id = upload(client, f"{prefix}.jsonl", lines(rows, prefix, max_tokens))
    created = client.batches.create(
        input_file_id=input_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        **({"output_expires_after": HOUR} if output_kept else {}),
    )
    batch = Batch(client, created.id, input_id, [f"{prefix}-{i:04d}" for i in range(rows)], output_kept)
    ledger.add_batch(batch)
    return batch


def finish(batch: Batch, timeout: float = 300) -> None:
    """Wait for the batch to end and read its output at once (a short-lived one expires SHORT seconds later)."""
    deadline = time.monotonic() + timeout
    while (done := batch.client.batches.retrieve(batch.id)).status not in FINAL:
        assert time.monotonic() < deadline, f"{batch.id} stuck at {done.status} {done.request_counts}"
        time.sleep(0.3)
    assert done.status == "completed", done.errors
    batch.output_id = done.output_file_id
    batch.output = batch.client.files.content(done.output_file_id).content


def rows_of(content: bytes) -> list[str]:
    return sorted(json.loads(line)["custom_id"] for line in content.decode().splitlines())


@contextlib.contextmanager
def database(server: Server) -> Iterator[sqlite3.Connection]:
    """The server's state, read-only, beside it (WAL: readers never block its writes)."""
    path = server.root / "data" / "state.sqlite"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    db.row_factory = sqlite3.Row
    try:
        yield db
    finally:
        db.close()


def burst_state(db: sqlite3.Connection) -> tuple[int, int]:
    """(marked, freed) burst files: marked deleted by a sweep with their bytes still on disk — nothing but a sweep
    in its freeing loop leaves a burst file so (no batch reads them, no client deletes them) — and freed."""
    row = db.execute(
        "SELECT COALESCE(SUM(deleted = 1 AND stored = 1), 0), COALESCE(SUM(stored = 0), 0) FROM files"
        " WHERE filename LIKE 'burst-%'"
    ).fetchone()
    return row[0], row[1]


def unfinished(db: sqlite3.Connection) -> int:
    return db.execute(f"SELECT COUNT(*) FROM batches WHERE status NOT IN {tuple(FINAL)}").fetchone()[0]


def mid_batch(db: sqlite3.Connection) -> bool:
    """Whether a batch is running with some of its rows done and some not."""
    row = db.execute(
        "SELECT 1 FROM batches WHERE status = 'in_progress' AND completed > 0 AND completed + failed < total"
    ).fetchone()
    return row is not None


# Ray's node agents outlive the raylet by their reconnect timeout (a minute) and never touch the data dir.
AGENTS = (b"ray::DashboardAgent", b"ray::RuntimeEnvAgent")


def session_pids(sid: int) -> list[int]:
    """Processes of the server's session (it started them all: its Ray, the replica, the batches' jobs and engines)
    but Ray's node agents."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) != sid or (entry / "stat").read_text().split()[2] == "Z":
                    continue
                if not (entry / "cmdline").read_bytes().startswith(AGENTS):
                    found.append(int(entry.name))
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
    return found


def crash_targets(server: Server) -> tuple[int, int]:
    """The server's session leader and its API replica — the replica holds the state and runs the sweeper; its pid
    is in the data dir's lock. Found before the moment to crash comes, so the kill follows that moment at once."""
    assert server.proc is not None
    sid = server.proc.pid
    replica = int((server.root / "data" / "server.lock").read_text().split()[0])
    assert os.getsid(replica) == sid and b"ServeReplica" in Path(f"/proc/{replica}/cmdline").read_bytes()
    return sid, replica


def crash(server: Server, targets: tuple[int, int]) -> None:
    """SIGKILL the server's API replica and the server together, the replica (the sweeper) first, so neither runs
    one more line; then wait for the rest of the server's processes (its Ray, the batches' jobs and engines) to
    follow them, as a crash of the machine would have them."""
    sid, replica = targets
    os.kill(replica, signal.SIGKILL)
    os.kill(sid, signal.SIGKILL)
    server.kill()  # reaps it and waits for its port to close
    until(lambda: not session_pids(sid), timeout=120, what="the killed server's processes to end")


SLOW_HEAD = 64 * 1024  # what a slow client's upload holds on disk (its scratch part) when the server dies
# What the slow client sends before it stalls: twice SLOW_HEAD, since the server writes a file part through a buffer
# (a block, 4 KiB here) whose tail waits for more bytes; how the proxy splits the body decides how much that is.
SLOW_SENT = 2 * SLOW_HEAD


def slow_upload(server: Server, finish: threading.Event) -> None:
    """An upload from a slow client: its form and the first SLOW_SENT bytes of its file, then nothing until
    `finish` — the server streams it into a scratch part meanwhile."""
    boundary = "soak-slow-upload"

    def body():
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
            'Content-Disposition: form-data; name="file"; filename="slow.jsonl"\r\n\r\n'
        ).encode() + chat_line("slow", "x" * SLOW_SENT).encode()
        finish.wait(600)
        yield f"\n\r\n--{boundary}--\r\n".encode()

    headers = {
        "Authorization": f"Bearer {KEY_A}",
        "Content-Type": f"multipart/form-data; boundary={boundary}",
    }
    with contextlib.suppress(httpx.HTTPError):  # the server is killed under it
        httpx.post(f"{server.base_url}/files", content=body(), headers=headers, timeout=600)


def stop_process(pid: int) -> None:
    """Stop the process (SIGSTOP) and return once every thread of it has stopped: kill() returns as soon as the signal
    is sent, and a thread that is running (on the other core) or inside a system call goes on until it is kicked or
    the call returns."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not all(state in "TZX" for state in thread_states(pid)):
        assert time.monotonic() < deadline, f"process {pid} not stopped 30 s after SIGSTOP"
        time.sleep(0.001)


def thread_states(pid: int) -> list[str]:
    """The state letter of each thread of the process (R, S, D, T...), from /proc; a thread gone is left out."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        states.append(stat[stat.rindex(")") + 2])  # after "pid (comm) ": comm may hold spaces and parentheses
    return states


def scratch_parts(data: Path, at_least: int = 0) -> list[Path]:
    """Uploads' scratch parts with at least `at_least` bytes on disk; one that goes meanwhile (an upload that ended)
    is left out."""
    parts = []
    for part in (data / "tmp").iterdir():
        with contextlib.suppress(FileNotFoundError):
            if part.stat().st_size >= at_least:
                parts.append(part)
    return parts


class Pollers:
    """Clients polling the API in a loop: successful calls' latencies per phase; failures are counted while the
    server is down (killed, then starting again) and kept, to fail the test, at any other time."""

    def __init__(self, clients: list[openai.OpenAI], ledger: Ledger) -> None:
        self.clients, self.ledger = clients, ledger
        self.latencies: dict[str, list[float]] = {}
        self.phase = "traffic"
        self.failures = 0
        self.unexpected: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(POLLERS)]

    def __enter__(self) -> Pollers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def _run(self, n: int) -> None:
        client = self.clients[n % len(self.clients)]
        while not self._stop.is_set():
            phase, t0 = self.phase, time.perf_counter()
            try:
                latest = self.ledger.latest(client)
                if n % 2 == 0 and latest:
                    client.batches.retrieve(latest)
                elif n % 4 == 1:
                    client.files.list(limit=20)
                else:
                    client.batches.list(limit=20)
            except Exception as exc:  # noqa: BLE001 - judged by the phase it failed in
                if self.phase == "down":
                    self.failures += 1
                    time.sleep(0.2)
                    continue
                self.unexpected.append(exc)
                return
            self.latencies.setdefault(phase, []).append(time.perf_counter() - t0)
            time.sleep(POLL_PAUSE)

    def report(self) -> str:
        out = []
        for phase, values in self.latencies.items():
            if (
                phase == "down"
            ):  # calls that landed just before the kill or once the restarted server answered
                continue
            ordered = sorted(values)
            p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
            out.append(
                f"{phase}: {len(ordered)} GETs, p50 {statistics.median(ordered) * 1000:.0f} ms, "
                f"p99 {p99 * 1000:.0f} ms"
            )
        return "; ".join(out) + f"; {self.failures} failed while the server was down"


def test_two_tenants_quotas_retention_and_a_kill_mid_sweep(soak):
    a = openai.OpenAI(base_url=soak.base_url, api_key=KEY_A, max_retries=0, timeout=120)
    b = openai.OpenAI(base_url=soak.base_url, api_key=KEY_B, max_retries=0, timeout=120)
    data = soak.root / "data"
    ledger = Ledger()
    stats: dict[str, object] = {}

    # -- B's stored bytes: an upload past them is refused, and leaves nothing on disk, in the lists or the counts.
    held = stored(soak, KEY_B)
    on_disk = set((data / "files").iterdir())
    with pytest.raises(openai.BadRequestError) as refused:
        upload(b, "too-big.jsonl", chat_line("pad", "x" * 100 * 1024).encode() + b"\n")
    assert refused.value.code == "storage_limit_exceeded" and f"max_stored_bytes: {B_STORED}" in str(
        refused.value
    )
    assert set((data / "files").iterdir()) == on_disk and not list((data / "tmp").iterdir())
    assert list(b.files.list()) == [] and stored(soak, KEY_B) == held

    def tenant_a() -> None:
        content = lines(3, "keep-a")
        ledger.kept[upload(a, "keep-a.jsonl", content, expires_after=HOUR)] = (a, content)
        ledger.lonely.append(lonely := upload(a, "lonely-a.jsonl", lines(2, "lonely-a")))
        ledger.expired[lonely] = a
        # 80 rows of 8 tokens, 4 at a time: 8 s of engine work, in turns with B's batches.
        finish(submit(ledger, a, "a-big", 80, output_kept=True, max_tokens=8))

    def tenant_b() -> None:
        content = lines(3, "keep-b")
        ledger.kept[upload(b, "keep-b.jsonl", content, expires_after=HOUR)] = (b, content)
        ledger.lonely.append(lonely := upload(b, "lonely-b.jsonl", lines(2, "lonely-b")))
        ledger.expired[lonely] = b
        first = submit(ledger, b, "b-1", 6, output_kept=False)
        submit(ledger, b, "b-2", 6, output_kept=True)
        # B's queue is full: a third batch is refused and leaves nothing behind.
        before = [x.id for x in b.batches.list()]
        refused_input = upload(b, "b-refused.jsonl", lines(6, "b-3"))
        ledger.expired[refused_input] = b
        with pytest.raises(openai.RateLimitError) as refused:
            b.batches.create(
                input_file_id=refused_input, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert refused.value.code == "queued_batches_limit_exceeded"
        assert f"max_queued_batches: {B_QUEUED}" in str(refused.value)
        assert [x.id for x in b.batches.list()] == before
        finish(first)  # a place in the queue frees as a batch ends
        submit(ledger, b, "b-3", 6, output_kept=True)

    with Pollers([a, b], ledger) as pollers:
        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            tenants = [pool.submit(tenant_a), pool.submit(tenant_b)]
            # -- A sweep during the traffic: the unused uploads expire and their bytes go while batches run.
            until(lambda: len(ledger.lonely) == 2, timeout=120, what="the lonely uploads")
            until(
                lambda: not any((data / "files" / f"{f}.jsonl").exists() for f in ledger.lonely),
                timeout=120,
                what="the lonely uploads swept",
            )
            running = [x.id for x in ledger.batches if x.client.batches.retrieve(x.id).status not in FINAL]
            assert running, "no batch ran while the sweep freed the lonely uploads"
            for future in tenants:
                future.result(timeout=600)
        stats["traffic"] = time.monotonic() - t0
        # Nothing a refused batch left: every batch folder is a batch the database knows.
        with database(soak) as db:
            known = {r["id"] for r in db.execute("SELECT id FROM batches")}
        until(
            lambda: {p.name for p in (data / "batches").iterdir()} <= known,
            timeout=10,
            what="no stray folder",
        )
        for batch in ledger.batches:  # kept outputs of batches done by now: to compare after the crash
            done = batch.client.batches.retrieve(batch.id)
            if batch.output_kept and done.status == "completed":
                batch.output = batch.client.files.content(done.output_file_id).content

        # -- The burst, a long batch running, and the kill while a sweep frees the burst.
        pollers.phase = "burst"
        # 160 rows of 8 tokens: 16 s of engine work, running when the kill lands (another, should it end first).
        late = [submit(ledger, a, "a-late-0", 160, output_kept=True, max_tokens=8)]
        killed = threading.Event()  # the burst's uploaders stop
        burst: dict[str, openai.OpenAI] = {}
        uploads: list[float] = []

        def upload_burst(n: int) -> None:
            for i in range(10_000):
                if killed.is_set():
                    return
                t = time.perf_counter()
                try:
                    file_id = upload(a, f"burst-{n}-{i:05d}.jsonl", lines(1, f"burst-{n}-{i}"))
                except (openai.APIConnectionError, openai.InternalServerError):
                    assert pollers.phase == "down"  # cut short by the kill
                    return
                uploads.append(time.perf_counter() - t)
                burst[file_id] = a

        t_burst = time.monotonic()
        targets = crash_targets(soak)
        with database(soak) as db, ThreadPoolExecutor(5) as pool, contextlib.ExitStack() as leaving:
            # The uploaders stop however the block ends: a failure in it must not wait for them forever.
            leaving.callback(killed.set)
            burst_futures = [pool.submit(upload_burst, n) for n in range(4)]
            burst_futures.append(pool.submit(slow_upload, soak, killed))
            # The slow client's upload on disk before the kill can come (expiring takes SHORT seconds): the server
            # streams it into its scratch part at once, but on a loaded box "at once" has no bound.
            until(
                lambda: scratch_parts(data, SLOW_HEAD), timeout=120, what="the slow client's upload on disk"
            )
            deadline = time.monotonic() + 240
            # A sweep in its freeing loop with plenty left (many burst files marked, some already freed) while a
            # batch is mid-run. The burst goes on until then, so every few seconds a sweep has plenty to do.
            while True:
                while (state := burst_state(db))[0] < MIN_PENDING or state[1] == 0 or not mid_batch(db):
                    assert time.monotonic() < deadline, (
                        f"no sweep of {MIN_PENDING} burst files mid-batch: {state}"
                    )
                    if not unfinished(db):
                        late.append(
                            submit(ledger, a, f"a-late-{len(late)}", 160, output_kept=True, max_tokens=8)
                        )
                    time.sleep(0.005)
                # The sweeper held where it is (the SIGKILL below lands in the same place) and the state read again
                # once it has stopped: on a loaded box a sweep can free the rest between the read and the kill.
                stop_process(targets[1])
                if (state := burst_state(db))[0] >= 1 and state[1] >= 1 and mid_batch(db):
                    break
                os.kill(targets[1], signal.SIGCONT)
            pollers.phase = "down"
            t_kill = time.monotonic()
            stats["burst_rate"] = len(uploads) / (t_kill - t_burst)
            crash(soak, targets)
            stats["crash"] = time.monotonic() - t_kill
            killed.set()
            for future in burst_futures:
                future.result(timeout=60)
            stats["burst_upload"] = statistics.median(uploads)
            stats["at_kill"] = state

            # -- What the kill left: a sweep cut short (files it marked expired still on disk, beside freed ones).
            marked = [r["id"] for r in db.execute("SELECT id FROM files WHERE deleted = 1 AND stored = 1")]
            marked_burst, freed = burst_state(db)
            cut_short = unfinished(db)
        stats["after_kill"] = (marked_burst, freed, cut_short)
        assert marked_burst >= 1 and freed >= 1, "the kill did not land in a sweep's freeing"
        # Their bytes are on disk — all but the one being unlinked as the kill landed, perhaps (its row is marked
        # freed after the unlink).
        gone = [f for f in marked if f in burst and not (data / "files" / f"{f}.jsonl").exists()]
        assert len(gone) <= 1, gone
        assert cut_short >= 1  # a batch was cut short with the sweep
        assert scratch_parts(data, SLOW_HEAD)  # and the slow client's upload, its scratch part left behind
        ledger.expired.update(burst)

        # -- Started again on the same data dir.
        soak.start()
        pollers.phase = "restarted"
        t_restart = time.monotonic()
        for batch in ledger.batches:
            earlier = batch.output
            if batch.output_kept:
                finish(batch, timeout=480)
                if earlier is not None:
                    assert batch.output == earlier  # a kept output survives the crash whole
            else:  # ended before the burst; its output was read then and expires meanwhile
                assert batch.client.batches.retrieve(batch.id).status == "completed"
                ledger.expired[batch.output_id] = batch.client
            assert rows_of(batch.output) == batch.ids, batch.id  # every row once
        stats["drain"] = time.monotonic() - t_restart

        # -- Nothing kept that expired: wait for every expiry and the sweeps after it.
        with database(soak) as db:
            last = db.execute("SELECT MAX(expires_at) FROM files WHERE expires_at < ?", (time.time() + 600,))
            last_expiry = last.fetchone()[0]
        until(lambda: time.time() > last_expiry + 1, timeout=120, what="the last short-lived file to expire")
        t_sweep = time.monotonic()

        def swept() -> bool:
            with database(soak) as db:
                kept = db.execute(
                    "SELECT COUNT(*) FROM files WHERE stored = 1 AND (deleted = 1 OR expires_at <= ?)",
                    (int(time.time()),),
                ).fetchone()[0]
                unpurged = db.execute(
                    "SELECT COUNT(*) FROM batches b WHERE purged = 0 AND NOT EXISTS (SELECT 1 FROM files f WHERE"
                    " f.batch_id = b.id AND f.deleted = 0)"
                ).fetchone()[0]
            return kept == 0 and unpurged == 0

        until(swept, timeout=120, what="every expired file freed and every emptied batch purged")
        stats["swept"] = time.monotonic() - t_sweep

    assert not pollers.unexpected, pollers.unexpected[:3]
    listed = {f.id for c in (a, b) for f in c.files.list(limit=100)}
    for file_id, client in ledger.expired.items():
        assert file_id not in listed
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            client.files.content(file_id)
        assert not (data / "files" / f"{file_id}.jsonl").exists()
    for file_id, (client, content) in ledger.kept.items():
        assert file_id in listed and client.files.content(file_id).content == content
    short = [x.id for x in ledger.batches if not x.output_kept]
    assert short and not any((data / "batches" / x).exists() for x in short)  # their outputs expired: purged

    # The disk holds exactly what the database says is live: no orphan upload, batch folder or scratch part.
    with database(soak) as db:
        live_uploads = {
            r["id"]: r["bytes"]
            for r in db.execute("SELECT id, bytes FROM files WHERE purpose = 'batch' AND deleted = 0")
        }
        stored_rows = db.execute("SELECT COUNT(*) FROM files WHERE stored = 1 AND deleted = 1").fetchone()[0]
        folders = {r["id"] for r in db.execute("SELECT id FROM batches WHERE purged = 0")}
    assert stored_rows == 0
    assert {p.name: p.stat().st_size for p in (data / "files").iterdir()} == {
        f"{k}.jsonl": v for k, v in live_uploads.items()
    }
    assert {p.name for p in (data / "batches").iterdir()} == folders
    assert not list((data / "tmp").iterdir()), "scratch parts of uploads cut short were kept"
    assert stored(soak, KEY_B)["batch"][0] == sum(1 for c, _ in ledger.kept.values() if c is b)

    marked_at_kill, freed_at_kill = stats["at_kill"]
    note(
        f"Batch API soak: {len(ledger.batches)} batches from 2 tenants in {stats['traffic']:.1f} s of traffic "
        f"(B's quotas refused an upload and a batch); a burst of {len(burst)} uploads "
        f"at {stats['burst_rate']:.1f}/s (median {stats['burst_upload'] * 1000:.0f} ms); killed with "
        f"{marked_at_kill} burst files marked expired and not yet freed ({freed_at_kill} freed), after the kill "
        f"{stats['after_kill'][0]} still on disk and {stats['after_kill'][2]} batches unfinished; its processes "
        f"gone {stats['crash']:.1f} s after the kill, restarted in {soak.starts[-1]:.1f} s, every batch completed {stats['drain']:.1f} s later, the rest swept "
        f"{stats['swept']:.1f} s after the last expiry.\n  {pollers.report()}"
    )
