"""Command-line flags declared on the config fields they set, as vLLM's `EngineArgs.add_cli_args` derives its
flags from its config: a field that is a flag carries a `Flag` (its name and its one-line help) in its annotation,

    max_num_seqs: Annotated[int | None, Flag("--max-num-seqs", "vLLM: most sequences run at once.")] = Field(...)

and the commands take their flags from the model, so no second map of flags to fields is kept beside it.

Runs on the driver, in the `nightshift` command. `Flag` and the walk over a model are plain Python, so config.py
(imported everywhere, Ray workers included) stays free of typer; typer is imported only where options are built.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, SecretStr


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change (pipeline.config raises it too)."""


@dataclass(frozen=True)
class Flag:
    """Marks a config field as a command-line flag (or, named in capitals, a positional argument)."""

    decls: str  # "--max-num-seqs"; "--fit/--no-fit" for an on/off pair; "INPUT" for an argument
    help: str
    # The typed text -> the field's value, for a flag whose text is not the field's type (a JSON object, prices);
    # called with the value and `decls`, it raises ConfigError naming the flag.
    parse: Callable[[Any, str], Any] | None = None
    multiple: bool = False  # may be repeated; the command gets the list

    @property
    def is_argument(self) -> bool:
        return not self.decls.startswith("-")

    @property
    def param_name(self) -> str:
        """The Python name typer passes it under: --cpu-kvcache-space -> cpu_kvcache_space, INPUT -> input."""
        return self.decls.split("/")[0].lstrip("-").replace("-", "_").lower()


@dataclass(frozen=True)
class ConfigFlag:
    """A flag and the config field it sets."""

    key: str  # dotted path in the config, e.g. engine.vllm.max_num_seqs
    flag: Flag
    annotation: Any  # the field's type


def config_flags(model: type[BaseModel], prefix: str = "") -> Iterator[ConfigFlag]:
    """Every field of `model` (nested models walked) that carries a Flag, in the model's field order."""
    for name, field in model.model_fields.items():
        flag = next((m for m in field.metadata if isinstance(m, Flag)), None)
        if flag is not None:
            yield ConfigFlag(prefix + name, flag, field.annotation)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from config_flags(field.annotation, f"{prefix}{name}.")


def flag_labels(model: type[BaseModel]) -> dict[str, str]:
    """Dotted config key -> the flag that sets it, so a validation error names what the user typed."""
    return {f.key: f.flag.decls for f in config_flags(model)}


class FlagValues:
    """The config flags one command was given, by dotted config key (a flag left out is None)."""

    def __init__(self, flags: list[ConfigFlag], values: dict[str, Any]) -> None:
        self._flags = {f.key: f for f in flags}
        # typer hands an unrepeated repeatable flag over as an empty list: not given, like any other.
        self._values = {key: None if value in ((), []) else value for key, value in values.items()}

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def overrides(self) -> dict[str, Any]:
        """Dotted key -> field value for merge_overrides (None: not given). A flag's own parse runs here, inside
        the command's error handling, and raises ConfigError naming the flag."""
        out = {}
        for key, value in self._values.items():
            flag = self._flags[key].flag
            out[key] = flag.parse(value, flag.decls) if value is not None and flag.parse else value
        return out

    def section(self, prefix: str) -> dict[str, Any]:
        """The overrides under one config section, keys relative to it: section("storage") -> {s3_region: ...}."""
        return {
            k.removeprefix(prefix + "."): v for k, v in self.overrides().items() if k.startswith(prefix + ".")
        }

    @property
    def labels(self) -> dict[str, str]:
        return {key: f.flag.decls for key, f in self._flags.items()}


def with_config_flags(
    model: type[BaseModel], *keys: str, help: dict[str, str] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A typer command that takes the flags declared on `model` (all of them, or those of `keys`), its own
    parameters kept. The command declares `flags: FlagValues` and receives the values there.

    `help` replaces a flag's help for this command (e.g. `resume --address` replaces the job's address). Typer
    reads a command's parameters from its signature, so the generated ones are set as the signature typer sees.
    """
    chosen = [f for f in config_flags(model) if not keys or f.key in keys]
    missing = set(keys) - {f.key for f in chosen}
    if missing:
        raise ValueError(f"no flag declared on {model.__name__} for {sorted(missing)}")

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        own = [p.replace(kind=p.KEYWORD_ONLY) for p in signature.parameters.values() if p.name != "flags"]
        clash = {p.name for p in own} & {f.flag.param_name for f in chosen}
        if clash:
            raise ValueError(f"{command.__name__}: parameters {sorted(clash)} are also config flags")
        generated = [_typer_parameter(f, (help or {}).get(f.key)) for f in chosen]
        arguments = [p for p, f in zip(generated, chosen, strict=True) if f.flag.is_argument]
        options = [p for p, f in zip(generated, chosen, strict=True) if not f.flag.is_argument]

        @functools.wraps(command)
        def with_flags(**kwargs: Any) -> Any:
            values = {f.key: kwargs.pop(f.flag.param_name) for f in chosen}
            return command(**kwargs, flags=FlagValues(chosen, values))

        parameters = [*arguments, *own, *options]
        with_flags.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        with_flags.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
        return with_flags

    return decorate


def _typer_parameter(config_flag: ConfigFlag, help: str | None) -> inspect.Parameter:
    import typer

    flag = config_flag.flag
    kind = _cli_type(config_flag)
    info = (
        typer.Argument(help=help or flag.help)
        if flag.is_argument
        else typer.Option(flag.decls, help=help or flag.help)
    )
    return inspect.Parameter(
        flag.param_name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind | None, info]
    )


def _cli_type(config_flag: ConfigFlag) -> Any:
    """The type typer converts the flag's text to: the field's own where typer knows it (so `--max-num-seqs x`
    fails as typer's 'not a valid integer'), text where pydantic or the flag's parse checks it."""
    flag = config_flag.flag
    if flag.parse is not None:
        return list[str] if flag.multiple else str
    field = _without_none(config_flag.annotation)
    if field in (bool, int, float, Path):
        return field
    if typing.get_origin(field) is list:
        return list[str]
    if field is str or field is SecretStr or typing.get_origin(field) is Literal:
        return str
    raise TypeError(f"{config_flag.key}: no command-line type for {field!r}; give the Flag a parse")


def _without_none(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation
