"""What a job process inherits from the environment of the process that launches it: an allowlist, not everything.

The launcher (runtime/hosting/launcher.py) runs in the Batch API's replica and in `nightshift run --hours`. The replica's
environment holds what no job may see: the server's API keys (NIGHTSHIFT_API_KEYS, or whichever variable
`auth.keys_env` names), credentials meant for other storage, whatever else an operator put there. So a job gets
only what it needs to run Python, join its Ray cluster, load its model, reach its servers through a proxy, and start
engines — a job without `--address` starts a private Ray whose engines inherit this environment, so the engines'
own settings (device visibility, vLLM's and its libraries' variables) pass too — and S3 credentials only when one
of its locations is `s3://`. The http engine's key and the caller's own variables are added on top by the launcher.

One table, here: a variable a job turns out to need is added to it, with the reason."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

# Names passed as they are.
JOB_VARIABLES: frozenset[str] = frozenset(
    {
        # The process itself: where programs and the user's files are, the locale, the clock, scratch space.
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TMP",
        "TEMP",
        "XDG_CACHE_HOME",
        "XDG_CONFIG_HOME",
        "XDG_RUNTIME_DIR",
        # Python and the environment it was installed in.
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        # The terminal a `run --hours` shift draws its progress on.
        "TERM",
        "COLORTERM",
        "COLUMNS",
        "LINES",
        "NO_COLOR",
        # nightshift's own: its home (the embedded model's cache, the head's Ray token file), the CPU-core locks
        # engines share on a node, the test clock of the night window.
        "NIGHTSHIFT_HOME",
        "NIGHTSHIFT_CPU_LOCK_DIR",
        "NIGHTSHIFT_TEST_CLOCK",
        # The model hub's token under its older name (HF_TOKEN is in the HF_ family below).
        "HUGGING_FACE_HUB_TOKEN",
        # Servers, the model hub and S3 behind a proxy or a private certificate authority.
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "all_proxy",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        # Native libraries the engines load (vLLM on CPU preloads tcmalloc and Intel's OpenMP).
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
    }
)

# What an engine reads from its environment: vLLM, the devices it may use, its numeric libraries, the model hub.
# A job with its own local Ray passes them to its engines; `nightshift up`'s runs compare them with its daemon's
# (runtime/hosting/warm_runtime.py).
ENGINE_PREFIXES: tuple[str, ...] = (
    "HF_",  # the model hub: HF_HOME, HF_TOKEN (gated models), HF_HUB_OFFLINE, HF_ENDPOINT
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "VLLM_",
    "CUDA_",
    "NVIDIA_",
    "HIP_",
    "ROCR_",
    "ROCM_",
    "HSA_",
    "NCCL_",
    "RCCL_",
    "TORCH",
    "TRITON_",
    "OMP_",
    "KMP_",
    "MKL_",
)

# Families passed by prefix.
JOB_PREFIXES: tuple[str, ...] = (
    "LC_",  # the locale's parts
    "PYTHON",  # PYTHONPATH, PYTHONHOME, PYTHONHASHSEED, ...: how this Python finds and runs nightshift
    "RAY_",  # joining the cluster: RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN(_PATH), Ray's own settings
    *ENGINE_PREFIXES,
)

# S3 credentials and settings (keys, session token, profile, region, endpoint, role for web identity): only for a
# job that reads or writes s3:// (its input, output, model or adapters).
S3_PREFIX = "AWS_"


def job_locations(job: Any) -> Iterator[str]:
    """Every string in the job's config: its input, output, model, adapters (job-wide and per pool) and the rest."""

    def walk(value: Any) -> Iterator[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, Mapping):
            for item in value.values():
                yield from walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                yield from walk(item)

    yield from walk(job.model_dump(mode="json", exclude_none=True))


def uses_s3(job: Any) -> bool:
    return any(text.startswith(("s3://", "s3a://")) for text in job_locations(job))


def inherited_environment(
    environ: Mapping[str, str], job: Any, withhold: Collection[str] = ()
) -> dict[str, str]:
    """The part of `environ` a job (a JobConfig) may see; a name in `withhold` never, whatever the table says."""
    s3 = uses_s3(job)

    def allowed(name: str) -> bool:
        if name in withhold:
            return False
        if name in JOB_VARIABLES or name.startswith(JOB_PREFIXES):
            return True
        return s3 and name.startswith(S3_PREFIX)

    return {name: value for name, value in environ.items() if allowed(name)}
