"""What an OpenAI-compatible server tells about itself before any work: its models, its kind and version, its slots —
and the traps of each kind, as warnings with their remedy.

    GET /v1/models     every OpenAI-compatible server: the model ids it serves (required: the job fails here
                       at once when a server does not answer it, before anything is read)
    GET /api/version   Ollama
    GET /props         llama.cpp's llama-server: total_slots (its parallel sequences), each slot's context
    GET /version       vLLM (`vllm serve`)

Every probe but the first is best effort: a server that answers none of them is simply "openai-compatible".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from pipeline.server_urls import endpoint_base

# Past this many times a llama.cpp server's slots, more requests in flight only queue on the server (and their
# wait counts against the request timeout).
SLOTS_FAR_ABOVE = 2
PROBE_TIMEOUT_S = 10.0


@dataclass
class ServerInfo:
    endpoint: str
    kind: str = "openai-compatible"  # vllm, llama.cpp, ollama, openai-compatible
    models: list[str] = field(default_factory=list)
    version: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # `server` and any *version* header it sent
    slots: int | None = None  # llama.cpp: sequences it runs at once
    slot_context: int | None = None  # llama.cpp: tokens of context each slot has
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _identity_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k == "server" or "version" in k}


def _get(client: httpx.Client, path: str) -> httpx.Response | None:
    try:
        return client.get(path)
    except httpx.HTTPError:
        return None


def _json_object(response: httpx.Response | None) -> dict[str, Any] | None:
    if response is None or response.status_code != 200:
        return None
    try:
        data = response.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def probe_server(
    base_url: str,
    api_key: str | None = None,
    concurrency: int | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> ServerInfo:
    """Probe one server (its base URL; a trailing /v1 is dropped); raise ValueError, saying what to change, when it does not
    answer /v1/models as an OpenAI-compatible server does."""
    base_url = endpoint_base(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info = ServerInfo(endpoint=base_url)
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s) as client:
        try:
            models = client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ValueError(
                f"endpoint {base_url} cannot be reached ({type(exc).__name__}: {exc}): check --endpoint and that "
                "the server is up"
            ) from exc
        if models.status_code in (401, 403):
            raise ValueError(
                f"endpoint {base_url} refused GET /v1/models with {models.status_code}: it needs an API key "
                "(--api-key, or the variable named by engine.http.api_key_env)"
            )
        listed = _json_object(models)
        if listed is None or not isinstance(listed.get("data"), list):
            raise ValueError(
                f"endpoint {base_url} answered GET /v1/models with {models.status_code}, not a model list: is it "
                "an OpenAI-compatible server (give its base URL, e.g. http://host:8000)?"
            )
        info.models = [str(m.get("id")) for m in listed["data"] if isinstance(m, dict) and m.get("id")]
        info.headers = _identity_headers(models)
        by_vllm = any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in listed["data"])
        _probe_kind(client, info, by_vllm)
    _warn_traps(info, concurrency)
    return info


def _probe_kind(client: httpx.Client, info: ServerInfo, models_owned_by_vllm: bool) -> None:
    ollama = _json_object(_get(client, "/api/version"))
    if ollama and "version" in ollama:
        info.kind, info.version = "ollama", str(ollama["version"])
        return
    props = _json_object(_get(client, "/props"))
    if props and "total_slots" in props:
        info.kind = "llama.cpp"
        info.slots = int(props["total_slots"]) if props.get("total_slots") else None
        settings = props.get("default_generation_settings") or {}
        if isinstance(settings, dict) and settings.get("n_ctx"):
            info.slot_context = int(settings["n_ctx"])
        info.version = str(props["build_info"]) if props.get("build_info") else None
        return
    version = _json_object(_get(client, "/version"))
    if version and "version" in version:
        # vLLM answers /version with {"version": ...}; SGLang and others may too, so the kind stays generic
        # unless its models say they are vLLM's (owned_by).
        info.version = str(version["version"])
        if models_owned_by_vllm:
            info.kind = "vllm"


def _warn_traps(info: ServerInfo, concurrency: int | None) -> None:
    where = info.endpoint
    if info.kind == "ollama":
        info.warnings.append(
            f"{where} is Ollama: it runs one request per model at a time unless started with "
            "OLLAMA_NUM_PARALLEL=N (set --concurrency to the same N), and answers 503 once OLLAMA_MAX_QUEUE "
            "requests wait (retried here, but slowly); it applies its own sampling defaults (the model's "
            "Modelfile), not the model's generation_config"
        )
    if info.kind == "llama.cpp" and info.slots:
        if concurrency and concurrency > SLOTS_FAR_ABOVE * info.slots:
            info.warnings.append(
                f"{where} (llama.cpp) runs {info.slots} request(s) at once; concurrency {concurrency} only "
                f"queues the rest on the server: use --concurrency {info.slots}, or start llama-server with "
                f"--parallel {concurrency} (and a --ctx-size to match)"
            )
        if info.slot_context:
            info.warnings.append(
                f"{where} (llama.cpp) gives each of its {info.slots} slot(s) {info.slot_context} tokens of "
                "context (older builds split --ctx-size across --parallel slots): a prompt + max_tokens longer "
                "than that fails; raise --ctx-size with --parallel"
            )


def default_concurrency(info: ServerInfo, given: int | None, fallback: int) -> int:
    """Requests in flight for this server: as given, else the slots it reports, else `fallback`."""
    return given or info.slots or fallback
