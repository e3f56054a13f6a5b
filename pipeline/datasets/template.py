"""Prompt templates: Jinja2 in a sandbox, with strict undefined, over one row's columns.

    template = PromptTemplate("Summarise {{ title }}:\\n{{ text }}", "dataset.template")
    template.columns          # {"title", "text"}: checked against the table before any work
    template.render(row)      # str, or RenderError naming the row's problem (that row's error, never the job's)

The sandbox (`ImmutableSandboxedEnvironment`) keeps a template from reaching Python internals or changing a row: a
job file may come from anyone who can submit one. Strict undefined makes a column the row lacks an error instead of
an empty string, and a null column is an error too unless the template says what to do with it
(`{{ note or "" }}`, `{% if note %}`), since a prompt with a silent gap is a wrong answer that looks right.

Pure: no Ray, no vLLM.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError


class TemplateError(ValueError):
    """A template that cannot be compiled: the job's error, before any work."""


class RenderError(ValueError):
    """A row its template cannot render: that row's error. `columns`: the row's columns that made it fail (missing
    or null), when known."""

    def __init__(self, message: str, columns: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.columns = columns


class _NullPrinted(Exception):
    """A null value reached the output of `{{ … }}`: raised by the environment's finalize, told apart above."""


def _no_null(value: Any) -> Any:
    if value is None:
        raise _NullPrinted
    return value


# finalize runs on the value of every `{{ … }}`: a null printed as "None" is refused there, while a null the
# template tests or replaces (`{% if note %}`, `{{ note or "" }}`) never reaches it.
_ENV = ImmutableSandboxedEnvironment(
    undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True, finalize=_no_null
)


def _shown(value: Any) -> Any:
    """A column value as a template sees it: bytes as UTF-8 text (base64 when it is not text), dates in ISO form,
    decimals as their digits; lists and structs element by element."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, list | tuple):
        return [_shown(v) for v in value]
    if isinstance(value, dict):
        return {k: _shown(v) for k, v in value.items()}
    return value


def _plain_parts(parsed: nodes.Template) -> list[tuple[bool, str]] | None:
    """A template made of text and `{{ column }}` only, as (is_column, text or column name) in order; None for any
    other (filters, tests, loops, attributes...). Most prompt templates are plain, and a million rows rendered by
    joining strings instead of running Jinja's compiled code saves most of a core-second per ten thousand."""
    if len(parsed.body) != 1 or not isinstance(parsed.body[0], nodes.Output):
        return None if parsed.body else []
    parts: list[tuple[bool, str]] = []
    for node in parsed.body[0].nodes:
        if isinstance(node, nodes.TemplateData):
            parts.append((False, node.data))
        elif isinstance(node, nodes.Name) and node.ctx == "load":
            parts.append((True, node.name))
        else:
            return None
    return parts


class PromptTemplate:
    def __init__(self, text: str, name: str) -> None:
        self.name, self.text = name, text
        try:
            parsed = _ENV.parse(text)
            self._template = _ENV.from_string(parsed)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"{name}: line {exc.lineno}: {exc.message}") from exc
        # The names the template reads from the row (loop variables and `set` names are its own).
        self.columns: frozenset[str] = frozenset(meta.find_undeclared_variables(parsed))
        self._plain = _plain_parts(parsed)
        # Text only (a system prompt that names no column): the same for every row.
        self._constant = (
            "".join(text for _, text in self._plain) if self._plain is not None and not self.columns else None
        )

    def render(self, row: dict[str, Any]) -> str:
        if self._constant is not None:
            return self._constant
        if self._plain is not None:
            return self._render_plain(row)
        return self._render(row)

    def _render_plain(self, row: dict[str, Any]) -> str:
        """What Jinja renders for a plain template (text and `{{ column }}`), and the same errors: the first
        problem in the template's order decides, a column the row lacks or a null one."""
        out = []
        for is_column, text in self._plain:
            if not is_column:
                out.append(text)
                continue
            if text not in row:
                missing = sorted(c for c in self.columns if c not in row)
                raise RenderError(f"{self.name}: the row has no column {', '.join(missing)}")
            value = row[text]
            if value is None:
                raise self._null_printed(sorted(c for c in self.columns if c in row and row[c] is None))
            out.append(str(_shown(value)))
        return "".join(out)

    def _null_printed(self, nulls: list[str]) -> RenderError:
        return RenderError(
            f"{self.name}: a null value would be printed as 'None' (null in this row: "
            f"{', '.join(nulls) or 'a value the template computed'}); a template that allows it says so, "
            f'e.g. {{{{ {(nulls or ["column"])[0]} or "" }}}}',
            tuple(nulls),
        )

    def _render(self, row: dict[str, Any]) -> str:
        values = {column: _shown(row[column]) for column in self.columns if column in row}
        nulls = sorted(c for c in self.columns if c in row and row[c] is None)
        try:
            text = self._template.render(values)
        except jinja2.UndefinedError as exc:
            missing = sorted(c for c in self.columns if c not in row)
            if missing:
                raise RenderError(f"{self.name}: the row has no column {', '.join(missing)}") from exc
            if nulls:  # an attribute or item of a null column
                raise RenderError(
                    f"{self.name}: column {', '.join(nulls)} is null in this row ({exc.message})"
                ) from exc
            raise RenderError(f"{self.name}: {exc.message}") from exc
        except _NullPrinted:
            raise self._null_printed(nulls) from None
        except SecurityError as exc:
            raise RenderError(f"{self.name}: the sandbox refused: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - whatever a row's values make a template raise is that row's error
            null = f" (null in this row: {', '.join(nulls)})" if nulls else ""
            raise RenderError(f"{self.name}: {type(exc).__name__}: {exc}{null}", tuple(nulls)) from exc
        return text
