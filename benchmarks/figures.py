"""results.json and one seaborn figure per benchmark, for the collated report."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from peat.io import PeatError, atomic_path, read_json, write_json  # noqa: E402

ORDER = ("profiler_overhead", "context_storage", "kernel_interface_overhead", "playback_vs_retraining",
         "playback_efficiency", "sdc_checks", "checkpoint_alteration", "incremental_rerun", "end_to_end")


# Merged runs may differ in these (--only, --merge of runs on other machines): each entry keeps
# those of the run that measured it, and the header says "per entry" where they differ.
PER_ENTRY = ("quick", "cpu", "cores", "torch", "vendor", "device")


def write(out: Path, header: dict, entries: list[dict], merge: bool = False) -> None:
    out = Path(out)
    path = out / "results.json"
    entries = [_stamped(e, header) for e in entries]
    if merge and path.exists():
        fresh = {e["name"] for e in entries}
        old = read(path)
        entries = [_stamped(e, old["machine"]) for e in old["benchmarks"] if e["name"] not in fresh] + entries
    for key in PER_ENTRY:
        values = {json.dumps(e.get(key)) for e in entries}
        header = header | {key: json.loads(values.pop()) if len(values) == 1 else "per entry"}
    entries.sort(key=lambda e: ORDER.index(e["name"]))
    for entry in entries:
        if entry.get("median") is not None:
            figure(out / f"{entry['name']}.png", entry)
        else:  # an earlier run's figure would show numbers this entry no longer has (the report takes every png)
            (out / f"{entry['name']}.png").unlink(missing_ok=True)
    write_json(path, {"machine": header, "benchmarks": entries})


def read(path: Path) -> dict:
    """A results.json; one line naming it where it is damaged or not one."""
    results = read_json(path)
    if not isinstance(results, dict) or not {"machine", "benchmarks"} <= set(results):
        raise PeatError(f"{path}: no 'machine' and 'benchmarks' (not a benchmarks/run.py results.json?)")
    if not isinstance(results["machine"], dict):
        raise PeatError(f"{path}: 'machine' is not an object")
    if not isinstance(results["benchmarks"], list):
        raise PeatError(f"{path}: 'benchmarks' is not a list of entries")
    for i, entry in enumerate(results["benchmarks"]):
        problem = _entry_problem(entry)
        if problem:
            raise PeatError(f"{path}: benchmarks[{i}]{problem}")
    return results


# What write() (sorting, figures) and markdown() read of an entry that has a median.
MEASURED_KEYS = ("min", "max", "repeats", "goal", "goal_value", "met", "samples", "unit")


def _entry_problem(entry) -> str | None:
    """Why an entry would break a merge or the table (a traceback, or a silent drop), else None."""
    if not isinstance(entry, dict):
        return ": not an object"
    if "name" not in entry:
        return ": no name"
    if entry["name"] not in ORDER:
        return f": {entry['name']!r} is no benchmark of run.py"
    if entry.get("median") is None:  # a failed benchmark: its error is all there is
        return None
    missing = sorted(set(MEASURED_KEYS) - set(entry))
    if missing:
        return f" ({entry['name']}): measured, but no {', '.join(missing)}"
    for key in ("median", "min", "max"):
        if isinstance(entry[key], bool) or not isinstance(entry[key], (int, float)):
            return f" ({entry['name']}): {key} {entry[key]!r} is not a number"
    return None


def _stamped(entry: dict, header: dict) -> dict:
    return {k: header.get(k) for k in PER_ENTRY} | entry


def figure(path: Path, entry: dict) -> None:
    """Each repeat as a point, the median as a bar, the goal as a dashed line."""
    sns.set_theme(style="whitegrid", context="paper")
    sweep = entry.get("details", {}).get("sweep")
    if sweep:
        fig = sweep_figure(entry, pd.DataFrame(sweep))
    else:
        fig, ax = plt.subplots(figsize=(4.5, 3))
        sns.stripplot(clocks(entry), x="clock", y=entry["unit"], hue="clock", ax=ax, size=7, jitter=0.08)
        ax.axhline(entry["median"], color="tab:blue", lw=1, label=f"median {entry['median']:.4g}")
        ax.axhline(entry["goal_value"], color="tab:red", ls="--", lw=1, label=f"goal {entry['goal']}")
        ax.set_xlabel("")
        ax.legend(loc="best", fontsize=7)
    fig.suptitle(f"{entry['name']}: median {entry['median']:.4g} [{entry['min']:.4g}, {entry['max']:.4g}], "
                 f"goal {'met' if entry['met'] else 'NOT met'}", fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def clocks(entry: dict) -> pd.DataFrame:
    """One row per repeat and clock: the primary samples, and the other clock's ratios where kept apart."""
    details = entry.get("details", {})
    if "wall_ratios" not in details:
        return pd.DataFrame({"clock": "measured", entry["unit"]: entry["samples"]})
    # CPU seconds are the primary clock on the CPU, wall seconds on a GPU (--vendor): the samples say which.
    if details.get("cpu_ratios", entry["samples"]) == entry["samples"]:
        primary, other, others = "CPU time (primary)", "wall clock", details["wall_ratios"]
    else:
        primary, other, others = "wall clock (primary)", "CPU time", details["cpu_ratios"]
    return pd.concat([pd.DataFrame({"clock": primary, entry["unit"]: entry["samples"]}),
                      pd.DataFrame({"clock": other, entry["unit"]: others})])


def sweep_figure(entry: dict, frame: pd.DataFrame):
    """Checkpoint alteration: flip throughput against the number of flips, one line per file size."""
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    frame = frame.assign(size=frame["mb"].map(lambda mb: f"{mb:g} MB"))
    sns.lineplot(frame, x="flips", y="flips_per_s", hue="size", marker="o", ax=axes[0])
    sns.lineplot(frame, x="flips", y="seconds_beyond_copy", hue="size", marker="o", ax=axes[1], legend=False)
    axes[1].axhline(entry["goal_value"], color="tab:red", ls="--", lw=1)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
    return fig


def markdown(results: dict) -> str:
    """The results as a Markdown table (for docs/benchmarks.md), one row per benchmark."""
    lines = ["| benchmark | median | min | max | repeats | goal | met |", "|---|---|---|---|---|---|---|"]
    for e in results["benchmarks"]:
        if e.get("median") is None:
            lines.append(f"| `{e['name']}` | error: {e.get('error')} | | | 0 | {e.get('goal', '')} | no |")
            continue
        unit = " s" if e.get("unit") == "seconds" else ""
        note = " (not finished)" if e.get("details", {}).get("finished") is False else ""
        quick = " (quick)" if e.get("quick") else ""
        lines.append(f"| `{e['name']}`{quick} | {e['median']:.4g}{unit}{note} | {e['min']:.4g}{unit} | "
                     f"{e['max']:.4g}{unit} | {e['repeats']} | {e['goal']} | {'yes' if e['met'] else '**no**'} |")
    return "\n".join(lines)
