"""The workflow follows the catalog's conventions: lint-clean, snakefmt-formatted, pinned envs; the Python
code is pyflakes-clean."""

from __future__ import annotations

import re
import subprocess

import yaml

from conftest import BIN, REPO, snakemake


def pins(lines) -> dict[str, str]:
    return dict(m.groups() for line in lines if (m := re.fullmatch(r"\s*([\w.-]+)==(\S+)\s*", line)))


def test_snakemake_lint_is_clean(tmp_path):
    proc = snakemake(tmp_path, "--lint", configfile=REPO / "config/config.yaml")
    assert "Congratulations, your workflow is in a good condition!" in proc.stdout + proc.stderr


def test_rule_files_are_snakefmt_formatted():
    proc = subprocess.run([str(BIN / "snakefmt"), "--check", "Snakefile", "workflow/rules"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_python_code_is_pyflakes_clean():
    proc = subprocess.run([str(BIN / "ruff"), "check", "--no-cache", "src", "tests", "benchmarks", "workflow/scripts"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_job_environment_pins_match_requirements():
    """envs/peat.yaml (the jobs' conda environment) pins the same versions as envs/requirements.txt."""
    env = yaml.safe_load((REPO / "envs/peat.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    job, requirements = pins(pip), pins((REPO / "envs/requirements.txt").read_text().splitlines())
    assert job and {name: requirements.get(name) for name in job} == job
    assert {"torch", "torchvision", "transformers", "h5py", "pandas", "seaborn"} <= set(job)
