"""Retention and fidelity of the Batch API without a server: expiration bounds, the schema migration, the sweeper on a
real store and data dir, the upload's JSONL check, validation before a batch runs, and a batch's usage and model."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from pipeline.config import ConfigError, InputLimits, JobConfig
from pipeline.io.staging import StagedRow, StagingArea
from pipeline.server.accounting import account, from_manifest
from pipeline.server.expiry import MAX_SECONDS, MIN_SECONDS, ExpiryError, form_policy, parse_policy
from pipeline.server.linecheck import check_upload, invalid_lines, served_before_run
from pipeline.server.metrics import exposition, storage_families
from pipeline.server.retention import Sweeper
from pipeline.server.runner import DataDir
from pipeline.server.settings import load_server_config
from pipeline.server.store import MIGRATIONS, SCHEMA_VERSION, FileGone, Store
from tests.lines import chat_line

DAY = 86400


# -- expiration policies ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seconds", [MIN_SECONDS, 86400, MAX_SECONDS])
def test_policies_within_openais_bounds_are_taken(seconds):
    form = {"expires_after[anchor]": "created_at", "expires_after[seconds]": str(seconds)}
    assert form_policy(form).seconds == seconds
    assert (
        parse_policy({"anchor": "created_at", "seconds": seconds}, "output_expires_after").seconds == seconds
    )
    assert form_policy({"purpose": "batch"}) is None and parse_policy(None, "output_expires_after") is None


@pytest.mark.parametrize(
    "form,param",
    [
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": str(MIN_SECONDS - 1)}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": str(MAX_SECONDS + 1)}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1h"}, "seconds"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600.5"}, "seconds"),
        ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "anchor"),
        ({"expires_after[seconds]": "3600"}, "anchor"),
        ({"expires_after[anchor]": "created_at"}, "seconds"),
        (
            {
                "expires_after[anchor]": "created_at",
                "expires_after[seconds]": "3600",
                "expires_after[x]": "1",
            },
            "x",
        ),
    ],
)
def test_bad_upload_policies_name_the_form_field(form, param):
    with pytest.raises(ExpiryError) as exc:
        form_policy(form)
    assert exc.value.param == f"expires_after[{param}]" and exc.value.param in exc.value.message


@pytest.mark.parametrize(
    "value,param",
    [
        ({"anchor": "created_at", "seconds": 60}, "output_expires_after.seconds"),
        ({"anchor": "created_at", "seconds": "3600"}, "output_expires_after.seconds"),  # JSON has numbers
        ({"anchor": "created_at", "seconds": True}, "output_expires_after.seconds"),
        ({"seconds": 3600}, "output_expires_after.anchor"),
        ({"anchor": "created_at", "seconds": 3600, "extra": 1}, "output_expires_after.extra"),
        (3600, "output_expires_after"),
    ],
)
def test_bad_batch_policies_name_the_param(value, param):
    with pytest.raises(ExpiryError) as exc:
        parse_policy(value, "output_expires_after")
    assert exc.value.param == param and param in exc.value.message


def test_retention_settings_are_checked_before_start():
    config = load_server_config(None, {})
    assert config.retention.output_seconds == 30 * DAY and config.retention.upload_seconds is None
    assert config.limits.line_errors == "record"
    for key, value in (
        ("retention.output_seconds", 0),
        ("retention.sweep_seconds", 0),
        ("limits.line_errors", "x"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_server_config(None, {key: value})
    # OpenAI's validation needs the model names a line may give before the batch runs: an http job without one
    # is refused at start, saying what to give.
    http = {"engine.backend": "http", "engine.http.endpoints": ["http://127.0.0.1:9"]}
    with pytest.raises(ConfigError, match="job.model"):
        load_server_config(
            None, {"limits.line_errors": "fail_batch", **{f"job.{k}": v for k, v in http.items()}}
        )
    assert load_server_config(
        None,
        {"limits.line_errors": "fail_batch", "job.model": "m", **{f"job.{k}": v for k, v in http.items()}},
    )


# -- the store's migration ----------------------------------------------------------------------------------------
def test_a_version_2_database_is_migrated_keeping_every_file_and_batch(tmp_path):
    path = tmp_path / "state.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    for version in range(2):
        conn.executescript(f"BEGIN; {MIGRATIONS[version]} PRAGMA user_version = {version + 1}; COMMIT;")
    conn.execute(
        "INSERT INTO files (id, owner, filename, purpose, bytes, created_at, seq, deleted, batch_id, kind) VALUES "
        "('file-in', 'o1', 'a.jsonl', 'batch', 10, 1, 1, 0, NULL, NULL),"
        "('file-gone', 'o1', 'b.jsonl', 'batch', 20, 2, 2, 1, NULL, NULL),"
        "('file-out', 'o1', 'batch_1_output.jsonl', 'batch_output', 30, 3, 3, 0, 'batch_1', 'results')"
    )
    conn.execute(
        "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, created_at,"
        " completed_at, seq, output_file_id) VALUES"
        " ('batch_1', 'o1', '/v1/chat/completions', 'file-in', '24h', 'completed', 1, 2, 1, 'file-out')"
    )
    conn.close()

    store = Store(path)
    assert store._one("PRAGMA user_version", ())[0] == SCHEMA_VERSION == 3
    files, _ = store.list_files("o1", None, 10, None, ascending=False)
    assert [f.id for f in files] == ["file-out", "file-in"]
    assert all(f.status == "processed" and f.expires_at is None for f in files)  # nothing expires unasked
    batch = store.batch("batch_1")
    assert batch.status == "completed" and batch.usage is None and batch.model is None
    # What the older server deleted without freeing (it kept a deleted input's bytes forever) is freed now;
    # what it kept stays.
    assert store.stored_by_purpose("o1") == {"batch": (2, 30), "batch_output": (1, 30)}
    data = DataDir(tmp_path / "data")
    data.create()
    for file_id in ("file-in", "file-gone"):
        data.upload(file_id).write_text("{}\n")
    swept = Sweeper(store, data, 60).sweep()
    assert (swept.expired, swept.freed, swept.freed_bytes, swept.purged) == (0, 1, 20, 0)
    assert data.upload("file-in").exists() and not data.upload("file-gone").exists()
    assert store.stored_by_purpose("o1") == {"batch": (1, 10), "batch_output": (1, 30)}
    store.close()


# -- the sweeper ----------------------------------------------------------------------------------------------
def _committed_output(data: DataDir, batch_id: str) -> None:
    """A committed batch output as the job writes it: shards per kind, and manifest.json naming them."""
    out = data.output(batch_id)
    out.mkdir(parents=True)
    (out / "results-00000-of-00001.jsonl").write_text('{"custom_id": "a"}\n')
    (out / "errors-00000-of-00001.jsonl").write_text('{"custom_id": "b"}\n')
    (data.batch(batch_id) / "job.log").write_text("log\n")
    shards = {
        "results": [{"name": "results-00000-of-00001.jsonl", "rows": 1}],
        "errors": [{"name": "errors-00000-of-00001.jsonl", "rows": 1}],
    }
    (out / "manifest.json").write_text(json.dumps({"shards": shards}))


@pytest.fixture
def sweeping(tmp_path):
    data = DataDir(tmp_path / "data")
    data.create()
    store = Store(data.database)
    yield store, data, Sweeper(store, data, 60)
    store.close()


def test_an_expired_upload_is_gone_at_once_and_its_bytes_freed_by_the_sweep(sweeping):
    store, data, sweeper = sweeping
    kept = store.add_file("file-kept", "o", "k.jsonl", "batch", 3)
    short = store.add_file("file-short", "o", "s.jsonl", "batch", 5, expires_seconds=3600)
    assert kept.expires_at is None and short.expires_at == short.created_at + 3600
    for file_id in ("file-kept", "file-short"):
        data.upload(file_id).write_text("{}\n")
    assert sweeper.sweep().expired == 0
    later = short.expires_at
    swept = sweeper.sweep(now=later)
    assert (swept.expired, swept.freed, swept.freed_bytes) == (1, 1, 5)
    assert not data.upload("file-short").exists() and data.upload("file-kept").exists()
    assert store.file_row("file-short", "o") is None and store.stored_by_purpose("o") == {"batch": (1, 3)}
    assert sweeper.sweep(now=later) == type(swept)()  # nothing twice


def test_an_upload_a_running_batch_reads_keeps_its_bytes_until_the_batch_ends(sweeping):
    store, data, sweeper = sweeping
    store.add_file("file-in", "o", "in.jsonl", "batch", 7, expires_seconds=3600)
    data.upload("file-in").write_text("{}\n")
    store.add_batch("batch_1", "o", "/v1/chat/completions", "file-in", "24h", None, 0, int(time.time()) + DAY)
    later = int(time.time()) + 2 * 3600
    swept = sweeper.sweep(now=later)
    assert (swept.expired, swept.freed) == (1, 0) and data.upload("file-in").exists()
    assert store.stored_by_purpose("o") == {"batch": (1, 7)}  # held for the batch: still counted
    # Deleted (expired) inputs take no new batch: the check is in add_batch's own transaction.
    with pytest.raises(FileGone):
        store.add_batch("batch_2", "o", "/v1/chat/completions", "file-in", "24h", None, 0, later + DAY)
    store.update_batch("batch_1", status="completed", completed_at=later)
    assert sweeper.sweep(now=later).freed == 1 and not data.upload("file-in").exists()


def test_output_files_free_their_shards_and_then_their_batch_folder(sweeping):
    store, data, sweeper = sweeping
    store.add_file("file-in", "o", "in.jsonl", "batch", 7)
    store.add_batch(
        "batch_1", "o", "/v1/chat/completions", "file-in", "24h", None, 0, int(time.time()) + DAY, 3600
    )
    _committed_output(data, "batch_1")
    out = data.output("batch_1")
    results = store.add_file(
        "file-res", "o", "r.jsonl", "batch_output", 19, batch_id="batch_1", kind="results"
    )
    errors = store.add_file("file-err", "o", "e.jsonl", "batch_output", 19, batch_id="batch_1", kind="errors")
    # The batch's output_expires_seconds, from each file's own created_at (OpenAI's anchor).
    assert results.expires_at == results.created_at + 3600 and errors.expires_at == errors.created_at + 3600
    store.update_batch("batch_1", status="completed", completed_at=int(time.time()))
    # A delete through the API frees that file's shards at once; the other file stays readable.
    assert store.delete_file("file-err", "o") and sweeper.free_file("file-err")
    assert (
        not (out / "errors-00000-of-00001.jsonl").exists() and (out / "results-00000-of-00001.jsonl").exists()
    )
    assert data.batch("batch_1").exists()
    # The last one expires: its shards go, and with nothing of the batch left, its folder.
    swept = sweeper.sweep(now=results.expires_at)
    assert (swept.expired, swept.freed, swept.purged) == (1, 1, 1)
    assert not data.batch("batch_1").exists() and store.stored_by_purpose("o") == {"batch": (1, 7)}


def test_a_killed_sweep_is_finished_by_the_next(sweeping):
    """A server killed between marking a file deleted and freeing its bytes (or between the unlink and the mark)
    leaves rows the next sweep completes: nothing kept that was deleted, nothing lost that was not."""
    store, data, sweeper = sweeping
    for file_id in ("file-a", "file-b", "file-c"):
        store.add_file(file_id, "o", "x.jsonl", "batch", 1)
        data.upload(file_id).write_text("{}\n")
    store.delete_file("file-a", "o")  # marked, killed before the unlink
    store.delete_file("file-b", "o")
    data.upload("file-b").unlink()  # unlinked, killed before the mark
    swept = sweeper.sweep()
    assert swept.freed == 2 and store.stored_by_purpose("o") == {"batch": (1, 1)}
    assert data.upload("file-c").exists()


def test_what_a_server_killed_mid_request_left_is_removed_when_the_next_starts(
    sweeping, tmp_path, monkeypatch
):
    """A kill while an upload streamed in (its scratch part), between an upload's rename into place and its row
    (a file no row names), or between a batch's folder and its row (a folder no row names): nothing points at them,
    and the next service on the data dir removes them before it takes a request — and nothing else."""
    from pipeline.server.routes import BatchService
    from pipeline.server.settings import AuthSettings, ServerConfig

    store, data, _ = sweeping
    store.add_file("file-kept", "o", "k.jsonl", "batch", 3)
    data.upload("file-kept").write_text("{}\n")
    store.add_file("file-held", "o", "h.jsonl", "batch", 3)  # deleted, its bytes held by a batch: kept
    data.upload("file-held").write_text("{}\n")
    store.add_batch(
        "batch_live", "o", "/v1/chat/completions", "file-held", "24h", None, 0, int(time.time()) + DAY
    )
    store.delete_file("file-held", "o")
    (data.output("batch_live") / "_staging").mkdir(parents=True)
    store.add_batch(
        "batch_gone", "o", "/v1/chat/completions", "file-kept", "24h", None, 0, int(time.time()) + DAY
    )
    store.update_batch("batch_gone", status="completed", completed_at=int(time.time()))
    store.mark_purged("batch_gone")
    store.close()
    leftovers = [
        data.scratch / "upload-0123456789abcdef.part",  # killed mid-stream
        data.upload("file-0123456789abcdef01234567"),  # killed between the rename and the row
        data.batch("batch_0123456789abcdef01234567") / "job.log",  # killed between the mkdir and the row
        data.batch("batch_gone") / "job.log",  # a folder the rows say was purged
    ]
    for path in leftovers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")

    monkeypatch.setenv("NIGHTSHIFT_API_KEYS", KEY)
    service = BatchService(ServerConfig(data_dir=data.root, auth=AuthSettings()), None)
    try:
        assert not any(p.exists() for p in leftovers)
        assert (
            not data.batch("batch_0123456789abcdef01234567").exists()
            and not data.batch("batch_gone").exists()
        )
        assert sorted(p.name for p in data.files.iterdir()) == ["file-held.jsonl", "file-kept.jsonl"]
        assert [p.name for p in data.batches.iterdir()] == ["batch_live"]
        assert (data.output("batch_live") / "_staging").is_dir() and not list(data.scratch.iterdir())
    finally:
        service.store.close()
        service.lock.release()


def test_beside_a_new_database_uploads_and_batch_folders_are_kept(tmp_path, monkeypatch):
    """A data dir whose database is created now (lost, or moved away): no row could name its files, so none is
    taken for a leftover; a scratch part is one all the same."""
    from pipeline.server.routes import BatchService
    from pipeline.server.settings import AuthSettings, ServerConfig

    data = DataDir(tmp_path / "data")
    data.create()
    kept = [
        data.upload("file-0123456789abcdef01234567"),
        data.batch("batch_0123456789abcdef01234567") / "job.log",
    ]
    part = data.scratch / "upload-0123456789abcdef.part"
    for path in [*kept, part]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    monkeypatch.setenv("NIGHTSHIFT_API_KEYS", KEY)
    service = BatchService(ServerConfig(data_dir=data.root, auth=AuthSettings()), None)
    try:
        assert all(p.exists() for p in kept) and not part.exists()
    finally:
        service.store.close()
        service.lock.release()


def test_a_batch_that_made_no_file_keeps_its_folder_for_the_output_lifetime(sweeping):
    store, data, sweeper = sweeping
    store.add_file("file-in", "o", "in.jsonl", "batch", 7)
    now = int(time.time())
    store.add_batch("batch_1", "o", "/v1/chat/completions", "file-in", "24h", None, 0, now + DAY, 3600)
    store.add_batch("batch_2", "o", "/v1/chat/completions", "file-in", "24h", None, 0, now + DAY, None)
    for batch_id in ("batch_1", "batch_2"):
        data.batch(batch_id).mkdir(parents=True)
        store.update_batch(batch_id, status="failed", failed_at=now)
    assert sweeper.sweep(now=now + 3599).purged == 0
    assert sweeper.sweep(now=now + 3600).purged == 1
    assert not data.batch("batch_1").exists() and data.batch("batch_2").exists()  # null: kept
    assert sweeper.sweep(now=now + 100 * DAY).purged == 0


def test_the_sweeper_thread_runs_and_stops(sweeping):
    store, data, _ = sweeping
    store.add_file("file-a", "o", "x.jsonl", "batch", 1)
    data.upload("file-a").write_text("{}\n")
    store.delete_file("file-a", "o")
    sweeper = Sweeper(store, data, 0.05)
    sweeper.start()
    deadline = time.monotonic() + 10
    while data.upload("file-a").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sweeper.stop()
    assert not data.upload("file-a").exists() and not sweeper._thread.is_alive()


def test_the_callers_stored_bytes_are_metrics(sweeping):
    store, _, _ = sweeping
    store.add_file("file-a", "o", "x.jsonl", "batch", 11)
    store.add_file("file-b", "other", "x.jsonl", "batch", 99)
    text = exposition({}, [], None, storage_families(store.stored_by_purpose("o"))).decode()
    assert 'nightshift_server_stored_bytes{purpose="batch"} 11.0' in text
    assert 'nightshift_server_stored_files{purpose="batch"} 1.0' in text
    assert 'nightshift_server_stored_bytes{purpose="batch_output"} 0.0' in text


# -- the upload's JSONL check -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content,line,why",
    [
        (b"custom_id,prompt\nq1,hello\n", 1, "not JSON"),
        (b'[{"custom_id": "a"}, {"custom_id": "b"}]\n', 1, "a JSON array"),
        (b'\n\n{\n  "custom_id": "a"\n}\n', 3, "not JSON"),  # pretty-printed JSON: blank lines are skipped
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\n", 1, "not UTF-8"),
    ],
)
def test_a_file_that_is_not_jsonl_at_all_is_refused_naming_its_first_line(tmp_path, content, line, why):
    path = tmp_path / "upload"
    path.write_bytes(content)
    refusal = check_upload(path, InputLimits()).refusal()
    assert refusal and f"line {line} " in refusal and why in refusal


def test_a_jsonl_file_with_some_bad_lines_is_kept_in_error_status(tmp_path):
    path = tmp_path / "upload"
    path.write_text(chat_line("a", "q") + "\n\n{not json\n[1]\n" + chat_line("b", "q") + "\n")
    check = check_upload(path, InputLimits())
    assert check.refusal() is None and (check.lines, check.objects) == (4, 2)
    status, details = check.status()
    assert status == "error" and "2 of 4 lines" in details and "line 3:" in details and "line 4:" in details
    path.write_text(chat_line("a", "q") + "\n" + chat_line("b", "q") + "\n")
    assert check_upload(path, InputLimits()).status() == ("processed", None)


# -- validation before a batch runs (limits.line_errors: fail_batch) ---------------------------------------------
def test_validation_before_a_run_lists_each_invalid_line_as_the_job_would(tmp_path):
    job = JobConfig.model_validate({"engine": {"backend": "fake", "fake": {"lora_modules": {"tuned": "/a"}}}})
    served = served_before_run(job)
    assert set(served) == {"smollm2-135m-instruct", "tuned"}
    path = tmp_path / "in.jsonl"
    lines = [
        chat_line("a", "q"),
        "{not json",
        chat_line("a", "again"),
        chat_line("c", "q", model="tuned"),
        chat_line("d", "q", model="gpt-4o"),
        json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
    ]
    path.write_text("\n".join(lines) + "\n")
    limits = InputLimits(only_url="/v1/chat/completions")
    errors, invalid, total = invalid_lines(path, served, limits)
    assert (invalid, total) == (4, 6)
    assert [(e.line, e.code) for e in errors] == [
        (2, "invalid_json"),
        (3, "duplicate_custom_id"),
        (5, "model_not_found"),
        (6, "unsupported_url"),
    ]
    assert all(
        e.message and str(tmp_path) not in e.message for e in errors
    )  # no server path in what users see


# -- usage and model ------------------------------------------------------------------------------------------
def test_usage_and_model_from_a_manifest():
    manifest = {
        "model": {"name": "base"},
        "tokens": {"prompt": 120, "completion": 30},
        "models": {
            "base": {"rows": 10, "adapters": {"tuned": {"rows": 7}}},
            "other": {"rows": 2, "adapters": {}},
        },
    }
    found = from_manifest(manifest)
    assert found.model == "tuned"  # 7 rows named the adapter, 3 the base model, 2 the other
    usage = found.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (120, 30, 150)
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert from_manifest(
        {"model": {"name": "base"}, "tokens": {"prompt": 0, "completion": 0}, "models": {}}
    ).model == ("base")


def test_usage_of_a_batch_cut_short_sums_what_its_checkpoint_staged(tmp_path):
    staging = StagingArea(tmp_path)
    staging.create()
    staging.write_rows(
        "results",
        [StagedRow(f"r{i}", i, "in", None, 10, 4, "default", "{}", model="base") for i in range(3)],
    )
    staging.write_rows(
        "errors", [StagedRow("e", 9, "in", "engine_error", 5, 0, "default", "{}", model="tuned")]
    )
    found = account(tmp_path)
    assert (found.usage.input_tokens, found.usage.output_tokens, found.usage.total_tokens) == (35, 12, 47)
    assert found.model == "base"
    empty = account(tmp_path / "nothing")
    assert empty.usage.total_tokens == 0 and empty.model is None


def test_store_keeps_usage_and_model(sweeping):
    store, _, _ = sweeping
    store.add_file("file-in", "o", "in.jsonl", "batch", 7)
    store.add_batch("batch_1", "o", "/v1/chat/completions", "file-in", "24h", None, 0, int(time.time()) + DAY)
    assert store.batch("batch_1").usage is None
    found = from_manifest({"model": {"name": "m"}, "tokens": {"prompt": 5, "completion": 2}, "models": {}})
    store.update_batch("batch_1", usage=found.usage, model=found.model)
    batch = store.batch("batch_1")
    assert batch.usage == found.usage and batch.model == "m"


# -- the API in process, through the official client --------------------------------------------------------------
KEY = "key-retention-" + "0" * 16


@pytest.fixture
def api(tmp_path, monkeypatch):
    """The app over a BatchService whose runner and sweeper are not started (sweeps are the test's), and the
    official `openai` client talking to it in process."""
    import openai
    from fastapi.testclient import TestClient

    from pipeline.server.routes import BatchService, create_app
    from pipeline.server.settings import AuthSettings, ServerConfig

    monkeypatch.setenv("NIGHTSHIFT_API_KEYS", KEY)
    config = ServerConfig(data_dir=tmp_path / "data", auth=AuthSettings(), retention={"upload_seconds": 2})
    service = BatchService(config, None)
    service.runner.submit = lambda *_: None  # nothing runs: the rows are the whole state
    http = TestClient(create_app(service))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)
    yield service, client
    service.store.close()


def test_expires_after_as_the_client_sends_it_sets_expires_at(api, tmp_path):
    import openai

    service, client = api
    path = tmp_path / "in.jsonl"
    path.write_text(chat_line("a", "q") + "\n")
    uploaded = client.files.create(
        file=path.open("rb"), purpose="batch", expires_after={"anchor": "created_at", "seconds": 7200}
    )
    assert uploaded.expires_at == uploaded.created_at + 7200 and uploaded.status == "processed"
    defaulted = client.files.create(
        file=path.open("rb"), purpose="batch"
    )  # the server's retention.upload_seconds
    assert defaulted.expires_at == defaulted.created_at + 2
    for seconds in (MIN_SECONDS - 1, MAX_SECONDS + 1):
        with pytest.raises(openai.BadRequestError) as exc:
            client.files.create(
                file=path.open("rb"),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": seconds},
            )
        assert exc.value.body["param"] == "expires_after[seconds]"
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 60},
        )
    assert exc.value.body["param"] == "output_expires_after.seconds" and "3600" in exc.value.body["message"]
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 3600},
    )
    # Its output files will live an hour from when they are made.
    made = service.store.add_file(
        "file-o", service.store.owner_of(batch.id), "o", "batch_output", 1, batch_id=batch.id
    )
    assert made.expires_at == made.created_at + 3600
    assert {f.id for f in client.files.list()} == {uploaded.id, defaulted.id, "file-o"}
    # Past its expires_at a file is gone at once — before any sweep — and the sweep frees its bytes.
    time.sleep(2.1)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(defaulted.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id=defaulted.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert defaulted.id not in {f.id for f in client.files.list()}
    assert service.data.upload(defaulted.id).exists()
    service.sweeper.sweep()
    assert not service.data.upload(defaulted.id).exists() and service.data.upload(uploaded.id).exists()


def test_a_file_that_is_not_jsonl_is_refused_at_upload(api, tmp_path):
    import openai

    service, client = api
    path = tmp_path / "table.csv"
    path.write_text("custom_id,prompt\nq1,hello\n")
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=path.open("rb"), purpose="batch")
    body = exc.value.body
    assert body["param"] == "file" and body["code"] == "invalid_file_format" and "line 1 " in body["message"]
    assert not list(service.data.files.iterdir()) and not list(service.data.scratch.iterdir())
    path.write_text(chat_line("a", "q") + "\n{broken\n")
    kept = client.files.create(file=path.open("rb"), purpose="batch")
    assert kept.status == "error" and "line 2:" in kept.status_details
    assert client.files.retrieve(kept.id).status_details == kept.status_details


def test_a_delete_frees_an_uploads_bytes_unless_a_batch_still_reads_it(api, tmp_path):
    service, client = api
    path = tmp_path / "in.jsonl"
    path.write_text(chat_line("a", "q") + "\n")
    free = client.files.create(file=path.open("rb"), purpose="batch")
    held = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=held.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    client.files.delete(free.id)
    client.files.delete(held.id)
    assert not service.data.upload(free.id).exists() and service.data.upload(held.id).exists()
    owner = service.store.owner_of(batch.id)
    assert service.store.stored_by_purpose(owner) == {"batch": (1, path.stat().st_size)}
    service.store.update_batch(batch.id, status="completed", completed_at=int(time.time()))
    service.sweeper.sweep()
    assert not service.data.upload(held.id).exists() and service.store.stored_by_purpose(owner) == {}
