"""Shared fixtures: run the real workflow on config/test.yaml once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TEST_CONFIG = REPO / "config" / "test.yaml"
BIN = Path(sys.executable).parent


# Tests that need a CUDA GPU (``pytest -m gpu`` selects them all, as .ci/gpu does): skipped where none is visible.
NEEDS_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]
# Tests of code that runs on a GPU take both: "cuda" runs where one is (a lent GPU machine).
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_GPU)]


def needs_gpu(test):
    """A test that runs on a CUDA GPU only."""
    for mark in NEEDS_GPU:
        test = mark(test)
    return test


def snakemake(workdir: Path, *args: str, configfile: Path | None = TEST_CONFIG, check: bool = True,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the real ``snakemake`` on this repository's Snakefile with ``workdir`` as its directory."""
    cmd = [str(BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--cores", "2", *args]
    if configfile is not None:
        cmd += ["--configfile", str(configfile)]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    # A session fixture runs once per xdist worker: keep every user of the (expensive) test
    # workflow on one worker. tryfirst, so xdist's own hook sees the group.
    for item in items:
        if "workflow_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("workflow"))


@pytest.fixture(scope="session")
def workflow_run(tmp_path_factory) -> Path:
    """The whole test workflow, run once (all its users share one xdist worker)."""
    workdir = tmp_path_factory.mktemp("workflow")
    snakemake(workdir)
    return workdir


def tiny_gpt2_golden(root: Path) -> tuple[dict, Path]:
    """A real (tiny) golden training of GPT-2 under the Profiler in ``root / "run"``: 3 steps an epoch,
    2 epochs, a checkpoint after the first. Returns its model spec and dataset."""
    from peat.data import prepare
    from peat.train import train_model

    data = root / "pydoc.h5"
    prepare("pydoc", {"source": "pydoc", "seq_len": 16, "part": [0.0, 0.05], "val_fraction": 0.1}, data)
    spec = {"arch": "gpt2", "dataset": "pydoc", "size": {"hidden": 16, "layers": 2, "heads": 2}, "epochs": 2,
            "batch_size": 8, "max_train_samples": 24, "max_val_samples": 8, "optimizer": {"name": "adamw", "lr": 0.01},
            "checkpoint_epochs": [1], "record": {"layers": ["transformer.h.0.mlp.c_fc", "transformer.h.1.ln_1"],
                                                 "every": 1}}
    train_model("gpt2", spec, data, root / "run", config_hash="h")
    return spec, data


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> Path:
    """The test config's digits dataset, prepared by the library."""
    import yaml

    from peat import data

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    spec = yaml.safe_load(TEST_CONFIG.read_text())["datasets"]["digits"]
    data.prepare("digits", spec | {"val_fraction": 0.2}, path)
    return path


@pytest.fixture(scope="session")
def golden_twice(digits, tmp_path_factory) -> list[Path]:
    """Two independent golden trainings of the test config's resnet18."""
    import yaml

    from peat.train import train_model

    spec = yaml.safe_load(TEST_CONFIG.read_text())["models"]["resnet18"]
    runs = []
    for _ in range(2):
        out = tmp_path_factory.mktemp("golden")
        train_model("resnet18", spec, digits, out, seed=0, threads=1, config_hash="abc", progress=False)
        runs.append(out)
    return runs
