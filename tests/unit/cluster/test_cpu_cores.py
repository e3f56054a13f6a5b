"""Core claims: disjoint between claimants, freed by release or by the claimant's death."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from cluster.cpu_cores import claim_cores, usable_cpus


def test_claims_are_disjoint_and_lowest_first(tmp_path):
    first = claim_cores(1, candidates=[0, 1, 2], directory=tmp_path)
    second = claim_cores(2, candidates=[0, 1, 2], directory=tmp_path)
    assert first is not None and second is not None
    assert first.cores == [0]
    assert second.cores == [1, 2]
    assert second.omp_bind == "1,2"


def test_too_few_free_cores_claims_nothing(tmp_path):
    held = claim_cores(1, candidates=[0, 1], directory=tmp_path)
    assert claim_cores(2, candidates=[0, 1], directory=tmp_path) is None
    # The failed claim must not keep core 1: it is still there for a one-core claimant.
    other = claim_cores(1, candidates=[0, 1], directory=tmp_path)
    assert held is not None and other is not None and other.cores == [1]


def test_release_frees_cores(tmp_path):
    claim = claim_cores(1, candidates=[3], directory=tmp_path)
    assert claim is not None
    assert claim_cores(1, candidates=[3], directory=tmp_path) is None
    claim.release()
    again = claim_cores(1, candidates=[3], directory=tmp_path)
    assert again is not None and again.cores == [3]


def _holder(code: str) -> subprocess.Popen:
    """Another process that runs `code` (which prints what it holds, then sleeps), to be killed by the test."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from pathlib import Path; import cluster.cpu_cores as cc\n" + code,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_killed_claimant_frees_its_cores(tmp_path):
    holder = _holder(
        f"c = cc.claim_cores(1, candidates=[5], directory=Path({str(tmp_path)!r}))\n"
        "print(c.cores, flush=True); time.sleep(60)"
    )
    try:
        assert holder.stdout.readline().strip() == "[5]"
        assert claim_cores(1, candidates=[5], directory=tmp_path) is None
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 5
        claim = None
        while claim is None and time.monotonic() < deadline:
            claim = claim_cores(1, candidates=[5], directory=tmp_path)
        assert claim is not None and claim.cores == [5]
    finally:
        holder.kill()


def test_zero_cpus_claims_nothing(tmp_path):
    assert claim_cores(0, directory=tmp_path) is None


def test_default_candidates_are_this_process_cpus(tmp_path):
    claim = claim_cores(1, directory=tmp_path)
    assert claim is not None and claim.cores[0] in usable_cpus()


def test_unwritable_lock_directory_falls_back(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert claim_cores(1, candidates=[0], directory=blocker / "locks") is None


def test_start_slots_let_that_many_start_at_once_and_the_rest_wait(tmp_path):
    from cluster.cpu_cores import start_slot

    inside, most, lock = [0], [0], threading.Lock()
    order: list[int] = []

    def start(i: int) -> None:
        with start_slot(2, directory=tmp_path, poll_s=0.01) as slot:
            assert slot in (0, 1)
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                order.append(i)
            time.sleep(0.1)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=start, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(order) == [0, 1, 2, 3, 4]  # every start got a slot in the end
    assert most[0] == 2  # never more than two at once, and the two slots were used together


def test_a_start_slot_is_freed_by_its_holders_death_and_by_an_error(tmp_path):
    from cluster.cpu_cores import start_slot

    holder = _holder(
        f"with cc.start_slot(1, directory=Path({str(tmp_path)!r})) as slot:\n"
        "    print(slot, flush=True); time.sleep(60)"
    )
    try:
        assert holder.stdout.readline().strip() == "0"
        waited = time.monotonic()
        threading.Timer(0.3, holder.kill).start()
        with start_slot(1, directory=tmp_path, poll_s=0.01) as slot:
            assert slot == 0 and time.monotonic() - waited >= 0.3  # it waited for the holder to die
    finally:
        holder.kill()
    try:
        with start_slot(1, directory=tmp_path):
            raise RuntimeError("the engine's imports failed")
    except RuntimeError:
        pass
    with start_slot(1, directory=tmp_path, poll_s=0.01) as slot:
        assert slot == 0


def test_start_slots_are_half_the_usable_cores(monkeypatch):
    import cluster.cpu_cores as cc

    monkeypatch.setattr(cc, "usable_cpus", lambda: [0, 1])
    assert cc.start_slots() == 1
    monkeypatch.setattr(cc, "usable_cpus", lambda: [0])
    assert cc.start_slots() == 1
    monkeypatch.setattr(cc, "usable_cpus", lambda: list(range(64)))
    assert cc.start_slots() == 32


def test_no_lock_directory_means_no_wait(tmp_path):
    from cluster.cpu_cores import start_slot

    blocker = tmp_path / "file"
    blocker.write_text("")
    with start_slot(1, directory=blocker / "locks") as slot:  # a directory under a file cannot exist
        assert slot is None


def test_a_start_waits_for_a_slot_only_so_long(tmp_path):
    from cluster.cpu_cores import start_slot

    with start_slot(1, directory=tmp_path) as held:
        began = time.monotonic()
        with start_slot(1, directory=tmp_path, poll_s=0.01, wait_at_most_s=0.2) as slot:
            assert held == 0 and slot is None  # went ahead without one
            assert 0.2 <= time.monotonic() - began < 5
