"""The workflow as a user drives it from a second checkout (a git worktree, or a clone sharing
another checkout's venv): the Snakefile must read this checkout's peat, as its jobs do. And
`make run`'s variables as the Quick start has a new user type them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conftest import BIN, REPO


def test_a_second_checkout_tracks_its_own_kernel_sources(tmp_path):
    """The venv's peat (installed from another checkout) checked the config and named the kernel
    files to track: a dry run of a copy listed the shipped im2col kernel of the installed checkout
    as the candidate's input, while the job ran the copy's (PYTHONPATH), so editing the copy's
    kernel reran nothing."""
    checkout = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for part in ("workflow", "src", "config", "kernels", "envs"):
        shutil.copytree(REPO / part, checkout / part, ignore=ignore)
    shutil.copy(REPO / "Snakefile", checkout / "Snakefile")
    workdir = tmp_path / "work"
    workdir.mkdir()
    proc = subprocess.run([str(BIN / "snakemake"), "-n", "--snakefile", str(checkout / "Snakefile"), "--directory",
                           str(workdir), "results/candidate/resnet18/cpu/im2col/outcome.json", "--configfile",
                           str(checkout / "config/test.yaml")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kernels = sorted(set(re.findall(r"(\S+/alt_kernels/\w+\.py)", proc.stdout)))
    assert kernels == [f"{checkout}/src/peat/alt_kernels/im2col.py"]  # it imports no _*.py sibling


def _make(*args: str) -> subprocess.CompletedProcess:
    """make as a user types it: under `make test` the inherited MAKELEVEL and MAKEFLAGS made it a
    sub-make, which prints "make[1]: Entering directory ..." on stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", *args], cwd=REPO, capture_output=True, text=True, env=env)


def _make_run_dry(*variables: str) -> subprocess.CompletedProcess:
    # -n: make prints the recipes instead of running them, so no install and no workflow
    return _make("-n", "run", *variables)


@pytest.mark.parametrize(("variable", "message"), [
    ("CONFIG=missing.yaml", "*** CONFIG=missing.yaml: no such file 'missing.yaml' (paths are relative to "),
    ("CONFIG=config/test.yaml nope.yaml", "*** CONFIG=config/test.yaml nope.yaml: no such file 'nope.yaml' "),
    ("CONFIG=", "*** CONFIG is empty: name a config file, e.g. make run CONFIG=config/test.yaml.  Stop."),
    ("CORES=0", "*** CORES=0: give a whole number of cores above 0, or all.  Stop."),
    ("CORES=abc", "*** CORES=abc: give a whole number of cores above 0, or all.  Stop."),
    ("CORES=", "*** CORES=: give a whole number of cores above 0, or all.  Stop."),
    ("CORES=1 2", "*** CORES=1 2: give a whole number of cores above 0, or all.  Stop."),
    ("CORES=00", "*** CORES=00: give a whole number of cores above 0, or all.  Stop."),
    ("CORES=1.5", "*** CORES=1.5: give a whole number of cores above 0, or all.  Stop."),
    ("CORES=+1", "*** CORES=+1: give a whole number of cores above 0, or all.  Stop."),
    # the check quotes CORES for a shell: a quote in it must not end that quoted word
    ("CORES=1'2", "*** CORES=1'2: give a whole number of cores above 0, or all.  Stop."),
])
def test_make_run_refuses_a_bad_variable_in_one_line_before_any_work(variable, message):
    """A typo in `make run`'s CONFIG or CORES stops make as it reads the Makefile: one line, and
    neither the venv install nor Snakemake runs (before, a missing CONFIG ended in a Snakemake
    traceback and CORES=0 in a planned DAG, each after the install)."""
    proc = _make_run_dry(variable)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize(("variables", "cores", "configs"), [
    ((), "all", "config/config.yaml"),
    (("CONFIG=config/test.yaml", "CORES=2"), "2", "config/test.yaml"),
    (("CONFIG=config/test.yaml", "CORES=007"), "007", "config/test.yaml"),
    (("CONFIG=config/test.yaml config/gpu.yaml", "CORES=all"), "all", "config/test.yaml config/gpu.yaml"),
])
def test_make_run_passes_good_variables_to_snakemake(variables, cores, configs):
    proc = _make_run_dry(*variables)
    assert proc.returncode == 0, proc.stderr
    assert f"snakemake --cores {cores} --show-failed-logs --configfile {configs}\n" in proc.stdout


def test_a_bare_make_lists_the_commands_and_installs_nothing():
    """`make` alone used to build the Makefile's first rule, the venv stamp: an install on a
    fresh clone, else "'.venv/.installed' is up to date", neither saying to type `make run`."""
    proc = _make()
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    commands = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("make ")]
    assert commands == ["run", "test", "lint", "bench", "clean"], proc.stdout
    assert "reports/<config name>/index.html" in proc.stdout
    assert "pip" not in proc.stdout and "up to date" not in proc.stdout
