# Two commands: `make run` (the default workflow) and `make test` (the test suite).
# Both create .venv on first use and install the pinned dependencies from envs/requirements.txt.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CORES  ?= all
CONFIG ?= config/config.yaml

.PHONY: run test lint bench clean

$(STAMP): envs/requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r envs/requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/snakemake --cores $(CORES) --show-failed-logs --configfile $(CONFIG)

test: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -n 2 --dist loadgroup --durations=20 tests

lint: $(STAMP)
	$(VENV)/bin/snakemake --lint
	$(VENV)/bin/snakefmt --check Snakefile workflow/rules
	$(VENV)/bin/ruff check src tests benchmarks workflow/scripts

bench: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) benchmarks/run.py

clean:
	rm -rf results logs .snakemake
