"""The checkpoint-alteration study: corrupt golden checkpoints over a grid, resume, compare.

One cell = (model, vendor, epoch, location class, bit region, number of flips, seed): flip bits
in the golden checkpoint of that epoch with ``peat.alter``, resume training from the altered
checkpoint to the end of the golden schedule, and compare its validation curve with golden.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from .alter import CLASSES, Plan, alter, scan
from .io import PeatError, read_csv, write_csv, write_json
from .provenance import columns, stamp

# Heatmap column order: from the sign bit down to the mantissa.
REGION_ORDER = ("sign", "exponent_msb", "exponent_other", "exponent", "mantissa", "any")
GRID = ("model", "vendor", "epoch", "cls", "region", "flips", "seed")
COLUMNS = GRID + ("status", "reason", "altered_values", "datasets_hit", "nonfinite_injected", "altered_accuracy",
                  "altered_loss", "final_accuracy",
                  "final_loss", "golden_accuracy", "golden_loss", "accuracy_loss_pct", "loss_change_pct", "diverged",
                  "epochs_to_recover", "resumed_epochs", "accuracy_gaps")
# A cell's own table: epochs_to_recover is the summary's, from accuracy_gaps and alter.tolerance, so that
# editing the tolerance reruns no cell (each a resumed training).
CELL_COLUMNS = tuple(name for name in COLUMNS if name != "epochs_to_recover")
COUNTS = ("altered_values", "datasets_hit", "nonfinite_injected", "epochs_to_recover", "resumed_epochs")
# A diverged run's NaN loss is a measurement: written as "nan", since an empty cell reads as not
# measured (a not_applicable row) or, in epochs_to_recover, as never.
MEASURED = ("altered_accuracy", "altered_loss", "final_accuracy", "final_loss", "golden_accuracy", "golden_loss",
            "accuracy_loss_pct", "loss_change_pct")


def check_config(config: dict) -> None:
    """Cross-check the ``alter`` section against the models (one line per problem, before any job)."""
    section = config.get("alter", {})
    for name in section.get("models", []):
        spec = config["models"].get(name)
        if spec is None:
            raise PeatError(f"config key 'alter.models': unknown model {name!r}; defined: {', '.join(config['models'])}")
        for epoch in section["epochs"]:
            if epoch not in spec.get("checkpoint_epochs", []) or epoch >= spec["epochs"]:
                raise PeatError(
                    f"config key 'alter.epochs': epoch {epoch} of model {name!r} is not a golden checkpoint "
                    f"before the last epoch (checkpoint_epochs: {spec.get('checkpoint_epochs', [])}, epochs: {spec['epochs']})"
                )


def run_cells(model: str, spec: dict, vendor: str, epoch: int, cls: str, regions: list[str], flips: list[int],
              seeds: list[int], *, checkpoints: str | Path, data: str | Path, golden_metrics: str | Path,
              run_seed: int, threads: int, config_hash: str, out_csv: str | Path,
              log_dir: str | Path) -> pd.DataFrame:
    """Every (region, flips, seed) cell of one (model, vendor, epoch, class); one row each.

    The cells of a class share one process: importing torch and transformers costs more than
    resuming the small models of a test run.
    """
    source = Path(checkpoints) / f"epoch{epoch:03d}.h5"
    scan(source)  # a damaged checkpoint fails the job: only a cell's own plan can be not applicable
    golden = golden_curve(golden_metrics, epoch, spec.get("epochs"))
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for region, n, seed in itertools.product(regions, flips, seeds):
        key = dict(model=model, vendor=vendor, epoch=epoch, cls=cls, region=region, flips=n, seed=seed)
        plan = Plan(classes=[cls], count=n, region=region, seed=seed)
        rows.append({**key, **_cell(model, spec, vendor, source, plan, golden, epoch, data, run_seed, threads,
                                    config_hash, log_dir / f"{region}_n{n}_seed{seed}.json")})
        print(rows[-1], flush=True)
    table = pd.DataFrame(rows, columns=list(CELL_COLUMNS))  # same columns when every cell is not_applicable
    # The stack the cells ran on, as a report row's prov_ columns (stamp alone is no result with a provenance).
    table = table.assign(**columns({"provenance": stamp(config_hash, vendor)}))
    _write_table(out_csv, table)
    return table


def _write_table(path: str | Path, table: pd.DataFrame) -> None:
    # Counts stay integers beside the empty cells of a never-recovered or not_applicable row (not 3.0).
    out = table.astype({name: object for name in MEASURED} | {name: "Int64" for name in COUNTS if name in table})
    for name in MEASURED:
        out.loc[(table["status"] == "ok") & table[name].isna(), name] = "nan"
    write_csv(path, out)


def made_nonfinite(records: list[dict]) -> int:
    """How many altered values the flips made NaN/Inf (written as strings in the log): a value already
    non-finite (a NaN flipped into another NaN) was none of their doing."""
    return sum(1 for r in records if isinstance(r["new"], str) and not isinstance(r["old"], str))


def _cell(model, spec, vendor, source, plan, golden, epoch, data, run_seed, threads, config_hash, log):
    import torch

    from .train import evaluate_checkpoint, train_model

    with tempfile.TemporaryDirectory(dir=log.parent, prefix=".cell") as tmp:
        altered = Path(tmp) / "altered.h5"
        try:
            result = alter(source, altered, plan, log=log, keep_records=True)
        except PeatError as err:
            # A class the model lacks, or fewer eligible values than flips: recorded, not fatal.
            write_json(log, {"injections": [], "skipped": str(err)})
            return {"status": "not_applicable", "reason": str(err)}
        # The damage right after the flips, then what training makes of it.
        now = evaluate_checkpoint(model, spec, data, altered, vendor=vendor, seed=run_seed, threads=threads)
        rows = []
        try:
            metrics = train_model(model, spec, data, Path(tmp) / "run", vendor=vendor, seed=run_seed, threads=threads,
                                  config_hash=config_hash, record=False, progress=False, start=altered,
                                  on_row=rows.append)
            outcome = {"reason": "", **compare(_val_curve(metrics), golden, epoch)}
        except (ArithmeticError, RuntimeError, ValueError) as err:
            # Corrupted state can stop the training itself (AdamW's step counter flipped negative: a
            # complex bias correction; -1.0: a division by zero): the cell's outcome, not the job's.
            if isinstance(err, torch.cuda.OutOfMemoryError):
                raise
            outcome = {"reason": f"resumed training stopped: {type(err).__name__}: {str(err).strip().splitlines()[0]}",
                       **stopped(pd.DataFrame(rows, columns=["split", "epoch", "accuracy", "loss"]), golden, epoch)}
    return {"status": "ok", "altered_values": result.flips, "datasets_hit": result.datasets,
            "nonfinite_injected": made_nonfinite(result.records), "altered_accuracy": now["accuracy"], "altered_loss": now["loss"], **outcome}


def _val_curve(metrics: pd.DataFrame) -> pd.DataFrame:
    return metrics[metrics["split"] == "val"].set_index("epoch")[["accuracy", "loss"]]


def golden_curve(path: str | Path, epoch: int, last: int | None = None) -> pd.DataFrame:
    """Golden's validation curve from its ``metrics.csv``, checked for what the cells compare with
    it: one finite accuracy and loss for each epoch after the altered ``epoch`` up to ``last`` (the
    model's epochs; None: the file's last, at least the one after ``epoch``). A damaged file ended the
    job in a KeyError or TypeError once its first cell had trained."""
    curve = _val_curve(read_csv(path, ("split", "epoch", "accuracy", "loss")))

    def refuse(problem: str):
        raise PeatError(f"{path}: {problem} (damaged, or not this model's golden run?)")

    epochs = pd.to_numeric(curve.index, errors="coerce")
    if epochs.isna().any() or (epochs != epochs.round()).any():
        refuse(f"validation epoch {curve.index[epochs.isna() | (epochs != epochs.round())][0]!r} is not an epoch number")
    curve.index = epochs.astype(int)
    last = last if last is not None else max(epoch + 1, *curve.index)
    for at in range(epoch + 1, last + 1):
        if at not in curve.index:
            refuse(f"no validation row of epoch {at}; the study compares epochs {epoch + 1} to {last} with golden's")
        rows = curve.loc[[at]]
        if len(rows) > 1:
            refuse(f"{len(rows)} validation rows of epoch {at}, one expected")
        for name, value in rows.iloc[0].items():
            number = pd.to_numeric(value, errors="coerce")
            if not np.isfinite(number):
                refuse(f"validation {name} of epoch {at} is {value!r}, not a finite number")
    return curve.apply(pd.to_numeric, errors="coerce")  # text read where a row before the compared ones was damaged


def compare(run: pd.DataFrame, golden: pd.DataFrame, epoch: int) -> dict:
    """Final accuracy/loss against golden, divergence, and ``accuracy_gaps``: |accuracy - golden's| at
    each epoch resumed after the altered ``epoch``, space-separated (``inf`` where the loss was not finite)."""
    resumed = run.loc[run.index > epoch]
    final, ref = resumed.iloc[-1], golden.loc[resumed.index[-1]]
    diverged = not bool(np.isfinite(resumed["loss"]).all())
    gaps = (resumed["accuracy"] - golden.loc[resumed.index, "accuracy"]).abs().where(np.isfinite(resumed["loss"]), math.inf)
    return {
        "final_accuracy": float(final["accuracy"]), "final_loss": float(final["loss"]),
        "golden_accuracy": float(ref["accuracy"]), "golden_loss": float(ref["loss"]),
        "accuracy_loss_pct": 100.0 * (ref["accuracy"] - final["accuracy"]) / max(ref["accuracy"], 1e-12),
        "loss_change_pct": 100.0 * (final["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
        if np.isfinite(final["loss"]) else math.inf,
        "diverged": diverged, "resumed_epochs": len(resumed), "accuracy_gaps": " ".join(map(repr, gaps.tolist())),
    }


def epochs_to_recover(gaps, tolerance: float) -> float:
    """Epochs after the alteration until validation accuracy is back within ``tolerance`` (absolute) of
    golden's: 1 = the first resumed epoch already was; NaN if never (or no gaps: a cell not run)."""
    for n, gap in enumerate(gaps.split() if isinstance(gaps, str) else [], 1):
        if float(gap) <= tolerance or _same(float(gap), tolerance):
            return n
    return math.nan


def _same(x, limit: float):
    """Whether a measured share equals a configured limit but for float rounding: accuracies are
    ratios such as 72 / 100, whose difference from 0.70 is 0.020000000000000018, not 0.02, and a
    loss of 1 sample in 10 is 9.999999999999998 %. Elementwise for arrays."""
    return np.isclose(x, limit, rtol=1e-9, atol=1e-12)


def stopped(run: pd.DataFrame, golden: pd.DataFrame, epoch: int) -> dict:
    """``compare`` for a resumed training that ended with an error: diverged, with no final values.

    ``run`` holds the rows it made before it stopped.
    """
    ref = golden.iloc[-1]
    return {
        "final_accuracy": math.nan, "final_loss": math.nan, "golden_accuracy": float(ref["accuracy"]),
        "golden_loss": float(ref["loss"]), "accuracy_loss_pct": math.nan, "loss_change_pct": math.nan,
        "diverged": True, "resumed_epochs": int((_val_curve(run).index > epoch).sum()), "accuracy_gaps": "",
    }


# ---------------------------------------------------------------------------------------------
# Summaries


def collect(parts: list[str | Path], out_csv: str | Path, tolerance: float) -> pd.DataFrame:
    table = pd.concat([read_csv(p, CELL_COLUMNS, keep_default_na=False, na_values=["", "nan"], dtype={"accuracy_gaps": str})
                       for p in parts], ignore_index=True)
    table["diverged"] = table["diverged"].astype(str).eq("True")
    table.insert(table.columns.get_loc("resumed_epochs"), "epochs_to_recover",
                 [epochs_to_recover(gaps, tolerance) for gaps in table["accuracy_gaps"]])
    table = table.sort_values(list(GRID), kind="stable").reset_index(drop=True)
    _write_table(out_csv, table)
    return table


def absorbed(table: pd.DataFrame, max_loss_pct: float) -> pd.DataFrame:
    """Per class x region: the most flips absorbed (every run at that count and below lost < X%)."""
    ok = table[table["status"] == "ok"].copy()
    lost = ok["accuracy_loss_pct"]
    ok["absorbed"] = (lost < max_loss_pct) & ~_same(lost, max_loss_pct) & ~ok["diverged"]
    rows = []
    for (cls, region), group in ok.groupby(["cls", "region"], sort=True):
        per_n = group.groupby("flips")["absorbed"].all().sort_index()
        failing = per_n.index[~per_n.values]
        below = per_n.index[per_n.index < failing.min()] if len(failing) else per_n.index
        rows.append({
            "cls": cls, "region": region, "max_loss_pct": max_loss_pct,
            "max_absorbed_flips": int(below.max()) if len(below) else 0,
            "first_harmful_flips": int(failing.min()) if len(failing) else None,
            "runs": len(group), "absorbed_runs": int(group["absorbed"].sum()),
            "diverged_runs": int(group["diverged"].sum()),
        })
    return pd.DataFrame(rows, columns=["cls", "region", "max_loss_pct", "max_absorbed_flips", "first_harmful_flips",
                                       "runs", "absorbed_runs", "diverged_runs"]).astype({"first_harmful_flips": "Int64"})


def summarize(parts: list[str | Path], sensitivity_csv, absorbed_csv, heatmap_png, max_loss_pct: float,
              tolerance: float, *, dpi: int = 110) -> None:
    table = collect(parts, sensitivity_csv, tolerance)
    write_csv(absorbed_csv, absorbed(table, max_loss_pct))
    heatmap(table, heatmap_png, dpi)


HEATMAP_SCALE = "accuracy loss vs golden (%)"


def heatmap(table: pd.DataFrame, out_png: str | Path, dpi: int = 110) -> None:
    """Mean loss of final accuracy (%) per class x region, one panel per number of flips; † = diverged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    from .io import atomic_path

    ok = table[table["status"] == "ok"]
    if ok.empty:  # e.g. only classes the model lacks: say so instead of failing the report
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, "no applicable cells (see sensitivity.csv, column reason)", ha="center", va="center")
        with atomic_path(out_png) as tmp:
            fig.savefig(tmp, dpi=dpi, format="png", metadata={"Software": None})
        plt.close(fig)
        return
    counts = sorted(ok["flips"].unique())
    regions = [r for r in REGION_ORDER if r in set(ok["region"])]
    classes = [c for c in CLASSES if c in set(ok["cls"])]
    fig, axes = plt.subplots(1, len(counts), figsize=(max(3.4 * len(counts) + 2.0, 7.0), 0.5 * max(len(classes), 2) + 2.4),
                             squeeze=False)
    # A training that stopped with an error has no final accuracy (NaN): no colour, yet its † is shown.
    vmax = max(100.0, float(ok["accuracy_loss_pct"].fillna(0).max()))
    for ax, n in zip(axes[0], counts):
        part = ok[ok["flips"] == n]
        grid = part.pivot_table(index="cls", columns="region", values="accuracy_loss_pct", aggfunc="mean")
        grid = grid.reindex(index=classes, columns=regions)
        div = part.pivot_table(index="cls", columns="region", values="diverged", aggfunc="max").reindex_like(grid)
        labels = grid.map(lambda v: "" if np.isnan(v) else f"{v:.1f}") + div.map(lambda d: "†" if d == 1 else "")
        # The colour bar says its unit itself: unlabelled, its 0-100 read as a count beside "10 flipped values".
        sns.heatmap(grid, annot=labels, fmt="", cmap="rocket_r", vmin=0, vmax=vmax, cbar=ax is axes[0][-1], ax=ax,
                    linewidths=0.5, cbar_kws={"label": HEATMAP_SCALE})
        for i, j in zip(*np.nonzero(grid.isna().to_numpy() & (labels != "").to_numpy())):
            ax.text(j + 0.5, i + 0.5, labels.iloc[i, j], ha="center", va="center")  # seaborn leaves NaN cells bare
        ax.set_title(f"{n} flipped value{'s' if n != 1 else ''}")
        ax.set_xlabel("bit region")
        ax.set_ylabel("location class" if ax is axes[0][0] else "")
        ax.tick_params(axis="y", rotation=0)
        ax.tick_params(axis="x", rotation=30)
    model, vendor = table["model"].iloc[0], table["vendor"].iloc[0]
    fig.suptitle(f"{model} ({vendor}): loss of final validation accuracy vs golden, %\n"
                 "(mean over seeds and altered epochs; † = a run diverged)", fontsize=10)
    fig.tight_layout()
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png", metadata={"Software": None})
    plt.close(fig)
