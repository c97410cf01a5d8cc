"""Reliability of the workflow as a user runs it: interruptions, untrusted files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time


from conftest import BIN, REPO, TEST_CONFIG, snakemake
from test_backbone import assert_bit_identical


def test_killed_training_job_resumes_with_rerun_incomplete(golden_twice, tmp_path):
    target = "results/golden/resnet18/cpu/metrics.csv"
    cmd = [str(BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
           "--cores", "1", target, "--configfile", str(TEST_CONFIG)]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    out = open(tmp_path / "first-run.log", "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    resume = tmp_path / "results/golden/resnet18/cpu/.partial/resume.h5"
    deadline = time.time() + 300
    while not resume.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None and resume.exists(), (tmp_path / "first-run.log").read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # snakemake and its training job, mid-run
    proc.wait()
    golden = tmp_path / "results/golden/resnet18/cpu"
    assert not (golden / "metrics.csv").exists() and not (golden / "context.h5").exists()

    snakemake(tmp_path, "--unlock", target)
    snakemake(tmp_path, "--rerun-incomplete", target)
    log = (tmp_path / "logs/golden/resnet18/cpu.log").read_text()
    assert re.search(r"resuming from .*resume\.h5 at step 4, epoch 2", log), log[-2000:]
    reference = golden_twice[0]  # the same training, never interrupted
    for name in ("final.h5", "context.h5", "checkpoints/epoch001.h5", "checkpoints/epoch002.h5"):
        assert_bit_identical(reference / name, golden / name)


def test_nothing_unpickles_untrusted_files():
    """torch.load only with weights_only=True, and no pickle anywhere in the library."""
    for path in (REPO / "src" / "peat").rglob("*.py"):
        text = path.read_text()
        assert "pickle.load" not in text, path
        for match in re.finditer(r"torch\.load\(", text):
            call = text[match.start():text.find("\n\n", match.start())]  # the statement, to the next blank line
            assert "weights_only=True" in call.split(")\n")[0], f"{path}: {call[:120]}"
