"""Labeled benchmark of PEAT's Detector against PEAT's rule of thumb and torch.allclose.

Cases are built on recorded training contexts (golden ``context.h5`` files): for every
recorded layer, every computation it has (forward, input gradient, weight gradient) and
every seed, the golden kernel is replayed with each pseudo-error spec of ``SPECS`` injected
into that computation (``peat.errors.faulty``), over ``--steps`` recorded iterations. The
shipped correct alternative kernels (``peat.alt_kernels``) are the should-pass cases.

A case's label is its spec's class (``peat.errors.TRUTH``), with the corrections the class
definitions force: an injection that made golden-finite values NaN/Inf is ``non_finite``
(first in the priority order), one that changed nothing is ``none``, and a lane fault that
leaves no lanes to see is labelled by what it left: on a view of one lane (a depthwise
convolution's weight gradient, 96x1x3x3, is one column) the whole output is wrong,
``block_structured``; one or two wrong elements of a vector are ``random_value``. The Detector
predicts a class per case (the worst over the iterations, as for a kernel verdict); the
baselines only say pass or fail.

Writes, under --out (default reports/benchmarks/detector/): ``cases.csv`` (one row per case),
``confusion.csv`` (method, truth, predicted, count), ``metrics.csv`` (per-class precision and
recall per method), ``summary.json`` (binary detection rate, false-alarm rate, class accuracy,
targets and whether they are met, the Detector rules they were judged by) and ``confusion.png``.

    python benchmarks/detector.py [--context PATH ...] [--seeds 5] [--steps 2] [--out DIR] [--smoke]
    python benchmarks/detector.py --combine DIR1 --combine DIR2 --out DIR   # runs side by side, one report
    snakemake detector_benchmark --cores 2
"""
# No `from __future__` import: Snakemake's `script:` prepends its own code to this file.

import argparse
import fnmatch
import glob
import json
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
import torch  # noqa: E402

from peat import detect, errors, kernels, playback  # noqa: E402
from peat.io import PeatError, atomic_path, check_int, read_csv, read_json, write_csv, write_json  # noqa: E402

SPECS = (
    "fp16", "bf16", "tf32",
    "rv:1", "rv:3", "rv:10",
    "rz:1", "rz:3",
    "bit_flip:exponent", "bit_flip:sign", "bit_flip:30", "bit_flip:22", "bit_flip:exponentx2:2",
    "lane:4", "lane:16", "lane:8:stuck", "lane:16:row",
    "tile:4:zero", "tile:16:zero", "tile:8:stale", "tile:16:splitk",
    "nan:1", "inf:2",
)
SMOKE_SPECS = ("fp16", "rv:3", "rz:1", "bit_flip:exponent", "lane:4", "tile:4:zero", "nan:1")
ALTERNATIVES = {
    "conv2d": ("im2col", "winograd", "tf32"),
    "linear": ("blocked_gemm", "splitk_gemm", "bf16_gemm", "fp16_gemm", "tf32"),
    "batch_norm": ("onepass_norm", "welford_norm"),
    "layer_norm": ("onepass_norm", "welford_norm"),
    "rms_norm": ("rms_norm",),
}
# A priori class of each correct alternative: operands rounded below fp32 -> reduced_precision.
REDUCED = {"tf32", "bf16_gemm", "fp16_gemm"}
PASSING = ("none", "reduced_precision")
TARGETS = {"binary_detection": 0.99, "false_alarms_on_correct_kernels": 0, "class_accuracy": 0.95}
METHODS = ("detector", "peat_rule_of_thumb", "allclose")


def applicable(spec: str, op: str, computation: str) -> bool:
    """Split-K tiles need a GEMM-like computation with a reduction to split."""
    if spec.endswith(":splitk"):
        return op == "linear" or (op == "conv2d" and computation == "forward")
    return True


def truth_of(spec: str, rows: pd.DataFrame) -> str:
    model = errors.parse(spec)
    label = model.truth
    if label != "non_finite" and (rows["nonfinite"] > 0).any():
        return "non_finite"
    if (rows["frac_diff"] == 0).all():
        return "none"
    if label == "periodic_lane":
        lanes, other = ("row_mass", "col_mass") if model.axis == "row" else ("col_mass", "row_mass")
        wrong = rows[rows["frac_diff"] > 0]  # (row_mass is binned where the view is long, never a single row)
        if (wrong[lanes].map(len) == 1).all():
            return "block_structured"
        if ((wrong[other].map(len) == 1) & (wrong[lanes].map(np.count_nonzero) < 3)).all():
            return "random_value"
    return label


def labeled(truth: str, rows: pd.DataFrame, rules: detect.Rules) -> dict:
    """A case's label, the verdict it should get and the three methods' predictions. The verdict
    follows the rules as the Detector's does: reduced_precision should fail where they refuse it."""
    # steps: the iterations replayed, fewer than --steps where the context recorded fewer.
    return {"truth": truth, "should_pass": detect.passes(truth, rules), "steps": int(rows["step"].nunique()),
            **judge(rows, rules)}


def judge(rows: pd.DataFrame, rules: detect.Rules) -> dict:
    """The three methods on one case's rows (one per replayed iteration)."""
    records = rows.to_dict("records")
    predicted = detect.worst(detect.classify(r, rules)[0] for r in records)
    peat = detect.peat_rule_of_thumb(rows)["verdict"]
    return {"detector": predicted, "detector_verdict": "pass" if detect.passes(predicted, rules) else "fail",
            "peat_rule_of_thumb": peat, "allclose": "pass" if rows["allclose"].all() else "fail"}


def layer_cases(context: str, layer: str, op: str, *, seeds: int, steps: int, specs, alternatives,
                rules: detect.Rules) -> list[dict]:
    """All cases of one recorded layer: pseudo-errors x computations x seeds, and the alternatives."""
    model = str(playback.check_context(context, {})["attrs"].get("model", Path(context).stem))
    out = []
    for computation in kernels.COMPUTATIONS:
        wanted = [s for s in specs if applicable(s, op, computation)]
        for seed in range(seeds):
            plan = playback.Plan(context=Path(context), kernel=kernels.golden(op), layers=[layer], errors=wanted,
                                 computations=(computation,), max_samples=steps, seed=seed, rules=rules)
            table, _ = playback.replay(plan)
            if table.empty:
                break  # this layer has no such computation (the first conv's input gradient)
            for spec, rows in table[table["fop"] == "output"].groupby("case", sort=False):
                if spec in wanted:
                    out.append({"context": str(context), "model": model, "layer": layer, "op": op,
                                "computation": computation, "seed": seed,
                                "case": spec, **labeled(truth_of(spec, rows), rows, rules)})
        for alt in alternatives.get(op, ()):
            kernel = kernels.load(f"peat.alt_kernels.{alt}", op, name=alt)
            plan = playback.Plan(context=Path(context), kernel=kernel, layers=[layer], computations=(computation,),
                                 max_samples=steps, rules=rules)
            table, _ = playback.replay(plan)
            rows = table[(table["case"] == "kernel") & (table["fop"] == "output")] if len(table) else table
            if len(rows):
                out.append({"context": str(context), "model": model, "layer": layer, "op": op,
                            "computation": computation, "seed": 0,
                            "case": f"kernel:{alt}", "correct_kernel": True,
                            **labeled("reduced_precision" if alt in REDUCED else "none", rows, rules)})
    return out


def build_cases(contexts, *, seeds: int, steps: int, specs, alternatives, rules, layers_per_op=None,
                layers=None) -> pd.DataFrame:
    todo, unmatched = [], {}
    for context in contexts:
        info = playback.check_context(context, {})
        kept = [(layer, op) for layer, op in info["ops"].items()
                if not layers or any(fnmatch.fnmatchcase(layer, g) for g in layers)]
        if not kept:
            unmatched[context] = list(info["ops"])
        seen: dict[str, int] = {}
        for layer, op in kept:
            seen[op] = seen.get(op, 0) + 1  # of the layers --layer keeps
            if layers_per_op is not None and seen[op] > layers_per_op:
                continue
            todo.append((context, layer, op))
    # Before any replay, each context: one without a case was left out of the results unsaid
    # (where another context matched), and with none at all there are no metrics to report.
    if unmatched:
        raise PeatError(f"no recorded layer of {', '.join(map(str, unmatched))} matches --layer "
                        f"{' '.join(map(repr, layers or []))} (recorded: "
                        f"{'; '.join(', '.join(names) or 'none' for names in unmatched.values())})")
    cases = []
    for context, layer, op in todo:
        print(f"{context}: {layer} ({op})", flush=True)
        cases += layer_cases(context, layer, op, seeds=seeds, steps=steps, specs=specs,
                             alternatives=alternatives, rules=rules)
    frame = pd.DataFrame(cases)
    if "correct_kernel" not in frame:
        frame["correct_kernel"] = False
    frame["correct_kernel"] = frame["correct_kernel"].fillna(False).astype(bool)
    return frame


# -- metrics -------------------------------------------------------------------------------------
def _binary(frame: pd.DataFrame, verdicts: pd.Series) -> dict:
    """Rates with no case to divide by are NaN (null in summary.json): a run of should-pass cases
    alone has no detection rate, and a suite without correct kernels has had no chance of a
    false alarm on one (its count says 0 of ``correct_kernel_cases``)."""
    bug = ~frame["should_pass"]
    fail = verdicts == "fail"
    correct = frame["correct_kernel"] & ~bug
    return {"bug_cases": int(bug.sum()), "should_pass_cases": int((~bug).sum()),
            "correct_kernel_cases": int(correct.sum()),
            "binary_detection": float(fail[bug].mean()) if bug.any() else float("nan"),
            "false_alarm_rate": float(fail[~bug].mean()) if (~bug).any() else float("nan"),
            "false_alarms_on_correct_kernels": int(fail[correct].sum())}


def metrics(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Confusion (long), per-class precision/recall, and the summary of every method."""
    confusion, per_class, summary = [], [], {}
    hit = (frame["detector"] == frame["truth"]) | (frame["correct_kernel"] & frame["detector"].isin(PASSING))
    for method in METHODS:
        verdicts = frame["detector_verdict"] if method == "detector" else frame[method]
        predicted = frame["detector"] if method == "detector" else frame[method]
        counts = pd.crosstab(frame["truth"], predicted)
        confusion += [{"method": method, "truth": t, "predicted": p, "count": int(counts.loc[t, p])}
                      for t in counts.index for p in counts.columns]
        summary[method] = _binary(frame, verdicts)
    summary["detector"]["class_accuracy"] = float(hit.mean())
    for cls in detect.CLASSES:
        truth, pred = frame["truth"] == cls, frame["detector"] == cls
        per_class.append({"method": "detector", "class": cls, "support": int(truth.sum()),
                          "precision": float((truth & pred).sum() / pred.sum()) if pred.any() else float("nan"),
                          "recall": float((truth & pred).sum() / truth.sum()) if truth.any() else float("nan")})
    for method in METHODS[1:]:
        for cls, rows in frame.groupby("truth"):
            fail = rows[method] == "fail"
            per_class.append({"method": method, "class": cls, "support": int(len(rows)), "precision": float("nan"),
                              "recall": float((fail != rows["should_pass"]).mean())})
    det = summary["detector"]
    # A target whose metric is undefined is neither met nor missed: None (null), not False or True.
    summary["targets"] = {**TARGETS, "met": {
        "binary_detection": _at_least(det["binary_detection"], TARGETS["binary_detection"]),
        "false_alarms_on_correct_kernels": det["false_alarms_on_correct_kernels"] == 0
        if det["correct_kernel_cases"] else None,
        "class_accuracy": _at_least(det["class_accuracy"], TARGETS["class_accuracy"])}}
    return pd.DataFrame(confusion), pd.DataFrame(per_class), summary


def _at_least(value: float, target: float) -> bool | None:
    return None if np.isnan(value) else bool(value >= target)


def _rate(value: float | None, what: str) -> str:
    """A rate as printed, or undefined where there was no ``what`` to divide by (NaN)."""
    return f"undefined (no {what})" if value is None or np.isnan(value) else f"{value:.4f}"


def figure(confusion: pd.DataFrame, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5), gridspec_kw={"width_ratios": [3, 1, 1]})
    order = [c for c in detect.CLASSES if c in set(confusion["truth"])]
    for ax, method in zip(axes, METHODS):
        rows = confusion[confusion["method"] == method]
        cols = [c for c in detect.CLASSES if c in set(rows["predicted"])] if method == "detector" else ["pass", "fail"]
        grid = rows.pivot_table(index="truth", columns="predicted", values="count", aggfunc="sum", fill_value=0)
        grid = grid.reindex(index=order, columns=cols, fill_value=0)
        sns.heatmap(grid, annot=True, fmt="d", cmap="Blues", cbar=False, ax=ax)
        ax.set_title(method.replace("_", " "))
        ax.set_xlabel("predicted")
        ax.set_ylabel("true class" if method == "detector" else "")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)


def run(contexts, out: str | Path, *, seeds: int = 5, steps: int = 2, smoke: bool = False,
        rules: detect.Rules = detect.Rules(), layers: list[str] | None = None, specs: list[str] | None = None) -> dict:
    """``specs``: the pseudo-errors injected instead of ``SPECS`` (or the smoke run's)."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    check_int("--seeds", seeds, 1, "seeds per pseudo-error case, at least 1")
    check_int("--steps", steps, 1, "recorded iterations replayed per case, at least 1")
    if not contexts:
        raise PeatError("no context files given (--context) and none under results/golden/*/*/context.h5")
    _once(contexts, "--context")
    specs = list(specs or (SMOKE_SPECS if smoke else SPECS))
    for spec in specs:  # before any replay: a typo would otherwise fail after the first layers
        errors.parse(spec)
    frame = build_cases(contexts, seeds=seeds, steps=steps, specs=specs,
                        alternatives={k: v[:1] for k, v in ALTERNATIVES.items()} if smoke else ALTERNATIVES,
                        rules=rules, layers_per_op=1 if smoke else None, layers=layers)
    return report(frame, out, contexts=[str(c) for c in contexts], seeds=seeds, steps=steps, smoke=smoke,
                  layers=layers, specs=specs, rules=vars(rules), wall_s=time.perf_counter() - start)


def combine(parts, out: str | Path) -> dict:
    """One report from the cases of several runs (say one per context, run side by side)."""
    _once(parts, "--combine")
    for part in map(Path, parts):
        if part.resolve() == Path(out).resolve():
            raise PeatError(f"--combine {part}: also --out: the combined report would replace its cases, "
                            "and a rerun count them twice")
    frames, metas = [], []
    for part in map(Path, parts):
        cases, meta = _finished_run(part)
        # Cases written before should_pass was kept were judged by the default rules.
        frames.append(cases if "should_pass" in cases else cases.assign(should_pass=cases["truth"].isin(PASSING)))
        metas.append(meta)
    frame = pd.concat(frames, ignore_index=True)
    frame["correct_kernel"] = frame["correct_kernel"].astype(str).eq("True")
    frame["should_pass"] = frame["should_pass"].astype(str).eq("True")
    # Parts written before the rules were kept in summary.json have null there.
    same = {k: sorted({json.dumps(m.get(k)) for m in metas}) for k in ("seeds", "steps", "specs", "rules")}
    return report(frame, out, contexts=[c for m in metas for c in m["contexts"]],
                  **{k: json.loads(v[0]) if len(v) == 1 else [json.loads(x) for x in v] for k, v in same.items()},
                  smoke=any(m["smoke"] for m in metas),
                  layers=[{"contexts": m["contexts"], "layers": m["layers"]} for m in metas],
                  wall_s=sum(m["wall_s"] for m in metas), parts=[str(p) for p in parts])


def _once(paths, option: str) -> None:
    seen = set()
    for path in map(Path, paths):
        if path.resolve() in seen:
            raise PeatError(f"{option} {path}: given twice (its cases would count twice)")
        seen.add(path.resolve())


SUMMARY_KEYS = ("contexts", "layers", "smoke", "wall_s")


def _finished_run(part: Path) -> tuple[pd.DataFrame, dict]:
    """The cases and summary of a run's --out folder; one line naming it where it has not both."""
    if not part.is_dir():
        raise PeatError(f"--combine {part}: no such folder")
    for name in ("cases.csv", "summary.json"):
        if not (part / name).is_file():
            raise PeatError(f"--combine {part}: no {name} (not a finished detector benchmark run?)")
    try:
        cases = read_csv(part / "cases.csv", ("case", "truth", *METHODS, "detector_verdict", "correct_kernel"),
                         keep_default_na=False)
        summary = read_json(part / "summary.json")
    except PeatError as err:
        raise PeatError(f"--combine {part}: {err}") from None
    # combine() reads these of every part: without them it ended in a KeyError traceback
    missing = [k for k in SUMMARY_KEYS if k not in summary] if isinstance(summary, dict) else list(SUMMARY_KEYS)
    if missing:
        raise PeatError(f"--combine {part}: summary.json has no {', '.join(missing)} "
                        "(not a detector benchmark run's?)")
    return cases, summary


def report(frame: pd.DataFrame, out: str | Path, **meta) -> dict:
    """Metrics of the cases in ``frame``, written under ``out`` (``meta`` goes into summary.json)."""
    out = Path(out)
    confusion, per_class, summary = metrics(frame)
    # --steps asks; a context that recorded fewer iterations replays what it has (parts written
    # before cases.csv kept the count have none).
    replayed = frame["steps"].dropna().astype(int) if "steps" in frame else pd.Series(dtype=int)
    summary |= {"cases": int(len(frame)), **meta,
                "replayed_steps": {"min": int(replayed.min()), "max": int(replayed.max())} if len(replayed) else None,
                "label_corrections": frame.loc[frame["truth"] != frame["case"].map(_spec_truth), "case"]
                .value_counts().to_dict()}
    write_csv(out / "cases.csv", frame)
    write_csv(out / "confusion.csv", confusion)
    write_csv(out / "metrics.csv", per_class)
    write_json(out / "summary.json", summary)
    figure(confusion, out / "confusion.png")
    return summary


def _spec_truth(case: str) -> str:
    if case.startswith("kernel:"):
        return "reduced_precision" if case.split(":", 1)[1] in REDUCED else "none"
    return errors.parse(case).truth


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", action="append", default=None, help="context.h5 (repeatable)")
    parser.add_argument("--seeds", type=int, default=5,
                        help="seeds per pseudo-error case, each its own draw of the fault (default 5)")
    parser.add_argument("--steps", type=int, default=2, help="recorded iterations replayed per case")
    parser.add_argument("--out", default="reports/benchmarks/detector", metavar="DIR",
                        help="folder of the report: cases.csv, confusion.csv, metrics.csv, summary.json, "
                             "confusion.png (default reports/benchmarks/detector)")
    parser.add_argument("--smoke", action="store_true", help="a few specs, one layer per op (for the tests)")
    parser.add_argument("--layer", action="append", default=None, help="only recorded layers matching this glob")
    parser.add_argument("--spec", action="append", default=None,
                        help="a pseudo-error to inject instead of the default grid (repeatable; peat.errors' grammar)")
    parser.add_argument("--combine", action="append", default=None, metavar="DIR",
                        help="report the cases of earlier runs' --out DIRs together (repeatable; runs nothing)")
    args = parser.parse_args(argv)
    contexts = args.context or sorted(glob.glob("results/golden/*/*/context.h5"))
    try:
        import harness  # here: the workflow's `script:` run of this file needs none of main()

        harness.check_out_folder(args.out)  # before the cases, not when their report is written
        summary = combine(args.combine, args.out) if args.combine else \
            run(contexts, args.out, seeds=args.seeds, steps=args.steps, smoke=args.smoke, layers=args.layer,
                specs=args.spec)
    except PeatError as err:
        print(f"detector benchmark: error: {err}", file=sys.stderr)
        return 2
    det = summary["detector"]
    print(f"{summary['cases']} cases: detection {_rate(det['binary_detection'], 'bug case')}, false alarms "
          f"{_rate(det['false_alarm_rate'], 'should-pass case')}, class accuracy "
          f"{_rate(det['class_accuracy'], 'case')}; allclose false alarms "
          f"{_rate(summary['allclose']['false_alarm_rate'], 'should-pass case')}, PEAT rule-of-thumb detection "
          f"{_rate(summary['peat_rule_of_thumb']['binary_detection'], 'bug case')}")
    return 0


if "snakemake" in globals():
    sys.stderr = sys.stdout = open(snakemake.log[0], "w")  # noqa: F821
    run(list(snakemake.input.contexts), Path(snakemake.output.summary).parent,  # noqa: F821
        seeds=snakemake.params.seeds, rules=detect.rules_from(snakemake.params.rules))  # noqa: F821
elif __name__ == "__main__":
    sys.exit(main())
