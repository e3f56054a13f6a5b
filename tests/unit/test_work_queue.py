"""The work queue serves every request exactly once, in full chunks, across read-batch and file boundaries —
the job creates ceil(rows / chunk) pulls, so a short chunk mid-stream would strand rows."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.runtime.work_queue import WorkQueue


def test_every_row_served_once_in_ceil_rows_over_chunk_pulls(tmp_path):
    files, n = [], 0
    for i, size in enumerate([50, 50, 20]):  # part sizes that are no multiple of the chunk or read batch
        path = tmp_path / f"part-{i}.parquet"
        pq.write_table(pa.table({"custom_id": [f"r-{n + k:04d}" for k in range(size)]}), path)
        files.append(str(path))
        n += size
    chunk = 16
    queue = WorkQueue(files, credit={"p": 10_000}, read_rows=7)

    async def drain() -> list[pa.Table]:
        chunks = []
        for _ in range(-(-n // chunk)):
            table = await queue.next_chunk("p", chunk)
            assert table is not None
            chunks.append(table)
            await queue.done("p", table.num_rows)
        assert await queue.next_chunk("p", chunk) is None
        return chunks

    chunks = asyncio.run(drain())
    ids = [i for table in chunks for i in table.column("custom_id").to_pylist()]
    assert sorted(ids) == [f"r-{k:04d}" for k in range(n)]
    assert [t.num_rows for t in chunks] == [16] * 7 + [8]
