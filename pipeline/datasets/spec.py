"""A dataset job's settings (`dataset:` in the job file, `--template` and its siblings on the command line).

A job that names a template reads an ordinary table — Parquet, or JSONL of objects — instead of request lines: each
row becomes one request of `route`, its body made from the rendered templates (the route's registry entry says where
each text goes) and the sampling fields given once, and the output is the table back with answer columns.

Pure: no Ray, no vLLM; config.py embeds it in JobConfig.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.config_flags import ConfigError, Flag

# Body fields a dataset job sets itself: a template's text goes there, the id is the table's.
_RENDERED_FIELDS = frozenset({"messages", "prompt", "input", "instructions", "text_1", "text_2"})


def text_or_file(value: str, flag: str) -> str:
    """A template flag's value: the text of the file it names, when it names one; else the text itself."""
    path = Path(value)
    try:
        if len(value) < 4096 and "\n" not in value and path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {value}: the file cannot be read as UTF-8 text ({exc})") from exc
    return value


def comma_list(value: str, flag: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise ConfigError(f"{flag}: give the column names, separated by commas")
    return names


class DatasetConfig(BaseModel):
    """Templates over a table's columns: set `template` and the input is a table, the output the table answered."""

    model_config = ConfigDict(extra="forbid")

    template: Annotated[
        str | None,
        Flag(
            "--template",
            "Jinja2 template of each row's prompt over the table's columns (text, or a file holding it): "
            "the input is then a table (Parquet, or JSONL of objects) and the output the table with answers.",
            parse=text_or_file,
        ),
    ] = Field(
        default=None,
        description="Jinja2 template of each row's prompt (the user message for chat), over the row's columns: "
        "`{{ title }}`, loops over a list column, filters. Setting it makes the job a dataset job.",
    )
    system: Annotated[
        str | None,
        Flag(
            "--system",
            "Jinja2 template of the system prompt (text, or a file holding it).",
            parse=text_or_file,
        ),
    ] = Field(default=None, description="Jinja2 template of the system prompt (chat, responses).")
    pair_template: Annotated[
        str | None,
        Flag(
            "--pair-template",
            "Jinja2 template of the second text of a pair (the score route's text_2).",
            parse=text_or_file,
        ),
    ] = Field(default=None, description="Jinja2 template of the second text of a pair (score: text_2).")
    route: Annotated[
        str,
        Flag(
            "--route",
            "The route each row's request takes: chat, completions, responses, embeddings, score, transcriptions, "
            "translations.",
        ),
    ] = Field(
        default="chat", description="The route each row's request takes (a name from the route registry)."
    )
    id_column: Annotated[
        str | None,
        Flag("--id-column", "The column that identifies a row (unique); the output is sorted by it."),
    ] = Field(
        default=None,
        description="The column that identifies each row (unique, string or integer); the output is sorted by it. "
        "Default: the row's place in the input (file, row), which resume keeps.",
    )
    keep_columns: Annotated[
        list[str] | None,
        Flag(
            "--keep-columns",
            "The input columns the output keeps (comma-separated); default: all.",
            parse=comma_list,
        ),
    ] = Field(default=None, description="The input columns the output keeps; default: all of them.")
    max_tokens: Annotated[int | None, Flag("--max-tokens", "Most tokens each row's answer may have.")] = (
        Field(
            default=None,
            ge=1,
            description="Most tokens each row's answer may generate (the body's max_tokens).",
        )
    )
    temperature: Annotated[float | None, Flag("--temperature", "Sampling temperature of every row.")] = Field(
        default=None, ge=0, description="Sampling temperature of every row (the body's temperature)."
    )
    body: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other body field of the route, given once for every row (seed, response_format, stop, "
        "n, …; `--seed` is vLLM's engine seed, as in vLLM).",
    )
    json_output: Annotated[
        Literal["struct", "columns"] | None,
        Flag(
            "--json-output", "A JSON answer parsed into the table: struct (one `parsed` column) or columns."
        ),
    ] = Field(
        default=None,
        description="For requests that ask for JSON (body.response_format): the parsed answer as a `parsed` struct "
        "column typed by the JSON schema, or (`columns`) its fields as columns of their own.",
    )
    image_column: Annotated[
        str | None,
        Flag(
            "--image-column",
            "The column of each row's image (bytes, a path or a URL; a list for several), sent with the prompt.",
        ),
    ] = Field(
        default=None,
        description="The column holding each row's image: bytes, a path (absolute, or under media_root), or a URL "
        "(http(s)://, data:, file://); a list column for several. Chat: the images follow the prompt in the user "
        "message. Fetched under the job's media policy.",
    )
    audio_column: Annotated[
        str | None,
        Flag(
            "--audio-column",
            "The column of each row's audio (bytes, a path or a URL): --route transcriptions/translations, or chat.",
        ),
    ] = Field(
        default=None,
        description="The column holding each row's audio, as image_column: the file to transcribe with --route "
        "transcriptions or translations (the template, if any, is then the decoder's prompt), or audio parts of "
        "a chat message for an audio model.",
    )
    media_root: Annotated[
        str | None,
        Flag("--media-root", "The directory relative paths in the image/audio column are under."),
    ] = Field(
        default=None,
        description="The directory relative paths in image_column / audio_column are under. Default: the input's "
        "directory, when the input is on local disk (a job allows reading it: media.allowed_local_media_path).",
    )
    body_columns: dict[str, str] = Field(
        default_factory=dict,
        description="Body fields whose value each row carries in a column of its own, e.g. {max_tokens: budget} "
        "or {model: adapter} (a LoRA adapter per row).",
    )

    @property
    def enabled(self) -> bool:
        return self.template is not None or bool(self.media_columns)

    @property
    def media_columns(self) -> dict[str, str]:
        """The media kinds rows carry, and the column of each."""
        named = {"image": self.image_column, "audio": self.audio_column}
        return {kind: column for kind, column in named.items() if column is not None}

    @field_validator("media_root")
    @classmethod
    def _a_local_directory(cls, root: str | None) -> str | None:
        # Made absolute where the job is started: the engines that read the files run elsewhere.
        if root is None:
            return None
        if "://" in root:
            raise ValueError(
                f"{root!r}: the media root is a local directory (media on S3 or HTTP: give URLs)"
            )
        return os.path.abspath(os.path.expanduser(root))

    @field_validator("route")
    @classmethod
    def _a_templated_route(cls, route: str) -> str:
        from pipeline.endpoints import TEMPLATED_ROUTES

        if route not in TEMPLATED_ROUTES:
            raise ValueError(
                f"{route!r} is not a route a template can fill; one of {', '.join(TEMPLATED_ROUTES)}"
            )
        return route

    @model_validator(mode="after")
    def _consistent(self) -> DatasetConfig:
        from pipeline.endpoints import endpoint_named

        given = [
            name
            for name, field in type(self).model_fields.items()
            if name not in ("template", "image_column", "audio_column")
            and getattr(self, name) != field.get_default(call_default_factory=True)
        ]
        if not self.enabled:
            if given:
                raise ValueError(
                    f"{', '.join(sorted(given))} apply to a dataset job: set dataset.template too"
                )
            return self
        takes = endpoint_named(self.route).templated
        assert takes is not None
        if self.template is None and takes.needs_text:
            raise ValueError(f"the {self.route} route needs a prompt: give dataset.template (--template)")
        for kind in self.media_columns:
            if kind not in takes.media:
                raise ValueError(
                    f"the {self.route} route takes no {kind}: drop dataset.{kind}_column (routes that take one: "
                    f"{', '.join(_routes_taking(kind))})"
                )
        if takes.needs_media and takes.needs_media not in self.media_columns:
            raise ValueError(
                f"the {self.route} route reads each row's {takes.needs_media}: name its column with "
                f"dataset.{takes.needs_media}_column (--{takes.needs_media}-column)"
            )
        if self.media_root is not None and not self.media_columns:
            raise ValueError(
                "dataset.media_root is where media paths are: name the image or audio column too"
            )
        if self.system is not None and not takes.system:
            raise ValueError(f"the {self.route} route takes no system prompt: drop dataset.system")
        if takes.pair and self.pair_template is None:
            raise ValueError(f"the {self.route} route scores a pair of texts: give dataset.pair_template too")
        if not takes.pair and self.pair_template is not None:
            raise ValueError(f"the {self.route} route takes one text: drop dataset.pair_template")
        rendered = sorted(_RENDERED_FIELDS & (set(self.body) | set(self.body_columns)))
        if rendered:
            raise ValueError(
                f"body field(s) {', '.join(rendered)} come from the templates: drop them from body"
            )
        if self.json_output is not None:
            from pipeline.datasets.json_columns import asks_json

            if not asks_json(self.sampling()):
                raise ValueError(
                    "dataset.json_output parses JSON answers: ask for them with dataset.body.response_format "
                    "(a json_schema, or json_object)"
                )
            if not endpoint_named(self.route).generates:
                raise ValueError(
                    f"the {self.route} route generates no text to parse: drop dataset.json_output"
                )
        if "custom_id" in self.body_columns:
            raise ValueError("custom_id is not a body field: name the id column with dataset.id_column")
        unknown = sorted((set(self.sampling()) | set(self.body_columns)) - _body_fields(self.route))
        if unknown:
            hint = " (its output limit is max_completion_tokens)" if "max_tokens" in unknown else ""
            raise ValueError(
                f"the {self.route} route's requests take no {', '.join(unknown)}{hint}: drop it from the dataset "
                "settings"
            )
        return self

    def sampling(self) -> dict[str, Any]:
        """The body fields every row's request carries, the named flags over `body`."""
        named = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        return {**self.body, **{key: value for key, value in named.items() if value is not None}}

    def columns_read(self, template_columns: set[str]) -> set[str]:
        """The columns a row's request is made from (the templates', the id, the media, the per-row body fields)."""
        own = set(self.body_columns.values()) | ({self.id_column} if self.id_column else set())
        return template_columns | own | set(self.media_columns.values())


def _body_fields(route: str) -> frozenset[str]:
    """Every body field the route's requests take (as vLLM's request model knows them, and OpenAI's bookkeeping)."""
    from pipeline.endpoints import endpoint_named
    from pipeline.endpoints.base import OPENAI_BOOKKEEPING_FIELDS

    return endpoint_named(route).body_fields | OPENAI_BOOKKEEPING_FIELDS


def _routes_taking(kind: str) -> list[str]:
    from pipeline.endpoints import ENDPOINTS

    return [e.name for e in ENDPOINTS if e.templated is not None and kind in e.templated.media]
