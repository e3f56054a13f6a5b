"""The server's configuration (`--config server.yaml`, flags win): where state lives, the limits OpenAI applies by
default, who may call it, and the job every batch runs as. Everything is checked before Ray or Serve starts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    field_validator,
    model_serializer,
)

from pipeline.config import ConfigError, JobConfig, format_validation_error, read_yaml_mapping, set_dotted
from pipeline.config_flags import Flag


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerLimits(_Strict):
    max_requests_per_batch: int = Field(
        default=50_000, ge=1, description="Lines one batch input may hold (OpenAI: 50,000)."
    )
    max_file_bytes: int = Field(
        default=200 * 1024 * 1024,
        ge=1,
        description="Bytes one uploaded file may hold (OpenAI batch input: 200 MB).",
    )
    max_concurrent_uploads_per_key: int = Field(
        default=8,
        ge=1,
        description="Uploads one key may send at once; one more is refused (429) until one of them ends. Each "
        "counts against the key's max_stored_bytes at its declared size while it arrives.",
    )
    max_output_bytes_per_batch: int | None = Field(
        default=10 * 1024**3,
        ge=1,
        description="Bytes one batch's output may take on disk (its checkpoint, then its shards): a batch past it "
        "is stopped and ends `failed` (code output_too_large). Long answers, n and logprobs make an output many "
        "times its input. null: no limit.",
    )
    max_concurrent_batches: int = Field(
        default=1,
        ge=1,
        description="Batches running at once; the rest wait their turn, one key after another.",
    )
    fair_share_seconds: float = Field(
        default=300.0,
        ge=0,
        description="A key's turn on the engines while another key's batch waits for a slot: a running batch that "
        "has run this long (times its key's quotas weight) and finished rows in that time is paused — stopped as "
        "the night window stops it, its rows kept — and resumes from its checkpoint at its key's next turn. Each "
        "pause costs a job start (seconds), so keep turns well above that. 0: never pause a batch for another "
        "key's.",
    )
    completion_windows: list[Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{0,4}[mhd]$")]] = Field(
        default_factory=lambda: ["24h"],
        min_length=1,
        description="completion_window values accepted, e.g. 24h, 90m, 7d (OpenAI: only 24h).",
    )
    line_errors: Literal["record", "fail_batch"] = Field(
        default="record",
        description="A batch input's invalid lines (not JSON, not a request, a duplicate custom_id, another "
        "endpoint's url, a model not served): `record` runs the batch and makes each such line an error record "
        "of its error file; `fail_batch` is OpenAI's behaviour: the batch is validated before it runs and ends "
        "`failed`, its errors naming the lines, without running any of them.",
    )


class RetentionSettings(_Strict):
    """How long files live when a request gives no `expires_after` / `output_expires_after`, and how often expired
    ones are swept. A request's own policy (OpenAI's bounds: 1 hour to 30 days) wins over these."""

    upload_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Uploads (purpose batch) expire this long after their upload; null: kept until deleted. "
        "(OpenAI expires batch uploads after 30 days: 2592000.)",
    )
    output_seconds: int | None = Field(
        default=30 * 24 * 3600,
        ge=1,
        description="A batch's output and error files expire this long after they are made (30 days); null: kept "
        "until deleted. A finished batch's folder goes once its files are gone (a batch that made none: this long "
        "after it ended).",
    )
    sweep_seconds: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="How often expired files are deleted and the bytes of deleted ones freed (an upload a running "
        "batch still reads is freed at the first sweep after that batch ends).",
    )


# A key's label: how the server config names a key without holding its secret (`KEY LABEL` in the keys file).
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
Label = Annotated[str, StringConstraints(pattern=LABEL_PATTERN)]


class Quota(_Strict):
    """What one key may hold and run. null: no limit."""

    max_stored_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Bytes of files a key may hold: its uploads and its batches' output and error files (null: no "
        "limit). An upload that would pass it is refused, and so is a new batch while the key is at it (400).",
    )
    max_files: int | None = Field(
        default=None,
        ge=0,
        description="Files a key may hold, uploads and batch outputs (null: no limit); an upload past it is refused "
        "(400).",
    )
    max_queued_batches: int | None = Field(
        default=None,
        ge=0,
        description="Batches a key may have unfinished at once — waiting, running or paused, as OpenAI counts "
        "enqueued batches (null: no limit); creating one more is refused (429).",
    )
    max_running_batches: int | None = Field(
        default=None,
        ge=1,
        description="Of a key's batches, how many may run at once (null: up to limits.max_concurrent_batches); the "
        "others wait for one to end. Nothing is refused.",
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="The key's share of the engines against other keys with batches waiting: its turn lasts "
        "limits.fair_share_seconds × weight.",
    )


class KeyQuota(Quota):
    """One key's overrides: the fields given replace the defaults (null: no limit for this key), the others
    inherit them."""

    @model_serializer(mode="wrap")
    def _given_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Only what was given: the server config travels to the Serve replica as JSON, and a dumped default would
        # come back as an override (a key's `null`, no limit, would replace a limited default).
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class QuotaSettings(Quota):
    """Every key's quotas (the fields above), and per key, by its label, the fields that differ."""

    keys: dict[Label, KeyQuota] = Field(
        default_factory=dict,
        description="Per key, by the label it carries in the keys file (a line `KEY LABEL`): the fields given "
        "replace the defaults above, e.g. {team-a: {max_stored_bytes: 10000000000, weight: 2}}.",
    )

    def for_label(self, label: str | None) -> Quota:
        """The quotas of a key with this label (None: an unlabelled key)."""
        base = Quota(**{name: getattr(self, name) for name in Quota.model_fields})
        given = self.keys.get(label) if label is not None else None
        if given is None:
            return base
        return base.model_copy(update={name: getattr(given, name) for name in given.model_fields_set})


class KeyDigest(_Strict):
    """One API key as its SHA-256 digest, and its label."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The key's SHA-256, hex.")
    label: Label | None = Field(default=None, description="The key's label (quotas.keys), if it has one.")


class AuthSettings(_Strict):
    key_digests: list[KeyDigest] = Field(
        default_factory=list,
        description="API keys as their SHA-256 digests: what `nightshift serve` hands the server it starts in place "
        "of the keys it read (from the file or the variable, which it then removes from its environment), so no "
        "process of its Ray holds a key. A config may give them too.",
    )
    keys_file: Annotated[
        Path | None,
        Flag(
            "--api-keys-file",
            "File of API keys, one per line (`KEY` or `KEY LABEL`). Also: $NIGHTSHIFT_API_KEYS.",
        ),
    ] = Field(
        default=None,
        description="File of API keys, one per line (# comments): `KEY`, or `KEY LABEL` to name the key in quotas.keys "
        "(the label: letters, digits, . _ -).",
    )
    keys_env: str = Field(
        default="NIGHTSHIFT_API_KEYS",
        description="Environment variable holding API keys, comma-separated, each `KEY` or `KEY LABEL`.",
    )
    disabled: Annotated[bool, Flag("--no-auth", "Accept requests without a key (loopback only).")] = Field(
        default=False, description="No keys at all (--no-auth); allowed only when listening on loopback."
    )


class ServerConfig(_Strict):
    """The server's settings; the fields that carry a Flag are `nightshift serve`'s flags (serve_flags)."""

    host: Annotated[str, Flag("--host", "Address to listen on. Default: 127.0.0.1.")] = Field(
        default="127.0.0.1", description="Address the HTTP API listens on."
    )
    port: Annotated[int, Flag("--port", "Port to listen on. Default: 8000.")] = Field(
        default=8000, ge=1, le=65535, description="Port the HTTP API listens on."
    )
    address: Annotated[str | None, Flag("--address", "Ray cluster to join; default: start a local Ray.")] = (
        Field(default=None, description="Ray cluster to join; default: start a local Ray.")
    )
    data_dir: Annotated[
        Path, Flag("--data-dir", "Files, batch outputs and the SQLite state. Default: ./nightshift-data.")
    ] = Field(
        default=Path("nightshift-data"), description="Files, batch outputs and the SQLite state live here."
    )
    auth: AuthSettings = Field(default_factory=AuthSettings, description="API keys.")
    limits: ServerLimits = Field(default_factory=ServerLimits, description="Limits, OpenAI's by default.")
    retention: RetentionSettings = Field(
        default_factory=RetentionSettings,
        description="How long files are kept, and the sweeper that frees them.",
    )
    quotas: QuotaSettings = Field(
        default_factory=QuotaSettings,
        description="Per key: stored bytes, files, unfinished and running batches, and its share of the engines. No "
        "limits by default.",
    )
    job: JobConfig = Field(
        default_factory=JobConfig,
        validate_default=True,
        description="The job config every batch runs with (model, engine, resources …); input and output are the "
        "batch's own. Its media policy refuses private networks unless job.media.allow_private_networks says "
        "otherwise: a tenant's image URL must not reach the cluster's own network.",
    )
    hours: Annotated[
        str | None,
        Flag(
            "--hours",
            "Run batches only inside this daily window, HH:MM-HH:MM (may wrap midnight): running ones stop at its "
            "end, finished rows kept, and resume at the next opening.",
        ),
    ] = Field(
        default=None,
        description="Run batches only inside this daily window, HH:MM-HH:MM (may wrap midnight, e.g. 22:00-06:00): "
        "batches start or resume only inside it, and running ones are stopped at its end (they stay in_progress, "
        "their finished rows kept) and resume at the next opening.",
    )
    timezone: Annotated[
        str | None, Flag("--timezone", "--hours: the window's IANA timezone (default: local time).")
    ] = Field(default=None, description="The window's IANA timezone (default: the server's local time).")
    engine_idle_seconds: Annotated[
        float,
        Flag(
            "--engine-idle-seconds",
            "Keep engines warm this long after the last batch, for the next batch of the same model "
            "(default 600; 0: every batch starts its own).",
        ),
    ] = Field(
        default=600.0,
        ge=0,
        description="Warm engines: batches of the same model reuse running engines, which stop after this long "
        "without a batch (and when the night window closes). 0: every batch starts its own engines.",
    )
    min_free_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=0,
        description="Free space the data dir must have for a batch's job to start or resume: a batch waits for it "
        "(in_progress, its finished rows staged), also after a full disk stopped its job, until it is cancelled or "
        "expires.",
    )
    poll_seconds: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="How often a running batch's counts are read from its checkpoint.",
    )

    @field_validator("job")
    @classmethod
    def _no_paths(cls, job: JobConfig) -> JobConfig:
        if job.input or job.output:
            raise ValueError(
                "job.input and job.output are each batch's own: remove them from the server config"
            )
        if job.output_options.format not in (None, "jsonl"):
            raise ValueError("output files are JSONL, as OpenAI's are: remove job.output_options.format")
        if job.dataset.enabled:
            raise ValueError(
                "a batch's input file is request lines, as OpenAI's are: remove job.dataset (templates over a "
                "table are for `nightshift run` and pipeline.run_table)"
            )
        if job.observe.metrics_port is not None:
            # Every batch's job would open that port on its driver, answering anyone without a key (and a second
            # batch running at once could not bind it): the server's own /metrics, behind the keys, has them.
            raise ValueError(
                "job.observe.metrics_port would open an unauthenticated port for every batch: remove it; the "
                "server's /metrics (with an API key) shows each key's batches"
            )
        if "allow_private_networks" not in job.media.model_fields_set:
            job = job.model_copy(
                update={"media": job.media.model_copy(update={"allow_private_networks": False})}
            )
        return job

    def window(self):  # noqa: ANN201 - pipeline.hours.Hours | None
        """The night window, read as `run --hours` reads it (one parser, the same messages)."""
        from pipeline.hours import HoursError, window

        try:
            return window(self.hours, self.timezone)
        except HoursError as exc:
            raise ConfigError(str(exc)) from exc

    def check(self) -> None:
        """What cannot be expressed per field: keys are required unless --no-auth on loopback; a usable window;
        with limits.line_errors fail_batch, model names a batch's lines can be checked against before it runs;
        per-key quotas need keys (that each label names one is checked against the keys: server/quotas.py)."""
        self.window()
        if self.limits.line_errors == "fail_batch":
            from pipeline.server.linecheck import served_before_run

            served_before_run(self.job)
        if self.auth.disabled and not is_loopback(self.host):
            raise ConfigError(
                f"--no-auth is allowed only on loopback; --host {self.host} is reachable from elsewhere: "
                "give API keys (--api-keys-file or $NIGHTSHIFT_API_KEYS) or listen on 127.0.0.1"
            )
        if self.auth.disabled and self.quotas.keys:
            raise ConfigError(
                "quotas.keys names API keys by their labels, and --no-auth has no keys: remove quotas.keys (the "
                "quotas above it apply to every request) or give labelled keys"
            )


def is_loopback(host: str) -> bool:
    from cluster.auth import is_loopback_host

    return is_loopback_host(host)


def load_server_config(
    path: Path | None, overrides: dict[str, Any], labels: dict[str, str] | None = None
) -> ServerConfig:
    """The YAML file (if any) with flags (dotted keys, None = not given) over it; one line per problem, a value
    given as a flag named by its flag (`labels`: dotted key -> flag)."""
    data = read_yaml_mapping(path, "server config", "server config") if path is not None else {}
    set_dotted(data, overrides)
    try:
        config = ServerConfig.model_validate(data)
    except ValidationError as exc:
        given = {k: v for k, v in (labels or {}).items() if overrides.get(k) is not None}
        where = f"server config {path}: " if path else ""
        raise ConfigError(where + format_validation_error(exc, given)) from exc
    config.check()
    return config


def serve_flags() -> list[str]:
    """`nightshift serve`'s flags: the server's own fields that carry a Flag (the job section's flags are `run`'s)."""
    from pipeline.config_flags import config_flags

    return [f.key for f in config_flags(ServerConfig) if not f.key.startswith("job.")]
