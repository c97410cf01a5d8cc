"""Workflow benchmarks: the full run from scratch, and the rerun after editing one kernel.

Both run the real ``snakemake`` on this repository's Snakefile in a scratch directory, the
default config (quick: config/test.yaml).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from harness import Goal, Result

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def config_path(settings) -> Path:
    return REPO / "config" / ("test.yaml" if settings.quick else "config.yaml")


class Unfinished(RuntimeError):
    """The workflow failed or ran past its time limit; ``seconds`` is a lower bound."""

    def __init__(self, seconds: float, why: str, progress: str):
        super().__init__(f"{why} after {seconds:.0f} s, {progress}")
        self.seconds, self.progress = seconds, progress


def snakemake(workdir: Path, configfile: Path, *args: str, timeout: float | None = None) -> float:
    """Wall seconds of one ``snakemake --cores all`` run; raises with the log tail if it fails.

    Past ``timeout`` the run is stopped (SIGTERM to its process group, which it and its jobs
    alone form) and ``Unfinished`` says how far it got. ``--keep-going``: a failing job still
    lets the others run, so a failed run says how much of the workflow works and how long that took.
    """
    cmd = [str(BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(configfile), "--cores", "all", "--keep-going", *args]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    log = workdir / "bench-snakemake.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            seconds = time.perf_counter() - start
            stop(proc)
            limit = f"{timeout:.3f}".rstrip("0").rstrip(".")  # as given: a limit of 0.5 s was said as 0 s
            raise Unfinished(seconds, f"stopped at the {limit} s limit", progress(log)) from None
        except BaseException:
            # Its own session keeps Ctrl-C in the terminal from reaching it: without this it ran
            # on after benchmarks/run.py stopped, in a scratch folder being removed under it.
            stop(proc)
            raise
    seconds = time.perf_counter() - start
    if returncode != 0:
        raise Unfinished(seconds, f"snakemake failed ({returncode}; failed rules: {', '.join(failed_rules(log))})",
                         progress(log))
    return seconds


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (snakemake and its jobs), SIGKILL after a minute."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group had ended by itself
        pass
    proc.wait()


def failed_rules(log: Path) -> list[str]:
    """Rules of the jobs snakemake reports as failed ("Error in rule NAME:")."""
    lines = log.read_text().splitlines()
    return sorted({line.split("Error in rule ", 1)[1].rstrip(":") for line in lines if "Error in rule " in line})


def progress(log: Path) -> str:
    """Snakemake's last "N of M steps (P%) done" line, or that no job finished."""
    done = [line.strip() for line in log.read_text().splitlines() if " steps (" in line and "done" in line]
    return done[-1] if done else "no job finished"


def full_run(settings) -> tuple[Path, Path, float]:
    """The whole workflow from scratch, once per benchmark session: later callers get the same
    run (or the same failure)."""
    key = config_path(settings).name
    if key not in settings.workflow_runs:
        workdir = settings.workdir / "workflow" / config_path(settings).stem
        # A reused --workdir holds an earlier session's run: snakemake would find it (mostly) done.
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        configfile = private_config(config_path(settings), workdir)
        if not settings.quick and settings.results is None:
            settings.results = workdir / "results"  # context_storage reads the golden runs that finish
        try:
            settings.workflow_runs[key] = (workdir, configfile, snakemake(workdir, configfile,
                                                                          timeout=settings.workflow_timeout))
        except Exception as err:
            settings.workflow_runs[key] = err
    if isinstance(settings.workflow_runs[key], Exception):
        raise settings.workflow_runs[key]
    return settings.workflow_runs[key]


def kernel_sources(config: dict) -> list[str]:
    """Kernel source files named by the config's ``kernels`` section (the values that are files)."""
    found = []
    for spec in (config.get("kernels") or {}).values():
        values = spec.values() if isinstance(spec, dict) else [spec]
        found += [v for v in values if isinstance(v, str) and (REPO / v).is_file()]
    return found


def private_config(configfile: Path, workdir: Path) -> Path:
    """A copy of the config whose kernel sources are copies inside ``workdir``.

    The incremental benchmark edits one of them; editing the repository's own file would
    invalidate everyone else's results.
    """
    config = yaml.safe_load(configfile.read_text())
    for source in kernel_sources(config):
        copy = workdir / "kernels" / source
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes((REPO / source).read_bytes())
        _replace_value(config["kernels"], source, str(copy))
    out = workdir / f"bench-{configfile.name}"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def _replace_value(section: dict, old: str, new: str) -> None:
    for name, spec in section.items():
        if spec == old:
            section[name] = new
        elif isinstance(spec, dict):
            section[name] = {k: new if v == old else v for k, v in spec.items()}


def end_to_end(settings) -> Result:
    configfile = config_path(settings)
    result = Result("end_to_end",
                    f"wall seconds of `snakemake --cores all` from scratch on {configfile.relative_to(REPO)} "
                    f"({os.cpu_count()} cores, machine shared with other jobs: see load averages)",
                    Goal("<=", 1200.0, "< 20 minutes (1200 s)"), unit="seconds",
                    details={"config": str(configfile.relative_to(REPO)), "finished": True})
    try:
        workdir, _, seconds = full_run(settings)
    except Unfinished as stop:
        # Failed or stopped: the elapsed time is a lower bound, reported as such.
        result.measured_as += f"; NOT FINISHED ({stop}): the sample is a lower bound"
        result.samples, result.error = [stop.seconds], str(stop)
        result.details |= {"finished": False, "progress": stop.progress}
        return result
    result.samples = [seconds]
    result.details["jobs"] = _jobs(workdir)
    return result


def incremental_rerun(settings) -> Result:
    workdir, configfile, full = full_run(settings)
    sources = kernel_sources(yaml.safe_load(configfile.read_text()))
    if not sources:
        raise RuntimeError(f"{config_path(settings).name} names no kernel source file to edit")
    edited = Path(sources[0])
    # Untimed catch-up first: on a shared checkout, files others edited during the full run
    # would otherwise be rerun (and timed) with our edit. A no-op when nobody else edits.
    catch_up = snakemake(workdir, configfile)
    caught_up = _jobs(workdir)
    # A real edit (not just a newer mtime): the content changes, the kernel's behaviour does not.
    edited.write_text(edited.read_text() + f"\n# edited by benchmarks/run.py at {time.time()}\n")
    rerun = snakemake(workdir, configfile)
    return Result("incremental_rerun",
                  f"wall seconds of the workflow rerun after editing one kernel source ({edited.name}) / "
                  f"wall seconds of the full run from scratch, {config_path(settings).relative_to(REPO)}",
                  Goal("<=", 0.25, "<= 0.25"), samples=[rerun / full],
                  details={"rerun_s": rerun, "full_s": full, "edited": edited.name,
                           "rerun_jobs": _jobs(workdir), "rerun_reasons": _reasons(workdir),
                           "catch_up_s": catch_up, "catch_up_jobs": caught_up})


def _jobs(workdir: Path) -> dict:
    """Job counts per rule from the last snakemake log (what the run actually did)."""
    log = (workdir / "bench-snakemake.log").read_text().splitlines()
    counts, inside = {}, False
    for line in log:
        if line.startswith("job ") and "count" in line:
            inside = True
            continue
        if inside:
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                if counts:
                    break
                continue
            counts[parts[0]] = int(parts[1])
    return counts


def _reasons(workdir: Path) -> list[str]:
    """Why snakemake reran what it did; on a shared checkout, other people's edits show up here."""
    log = (workdir / "bench-snakemake.log").read_text().splitlines()
    return sorted({line.split("reason:", 1)[1].strip() for line in log if "reason:" in line})
