# Two commands for a newcomer: `make demo` and `make test`. Each builds .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint typecheck check clean venv

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -c constraints.txt "torch==2.13.0"
	$(BIN)/pip install --disable-pip-version-check -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/crashsafe demo

test: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy
	$(BIN)/pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
