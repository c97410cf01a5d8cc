"""Where jobs go on a SLURM cluster: vendor -> partition and GPU request, checked before submitting
(partitions, and each job's CPUs and memory against the largest node of its partition).

The mapping lives in the config's ``slurm:`` section so that one profile
(``workflow/profiles/slurm``) serves every cluster; the rule files turn it into the
``slurm_partition`` and ``gres`` resources that snakemake-executor-plugin-slurm reads.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

from .io import PeatError

GPU_VENDORS = ("nvidia", "amd")


def resources(config: dict, vendor: str | None) -> dict[str, str]:
    """``slurm_partition`` and ``gres`` for a job of ``vendor`` (None: a CPU-only stage).

    "" means "not set": the plugin then leaves the option out of the sbatch call.
    """
    slurm = config.get("slurm") or {}
    if vendor is None:
        return {"slurm_partition": slurm.get("cpu_partition") or "", "gres": ""}
    spec = (slurm.get("vendors") or {}).get(vendor) or {}
    return {"slurm_partition": spec.get("partition") or "", "gres": spec.get("gres") or ""}


# The gres snakemake-executor-plugin-slurm submits (its set_gres_string): name[:type][:count], the
# type without '-'. It refuses any other at a job's submission, after the jobs before it have run.
PLUGIN_GRES = re.compile(r"[a-zA-Z0-9_]+(:[a-zA-Z0-9_.]+)?(:\d+[TGM]?)?")


def check_config(config: dict) -> None:
    """Every GPU vendor the study runs on needs a GPU request, or its jobs would land on CPUs, and
    every request must be one the SLURM plugin submits."""
    vendors = (config.get("slurm") or {}).get("vendors") or {}
    for vendor in config["vendors"]:
        gres = (vendors.get(vendor) or {}).get("gres")
        if vendor in GPU_VENDORS and not gres:
            raise PeatError(
                f"config key 'slurm.vendors.{vendor}.gres' is missing: {vendor} jobs need a GPU request "
                f"such as \"gpu:1\" (and usually a partition)"
            )
        if gres and not PLUGIN_GRES.fullmatch(str(gres)):
            raise PeatError(
                f"config key 'slurm.vendors.{vendor}.gres': {gres!r} is not a request snakemake-executor-plugin-slurm "
                f"submits (one NAME[:TYPE][:COUNT], TYPE of letters, digits, '_' and '.'); ask for \"gpu:1\" on a "
                f"partition of that GPU type"
            )


def config_origins(config: dict) -> dict[str, str]:
    """Partition name -> the config key that names it (for error messages)."""
    slurm = config.get("slurm") or {}
    origins = {}
    for vendor, spec in sorted((slurm.get("vendors") or {}).items(), reverse=True):
        if spec and spec.get("partition"):
            origins[spec["partition"]] = f"slurm.vendors.{vendor}.partition"
    if slurm.get("cpu_partition"):
        origins[slurm["cpu_partition"]] = "slurm.cpu_partition"
    return origins


@dataclass(frozen=True)
class Node:
    cpus: int
    mem_mb: int
    gres: dict = field(default_factory=dict)  # {(name, type): count}

    def __str__(self) -> str:
        gres = ",".join(f"{n}:{t}:{c}" if t else f"{n}:{c}" for (n, t), c in sorted(self.gres.items()))
        return f"{self.cpus} CPUs/{self.mem_mb} MB" + (f"/{gres}" if gres else "")


@dataclass(frozen=True)
class Partition:
    """What a partition offers a job, as ``sinfo`` lists it."""

    cpus: int                         # of its largest node
    mem_mb: int                       # of its largest node
    time_limit: int | None = None     # minutes; None: infinite
    nodes: tuple[Node, ...] = ()


def cluster_nodes() -> dict[str, Partition]:
    """Partition name -> ``Partition``; the default partition (marked with '*') is also under "",
    which is how a job without a partition asks."""
    if shutil.which("sinfo") is None:
        raise PeatError("executor 'slurm': 'sinfo' is not on PATH (run this on a SLURM login node)")
    # --all: a user's sinfo leaves out hidden partitions (Hidden=YES), which sbatch takes all the same.
    proc = subprocess.run(["sinfo", "--all", "--noheader", "--Node", "--format=%P %c %m %l %G"], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeatError(f"executor 'slurm': sinfo failed: {reason}")
    largest: dict[str, Partition] = {}
    for line in proc.stdout.splitlines():
        # With SLURM_CLUSTERS set, sinfo heads each cluster's nodes with "CLUSTER: name" (a traceback
        # here); sbatch, reading the same variable, submits to one of them: their nodes count as one.
        if not line.strip() or line.startswith("CLUSTER:"):
            continue
        fields = line.split()
        if len(fields) != 5:
            raise PeatError(f"executor 'slurm': sinfo printed a line peat cannot read: {line.strip()!r} "
                            "(expected partition, CPUs, memory, time limit, gres)")
        partition, cpus, mem, limit, gres = fields
        for name in {partition.rstrip("*"), *([""] if partition.endswith("*") else [])}:
            have = largest.get(name, Partition(0, 0))
            node = Node(int(cpus.rstrip("+")), int(mem.rstrip("+")), gres_counts(gres))
            largest[name] = Partition(max(have.cpus, node.cpus), max(have.mem_mb, node.mem_mb),
                                      time_limit_minutes(limit), (*have.nodes, node))
    return largest


def gres_counts(gres: str) -> dict[tuple[str, str], int]:
    """{(name, type): count} of a gres list as sinfo prints a node's ("gpu:a100:4(S:0-1),mps:100",
    "(null)") or as a job asks ("gpu", "gpu:2", "gpu:a100:1"; type "" when none is named)."""
    counts = {}
    for item in filter(None, re.sub(r"\([^)]*\)", "", gres).split(",")):
        name, *rest = item.split(":")
        count = int(rest.pop()) if rest and rest[-1].isdigit() else 1
        # Lowered: a false refusal here would block a request sbatch might take; sbatch judges the rest.
        key = (name.lower(), rest[0].lower() if rest else "")
        # One type listed once per socket ("gpu:a100:2(S:0),gpu:a100:2(S:1)"): the node has both.
        counts[key] = counts.get(key, 0) + count
    return counts


def time_limit_minutes(limit: str) -> int | None:
    """Minutes of a time limit as sinfo prints it ([D-]H:MM:SS; D-H[:MM], MM[:SS] read too), None for
    infinite or n/a; seconds are dropped, as a job's runtime is whole minutes."""
    if not limit[:1].isdigit():
        return None
    days, _, clock = limit.rpartition("-")
    fields = [int(p) for p in clock.split(":")]
    if days:  # D-HH[:MM[:SS]]
        hours, minutes = (fields + [0])[:2]
    elif len(fields) == 3:  # HH:MM:SS
        hours, minutes = fields[:2]
    else:  # MM[:SS]
        hours, minutes = 0, fields[0]
    return int(days or 0) * 1440 + hours * 60 + minutes


def check_partitions(requested: dict[str, str], origins: dict[str, str], available: list[str]) -> None:
    """Fail on the first requested partition the cluster does not have.

    ``requested`` maps partition -> the rule that asks for it; ``origins`` maps partition ->
    the config key that named it, so the message points at the line to fix.
    """
    for partition, rule in sorted(requested.items()):
        if partition and partition not in available:
            where = f"config key '{origins[partition]}'" if partition in origins else f"rule {rule} (slurm_partition)"
            raise PeatError(
                f"{where}: SLURM partition {partition!r} does not exist on this cluster; "
                f"sinfo lists: {', '.join(available) or 'none'}"
            )


def check_sizes(jobs, largest: dict[str, Partition], threads: int = 1, defaults: list[str] = ()) -> None:
    """Fail on the first job that asks for more CPUs or memory than any node of its partition has,
    or more time than the partition allows: sbatch refuses such memory, but such CPUs pend forever
    (squeue's reason PartitionConfig), and such time too.
    ``threads``: the config's, which every training job runs whatever it is granted; ``defaults``:
    the ``--default-resources`` in effect (``name=value``), which the hints repeat."""
    for job in jobs:
        if getattr(job, "is_local", False):  # localrules (plots, the report) run here, never through sbatch
            continue
        partition = job.resources.get("slurm_partition") or ""
        if partition not in largest:  # no such partition (check_partitions), or no default one
            continue
        part = largest[partition]
        cpus, mem_mb, limit = part.cpus, part.mem_mb, part.time_limit
        where = f"partition {partition!r}" if partition else "the default partition"
        rule = job.rule.name
        if job.threads > cpus:
            # Granted fewer than the config's threads, a training job stops (device.job_threads).
            fix = (f"lower the config's 'threads' to {cpus} (reruns everything)" if threads > cpus
                   else f"lower it, e.g. --set-threads {rule}={cpus}")
            raise PeatError(f"rule {rule} asks for {job.threads} CPUs per task, but the largest node of {where} has "
                            f"{cpus}: it would pend forever; {fix}")
        if (job.resources.get("mem_mb") or 0) > mem_mb:
            raise PeatError(f"rule {rule} asks for {job.resources['mem_mb']} MB (mem_mb), but the largest node of "
                            f"{where} has {mem_mb} MB; lower it, e.g. --set-resources {rule}:mem_mb={mem_mb} "
                            f"or {_default_resources(defaults, 'mem_mb', mem_mb)}")
        # Past the partition's MaxTime the job pends forever (reason PartitionTimeLimit), as for CPUs.
        runtime = job.resources.get("runtime") or 0
        if limit is not None and runtime > limit:
            raise PeatError(f"rule {rule} asks for {runtime} min (runtime), but {where} has a time limit of {limit} "
                            f"min: it would pend forever; lower it, e.g. --set-resources {rule}:runtime={limit} "
                            f"or {_default_resources(defaults, 'runtime', limit)}")
        gres = job.resources.get("gres") or ""
        if gres and part.nodes and not any(_has(node, gres) for node in part.nodes):
            vendor = getattr(getattr(job, "wildcards", None), "vendor", None)
            key = f" (config key 'slurm.vendors.{vendor}.gres')" if vendor else ""
            have = sorted({f"{n}:{t}:{c}" if t else f"{n}:{c}" for node in part.nodes for (n, t), c in node.gres.items()})
            raise PeatError(f"rule {rule} asks for --gres={gres}{key}, but no node of {where} has it "
                            f"(gres there: {', '.join(have) or 'none'}): sbatch would refuse it")
        # Each alone fits some node, but a job runs on one: the CPUs on one node, the memory on another.
        mem = job.resources.get("mem_mb") or 0
        if part.nodes and not any(node.cpus >= job.threads and node.mem_mb >= mem and (not gres or _has(node, gres))
                                  for node in part.nodes):
            asked = f"{job.threads} CPUs per task and {mem} MB" + (f" and --gres={gres}" if gres else "")
            raise PeatError(f"rule {rule} asks for {asked}, but no single node of {where} has them together "
                            f"(nodes: {'; '.join(sorted(set(map(str, part.nodes))))}): SLURM cannot place it; "
                            "lower one of them (--set-threads, --set-resources)")


def _default_resources(defaults: list[str], name: str, value: int) -> str:
    """``--default-resources`` with ``name`` changed: the option replaces the profile's whole list, so
    ``mem_mb=N`` alone would drop the profile's runtime (jobs get the partition's default time limit)."""
    # mem and mem_mib are mem_mb in other units; tmpdir is Snakemake's own default, there whatever
    # the option gives.
    same = {"mem_mb": {"mem_mb", "mem", "mem_mib"}}.get(name, {name})
    kept = [d for d in defaults if d.partition("=")[0] not in same and d != "tmpdir=system_tmpdir"]
    return " ".join(["--default-resources", f"{name}={value}", *kept])


def _has(node: dict, gres: str) -> bool:
    """Whether a node holds the request: its count of that name, of that type if one is named."""
    (name, kind), count = next(iter(gres_counts(gres).items()))
    return sum(c for (n, t), c in node.gres.items() if n == name and kind in ("", t)) >= count


def preflight(config: dict, jobs, defaults: list[str] = ()) -> None:
    """Run before the first sbatch: config sanity, then every job's partition, CPUs and memory
    against sinfo. ``defaults``: the ``--default-resources`` in effect, as ``name=value``."""
    check_config(config)
    jobs = list(jobs)
    requested = {}
    for job in jobs:
        partition = job.resources.get("slurm_partition") or ""
        requested.setdefault(partition, job.rule.name)
    largest = cluster_nodes()
    check_partitions(requested, config_origins(config), sorted(name for name in largest if name))
    check_sizes(jobs, largest, config["threads"], list(defaults or ()))
