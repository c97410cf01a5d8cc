"""The workflow follows the catalog's conventions: lint-clean, snakefmt-formatted, pinned envs; the Python
code is pyflakes-clean."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_checks_refuse_in_one_line_without_a_gpu(tmp_path):
    """.ci/gpu (docs/gpu.md) stops before its first check, writing nothing, where torch sees no CUDA GPU."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([str(REPO / ".ci/gpu")], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f".ci/gpu: no CUDA GPU visible to torch (python: {BIN / 'python'}); "
                           "run it on a machine with an NVIDIA GPU\n")
    assert list(tmp_path.iterdir()) == []


def test_the_rules_checked_before_the_first_job_are_those_whose_scripts_check_their_threads():
    """``device.check_granted`` stops a run before any job by the rule names in THREADED_RULES; a
    script that starts calling ``job_threads`` without its rule listed there fails only at its job."""
    from peat.device import THREADED_RULES

    checked = set()
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        for rule, body in re.findall(r"^rule (\w+):\n((?:[ \t]+.*\n|\n)*)", smk.read_text(), flags=re.M):
            script = re.search(r"script:\s*\n\s*\"([^\"]+)\"", body)
            if script and "job_threads(" in (smk.parent / script.group(1)).resolve().read_text():
                checked.add(rule)
    assert checked == set(THREADED_RULES)
