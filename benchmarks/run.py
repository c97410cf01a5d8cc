"""Benchmarks of every stage, as ratios of two things measured in the same run.

    python benchmarks/run.py                 # all benchmarks, default sizes
    python benchmarks/run.py --quick         # smoke run: tiny sizes, 2 repeats
    python benchmarks/run.py --only profiler_overhead sdc_checks

Writes ``reports/benchmarks/results.json`` and one figure per benchmark (``<name>.png``). A
benchmark that fails (e.g. its stage is missing) is reported with an ``error`` and does not
stop the others.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import figures  # noqa: E402
import harness  # noqa: E402

from peat.cli import interrupted  # noqa: E402
from peat.device import for_vendor  # noqa: E402
from peat.io import PeatError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Settings:
    quick: bool
    repeats: int
    workdir: Path  # scratch space for trainings and workflow runs
    results: Path | None = None  # a finished default-config workflow directory, when one exists
    storage_files: list[Path] = field(default_factory=list)
    workflow_runs: dict = field(default_factory=dict)  # config name -> (workdir, config, wall seconds of a full run)
    cache: dict = field(default_factory=dict)  # measurements shared by two benchmarks (playback)
    workflow_timeout: float | None = None  # seconds; a full workflow run past it is stopped
    record_layers: list[str] | None = None  # overrides the recorded layers of the training benchmarks
    vendor: str = "cpu"  # where the trainings and playback campaigns run (peat.device.for_vendor)


# Benchmark name -> "module:function" (function(settings) -> harness.Result), in the order they
# run: the full workflow run goes first, since incremental_rerun reuses it and context_storage
# reads its golden runs. results.json lists them in the order (figures.ORDER).
BENCHMARKS = {
    "end_to_end": "workflow_runs:end_to_end",
    "incremental_rerun": "workflow_runs:incremental_rerun",
    "profiler_overhead": "training:profiler_overhead",
    "context_storage": "training:context_storage",
    "kernel_interface_overhead": "training:kernel_interface_overhead",
    "playback_vs_retraining": "stages:playback_vs_retraining",
    "playback_efficiency": "stages:playback_efficiency",
    "sdc_checks": "stages:sdc_checks",
    "checkpoint_alteration": "stages:checkpoint_alteration",
}


def resolve(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def run_one(name: str, settings: Settings) -> dict:
    print(f"[bench] {name} ...", flush=True)
    start = time.perf_counter()
    try:
        entry = resolve(BENCHMARKS[name])(settings).as_json()
    except Exception as err:  # one broken stage must not hide the others' numbers
        traceback.print_exc()
        entry = {"name": name, "error": f"{type(err).__name__}: {err}".splitlines()[0], "repeats": 0,
                 "median": None, "min": None, "max": None, "met": False, "samples": []}
    entry["bench_seconds"] = round(time.perf_counter() - start, 1)
    entry["finished"] = now()
    entry["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"[bench] {name}: median={entry.get('median')} min={entry.get('min')} max={entry.get('max')} "
          f"goal={entry.get('goal')} met={entry['met']}" + (f" ERROR {entry['error']}" if "error" in entry else ""),
          flush=True)
    return entry


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _repeats(text: str) -> int:
    # 0 must not fall back to the default (it is falsy), and fewer left entries without a sample.
    if not text.lstrip("-").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _seconds(text: str) -> float:
    # 0 or less stopped the workflow at once: end_to_end became a lower bound of about 0 s.
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def _results(parser: argparse.ArgumentParser, option: str, path: Path) -> dict:
    try:
        return figures.read(path)
    except PeatError as err:
        parser.error(f"{option}: {err}")


def exit_on_sigterm() -> None:
    """SIGTERM as an exit, as Ctrl-C is an exception: by default it ended Python at once, with
    no cleanup, so the scratch folder stayed and a workflow entry's snakemake (its own session)
    ran on. results.json is written atomically either way."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    names = list(BENCHMARKS)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 2 repeats")
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=f"run only these: {', '.join(names)}")
    parser.add_argument("--repeats", type=_repeats, help="paired repeats per benchmark (default 5, quick 2)")
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "benchmarks", help="output folder")
    parser.add_argument("--results", type=Path,
                        help="the results/ folder of a default-config workflow run: context_storage reads its "
                             "golden storage.json files (end_to_end sets this to its own run)")
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a temporary one, removed)")
    parser.add_argument("--workflow-timeout", type=_seconds, metavar="SECONDS",
                        help="stop the full workflow run after this long (end_to_end then reports a lower bound)")
    parser.add_argument("--record-layers", nargs="+", metavar="GLOB",
                        help="layers the training benchmarks record instead of the default config's (said in results)")
    parser.add_argument("--vendor", choices=["cpu", "nvidia", "amd"], default="cpu",
                        help="run the trainings and playback campaigns on this vendor's GPU (profiler, context, "
                             "kernel-interface and playback benchmarks; ratios then use wall-clock seconds)")
    parser.add_argument("--table", action="store_true", help="print OUT/results.json as a Markdown table and exit")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="RESULTS_JSON",
                        help="merge the entries of results.json files of other runs into OUT and exit")
    args = parser.parse_args(argv)
    try:
        harness.check_out_folder(args.out)
        if args.workdir:
            harness.check_out_folder(args.workdir, "--workdir")
    except PeatError as err:
        parser.error(str(err))
    for path in args.merge or ([args.out / "results.json"] if args.table else []):
        if not path.is_file():  # a folder is most often another run's --out, not "missing"
            parser.error(f"{'--merge' if args.merge else '--table'}: {path} "
                         + ("is a folder, not a results.json" if path.is_dir() else "does not exist"))
    if (args.only or args.merge) and (args.out / "results.json").exists():
        # said now, not after every benchmark has run (--only) or as a traceback (--merge)
        _results(parser, "--out", args.out / "results.json")
    if args.merge:
        others = [_results(parser, "--merge", path) for path in args.merge]  # all read before any is merged
        for other in others:
            figures.write(args.out, other["machine"], other["benchmarks"], merge=True)
        return 0
    if args.table:
        print(figures.markdown(_results(parser, "--table", args.out / "results.json")))
        return 0
    if args.results is not None and not any(args.results.glob("golden/*/*/storage.json")):
        # context_storage would silently fall back to measuring its own truncated training
        parser.error(f"--results: {args.results}: no golden/*/*/storage.json under it "
                     "(not the results/ folder of a finished workflow run?)")
    if args.record_layers:
        import training  # here: it imports the model libraries, which no other option needs

        try:
            training.check_record_layers(args.record_layers)
        except PeatError as err:
            parser.error(str(err))
    try:  # a missing GPU is said before anything runs, not once per benchmark
        for_vendor(args.vendor)
    except PeatError as err:
        parser.error(f"--vendor: {err}")
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="peat-bench-") as tmp:
        settings = Settings(quick=args.quick, repeats=args.repeats or (2 if args.quick else 5),
                            workdir=(args.workdir or Path(tmp)).resolve(), results=args.results,
                            workflow_timeout=args.workflow_timeout, record_layers=args.record_layers,
                            vendor=args.vendor)
        settings.workdir.mkdir(parents=True, exist_ok=True)
        header = harness.machine() | {"quick": args.quick, "vendor": args.vendor, "started": now()}
        entries = [run_one(name, settings) for name in names if not args.only or name in args.only]
    header["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    # --only updates its entries in an existing results.json and keeps the others.
    figures.write(args.out, header, entries, merge=bool(args.only))
    print(f"[bench] wrote {args.out / 'results.json'}")
    return 0


def command(argv: list[str] | None = None) -> int:
    """main() as the command line runs it: SIGTERM exits quietly with 143, Ctrl-C with one line and
    130 (as ``peat``'s commands), not Python's traceback. Either way the scratch folder and a
    workflow entry's snakemake are gone by then (with blocks, finally), and results.json is as it
    was: it is written, atomically, once every benchmark has run."""
    exit_on_sigterm()
    try:
        return main(argv)
    except KeyboardInterrupt:
        return interrupted("run.py", "results.json left as it was")


if __name__ == "__main__":
    sys.exit(command())
