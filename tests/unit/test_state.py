"""The job state (`_staging/job.json`) and the manifest as typed models: they round-trip through JSON, read what
earlier runs wrote, and dump back exactly the same keys and values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.config import JobConfig
from pipeline.io.staging import JobStateError, StagingArea
from pipeline.manifest import Manifest
from pipeline.models import ResolvedModel
from pipeline.runtime.job import load_resumable
from pipeline.runtime.preflight import PreflightError
from pipeline.state import IngestRecord, JobInput, JobState

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "state"


def recorded(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def staged_job(tmp_path: Path, job: dict) -> StagingArea:
    staging = StagingArea(tmp_path / "out")
    staging.create()
    Path(staging.job_file).write_text(json.dumps(job, indent=2))
    return staging


def full_state() -> JobState:
    return JobState(
        job_id="j1",
        config=JobConfig(input="in.jsonl", output="out", engine={"backend": "fake"}),
        model=ResolvedModel(name="m", path="/models/m", revision="abc", source="local-dir", task="generate"),
        input=JobInput(
            location="in.jsonl", fingerprint="sha256:00", size_bytes=10, lines=3, valid=2, invalid=1
        ),
        lengths={"requests": 2, "longest_at": [0, 1]},
        ingest=IngestRecord(nodes=["n1"], tasks_by_node={"read": {"n1": 2}}, seconds={"read": 0.5}),
        ingested=True,
        fit={
            "enabled": True,
            "counted_by": "words",
            "max_model_len": {"value": 80, "source": "fitted", "model_limit": 8192, "block_size": 16},
        },
    )


def test_job_state_round_trips_through_staging(tmp_path):
    staging = StagingArea(tmp_path / "out")
    staging.create()
    state = full_state()
    staging.write_job(state)
    assert staging.read_job() == state
    assert json.loads(Path(staging.job_file).read_text()) == state.model_dump(mode="json")


def test_a_fresh_state_is_written_with_its_steps_still_empty(tmp_path):
    staging = StagingArea(tmp_path / "out")
    staging.create()
    staging.write_job(JobState(job_id="j1", config=JobConfig()))
    written = json.loads(Path(staging.job_file).read_text())
    assert written["job_id"] == "j1" and written["config"] == JobConfig().model_dump(mode="json")
    assert written["ingested"] is False and written["input"] is None and written["fit"] is None
    assert staging.read_job().fit is None


def test_a_job_json_written_before_the_state_was_typed_loads_and_dumps_back_unchanged(tmp_path):
    recorded_job = recorded("job.json")
    state = staged_job(tmp_path, recorded_job).read_job()
    assert state.ingested and state.input.valid == 17 and state.input.invalid == 2
    assert state.input.fingerprint.startswith("sha256:") and state.input.prefix_keyed == 0
    assert state.config.engine.backend == "fake" and state.model.name == "smollm2-135m-instruct"
    assert state.ingest.tasks_by_node["dedup"] and state.fit.max_model_len.value == 80
    # Fields this version added are left at their defaults; everything recorded comes back as it was.
    assert state.model_dump(mode="json", exclude_unset=True) == recorded_job


def test_unknown_and_missing_keys_of_another_version_do_not_break_resume(tmp_path):
    old = recorded("job.json")
    old["written_by_another_version"] = {"anything": [1, 2]}
    old["ingest"]["another_step_record"] = 3
    for key in ("location", "size_bytes", "prefix_keyed"):  # not recorded by earlier versions
        del old["input"][key]
    staging = staged_job(tmp_path, old)
    state = staging.read_job()
    assert state.input.location is None and state.input.size_bytes is None and state.input.prefix_keyed == 0
    # Kept, and written back when the state is saved again.
    staging.write_job(state)
    again = json.loads(Path(staging.job_file).read_text())
    assert again["written_by_another_version"] == {"anything": [1, 2]}
    assert again["ingest"]["another_step_record"] == 3
    config = load_resumable(str(tmp_path / "out"))
    assert config.job_id == old["job_id"] and config.output == str(tmp_path / "out")


def test_a_job_json_that_is_no_job_state_is_refused_with_its_path(tmp_path):
    staging = staged_job(tmp_path, {"job_id": "j1"})  # no config
    with pytest.raises(JobStateError, match=r"job\.json is not a nightshift job state"):
        staging.read_job()
    with pytest.raises(PreflightError, match="config"):
        load_resumable(str(tmp_path / "out"))


def test_assignments_are_checked():
    state = full_state()
    with pytest.raises(ValidationError):
        state.input.valid = "many"  # type: ignore[assignment]


def test_a_manifest_written_before_the_manifest_was_typed_validates_and_dumps_back_unchanged():
    recorded_manifest = recorded("manifest.json")
    manifest = Manifest.model_validate(recorded_manifest)
    assert manifest.counts.total == 19 and manifest.shards.results[0].rows == 17
    assert manifest.created_at.tzinfo is not None
    # Key order too: the file reads the same (fields this version added stay at their defaults, unset).
    dumped = manifest.model_dump(mode="json", exclude_unset=True)
    assert json.dumps(dumped) == json.dumps(recorded_manifest)


def test_the_manifest_names_every_key_it_holds():
    data = recorded("manifest.json")
    data["counts"]["unexpected"] = 1
    with pytest.raises(ValidationError, match="unexpected"):
        Manifest.model_validate(data)


# --- the fit records (pipeline/fit_record.py) ------------------------------------------------------------------


def test_each_kind_of_fit_record_loads_as_its_type_and_dumps_back_the_same_keys():
    from pipeline.fit_record import FitDecision, FitOff, FitSkipped, decision_of

    off = {"enabled": False, "reason": "turned off (--no-fit / engine.fit.enabled: false)"}
    skipped = {"enabled": True, "skipped": "measuring requests needs the model's tokenizer"}
    decided = recorded("job.json")["fit"]
    for data, kind in ((off, FitOff), (skipped, FitSkipped), (decided, FitDecision)):
        state = full_state().model_copy(update={"fit": None})
        state.fit = data  # validated on assignment, as fit_job stores it
        assert type(state.fit) is kind
        assert state.model_dump(mode="json")["fit"] == data
        assert (decision_of(state.fit) is not None) == (kind is FitDecision)
    assert decision_of(None) is None


def test_a_fit_record_of_the_first_fitting_version_still_loads(tmp_path):
    """The first fitting version wrote no longest_sequence, measured nothing under a given max_model_len, and named
    per-pool keys differently: the record loads (its keys kept), and resume applies what it decided."""
    old = recorded("job.json")
    old["fit"] = {
        "enabled": True,
        "counted_by": "m tokenizer + chat template",
        "max_model_len": {"value": 512, "source": "given", "model_limit": 8192, "block_size": 16},
        "max_num_seqs": {
            "default": {
                "value": 22,
                "source": "fitted",
                "max_model_len": 512,
                "kv_cache_tokens": 11264,
                "fits_at_max_model_len": 22,
                "why": "the KV cache holds 22",
            }
        },
        "notes": ["max_model_len given: requests not measured"],
        "warnings": [],
    }
    state = staged_job(tmp_path, old).read_job()
    assert state.fit.measured is None and state.fit.longest_sequence is None
    assert state.fit.fitted_max_num_seqs() == {"default": 22} and state.fit.fitted_max_model_len() is None
    assert state.model_dump(mode="json", exclude_unset=True)["fit"] == old["fit"]


def test_lengths_in_the_state_are_typed_and_written_as_before(tmp_path):
    from pipeline.fit_record import Lengths

    recorded_job = recorded("job.json")
    state = staged_job(tmp_path, recorded_job).read_job()
    assert isinstance(state.lengths, Lengths) and state.lengths.longest_at == (0, 5)
    assert state.model_dump(mode="json")["lengths"] == recorded_job["lengths"]
    merged = Lengths().merge(state.lengths)
    assert merged == state.lengths and merged.summary().model_dump() == recorded_job["fit"]["measured"]
