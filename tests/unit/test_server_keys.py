"""API keys with labels: `KEY LABEL` in the keys file (or $NIGHTSHIFT_API_KEYS) names a key for the server config
without putting the secret in it; a file of bare keys reads as before."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError
from pipeline.server.auth import Keyring, owner_of
from tests.unit.keyrings import ring

KEY_A, KEY_B, KEY_C = "a" * 20, "b" * 20, "c" * 20


def test_a_key_may_carry_a_label_and_old_keys_files_still_work(tmp_path, monkeypatch):
    keys = ring(
        tmp_path, f"# team keys\n{KEY_A}   team-a\n  {KEY_B}\n", monkeypatch, env=f" {KEY_C} ci.bot ,"
    )
    assert keys.labels == {owner_of(KEY_A): "team-a", owner_of(KEY_C): "ci.bot"}
    # The owner is the key's hash whatever its label: relabelling a key keeps its files and batches.
    assert (
        keys.owner(f"Bearer {KEY_A}") == owner_of(KEY_A) == Keyring([KEY_A], False).owner(f"Bearer {KEY_A}")
    )
    assert keys.owner(f"Bearer {KEY_B}") and keys.owner(f"Bearer {KEY_C}")
    assert keys.owner(f"Bearer {KEY_A} team-a") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{KEY_A} team a\n", "line 1: expected `KEY` or `KEY LABEL`, found 3 words"),
        (f"{KEY_A} team/a\n", "line 1: the label after the key must be"),
        (f"{KEY_A} x\n{KEY_B} x\n", "the label 'x' is given to two different API keys"),
        (f"{KEY_A} x\n{KEY_A} y\n", "one API key carries two labels, 'x' and 'y'"),
    ],
)
def test_a_bad_keys_file_says_what_to_change_and_never_quotes_a_key(tmp_path, monkeypatch, text, message):
    with pytest.raises(ConfigError, match=message) as err:
        ring(tmp_path, text, monkeypatch)
    assert KEY_A not in str(err.value) and KEY_B not in str(err.value)


def test_a_keyring_handed_on_as_digests_accepts_the_same_keys_with_the_same_owners_and_labels(
    tmp_path, monkeypatch
):
    from pipeline.server.settings import AuthSettings

    keys = ring(tmp_path, f"{KEY_A} team-a\n{KEY_B}\n", monkeypatch)
    digests = keys.as_digests()
    assert all(KEY_A not in d.model_dump_json() and KEY_B not in d.model_dump_json() for d in digests)
    monkeypatch.delenv("NIGHTSHIFT_API_KEYS", raising=False)
    again = Keyring.load(AuthSettings(key_digests=digests))
    for key in (KEY_A, KEY_B):
        assert again.owner(f"Bearer {key}") == keys.owner(f"Bearer {key}") == owner_of(key)
    assert again.owner(f"Bearer {KEY_C}") is None and again.owner(f"Bearer {KEY_A[:-1]}") is None
    assert again.labels == keys.labels == {owner_of(KEY_A): "team-a"}
