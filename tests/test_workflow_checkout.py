"""The workflow as a user drives it from a second checkout (a git worktree, or a clone sharing
another checkout's venv): the Snakefile must read this checkout's peat, as its jobs do."""

from __future__ import annotations

import re
import shutil
import subprocess

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
    assert kernels == [f"{checkout}/src/peat/alt_kernels/{name}.py" for name in ("_gemm", "_norm", "im2col")]
