# nightshift on AMD GPUs: AMD's ROCm vLLM image plus nightshift at the pinned Ray version.
#   docker build -f k8s/images/rocm.Dockerfile --build-arg BASE_IMAGE=rocm/vllm:<dated tag> \
#     -t ghcr.io/nightshift-batch/nightshift:rocm-0.1.0 .
# Pin BASE_IMAGE to a dated rocm/vllm tag whose vLLM matches cuda.Dockerfile's VLLM_VERSION (ROCm 6.3+ for
# MI200/MI300 and Radeon RX 7900, ROCm 7 for MI350). Ray requires the same Ray *and* Python version on every
# node: keep RAY_VERSION and PYTHON_VERSION equal to cuda.Dockerfile's; the last step fails the build otherwise.
# No default: a build names its dated tag (`latest` moves, and two builds of one Dockerfile would differ).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

ARG NIGHTSHIFT_VERSION=0.1.0
ARG RAY_VERSION=2.60.0
ARG PYTHON_VERSION=3.12

ENTRYPOINT []

# Never the `cuda` extra here: it would replace AMD's ROCm build of vLLM with the CUDA wheel.
RUN python3 -m pip install --no-cache-dir \
        "nightshift-batch[s3,serve]==${NIGHTSHIFT_VERSION}" \
        "ray[data,serve]==${RAY_VERSION}"

RUN python3 -c "import sys, ray, vllm, torch; \
v = '%d.%d' % sys.version_info[:2]; \
assert v == '${PYTHON_VERSION}', 'python ' + v + ' != ${PYTHON_VERSION}'; \
assert ray.__version__ == '${RAY_VERSION}', 'ray ' + ray.__version__; \
assert torch.version.hip, 'torch is not a ROCm build'; \
print('python', v, 'ray', ray.__version__, 'vllm', vllm.__version__, 'hip', torch.version.hip)"

# The pods run as uid 1000, never as root (runAsNonRoot, runAsUser in k8s/*.yaml): the image has that user, with a
# home for the caches vLLM, Triton and the model hub write. A base that already has uid 1000 (Ubuntu 24.04's
# `ubuntu`) keeps its user under its own name.
ARG NIGHTSHIFT_UID=1000
RUN set -eu; \
    getent group "${NIGHTSHIFT_UID}" >/dev/null || groupadd --gid "${NIGHTSHIFT_UID}" nightshift; \
    getent passwd "${NIGHTSHIFT_UID}" >/dev/null || \
        useradd --uid "${NIGHTSHIFT_UID}" --gid "${NIGHTSHIFT_UID}" --create-home --shell /bin/bash nightshift; \
    home="$(getent passwd "${NIGHTSHIFT_UID}" | cut -d: -f6)"; \
    mkdir -p "${home}"; \
    chown "${NIGHTSHIFT_UID}:${NIGHTSHIFT_UID}" "${home}"
USER ${NIGHTSHIFT_UID}:${NIGHTSHIFT_UID}
