"""Pure helpers of bench/cluster_sim.py (engine timelines) and bench/dataplane.py (sizes, generator, anchor rows)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cluster_sim  # noqa: E402
import dataplane  # noqa: E402


def test_busy_fraction_counts_the_union_between_first_start_and_last_end():
    # Busy 0-4 (two overlapping requests) and 6-10; idle 4-6 of a 10 s span.
    assert cluster_sim.busy_fraction([(0, 3), (1, 4), (6, 10)]) == pytest.approx(0.8)
    assert cluster_sim.busy_fraction([(0, 10), (2, 3)]) == 1.0
    assert cluster_sim.busy_fraction([]) == 0.0


def test_longest_idle_is_the_widest_gap_with_nothing_inside():
    assert cluster_sim.longest_idle([(0, 3), (1, 4), (6, 10), (10.5, 11)]) == pytest.approx(2.0)
    assert cluster_sim.longest_idle([(0, 5), (1, 2), (3, 4)]) == 0.0


def test_occupancy_is_time_weighted_and_capped_at_the_slots():
    # Two slots: one request alone for 0-2 (half full), three inside 2-4 (full, capped): (0.5*2 + 1*2) / 4.
    intervals = [(0, 4), (2, 4), (2, 4)]
    assert cluster_sim.occupancy(intervals, 2) == pytest.approx(0.75)


def test_tail_share_is_the_time_after_95_percent_of_rows_finished():
    # 100 rows finishing 1 s apart from t=1; the 95th at t=95; span 0-100: the last 5 rows took 5%.
    ends = [float(t) for t in range(1, 101)]
    assert cluster_sim.tail_share(ends, 0.0, 100.0) == pytest.approx(0.05)
    # The same rows, but the last one finishes at t=200: the tail is (200 - 95) / 200.
    assert cluster_sim.tail_share(ends[:-1] + [200.0], 0.0, 200.0) == pytest.approx(0.525)


def test_placement_entries_finds_keys_anywhere_without_failing_when_absent():
    manifest = {
        "ingest": {"placement": {"node-1": 3}},
        "pools": {"a": {"node_ids": ["x"]}},
        "counts": {"ok": 1},
    }
    assert cluster_sim.placement_entries(manifest) == [
        ("ingest.placement", {"node-1": 3}),
        ("pools.a.node_ids", ["x"]),
    ]
    assert cluster_sim.placement_entries({"counts": {}}) == []


def test_output_lengths_stay_in_bounds_and_spread():
    lengths = cluster_sim.output_lengths(5000, 128, 0.8)
    assert min(lengths) >= cluster_sim.MIN_TOKENS and max(lengths) <= cluster_sim.MAX_TOKENS
    assert len(set(lengths)) > 200


@pytest.mark.parametrize("rows", [1, 7, 100, 1000, 10_000, 65_536])
def test_request_numbers_are_a_permutation(rows):
    numbers = list(dataplane.request_numbers(rows))
    assert sorted(numbers) == list(range(rows))


def test_parse_rows_takes_suffixes_and_lists():
    assert dataplane.parse_rows("1M,10M") == [1_000_000, 10_000_000]
    assert dataplane.parse_rows("100k") == [100_000]
    assert dataplane.parse_rows("250000") == [250_000]


def test_generate_streams_valid_unique_lines(tmp_path):
    jsonl, parquet = dataplane.generate(tmp_path, 500, parquet=False)
    assert parquet is None
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) == 500 and len({line["custom_id"] for line in lines}) == 500
    assert {line["url"] for line in lines} == {"/v1/chat/completions"}


def test_anchor_response_line_has_the_batch_result_shape():
    row = {
        "custom_id": "req-1",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 16},
    }
    record = json.loads(dataplane.response_line(row))
    assert record["custom_id"] == "req-1" and record["error"] is None
    assert record["response"]["status_code"] == 200
    body = record["response"]["body"]
    assert len(body["choices"][0]["message"]["content"].split()) == 16
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19}


def test_the_table_and_its_lines_hold_the_same_rows_as_a_dataset_job_makes_them(tmp_path):
    """The dataset path's two inputs: each row's Batch line is the request the template makes of it, under the id
    the job gives it, so both runs do the same work."""
    import pyarrow.parquet as pq

    from pipeline.datasets.render import RowRenderer
    from pipeline.datasets.spec import DatasetConfig

    table_path, lines_path = dataplane.generate_table(tmp_path, 500)
    table, lines = pq.read_table(table_path).to_pylist(), pq.read_table(lines_path).to_pylist()
    assert sorted(row["id"] for row in table) == list(range(500))
    assert {len(row["text"]) for row in table} == {300}
    renderer = RowRenderer(
        DatasetConfig(
            template=dataplane.TABLE_TEMPLATE, id_column="id", max_tokens=dataplane.TABLE_MAX_TOKENS
        )
    )
    for row, line in zip(table, lines, strict=True):
        request = renderer.request(row, 1, 0)
        assert request["custom_id"] == line["custom_id"] and request["body"] == json.loads(line["body"])
