"""Map a GPU vendor name to a torch device, or fail with one line saying what to do."""

from __future__ import annotations

import torch

from .io import PeatError


def for_vendor(vendor: str) -> torch.device:
    if vendor == "cpu":
        return torch.device("cpu")
    stack = {"nvidia": ("CUDA", torch.version.cuda), "amd": ("ROCm/HIP", torch.version.hip)}.get(vendor)
    if stack is None:
        raise PeatError(f"vendor {vendor!r} is unknown; allowed: cpu, nvidia, amd")
    name, version = stack
    if version is None or not torch.cuda.is_available():
        raise PeatError(
            f"vendor {vendor!r}: no {name} GPU visible to torch {torch.__version__} "
            f"(torch.version.{'cuda' if vendor == 'nvidia' else 'hip'}={version}); "
            f"run this job on a node with an {vendor.upper()} GPU, e.g. with the SLURM profile"
        )
    return torch.device("cuda")


# The rules whose jobs run the config's torch threads (job_threads).
THREADED_RULES = ("golden_train", "candidate_train", "rfi", "playback", "alter_cells")


def job_threads(snakemake) -> int:
    """The torch threads of a workflow job: the config's ``threads``, checked
    against the CPUs Snakemake granted the job (``--cores``, ``--max-threads``, ``--set-threads``; on
    SLURM its ``--cpus-per-task``). The thread count decides the results (a CPU sum split over more
    threads rounds differently, and the config hash names it), so a smaller grant stops the job:
    running the config's threads anyway took CPUs the user did not give (``--cores 1`` capped
    nothing), and running fewer would give other bits under the same hash."""
    threads = snakemake.config["threads"]
    if snakemake.threads < threads:
        raise PeatError(_too_few(snakemake.rule, threads, snakemake.threads))
    return threads


def check_granted(jobs, threads: int) -> None:
    """job_threads before the first job: otherwise each such job stopped only once the jobs before
    it (data preparation, a golden training) had run."""
    for job in jobs:
        if job.rule.name in THREADED_RULES and job.threads < threads:
            raise PeatError(_too_few(job.rule.name, threads, job.threads))


def _too_few(rule: str, threads: int, granted: int) -> str:
    return (f"config key 'threads': rule {rule} runs {threads} torch threads, but Snakemake granted it "
            f"{granted} CPUs; fewer threads would change its results, so grant {threads} "
            f"(--cores {threads} or more, also above this machine's cores; on SLURM, no --set-threads "
            f"{rule}={granted}) or lower 'threads' (reruns everything)")


def seed_everything(seed: int, threads: int) -> None:
    """Fix every source of run-to-run variation we control on one machine, and make float32
    mean IEEE float32 on every GPU."""
    import os
    import random

    import numpy as np

    # cuBLAS needs this before its first call to give deterministic GEMMs.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    # torch.use_deterministic_algorithms(True) also sets inductor's flag, and importing inductor
    # costs 2-4 s of CPU in every job; only the peat.alt_kernels.compiled candidate compiles
    # (then without inductor's deterministic mode, which skips autotuning that changes numerics),
    # so set the ATen flag alone (what that function does besides).
    torch._C._set_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    # PyTorch convolves float32 in TF32 by default on NVIDIA Ampere and later (cuDNN's flag is
    # on, the matmul flag off): golden itself would then be reduced-precision, and a TF32 kernel
    # would look like golden. A candidate that wants TF32 asks for it in its own code.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
