# Quickstart: `make demo` (sets up, runs the main job on the embedded default) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
DEMO_ARGS ?=
OUT ?= runs/demo

.PHONY: demo test install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# One install (with the test extras, torch pinned to the local CPU wheel) serves demo and tests.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/m2r2 demo --out $(OUT) $(DEMO_ARGS)

# A crashed worker ends the run (xdist's loadfile scheduler can wait forever after replacing one).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 --durations=25 tests

clean:
	rm -rf $(VENV) runs
