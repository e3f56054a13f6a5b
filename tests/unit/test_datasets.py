"""Dataset jobs, the pure stages: templates, the rows made requests, ingest's kept rows, and the table finalize
writes back (in this process: no Ray, no engine)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from pipeline.config import JobConfig
from pipeline.datasets.output import TableOutput, answered_table, answers, table_encoder
from pipeline.datasets.render import DatasetError, RowRenderer, position_id, sortable_id
from pipeline.datasets.spec import DatasetConfig, text_or_file
from pipeline.datasets.template import PromptTemplate, RenderError, TemplateError
from pipeline.io.encoders import HashingSink, ShardInfo
from pipeline.io.readers import input_source
from pipeline.io.rows import BadRow, TableRead
from pipeline.io.staging import StagingArea
from pipeline.protocol import ErrorCode, failed_request_record, invalid_line_record, result_record
from pipeline.runtime.commit.finalize import write_outputs
from pipeline.runtime.ingest.tasks import ingest
from pipeline.stages.shard import sort_keys

MODEL = "smollm2-135m-instruct"


def renderer(**spec) -> RowRenderer:
    return RowRenderer(DatasetConfig(**spec))


# --- templates -------------------------------------------------------------------------------------------------------


def test_a_template_names_its_columns_and_renders_loops_and_filters():
    template = PromptTemplate(
        "{{ title | upper }}:{% for shot in shots %} [{{ shot.q }} -> {{ shot.a }}]{% endfor %} {{ note or '-' }}",
        "dataset.template",
    )
    assert template.columns == {"title", "shots", "note"}
    row = {"title": "été", "shots": [{"q": "1+1", "a": "2"}, {"q": "2+2", "a": "4"}], "note": None, "x": 1}
    assert template.render(row) == "ÉTÉ: [1+1 -> 2] [2+2 -> 4] -"


def test_values_render_as_text_a_user_would_write():
    template = PromptTemplate("{{ when }} {{ raw }} {{ blob }}", "t")
    row = {"when": dt.date(2026, 12, 7), "raw": b"caf\xc3\xa9", "blob": b"\xff\x00"}
    assert template.render(row) == "2026-12-07 café /wA="


@pytest.mark.parametrize(
    ("text", "row", "says"),
    [
        ("{{ title }}", {}, "the row has no column title"),
        ("{{ title }}", {"title": None}, "null in this row: title"),
        ("{% for s in shots %}{{ s }}{% endfor %}", {"shots": None}, "null in this row: shots"),
        ("{{ title.__class__.__mro__ }}", {"title": "a"}, "the sandbox refused"),
        ("{{ n / 0 }}", {"n": 1}, "ZeroDivisionError"),
    ],
)
def test_a_row_the_template_cannot_render_is_that_rows_error(text, row, says):
    with pytest.raises(RenderError, match=says):
        PromptTemplate(text, "dataset.template").render(row)


def test_a_template_that_does_not_compile_is_the_jobs_error():
    with pytest.raises(TemplateError, match=r"dataset.system: line 1"):
        PromptTemplate("{{ title }", "dataset.system")


def test_a_template_flag_reads_the_file_it_names(tmp_path: Path):
    path = tmp_path / "prompt.j2"
    path.write_text("Summarise {{ text }}\n")
    assert text_or_file(str(path), "--template") == "Summarise {{ text }}\n"
    assert text_or_file("Summarise {{ text }}", "--template") == "Summarise {{ text }}"


# --- the job's settings ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"id_column": "id"}, "set dataset.template too"),
        ({"template": "{{ t }}", "route": "rerank"}, "not a route a template can fill"),
        ({"template": "{{ t }}", "route": "completions", "system": "s"}, "takes no system prompt"),
        ({"template": "{{ t }}", "route": "score"}, "give dataset.pair_template too"),
        ({"template": "{{ t }}", "pair_template": "{{ u }}"}, "takes one text"),
        ({"template": "{{ t }}", "body": {"messages": []}}, "come from the templates"),
        ({"template": "{{ t }}", "body_columns": {"custom_id": "id"}}, "dataset.id_column"),
        ({"image_column": "photo"}, "the chat route needs a prompt"),
        ({"template": "{{ t }}", "route": "embeddings", "image_column": "p"}, "takes no image.*: chat"),
        ({"template": "{{ t }}", "route": "transcriptions"}, "dataset.audio_column"),
        ({"audio_column": "a", "route": "transcriptions", "image_column": "p"}, "takes no image"),
        ({"template": "{{ t }}", "media_root": "/data"}, "name the image or audio column too"),
        ({"media_root": "/data"}, "set dataset.template too"),
        (
            {"audio_column": "a", "route": "transcriptions", "max_tokens": 9},
            "take no max_tokens.*max_completion",
        ),
        ({"template": "{{ t }}", "body": {"max_tokenz": 9}}, "take no max_tokenz"),
        ({"template": "{{ t }}", "body_columns": {"max_tokenz": "b"}}, "take no max_tokenz"),
        ({"template": "{{ t }}", "image_column": "p", "media_root": "s3://b/img"}, "a local directory"),
    ],
)
def test_settings_that_cannot_make_requests_are_refused_by_name(spec, says):
    with pytest.raises(ValidationError, match=says):
        JobConfig.model_validate({"dataset": spec})


# --- rows made requests ----------------------------------------------------------------------------------------------


def test_each_route_puts_the_rendered_texts_where_it_takes_them():
    row = {"q": "why", "d": "because", "sys": "be brief"}
    chat = renderer(template="{{ q }}", system="{{ sys }}", max_tokens=8, temperature=0)
    assert chat.request(row, 1, 0)["body"] == {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"}],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    assert renderer(template="{{ q }}", route="embeddings").request(row, 1, 0) == {
        "custom_id": position_id(0, 1),
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"input": "why"},
    }
    score = renderer(template="{{ q }}", pair_template="{{ d }}", route="score").request(row, 1, 0)
    assert score["url"] == "/v1/score" and score["body"] == {"text_1": "why", "text_2": "because"}
    responses = renderer(template="{{ q }}", system="{{ sys }}", route="responses").request(row, 1, 0)
    assert responses["body"] == {"input": "why", "instructions": "be brief"}


PNG_BYTES = b"\x89PNG\r\n\x1a\n" + b"rest"


def test_an_image_column_puts_each_rows_images_after_its_prompt():
    chat = renderer(template="Describe {{ name }}.", image_column="photo", media_root="/data/shop")
    body = chat.request({"name": "a kettle", "photo": PNG_BYTES}, 1, 0)["body"]
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Describe a kettle."},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgpyZXN0"}},
    ]}]  # fmt: skip
    listed = chat.request({"name": "x", "photo": ["shots/a b.png", "https://img.example/b.png"]}, 2, 0)[
        "body"
    ]
    urls = [part["image_url"]["url"] for part in listed["messages"][0]["content"][1:]]
    assert urls == ["file:///data/shop/shots/a%20b.png", "https://img.example/b.png"]
    assert chat.columns == {"name", "photo"}


def test_media_cells_of_a_hugging_face_dataset_and_a_relative_media_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    chat = renderer(template="{{ name }}", image_column="photo", media_root="shop")
    assert chat.spec.media_root == str(tmp_path / "shop")  # made absolute where the job starts
    cells = [{"bytes": PNG_BYTES, "path": "ignored.png"}, {"bytes": None, "path": "a.png"}]
    body = chat.request({"name": "x", "photo": cells}, 1, 0)["body"]
    urls = [part["image_url"]["url"] for part in body["messages"][0]["content"][1:]]
    assert urls == ["data:image/png;base64,iVBORw0KGgpyZXN0", f"file://{tmp_path}/shop/a.png"]


@pytest.mark.parametrize(
    ("cell", "says"),
    [
        (None, "'photo' is null"),
        ([], "empty list"),
        (b"", "empty bytes"),
        (3, "holds a int"),
        ("gopher://x/a.png", "http(s)://, data: or file://"),
    ],
)
def test_a_media_cell_that_makes_no_url_is_that_rows_error(cell, says):
    chat = renderer(template="{{ name }}", image_column="photo", media_root="/data")
    bad = chat.request({"name": "x", "photo": cell}, 1, 0)
    assert isinstance(bad, BadRow) and bad.code == "template_error" and says in bad.message, bad
    assert chat.failures_by_column["photo"] == 1


def test_an_audio_column_is_the_file_a_transcription_reads_and_the_template_its_prompt():
    plain = renderer(route="transcriptions", audio_column="call", body={"language": "en"})
    assert plain.request({"call": "/calls/1.wav"}, 1, 0) == {
        "custom_id": position_id(0, 1),
        "method": "POST",
        "url": "/v1/audio/transcriptions",
        "body": {"language": "en", "file_url": "file:///calls/1.wav"},
    }
    prompted = renderer(route="translations", audio_column="call", template="Names: {{ names }}")
    body = prompted.request({"call": b"RIFF\0\0\0\0WAVEfmt ", "names": "Ada"}, 1, 0)["body"]
    assert body == {"prompt": "Names: Ada", "file_url": "data:audio/wav;base64,UklGRgAAAABXQVZFZm10IA=="}
    two = plain.request({"call": ["/calls/a.wav", "/calls/b.wav"]}, 2, 0)
    assert isinstance(two, BadRow) and "takes one audio file" in two.message
    no_root = plain.request({"call": "calls/1.wav"}, 3, 0)
    assert isinstance(no_root, BadRow) and "--media-root" in no_root.message


def test_relative_media_paths_are_under_the_local_inputs_directory_which_the_job_may_read(tmp_path: Path):
    from pipeline.datasets.media import input_media_root
    from pipeline.job_plan import JobPlan

    (tmp_path / "shop").mkdir()
    table = tmp_path / "shop" / "rows.parquet"
    table.write_bytes(b"")
    assert input_media_root(str(table)) == str(tmp_path / "shop")
    assert input_media_root(str(tmp_path / "shop")) == str(tmp_path / "shop")
    assert input_media_root(str(tmp_path / "shop" / "part-*.parquet")) == str(tmp_path / "shop")
    assert input_media_root("s3://bucket/rows.parquet") is None
    assert input_media_root("https://example.com/rows.jsonl") is None

    dataset = {"template": "{{ name }}", "image_column": "photo"}
    plan = JobPlan.of(JobConfig.model_validate({"input": str(table), "output": str(tmp_path / "out"),
                                                 "dataset": dataset}))  # fmt: skip
    assert plan.dataset_spec.media_root == str(tmp_path / "shop")
    assert plan.media_policy.allowed_local_media_path == str(tmp_path / "shop")
    # A directory the user named for the policy is theirs to keep.
    own = {"allowed_local_media_path": "/srv/media"}
    plan = JobPlan.of(JobConfig.model_validate({"input": str(table), "output": str(tmp_path / "out"),
                                                 "dataset": dataset, "media": own}))  # fmt: skip
    assert plan.media_policy.allowed_local_media_path == "/srv/media"


def test_a_column_carries_per_row_values_and_a_null_leaves_the_jobs_own():
    rows = renderer(
        template="{{ q }}", max_tokens=8, body_columns={"max_tokens": "budget", "model": "adapter"}
    )
    assert rows.request({"q": "a", "budget": 3, "adapter": "sql"}, 1, 0)["body"]["max_tokens"] == 3
    body = rows.request({"q": "a", "budget": None, "adapter": None}, 1, 0)["body"]
    assert body["max_tokens"] == 8 and "model" not in body  # the validator gives it the job's model


def test_ids_sort_as_the_id_column_does():
    ints = [-(2**63), -5, -1, 0, 1, 9, 10, 2**40, 2**63 - 1]
    assert sorted(ints, key=lambda v: sortable_id(v).encode()) == ints
    assert sortable_id("b-7") == "b-7"
    assert [sortable_id(v) for v in (None, 1.5, True, "", 2**63)] == [None] * 5
    places = [position_id(f, r) for f, r in [(0, 2), (0, 10), (1, 1)]]
    assert sorted(places) == places


def test_a_row_without_a_usable_id_keeps_its_place_and_gets_an_error():
    rows = renderer(template="{{ q }}", id_column="id")
    bad = rows.request({"q": "a", "id": None}, 7, 2)
    assert isinstance(bad, BadRow) and bad.code == "invalid_custom_id" and bad.custom_id == position_id(2, 7)
    assert rows.request({"q": "a", "id": 5}, 7, 2)["custom_id"] == sortable_id(5)


def test_a_jsonl_line_is_parsed_and_one_that_is_not_an_object_is_its_rows_error():
    rows = renderer(template="{{ q }}", keep_columns=["q"])
    request, row = rows.read(b'{"q": "hi", "other": 1}', 4, 0)
    assert request["body"]["messages"][0]["content"] == "hi" and rows.kept(row) == {"q": "hi"}
    for line, code in ((b"not json", "invalid_json"), (b"[1, 2]", "invalid_json")):
        request, row = rows.read(line, 5, 0)
        assert isinstance(request, BadRow) and request.code == code and request.custom_id == position_id(0, 5)
    failed, _ = rows.read({"other": 1}, 6, 0)
    assert isinstance(failed, BadRow) and failed.code == ErrorCode.TEMPLATE_ERROR.value


def test_columns_the_table_lacks_fail_before_any_work_naming_what_it_has():
    rows = renderer(template="{{ title }}: {{ body }}", id_column="key")
    with pytest.raises(
        DatasetError, match=r"column\(s\) the table does not have: body, key \(it has: id, title"
    ):
        rows.check_columns(["id", "title", "text"])
    with pytest.raises(DatasetError, match="keep_columns names"):
        renderer(template="{{ t }}", keep_columns=["nope"]).check_columns(["t"])
    with pytest.raises(DatasetError, match="names of answer columns"):
        renderer(template="{{ t }}").check_columns(["t", "content"])
    renderer(template="{{ t }}", keep_columns=["t"]).check_columns(["t", "content"])  # not kept: no clash


# --- answers and the table -------------------------------------------------------------------------------------------


def _chat_result(custom_id: str, text: str) -> str:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    return json.dumps(result_record(custom_id, body, seed=custom_id))


def test_answers_carry_the_text_tokens_and_errors_of_every_kind_of_record():
    refused = invalid_line_record(None, ErrorCode.TEMPLATE_ERROR, "null in this row: q", 3, "t.jsonl")
    too_long = failed_request_record("c", ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long")
    table = answers([_chat_result("a", "hi"), json.dumps(refused), json.dumps(too_long)], "chat")
    assert table.to_pylist() == [
        {"content": "hi", "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 2, "error": None},
        {
            "content": None,
            "finish_reason": None,
            "prompt_tokens": None,
            "completion_tokens": None,
            "error": {"code": "template_error", "message": "null in this row: q"},
        },
        {
            "content": None,
            "finish_reason": None,
            "prompt_tokens": None,
            "completion_tokens": None,
            "error": {"code": "context_length_exceeded", "message": "too long"},
        },
    ]


def test_the_table_keeps_the_inputs_types_and_adds_the_answers(tmp_path: Path):
    kept = pa.table({"row": pa.array([{"id": 1, "when": dt.datetime(2026, 1, 1)}])})
    table = answered_table(kept, [_chat_result("a", "hi")], TableOutput("chat"))
    assert table.schema.field("when").type == pa.timestamp("us")
    assert table.column_names == [
        "id",
        "when",
        "content",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "error",
    ]
    as_json = pa.table({"row": pa.array([json.dumps({"id": "x", "tags": ["a"]})])})
    assert answered_table(as_json, [_chat_result("a", "hi")], TableOutput("chat")).to_pylist()[0]["tags"] == [
        "a"
    ]
    info = ShardInfo("t.jsonl", rows=1)
    encoder, _ = table_encoder("jsonl")
    out = tmp_path / "t.jsonl"
    writer = encoder(HashingSink(out.open("wb"), info))
    writer.write_table(table)
    writer.close()
    assert json.loads(out.read_text()) == {
        "id": 1,
        "when": "2026-01-01T00:00:00",
        "content": "hi",
        "finish_reason": "stop",
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "error": None,
    }


def test_table_keys_order_by_id_then_place():
    table = pa.table(
        {"custom_id": ["b", "a", "ab", "a"], "source": ["f", "f", "f", "g"], "line": [1, 9, 2, 1]}
    )
    keys = sort_keys(table, "table").to_pylist()
    assert [keys.index(k) for k in sorted(keys)] == [1, 3, 2, 0]


# --- through ingest and finalize, in this process ---------------------------------------------------------------------


def _staged_answers(staging: StagingArea) -> None:
    """Answer every staged request the way an engine's sink stages results (one part)."""
    from pipeline.io.staging import StagedRow

    rows = []
    for part in staging.request_files():
        for request in pq.read_table(part).to_pylist():
            body = json.loads(request["body"])
            text = f"re: {body['messages'][-1]['content']}"
            rows.append(
                StagedRow(
                    request["custom_id"],
                    request["line"],
                    request["source"],
                    None,
                    5,
                    2,
                    "default",
                    _chat_result(request["custom_id"], text),
                )
            )
    staging.write_rows("results", rows)


@pytest.mark.parametrize("rows_per_shard", [100, 3])
def test_a_table_goes_in_and_comes_back_sorted_with_every_row_once(tmp_path: Path, rows_per_shard: int):
    source_path = tmp_path / "table.parquet"
    ids = [7, -2, 30, 4, 11, 5, 4]
    pq.write_table(
        pa.table(
            {
                "id": ids,
                "text": ["seven", "minus two", None, "four", "eleven", "five", "four again"],
                "score": [0.5] * 7,
            }
        ),
        source_path,
    )
    spec = DatasetConfig(template="Say {{ text }}", id_column="id")
    source = input_source(str(source_path))
    source.table = TableRead()
    staging = StagingArea(tmp_path / "out")
    staging.create()
    report = ingest(source, MODEL, staging, job_id="j", parallel=False, dataset=spec)
    assert report.lines == 7 and report.invalid_by_code == {"template_error": 1, "duplicate_custom_id": 1}
    _staged_answers(staging)
    outputs = write_outputs(
        tmp_path / "out", staging, rows_per_shard, 7, format="parquet", table=TableOutput("chat")
    )
    assert outputs.counts.succeeded == 5 and outputs.counts.failed == 2 and not outputs.shards.errors
    tables = [pq.read_table(tmp_path / "out" / shard.name) for shard in outputs.shards.results]
    table = pa.concat_tables(tables)
    assert table.column("id").to_pylist() == [-2, 4, 4, 5, 7, 11, 30]
    assert table.column_names[:3] == ["id", "text", "score"]
    by_text = {row["text"]: row for row in table.to_pylist()}
    assert by_text["four"]["content"] == "re: Say four" and by_text["four"]["error"] is None
    assert by_text["four again"]["error"]["code"] == "duplicate_custom_id"
    assert by_text[None]["error"]["code"] == "template_error" and by_text[None]["content"] is None
    assert [shard.rows for shard in outputs.shards.results] == ([7] if rows_per_shard == 100 else [3, 3, 1])


# --- structured answers and vectors ----------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative"]},
        "stars": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "extra": {},
    },
}
JSON_BODY = {"response_format": {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}}}


def test_a_json_schema_types_the_parsed_column_and_an_answer_that_does_not_fit_is_null():
    from pipeline.datasets.json_columns import answer_schema, arrow_type, parsed_column

    assert answer_schema(JSON_BODY) == SCHEMA
    kind = arrow_type(SCHEMA)
    assert kind == pa.struct(
        [
            ("sentiment", pa.string()),
            ("stars", pa.int64()),
            ("tags", pa.list_(pa.string())),
            ("extra", pa.string()),
        ]
    )
    texts = [
        '{"sentiment": "positive", "stars": 5, "tags": ["fast"], "extra": {"a": 1}}',
        '{"sentiment": "negative", "stars": "two"}',  # a string where an integer is asked for
        '{"sentiment": "neg',  # cut at max_tokens
        None,
    ]
    assert parsed_column(texts, SCHEMA).to_pylist() == [
        {"sentiment": "positive", "stars": 5, "tags": ["fast"], "extra": '{"a":1}'},
        None,
        None,
        None,
    ]


def test_json_output_puts_the_parsed_answer_in_a_struct_or_in_columns():
    content = '{"sentiment": "positive", "stars": 4, "tags": [], "extra": null}'
    kept = pa.table({"row": pa.array([{"id": 1}])})
    spec = DatasetConfig(template="{{ t }}", body=JSON_BODY, json_output="struct")
    table = answered_table(kept, [_chat_result("a", content)], TableOutput.of(spec))
    assert table.column("parsed").to_pylist()[0]["stars"] == 4
    spread = TableOutput.of(spec.model_copy(update={"json_output": "columns"}))
    table = answered_table(kept, [_chat_result("a", content)], spread)
    assert table.column_names[-4:] == ["sentiment", "stars", "tags", "extra"] == spread.answer_names()[-4:]
    assert table.column("sentiment").to_pylist() == ["positive"]
    with pytest.raises(ValidationError, match="ask for them with dataset.body.response_format"):
        DatasetConfig(template="{{ t }}", json_output="struct")


def test_embeddings_are_a_fixed_size_float32_list():
    def embedding(vector):
        body = {
            "id": "embd-1",
            "object": "list",
            "model": MODEL,
            "data": [{"index": 0, "object": "embedding", "embedding": vector}],
            "usage": {"prompt_tokens": 3, "total_tokens": 3},
        }
        return json.dumps(result_record("e", body, seed="e"))

    refused = json.dumps(invalid_line_record(None, ErrorCode.TEMPLATE_ERROR, "null", 2, "t"))
    table = answers([embedding([0.5, 0.25, 1.0]), refused, embedding([0.0, 1.0, 0.0])], "embeddings")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 3)
    assert table.column("embedding").to_pylist() == [[0.5, 0.25, 1.0], None, [0.0, 1.0, 0.0]]
    assert table.column("prompt_tokens").to_pylist() == [3, None, 3]


@pytest.mark.parametrize(
    "text",
    ["Title: {{ title }}\n{{ text }}", "{{ title }}", "{{ text }}{{ title }} and {{ text }}.", "Only words."],
)
def test_a_plain_template_renders_what_jinja_renders_and_fails_as_it_fails(text):
    """Text and `{{ column }}` only: rendered by joining strings, with Jinja's own text and errors for every kind of
    value a table holds (the sandboxed Jinja render is the reference)."""
    import decimal
    import itertools

    template = PromptTemplate(text, "dataset.template")
    assert template._plain is not None
    values = [
        "x", "", "ünï ✓ \n{{ not a template }}", 5, 0, -3, 1.5, float("nan"), True, False, None, [1, "a", None],
        {"k": [b"\xff"]}, b"bytes", b"\xff\xfe", dt.date(2026, 12, 7), decimal.Decimal("1.50"), "MISSING",
    ]  # fmt: skip
    for title, body in itertools.product(values, repeat=2):
        row = {name: value for name, value in (("title", title), ("text", body)) if value != "MISSING"}
        try:
            want = template._render(row)
        except RenderError as exc:
            with pytest.raises(RenderError) as got:
                template.render(row)
            assert (str(got.value), got.value.columns) == (str(exc), exc.columns), row
            continue
        assert template.render(row) == want, row


def test_kept_parquet_rows_are_sliced_from_their_batches_with_their_types(tmp_path):
    """A Parquet row's kept columns go from its Arrow batch to the staged part without passing through Python, run
    by run across batches: the same table as building it from the rows' values, types kept."""
    from pipeline.datasets.kept import KeptRows, kept_struct
    from pipeline.io.parquet import iter_table_parquet

    table = pa.table(
        {
            "id": pa.array(range(10), pa.int64()),
            "text": [f"t{i}" for i in range(10)],
            "when": pa.array([dt.datetime(2026, 12, 7, 0, i) for i in range(10)], pa.timestamp("us")),
            "tags": [[f"a{i}", None] for i in range(10)],
            "raw": [bytes([i, 255]) for i in range(10)],
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    keep = ["when", "tags", "raw", "id"]
    with open(path, "rb") as handle:
        rows = [
            row.payload
            for row in iter_table_parquet(handle, "t.parquet", None, batch_rows=4, rendered=["text"])
        ]
    assert {tuple(r) for r in rows} == {("text",)}  # only the rendered column is a Python value
    kept = KeptRows(kept_struct(table.schema, keep))
    chosen = [0, 1, 2, 3, 4, 6, 7, 9]  # runs across three batches, with gaps
    for i in chosen:
        kept.add(f"id-{i}", "t.parquet", i + 1, rows[i])
    expected = pa.array(
        [{name: table.column(name)[i].as_py() for name in keep} for i in chosen],
        kept_struct(table.schema, keep),
    )
    got = kept.table()
    assert got.column("row").combine_chunks().equals(expected)
    assert got.column("custom_id").to_pylist() == [f"id-{i}" for i in chosen]
