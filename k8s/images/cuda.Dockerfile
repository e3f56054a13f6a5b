# nightshift on NVIDIA GPUs: vLLM's CUDA image plus nightshift at the pinned Ray version.
#   docker build -f k8s/images/cuda.Dockerfile -t ghcr.io/nightshift-batch/nightshift:cuda-0.1.0 .
# Ray requires the same Ray *and* Python version on every node: keep RAY_VERSION and PYTHON_VERSION equal to
# rocm.Dockerfile's; the last step fails the build if the base image disagrees.
ARG VLLM_VERSION=0.32.0
FROM vllm/vllm-openai:v${VLLM_VERSION}

ARG NIGHTSHIFT_VERSION=0.1.0
ARG RAY_VERSION=2.60.0
ARG PYTHON_VERSION=3.12

# The base image starts `vllm serve`; KubeRay and `nightshift node start` run their own command.
ENTRYPOINT []

# The image's own vLLM is the engine: install nightshift without the `cuda` extra so pip keeps it.
RUN python3 -m pip install --no-cache-dir \
        "nightshift-batch[s3,serve]==${NIGHTSHIFT_VERSION}" \
        "ray[data,serve]==${RAY_VERSION}"

RUN python3 -c "import sys, ray, vllm, torch; \
v = '%d.%d' % sys.version_info[:2]; \
assert v == '${PYTHON_VERSION}', 'python ' + v + ' != ${PYTHON_VERSION}'; \
assert ray.__version__ == '${RAY_VERSION}', 'ray ' + ray.__version__; \
assert torch.version.cuda, 'torch is not a CUDA build'; \
print('python', v, 'ray', ray.__version__, 'vllm', vllm.__version__, 'cuda', torch.version.cuda)"
