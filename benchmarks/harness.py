"""Timing harness: paired, interleaved measurements reduced to ratios with median, min and max.

A shared machine drifts (other jobs start and stop), so a benchmark never divides two numbers
taken minutes apart: each repeat measures both sides back to back, alternating which goes
first, and the ratio of that pair is one sample. Drift that is slow against one pair cancels.
"""

from __future__ import annotations

import math
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np


def check_out_folder(path, option: str = "--out") -> None:
    """A PeatError ("a file, not a folder") where ``path`` (``option``), or a folder above it, is a file: said
    before anything runs, not as a traceback once the results are written."""
    from peat.io import PeatError  # here: the harness itself needs nothing of peat

    for folder in (Path(path), *Path(path).parents):
        if folder.exists():
            if not folder.is_dir():
                raise PeatError(f"{option}: {folder}: a file, not a folder")
            return


@dataclass
class Goal:
    """``value op goal`` must hold for the goal to be met (op is "<=" or ">=")."""

    op: str
    value: float
    text: str

    def met(self, measured: float) -> bool:
        return measured <= self.value if self.op == "<=" else measured >= self.value


@dataclass
class Result:
    name: str
    measured_as: str
    goal: Goal
    unit: str = "ratio"
    samples: list[float] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # the raw numbers behind the samples, for the report
    error: str | None = None

    def as_json(self) -> dict:
        finite = [s for s in self.samples if math.isfinite(s)]
        median = float(np.median(finite)) if finite else None
        entry = {
            "name": self.name, "measured_as": self.measured_as, "unit": self.unit, "repeats": len(self.samples),
            "median": median, "min": min(finite) if finite else None, "max": max(finite) if finite else None,
            "samples": self.samples, "goal": self.goal.text, "goal_op": self.goal.op, "goal_value": self.goal.value,
            "met": bool(self.goal.met(median)) if median is not None and self.error is None else False,
            "details": self.details,
        }
        if self.error is not None:
            entry["error"] = self.error
        return entry


@dataclass
class Times:
    """Wall and CPU seconds of one side of a paired measurement, one entry per repeat."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its finished children (isolated kernel
    calls, torchrun ranks, snakemake jobs)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed(func: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds of one call."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    func()
    return time.perf_counter() - wall, cpu_seconds() - cpu


def paired(subject: Callable[[], object], baseline: Callable[[], object], repeats: int,
           warmup: int = 1) -> tuple[Times, Times]:
    """Times of ``subject`` and ``baseline``, interleaved; the first ``warmup`` pairs are dropped.

    Odd repeats run the baseline first, so neither side always inherits a warm (or cold) cache.
    """
    subject_times, baseline_times = Times(), Times()
    for i in range(warmup + repeats):
        if i % 2:
            b, s = timed(baseline), timed(subject)
        else:
            s, b = timed(subject), timed(baseline)
        if i >= warmup:
            for side, (wall, cpu) in ((subject_times, s), (baseline_times, b)):
                side.wall.append(wall)
                side.cpu.append(cpu)
    return subject_times, baseline_times


def ratios(subject: list[float], baseline: list[float]) -> list[float]:
    return [s / b for s, b in zip(subject, baseline)]


def paired_details(subject: Times, baseline: Times, names: tuple[str, str], scale: float = 1.0) -> dict:
    """Both clocks of both sides, and the wall-clock ratios (subject / (scale x baseline))."""
    wall = ratios(subject.wall, [scale * b for b in baseline.wall])
    cpu = ratios(subject.cpu, [scale * b for b in baseline.cpu])
    return {f"{names[0]}_wall_s": subject.wall, f"{names[0]}_cpu_s": subject.cpu,
            f"{names[1]}_wall_s": baseline.wall, f"{names[1]}_cpu_s": baseline.cpu,
            "wall_ratios": wall, "wall_ratio_median": float(np.median(wall)),
            "cpu_ratios": cpu, "cpu_ratio_median": float(np.median(cpu))}


# CPU time, not wall time, is the primary clock of the in-process benchmarks: both sides are
# single-threaded and CPU-bound, and on a shared machine the wall clock mostly measures how
# long the scheduler kept us waiting. Wall-clock ratios are kept in the details.
CPU_NOTE = "CPU seconds of the process and its children (wall-clock ratios in details)"
# On a GPU the host mostly waits for the device, so its CPU seconds say little: wall time is the clock.
GPU_NOTE = ("wall-clock seconds, each measured call ending after its GPU work (it reads its results back); "
            "CPU-second ratios in details")


def clock(times: Times, vendor: str) -> list[float]:
    """The primary clock of one side: CPU seconds on the CPU, wall seconds on a GPU vendor."""
    return times.cpu if vendor == "cpu" else times.wall


def clock_note(vendor: str) -> str:
    return CPU_NOTE if vendor == "cpu" else f"{GPU_NOTE}; vendor {vendor}"


def machine() -> dict:
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": str(torch.__version__), "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cpu": _cpu_model(), "python": sys.version.split()[0], "platform": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in load],
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
