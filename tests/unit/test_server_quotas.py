"""Quotas per key: the `quotas` config (defaults, per-label overrides, checked at start against the keys' labels)
and the checks against what a key holds in the store."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from pipeline.config import ConfigError
from pipeline.server.quotas import QuotaExceeded, Quotas, stored_usage
from pipeline.server.settings import ServerConfig, load_server_config
from pipeline.server.store import Store
from tests.unit.keyrings import ring

KEY_A, KEY_B = "a" * 20, "b" * 20


def test_defaults_are_unlimited_and_a_label_overrides_what_it_gives(tmp_path):
    config = ServerConfig.model_validate(
        {
            "quotas": {
                "max_files": 10,
                "max_queued_batches": 3,
                "keys": {"team-a": {"max_files": None, "weight": 2}, "ci": {"max_running_batches": 1}},
            }
        }
    )
    assert ServerConfig().quotas.for_label(None).model_dump() == {
        "max_stored_bytes": None,
        "max_files": None,
        "max_queued_batches": None,
        "max_running_batches": None,
        "weight": 1.0,
    }
    team_a = config.quotas.for_label("team-a")
    assert (team_a.max_files, team_a.max_queued_batches, team_a.weight) == (None, 3, 2.0)  # null: no limit
    ci = config.quotas.for_label("ci")
    assert (ci.max_files, ci.max_running_batches, ci.weight) == (10, 1, 1.0)
    assert config.quotas.for_label("other") == config.quotas.for_label(None)
    # The config reaches the Serve replica as JSON: what a key was given (a null included) survives the trip.
    again = ServerConfig.model_validate_json(config.model_dump_json())
    assert again.quotas.for_label("team-a") == team_a and again.quotas.for_label("ci") == ci


def test_a_bad_quotas_config_fails_at_start_naming_what_to_change(tmp_path, monkeypatch):
    bad = tmp_path / "server.yaml"
    bad.write_text("quotas: {max_files: -1}\n")
    with pytest.raises(ConfigError, match="quotas.max_files"):
        load_server_config(bad, {})
    bad.write_text("quotas: {keys: {team-a: {max_bytes: 5}}}\n")
    with pytest.raises(ConfigError, match="quotas.keys.team-a.max_bytes"):
        load_server_config(bad, {})
    bad.write_text("quotas: {keys: {'a b': {max_files: 5}}}\n")
    with pytest.raises(ConfigError, match="quotas.keys.a b"):
        load_server_config(bad, {})
    with pytest.raises(ConfigError, match="--no-auth has no keys: remove quotas.keys"):
        load_server_config(None, {"auth.disabled": True, "quotas.keys": {"team-a": {"max_files": 1}}})
    # A label no key carries: a typo would leave the key on the defaults.
    keys = ring(tmp_path, f"{KEY_A} team-a\n{KEY_B}\n", monkeypatch)
    config = ServerConfig.model_validate({"quotas": {"keys": {"team-b": {"max_files": 1}}}})
    with pytest.raises(
        ConfigError, match=r"quotas.keys.team-b: .*\(the keys' labels are team-a\).*`KEY team-b`"
    ):
        Quotas(config.quotas, keys.labels)
    with pytest.raises(ConfigError, match="no key carries a label"):
        Quotas(config.quotas, {})


def test_serve_refuses_a_label_no_key_carries_before_ray_starts(tmp_path):
    from pipeline.cli import app

    (tmp_path / "keys").write_text(f"{KEY_A} team-a\n")
    (tmp_path / "server.yaml").write_text("quotas: {keys: {team-x: {max_files: 1}}}\n")
    result = CliRunner().invoke(
        app,
        ["serve", "--config", str(tmp_path / "server.yaml"), "--api-keys-file", str(tmp_path / "keys"),
         "--data-dir", str(tmp_path / "data")],
    )  # fmt: skip
    assert result.exit_code != 0
    assert "quotas.keys.team-x: no API key carries the label 'team-x'" in result.output
    assert not (tmp_path / "data").exists()


def test_the_checks_count_uploads_and_outputs_and_a_delete_frees(tmp_path):
    store = Store(tmp_path / "state.sqlite")
    settings = ServerConfig.model_validate(
        {"quotas": {"max_stored_bytes": 1000, "max_files": 3, "keys": {"big": {"max_stored_bytes": None}}}}
    ).quotas
    quotas = Quotas(settings, {"owner-big": "big"})
    quotas.check_upload(store, "owner", 1000)  # exactly the limit fits
    with pytest.raises(QuotaExceeded) as over:
        quotas.check_upload(store, "owner", 1001)
    assert (over.value.status, over.value.code, over.value.param) == (400, "storage_limit_exceeded", "file")
    assert "max_stored_bytes: 1000" in over.value.message
    quotas.check_upload(store, "owner-big", 10**12)  # its own, unlimited
    store.add_file("file-1", "owner", "in.jsonl", "batch", 600, lines=3)
    store.add_file(
        "file-2", "owner", "b_output.jsonl", "batch_output", 300, batch_id="batch_x", kind="results"
    )
    store.add_file("file-3", "other", "in.jsonl", "batch", 900, lines=3)
    assert (stored_usage(store, "owner").files, stored_usage(store, "owner").bytes) == (2, 900)
    quotas.check_upload(store, "owner", 100)
    with pytest.raises(
        QuotaExceeded,
        match="it holds 900 bytes, batch output files, running batches' checkpoints and uploads in progress "
        "included, and this file",
    ):
        quotas.check_upload(store, "owner", 101)
    store.add_file("file-4", "owner", "c.jsonl", "batch", 100, lines=1)
    with pytest.raises(QuotaExceeded) as over:  # 3 files: no fourth, whatever its size
        quotas.check_upload(store, "owner", 0)
    assert (over.value.status, over.value.code) == (400, "file_count_limit_exceeded")
    assert "max_files: 3" in over.value.message
    with pytest.raises(QuotaExceeded, match="a batch's output files need room"):  # 1000 bytes held
        quotas.check_batch(store, "owner")
    store.delete_file("file-2", "owner")
    quotas.check_upload(store, "owner", 300)
    quotas.check_batch(store, "owner")


def test_the_queue_limit_counts_unfinished_batches(tmp_path):
    store = Store(tmp_path / "state.sqlite")
    quotas = Quotas(ServerConfig.model_validate({"quotas": {"max_queued_batches": 2}}).quotas, {})
    expires = int(time.time()) + 60
    for batch_id in ("batch_1", "batch_2"):
        store.add_batch(batch_id, "owner", "/v1/chat/completions", "file-x", "24h", None, 1, expires)
    with pytest.raises(QuotaExceeded) as over:
        quotas.check_batch(store, "owner")
    assert (over.value.status, over.value.code, over.value.type) == (
        429,
        "queued_batches_limit_exceeded",
        "requests",
    )
    assert (
        "max_queued_batches: 2" in over.value.message
        and "it has 2 batches not yet finished" in over.value.message
    )
    store.update_batch("batch_1", status="in_progress")  # running or paused: still enqueued, as OpenAI counts
    with pytest.raises(QuotaExceeded):
        quotas.check_batch(store, "owner")
    store.update_batch("batch_2", status="cancelled")
    quotas.check_batch(store, "owner")
    quotas.check_batch(store, "someone-else")


def test_serve_warns_at_start_when_several_keys_share_it_without_quotas(tmp_path, monkeypatch):
    from structlog.testing import capture_logs

    from pipeline.server.service import BatchService

    def warnings_at_start(keys: str, quotas: dict | None = None, name: str = "data") -> list[str]:
        monkeypatch.setenv("NIGHTSHIFT_API_KEYS", keys)
        config = ServerConfig.model_validate({"data_dir": str(tmp_path / name), "quotas": quotas or {}})
        with capture_logs() as logs:
            BatchService(config, None).stop()
        return [entry["event"] for entry in logs if entry["log_level"] == "warning"]

    two = "a" * 20 + "," + "b" * 20
    (said,) = warnings_at_start(two)
    assert said.startswith("2 API keys share this server with no limit on ")
    for quota in ("max_stored_bytes", "max_files", "max_queued_batches", "max_running_batches"):
        assert quota in said
    (said,) = warnings_at_start(two, {"max_stored_bytes": 10**9, "max_files": 10}, name="partly")
    assert "max_queued_batches" in said and "max_stored_bytes" not in said
    every = {"max_stored_bytes": 10**9, "max_files": 10, "max_queued_batches": 5, "max_running_batches": 1}
    assert warnings_at_start(two, every, name="limited") == []
    assert warnings_at_start("a" * 20, name="alone") == []  # one key has no one to take from
