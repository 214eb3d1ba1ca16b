# Two commands for a newcomer: `make demo` and `make test`. Both set up what they need.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test check lint typecheck bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/extproc demo

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup
	$(VENV)/bin/mypy extproc

check: lint typecheck test

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache .ruff_cache
