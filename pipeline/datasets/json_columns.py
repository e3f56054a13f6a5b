"""Structured answers as columns: a dataset job that asks for JSON gets the parsed object next to the text.

    schema = answer_schema(spec.sampling())          # the JSON schema the job's requests ask for, or None
    arrow_type(schema)                                # its Arrow type: an object a struct, an array a list, ...
    parsed_column(texts, schema)                      # the texts parsed and typed (null where one does not parse)

With `dataset.json_output: struct` the table gets a `parsed` column of that type; with `columns`, the object's fields
become columns of their own (`parsed.<field>` → `<field>`). A schema's type decides a column's type, so every shard of
the table has the same schema whatever its rows answered; an answer that does not parse (cut at max_tokens) or does
not fit the schema is null there, its text still in `content`. A job that asks for a JSON object without a schema
gets Arrow's own typing of the objects, per shard.

Pure: pyarrow, no Ray.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from pipeline import json_codec

_SCALARS = {
    "string": pa.string(),
    "integer": pa.int64(),
    "number": pa.float64(),
    "boolean": pa.bool_(),
}


def answer_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema a request body asks its answer to follow (OpenAI's response_format, or vLLM's
    structured_outputs.json); None when it asks for none (a JSON object without a schema included)."""
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        return schema if isinstance(schema, dict) else None
    structured = body.get("structured_outputs")
    if isinstance(structured, dict) and isinstance(structured.get("json"), dict):
        return structured["json"]
    return None


def asks_json(body: dict[str, Any]) -> bool:
    from pipeline.endpoints.base import asks_json_output

    return asks_json_output(body.get("response_format"), body.get("structured_outputs"))


def arrow_type(schema: dict[str, Any] | None) -> pa.DataType | None:
    """The Arrow type of values of `schema`; None where the schema does not say one type (a union, no type, a
    reference): such a value is kept as its JSON text."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):  # ["string", "null"]: nullable is what every Arrow column is
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None and "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        kind = "string"
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array":
        inner = arrow_type(schema.get("items"))
        return pa.list_(inner if inner is not None else pa.string())
    if kind == "object":
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            return None
        fields = []
        for name, sub in properties.items():
            typed = arrow_type(sub)
            fields.append(pa.field(str(name), typed if typed is not None else pa.string()))
        return pa.struct(fields)
    return None


def _conform(value: Any, kind: pa.DataType) -> Any:
    """`value` as a value of `kind`, or raise ValueError: a number where a string is asked for is no string."""
    if value is None:
        return None
    if pa.types.is_struct(kind):
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return {
            kind.field(i).name: _conform(value.get(kind.field(i).name), kind.field(i).type)
            for i in range(kind.num_fields)
        }
    if pa.types.is_list(kind):
        if not isinstance(value, list):
            raise ValueError("not an array")
        return [_conform(item, kind.value_type) for item in value]
    if pa.types.is_string(kind):
        if isinstance(value, str):
            return value
        return json_codec.dumps(value)  # a value the schema left untyped, kept as its JSON text
    if pa.types.is_boolean(kind):
        if not isinstance(value, bool):
            raise ValueError("not a boolean")
        return value
    if pa.types.is_integer(kind):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("not an integer")
        return value
    if pa.types.is_floating(kind):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("not a number")
        return float(value)
    raise ValueError(f"no value of {kind}")


def parsed_column(texts: list[str | None], schema: dict[str, Any] | None) -> pa.Array:
    """Each text parsed as JSON and typed by `schema` (null where it does not parse or fit); without a schema, the
    objects as Arrow types them (their JSON text when it cannot)."""
    kind = arrow_type(schema)
    values: list[Any] = []
    for text in texts:
        try:
            value = json_codec.loads(text) if isinstance(text, str) else None
            values.append(_conform(value, kind) if kind is not None else value)
        except (ValueError, UnicodeDecodeError):
            values.append(None)
    if kind is not None:
        return pa.array(values, kind)
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else json_codec.dumps(v) for v in values], pa.string())
