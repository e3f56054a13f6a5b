"""Core claims: disjoint between claimants, freed by release or by the claimant's death."""

from __future__ import annotations

import subprocess
import sys
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


def test_a_killed_claimant_frees_its_cores(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from cluster.cpu_cores import claim_cores; "
            f"c = claim_cores(1, candidates=[5], directory=Path({str(tmp_path)!r})); "
            "print(c.cores, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
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
