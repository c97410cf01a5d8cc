# Two commands: `make run` (the default workflow) and `make test` (the test suite).
# Both create .venv on first use and install the pinned dependencies from envs/requirements.txt.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CORES  ?= all
CONFIG ?= config/config.yaml

.PHONY: help run test lint bench clean

# A bare `make` lists the commands: otherwise it would build the first rule, the venv stamp,
# and answer "'.venv/.installed' is up to date", which says nothing about what to type next.
.DEFAULT_GOAL := help
help:
	@echo 'make run [CONFIG=config/config.yaml] [CORES=all]  the workflow; report in reports/<config name>/index.html'
	@echo 'make test    the whole test suite'
	@echo 'make lint    snakemake --lint, snakefmt --check, ruff'
	@echo 'make bench   the benchmarks (benchmarks/run.py)'
	@echo 'make clean   remove results/, logs/ and .snakemake/'
	@echo 'The first of run, test, lint, bench creates .venv and installs the pinned dependencies.'

# Check `make run`'s variables when make reads this file, so a typo costs one line, not a pip
# install followed by a Snakemake traceback (missing CONFIG) or a planned DAG (CORES=0).
# "yes" when $(1) is one word (counted by make: $(shell) drops newlines) of digits, not all 0:
# 007 passes, 0 and 00 do not. A quote becomes x, a non-digit that cannot end the quoted word.
core_count = $(if $(filter 1,$(words $(1))),$(shell case '$(subst ',x,$(1))' in (*[!0-9]*) ;; (*[1-9]*) echo yes ;; esac))
ifneq ($(filter run,$(MAKECMDGOALS)),)
  ifeq ($(strip $(CONFIG)),)
    $(error CONFIG is empty: name a config file, e.g. make run CONFIG=config/test.yaml)
  endif
  $(foreach f,$(CONFIG),$(if $(wildcard $(f)),,$(error CONFIG=$(CONFIG): no such file '$(f)' (paths are relative to $(CURDIR)))))
  ifneq ($(CORES),all)
    ifeq ($(call core_count,$(CORES)),)
      $(error CORES=$(CORES): give a whole number of cores above 0, or all)
    endif
  endif
endif

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
