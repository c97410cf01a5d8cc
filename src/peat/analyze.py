"""PEAT's Analyzer: how a kernel's errors behave across layers, iterations and error models.

Reads one playback table (``peat.playback``) and the context's per-step summaries and writes:

- ``layers.csv``: per case x computation x layer x observing point, mean and std over
  iterations of each score in ``SCORES``;
- ``summary.json``: PEAT's [xmin, xmax] (range over layers of the per-layer mean top-10 %
  error) and [rmin, rmax] (same for the error variance) per case and computation; Spearman
  correlations of the top-10 % error with the mean and variance of the layer's weights and
  output activations; the pattern across repeated blocks (layers equal up to block indices);
  forward against backward (input and weight gradient) errors; forward errors at the kernel's
  output against the later observing points (``propagation``);
- seaborn figures: score against iteration per layer, per-layer distributions per error
  model, a layer x iteration heatmap, bit-position histograms and spatial error maps.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from scipy import stats  # noqa: E402

from .detect import CASE_KEYS, TABLE_KEYS, not_applicable  # noqa: E402
from .io import PeatError, atomic_path, iter_list_rows, open_h5, read_json, read_parquet_scalars, write_csv, write_json  # noqa: E402

SCORES = ("err_max", "err_mean", "err_top10", "err_var", "rel_top10", "ulp_median", "frac_diff")
KEYS = list(CASE_KEYS)  # a list: pandas' groupby takes a tuple for one key
# layers.csv's columns: the keys, mean and std of each score, iterations and those of them unscored.
LAYER_COLUMNS = [*KEYS, *(f"{score}_{stat}" for score in SCORES for stat in ("mean", "std")), "iterations", "unscored"]
SUMMARY_KEYS = ("ranges", "spearman", "repeated_blocks", "forward_backward", "propagation")
FIGURES = ("score_vs_iteration", "distributions", "heatmap", "bits", "spatial")
# A training batch norm forward's updated running statistics: rows of its output too (peat.playback).
RUNNING = ("running_mean", "running_var")
SUMMARY_SLICE = 1 << 18  # rows of the context's summaries read at a time (50 MB)
# Plotted ratios to fp32 noise are floored here: an exact match to golden (ratio 0) has no logarithm.
REL_FLOOR = 1e-3
# Three lines: on two, the distributions' labels ran into their neighbours' where long case names
# ("bit_flip:exponent (NaN/Inf)") narrowed the panels.
REL_LABEL = "log10 top-10% err\n/ fp32 noise\n(exact match: -3)"
# The distributions' x axis ends here (decades over fp32 noise): a flipped exponent bit (38)
# squeezed rounding (3-5) and scattered bugs (5-10) into the panels' left tenth.
REL_CUT = 12
# Layers drawn apart: score_vs_iteration took ~1 s a panel and 20 layers made it 4,700 px wide; the
# distributions packed 20 layers' boxes per case into 3.2 in. Beyond this, see ``_shown_layers``.
MAX_LAYERS = 6
# The distributions' panels (inches): as wide whatever their height, which grows by a case's row beyond a dozen cases.
DIST_WIDTH, DIST_HEIGHT, DIST_CASE = 2.9, 3.2, 0.27
# Inches of the heatmap's step columns at most: at half an inch a step, every step of a long training
# replayed (max_samples_per_layer: null) made it 5,571 px wide at 200 steps, 269 tall, a strip in the report.
HEAT_WIDTH = 12
# Decades over fp32 noise the heatmap's colours reach at least: a thousand times the noise, about fp16's
# rounding (3-4), so a kernel at noise level sits mid-scale and the top colour means reduced precision or worse.
HEAT_TOP = 3.0
# What a panel or figure without a finite score says: a result without a finite error (an output without
# elements, as of a zero-size batch, or one all NaN/Inf) has NaN scores, which no line or box can draw.
NO_SCORE = "no finite error\n(no element, or all NaN/Inf)"
NO_SCORE_ANYWHERE = "no result has a finite error (outputs without elements, or all NaN/Inf): nothing to plot"
# Characters of a spatial map's title line at most: a panel's 3 in at 7 pt, its gaps included.
SPATIAL_TITLE_CHARS = 42
# Without it, bits.png did not say what its bits differ from.
BITS_TITLE = "bits where each case's float32 result differs from golden (all replayed tensors)"
# The playback table's columns the Analyzer reads; its list columns only the figures drawing them.
COLUMNS = [*TABLE_KEYS, *SCORES, "error", "status", "map_rows", "map_cols", "nonfinite"]
# Those a table with rows must hold: another parquet file ended the job in a KeyError naming no file.
REQUIRED = [*TABLE_KEYS, *SCORES]


def _ok(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["error"].isna()] if "error" in table else table


def per_layer(table: pd.DataFrame) -> pd.DataFrame:
    """Mean and sample std (ddof 1: NaN for one iteration) over iterations of each score in
    ``SCORES``, per case x computation x layer x observing point. ``unscored``: iterations whose
    result had no finite error (its ``err_*`` scores NaN: an all-NaN output), which the means
    leave out, so they are counted apart from ``iterations``. Layers in the network's order (the
    table's), as in the figures: by name, MobileNetV2's features.10-17 came before features.2."""
    own = _ok(table)
    own = own.assign(layer=pd.Categorical(own["layer"], categories=list(dict.fromkeys(own["layer"]))))
    # As floats: a column of None (rows holding no score) has no isfinite.
    scores = own[list(SCORES)].astype(float)
    scale = _scales(scores, own[KEYS])
    scaled = own[KEYS].join(scores / scale).join(scale.add_suffix("_scale"))
    grouped = scaled.groupby(KEYS, sort=True, observed=True)
    moments = grouped[list(SCORES)].agg(["mean", "std"])
    factor = grouped[[f"{score}_scale" for score in SCORES]].first()
    out = pd.DataFrame({f"{score}_{stat}": moments[(score, stat)] * factor[f"{score}_scale"]
                        for score in SCORES for stat in ("mean", "std")})
    out["iterations"] = grouped.size()
    out["unscored"] = out["iterations"] - grouped["err_top10"].count()
    out = out.reset_index()
    return out.assign(layer=out["layer"].astype(str))


# Scores beyond this are summed over iterations as fractions of their layer's largest (see _scales).
HUGE_SCORE = 2.0 ** 500


def _scales(scores: pd.DataFrame, keys: pd.DataFrame) -> pd.DataFrame:
    """Per row and score: its layer's largest finite value of it where that is beyond HUGE_SCORE, else 1
    (dividing by 1 leaves every other mean and std as it was, bit for bit). An Inf element's error counts
    as the largest float64, so under inf:1 every step's err_max was that finite value: their sum
    overflowed, and layers.csv wrote an empty err_max_mean (pandas' compensated sum turned NaN) beside
    an err_max_std of 0, at 4 iterations, none unscored."""
    top = scores.abs().where(np.isfinite(scores)).groupby([keys[key] for key in KEYS], observed=True).transform("max")
    return top.where(top > HUGE_SCORE, 1.0)


def ranges(layers: pd.DataFrame) -> list[dict]:
    """PEAT's [xmin, xmax] of per-layer mean top-10 % error and [rmin, rmax] of error variances."""
    out = []
    own = layers[layers["fop"] == "output"]
    for (case, comp), rows in own.groupby(["case", "computation"], sort=True):
        out.append({"case": case, "computation": comp,
                    "xmin": float(rows["err_top10_mean"].min()), "xmax": float(rows["err_top10_mean"].max()),
                    "rmin": float(rows["err_var_mean"].min()), "rmax": float(rows["err_var_mean"].max())})
    return out


def summaries(context: str | Path, steps=None) -> pd.DataFrame:
    """The context's per-step summaries as a wide table: layer, step, W_mean, W_var, act_mean, act_var;
    of ``steps`` alone when given. The file holds every training step of every layer (millions of
    rows in a long training) where playback replays a few: it is read a slice at a time and filtered."""
    parts, wanted = [], None if steps is None else np.fromiter(steps, dtype=np.int64)
    with open_h5(context) as f:
        data = f["summaries"] if "summaries" in f else np.zeros(0)
        for start in range(0, len(data), SUMMARY_SLICE):
            chunk = data[start:start + SUMMARY_SLICE]
            keep = np.isin(chunk["tensor"], [b"W", b"act"])
            if wanted is not None:
                keep &= np.isin(chunk["step"], wanted)
            parts.append(chunk[keep])
    rows = pd.DataFrame(np.concatenate(parts)) if parts else pd.DataFrame()
    if rows.empty:
        return pd.DataFrame(columns=["layer", "step"])
    rows["layer"] = rows["layer"].str.decode("utf-8")
    rows["tensor"] = rows["tensor"].str.decode("utf-8")
    rows["var"] = rows["std"] ** 2
    wide = rows[rows["tensor"].isin(["W", "act"])].pivot_table(index=["layer", "step"], columns="tensor",
                                                              values=["mean", "var"])
    wide.columns = [f"{tensor}_{stat}" for stat, tensor in wide.columns]
    return wide.reset_index()


def spearman(table: pd.DataFrame, context_summaries: pd.DataFrame) -> list[dict]:
    """Spearman correlation of the top-10 % error with weight/activation mean and variance, over the
    layers and steps of a case and computation; left out where undefined (< 3 points, a constant side)."""
    own = _ok(table)
    own = own[own["fop"] == "output"].merge(context_summaries, on=["layer", "step"], how="inner")
    out = []
    for (case, comp), rows in own.groupby(["case", "computation"], sort=True):
        for column in [c for c in ("W_mean", "W_var", "act_mean", "act_var") if c in rows]:
            pair = rows[["err_top10", column]].dropna()  # an infinite error ranks highest: kept
            if len(pair) < 3 or pair[column].nunique() < 2 or pair["err_top10"].nunique() < 2:
                continue
            rho, p = stats.spearmanr(pair["err_top10"], pair[column])
            out.append({"case": case, "computation": comp, "against": column, "rho": float(rho),
                        "p": float(p), "points": int(len(pair))})
    return out


# The first run of index components is the block's place (ResNet's layer2.1., GPT-2's h.3.,
# MobileNetV2's features.4., EfficientNet's features.2.0.); an index after a named part inside the
# block is a position in it (MobileNetV2's conv.0 expands, conv.1 is depthwise), so it is kept.
_BLOCK_INDICES = re.compile(r"^((?:[^.]*\.)*?)((?:(?:layer)?\d+\.)+)")


def block_role(layer: str) -> str:
    """A layer's role in a repeated block: its name with block indices replaced by '*'."""
    return _BLOCK_INDICES.sub(lambda m: m[1] + re.sub(r"\d+", "*", m[2]), layer, count=1)


def repeated_blocks(layers: pd.DataFrame) -> list[dict]:
    """For layers repeated across blocks: each block's mean top-10 % error and their spread."""
    own = layers[(layers["fop"] == "output") & (layers["case"] == "kernel")].copy()
    own["role"] = own["layer"].map(block_role)
    out = []
    for (role, comp), rows in own.groupby(["role", "computation"], sort=True):
        if rows["layer"].nunique() < 2:
            continue
        values = rows.set_index("layer")["err_top10_mean"]
        out.append({"role": role, "computation": comp, "blocks": values.to_dict(), "cv": _cv(values)})
    return out


def _cv(values: pd.Series) -> float:
    """Sample std over mean; 0 where all are exact. Of values near the largest float64 (a kernel's own
    Inf elements) as fractions of their largest: their squares overflowed, and the cv was null."""
    top = values[np.isfinite(values)].max()
    values = values / top if top > HUGE_SCORE else values
    return float(values.std() / values.mean()) if values.mean() else 0.0


def forward_backward(layers: pd.DataFrame) -> list[dict]:
    """Per case: median over layers of each computation's ``rel_top10`` (top-10 % error over fp32
    noise), and forward over the larger backward one (a backward median that is NaN, every score
    of that computation NaN, is left out)."""
    own = layers[layers["fop"] == "output"]
    out = []
    for case, rows in own.groupby("case", sort=True):
        med = rows.groupby("computation")["rel_top10_mean"].median().to_dict()
        back = [med[c] for c in ("input_grad", "weight_grad") if pd.notna(med.get(c))]
        ratio = med.get("forward", np.nan) / max(back) if back and max(back) > 0 else np.nan
        out.append({"case": case, "median_rel_top10": med, "forward_over_backward": float(ratio)})
    return out


def propagation(table: pd.DataFrame) -> list[dict]:
    """Forward errors at the kernel output against the later observing points (median over the
    steps followed downstream; over every replayed step where none was)."""
    own = _ok(table)
    own = own[own["computation"] == "forward"]
    if own.empty:
        return []
    # playback.propagate_samples of the replayed steps are followed: the output's median over all of
    # them beside the loss's at those few compared different steps (fp16 at the test config's conv1:
    # output 163 against loss 149, where at the one step followed the output was 982).
    followed = own.loc[own["fop"] != "output", ["case", "layer", "step"]].drop_duplicates()
    if len(followed):
        runs = followed[["case", "layer"]].drop_duplicates().assign(downstream=True)
        marked = own.merge(runs, on=["case", "layer"], how="left").merge(
            followed.assign(followed=True), on=["case", "layer", "step"], how="left")
        own = own[(marked["downstream"].isna() | marked["followed"].notna()).to_numpy()]
    # Each observing point the case reached, NaN (null in summary.json) where no result there had a finite
    # error: unstacked, such a point was dropped with those never followed, and a flip that made the loss
    # NaN read as a case observed at its output alone.
    out = {}
    for (case, layer, fop), value in own.groupby(["case", "layer", "fop"])["rel_top10"].median().items():
        out.setdefault((case, layer), {"case": case, "layer": layer})[fop] = float(value)
    return list(out.values())


def failures(table: pd.DataFrame, outcomes: list[dict] = ()) -> list[str]:
    """One line per computation in which the kernel failed, with its first failure: at its probe (an
    outcome of the playback record; the computation then has no row at all) or at a later call (a
    row with an error). The figures say so, or that computation's panel or line would just be missing."""
    failed = [(o["computation"], o["layer"], f"{o['status']}: {o['message']}") for o in outcomes if o["status"] != "ok"]
    if "error" in table:
        # In any case, as the Detector counts them: an operand pseudo-error (fp16) calls the kernel
        # again, and a kernel crashing there failed its verdict while the figures named nothing.
        # A pseudo-error that cannot act on the op (tile:T:splitk on a norm) is no failure of the kernel.
        rows = table[table["error"].notna() & (table["status"] != "not_applicable")]
        failed += [(r.computation, r.layer if r.case == "kernel" else f"{r.layer}, case {r.case}",
                    f"{r.status}: {r.error}") for r in rows.itertuples()]
    first = {}
    for computation, layer, text in failed:
        first.setdefault(computation, f"{computation} (layer {layer}) {text}")
    return list(first.values())


# -- figures -----------------------------------------------------------------------------------
def _save(fig, path: Path, dpi: int, failed: list[str] = ()) -> None:
    if failed:  # under everything drawn, tick labels included (the figure's bottom edge cuts through them)
        box = fig.get_tightbbox()  # in inches
        fig.text(box.x0 / fig.get_figwidth(), box.y0 / fig.get_figheight(),
                 _literal("\n".join(["kernel failures, not plotted:", *failed])), ha="left", va="top", fontsize=7,
                 color="firebrick", wrap=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
    plt.close(fig)


def _literal(text: str) -> str:
    """``text`` drawn as it is: a kernel's failure message holding "$x^$" ended the job in mathtext's
    ParseSyntaxException (``parse_math=False`` does not reach a wrapped text's measuring)."""
    return text.replace("$", r"\$")


def _empty(path: Path, text: str, dpi: int, failed: list[str] = ()) -> None:
    fig, ax = plt.subplots(figsize=(5, 1.2))
    ax.axis("off")
    ax.text(0.5, 0.5, _literal(text), ha="center", va="center", wrap=True)
    _save(fig, path, dpi, failed)


def _log(values: pd.Series, floor: float = 1e-30) -> pd.Series:
    """log10 of scores from ``floor`` to the largest float64: an infinite score (a mean or variance over
    Inf elements, each counted as that float, overflowed) had no line in the score figure, a blank heatmap
    cell and a distribution box of inf."""
    return np.log10(values.astype(float).clip(lower=floor, upper=np.finfo(np.float64).max))


def _shown_layers(own: pd.DataFrame) -> tuple[list[str], list[str]]:
    """Layers drawn apart (in table order) and those left out: beyond ``MAX_LAYERS``, those where
    the kernel's largest top-10 % error over fp32 noise is largest, where a bug shows first; a NaN
    or Inf where golden is finite is the largest of all."""
    order = list(dict.fromkeys(own["layer"]))
    if len(order) <= MAX_LAYERS:
        return order, []
    kernel = own[own["case"] == "kernel"] if (own["case"] == "kernel").any() else own
    # Not the score alone: an all-NaN result has none (NaN), which ranked its layer last.
    score = kernel["log10_rel_top10"].where(kernel["nonfinite"] == 0, np.inf)
    worst = score.groupby(kernel["layer"]).max().reindex(order).fillna(-np.inf)
    shown = set(worst.sort_values(ascending=False, kind="stable").index[:MAX_LAYERS])
    return [x for x in order if x in shown], [x for x in order if x not in shown]


def _note(fig, text: str) -> None:
    # Wrapped here: matplotlib's wrap=True left a suptitle's unwrapped height as blank space above it.
    fig.suptitle(textwrap.fill(text, int(fig.get_figwidth() * 14)), y=1.0, va="bottom", fontsize=8)


def figures(table: pd.DataFrame, out: Path, dpi: int = 80, outcomes: list[dict] = (), lists=None,
            unreplayed: str = "the context has no recorded layer of this kernel's op") -> None:
    """``lists(column, index)``: the arrays of a list column (``bits``, ``map``) at the increasing
    index labels; by default from ``table``, which then holds them. ``unreplayed``: why a table
    without rows or failures has none (``detect.not_applicable`` of the playback record)."""
    lists = lists or (lambda column, index: iter(table.loc[index, column]))
    failed = failures(table, outcomes)
    own = _ok(table)
    own = own[own["fop"] == "output"] if len(own) else own
    if own.empty:
        text = "no scored rows" if failed else f"no playback rows: {unreplayed}"
        for name in FIGURES:
            _empty(out / f"{name}.png", text, dpi, failed)
        return
    # NaN/Inf counts: 0 where the table has none for a row (a table without the column, or rows concatenated to it).
    bad = own["nonfinite"].fillna(0).astype(int) if "nonfinite" in own else 0
    own = own.assign(nonfinite=bad, log10_err_top10=_log(own["err_top10"]),
                     log10_rel_top10=_log(own["rel_top10"], REL_FLOOR))
    shown, left = _shown_layers(own)
    named = _nonfinite_named(own)
    # By name, which is forward, input_grad, weight_grad, as in the heatmap: in the table's order a first
    # layer without an input gradient put weight_grad before input_grad, so panels moved between runs.
    computations = sorted(pd.unique(own["computation"]))
    _score_vs_iteration(named, shown, left, computations, out / "score_vs_iteration.png", dpi, failed)
    _distributions(named, left, computations, out / "distributions.png", dpi, failed)
    _heatmap(own[own["case"] == "kernel"], out / "heatmap.png", dpi, failed)

    counts = {}
    for case, row in zip(own["case"], lists("bits", own.index)):
        counts[case] = counts.get(case, 0) + row
    # Cases in the table's order, as the other figures list them (references, kernel, pseudo-errors):
    # sorted by name, "kernel" sat between bit_flip and lane, ref:fp64 among the references' bf16 and tf32.
    bits = pd.DataFrame(counts).T
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.3 * len(bits)))
    sns.heatmap(np.log10(bits.astype(float) + 1), ax=ax, cmap="rocket_r",
                cbar_kws={"label": "log10(1 + elements whose bit differs)"})
    ax.set_xlabel("bit (0 = mantissa LSB, 23-30 exponent, 31 = sign)")
    ax.set_ylabel("")
    ax.set_title(BITS_TITLE, fontsize=10)
    _save(fig, out / "bits.png", dpi, failed)
    _spatial_maps(own, out / "spatial.png", dpi, failed, lists)


def _score_vs_iteration(named: pd.DataFrame, shown: list[str], left: list[str], computations: list[str],
                        path: Path, dpi: int, failed: list[str]) -> None:
    if named["log10_err_top10"].isna().all():  # seaborn cannot draw lines of NaN alone (a ValueError on "_y")
        _empty(path, NO_SCORE_ANYWHERE, dpi, failed)
        return
    # A dozen cases in hue alone gave near-identical teals and pinks: the marker tells them apart too.
    grid = sns.relplot(named[named["layer"].isin(shown)], x="step", y="log10_err_top10", hue="case", style="case",
                       col="layer", row="computation", kind="line", markers=True, dashes=False, height=2.2,
                       aspect=1.3, row_order=computations, facet_kws={"sharey": False}, errorbar=None)
    grid.set_axis_labels("training step", "log10 top-10% |error|\n(exact match: -30)")
    # Two lines: seaborn's "computation = ... | layer = ...", and even "forward | <GPT-2 layer>", overran the next panel's.
    grid.set_titles("{row_name}\n{col_name}")
    for ax in grid.axes.flat:
        # Steps: a lone step was ticked -0.050 to 0.050, and nine ticks of 0..120 ran into each other.
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4, integer=True, min_n_ticks=1))
    _say_unscored(grid.axes_dict, named.groupby(["computation", "layer"])["log10_err_top10"].count(), clear_y=True)
    grid.tight_layout()  # again, for the two-line titles: their first line ran into the panel above
    _legend_beside(grid)
    if left:
        _note(grid.figure, f"{len(shown)} of {len(shown) + len(left)} layers: those with the kernel's largest "
                           f"top-10% error over fp32 noise; left out (in layers.csv): {', '.join(left)}")
    _save(grid.figure, path, dpi, failed)


def _legend_beside(grid) -> None:
    """The legend just right of everything the panels draw: beside the panels, a long layer name's
    title ran under it; at the figure's right edge (1.0), seaborn's width kept for it stayed blank
    between panels and legend, a third of a one-column figure."""
    fig = grid.figure
    renderer = fig.canvas.get_renderer()
    # Without a legend drawn in a panel (legend_out=False), which would count as the panel's own width.
    right = max(ax.get_tightbbox(renderer, bbox_extra_artists=[a for a in ax.get_children() if a is not ax.get_legend()]).x1
                for ax in grid.axes.flat) / (fig.get_figwidth() * fig.dpi)
    sns.move_legend(grid, "upper left", bbox_to_anchor=(right + 0.02, 0.9))


def _distributions(named: pd.DataFrame, left: list[str], computations: list[str], path: Path, dpi: int,
                   failed: list[str]) -> None:
    """One x scale for all computations: the axis is relative to each tensor's own fp32 noise, so
    forward and backward sit side by side as PEAT compares them. Beyond MAX_LAYERS, one box per
    case over every layer and step."""
    if named["log10_rel_top10"].isna().all():  # seaborn's boxplot fails on NaN alone (UnboundLocalError)
        _empty(path, NO_SCORE_ANYWHERE, dpi, failed)
        return
    cases = list(pd.unique(named["case"]))
    layers = named["layer"].nunique()
    # Taller with more cases, each panel as wide: 28 cases (every error spec) in 3.2 in ran their labels together.
    height = max(DIST_HEIGHT, DIST_CASE * len(cases))
    grid = sns.catplot(named, x="log10_rel_top10", y="case", hue=None if left else "layer", col="computation",
                       order=cases, col_order=computations, kind="box", legend=not left and "auto", height=height,
                       aspect=DIST_WIDTH / height, sharex=True, fliersize=2,
                       # Drawn in the panel, then moved beside them: seaborn's own place outside, beside
                       # one panel narrowed by long case names, failed ("left cannot be >= right") for
                       # BERT's layer names on a forward-only table, and the job with it.
                       legend_out=False)
    grid.set_axis_labels(REL_LABEL, "")
    # The computation alone, as the other figures title it: seaborn's "computation = weight_grad" is wider
    # than a panel narrowed by long case names and a GPT-2 layer's legend, and ran into its neighbour's.
    grid.set_titles("{col_name}")
    _say_unscored(grid.axes_dict, named.groupby("computation")["log10_rel_top10"].count(), clear_y=False)
    if not left:
        _colour_flat_boxes(grid)
    _cut_beyond(grid, named, cases)
    _one_decade_at_least(grid.axes.flat[0])
    if grid.legend is not None:
        _legend_beside(grid)
    if left:
        _note(grid.figure, f"all {layers} layers pooled (each layer's statistics: layers.csv)")
    _save(grid.figure, path, dpi, failed)


def _colour_flat_boxes(grid) -> None:
    """A box of one value (a layer replayed at one step) is its median's line alone, grey whatever
    its layer, so the layers' legend matched nothing drawn: such a line takes its box's colour."""
    for ax in grid.axes.flat:
        for container in ax.containers:
            for box, median in zip(container.boxes, container.medians):
                if box.get_path().get_extents().width == 0:
                    median.set(color=box.get_facecolor(), linewidth=2)


def _one_decade_at_least(ax) -> None:
    """Widen a log axis narrower than a decade around its middle (the axis is shared): one value alone
    (a kernel at exactly fp32 noise, the table's one case) was ticked -0.075 to 0.075, seven labels run together."""
    low, high = ax.get_xlim()
    if high - low < 1:
        middle = (low + high) / 2
        ax.set_xlim(middle - 0.5, middle + 0.5)


def _say_unscored(axes: dict, scored: pd.Series, clear_y: bool) -> None:
    """Write on each empty panel why it is empty: nothing replayed there (``axes``' key not in
    ``scored``, the count of finite scores per panel) or no finite score. Not ``ax.has_data()``:
    seaborn puts its legend's handles on the first panel, which then never said it was empty, and a
    panel of NaN lines has data too."""
    for key, ax in axes.items():
        count = scored.get(key, None)
        if count:
            continue
        ax.text(0.5, 0.5, "not replayed" if count is None else NO_SCORE, ha="center", va="center",
                transform=ax.transAxes, color="grey")
        if clear_y:  # not a shared axis, whose case labels the first panel holds for all
            ax.set_yticks([])


def _nonfinite_named(own: pd.DataFrame) -> pd.DataFrame:
    """``own`` with " (NaN/Inf)" after the name of every case that made a NaN or Inf where golden
    is finite. Scores are those of the finite elements, so such a case sat among the exact
    matches where it erred in nothing else (a NaN in an otherwise exact gradient drew at -30)."""
    flagged = own["case"].isin(set(own.loc[own["nonfinite"] > 0, "case"]))
    return own.assign(case=own["case"].where(~flagged, own["case"] + " (NaN/Inf)"))


def _cut_beyond(grid, own: pd.DataFrame, cases: list[str]) -> None:
    """End the distributions' shared x axis at REL_CUT where some case lies beyond it; such a
    case's row says its largest value at the edge, so nothing shown is out of sight unsaid."""
    top = own.groupby(["computation", "case"])["log10_rel_top10"].max()
    if not (top > REL_CUT).any():
        return
    for computation, ax in grid.axes_dict.items():
        ax.set_xlim(right=REL_CUT)
        beyond = top.get(computation, pd.Series(dtype=float))
        for case, value in beyond[beyond > REL_CUT].items():
            ax.text(REL_CUT, cases.index(case), f"{value:.0f} \u25b8", ha="right", va="center", fontsize=7,
                    color="firebrick", bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})


def _heatmap(kernel: pd.DataFrame, path: Path, dpi: int, failed: list[str]) -> None:
    if kernel.empty:  # every call of the kernel after its isolated probe failed (rows with an error)
        _empty(path, "no scored rows of the kernel itself: it failed after its first call", dpi, failed)
        return
    # Not pivot_table: it drops a row whose every score is NaN, so a layer where the kernel's every
    # result was all NaN (no finite element) vanished, its "NaN/Inf" marks with it.
    heat = kernel.groupby(["layer", "computation", "step"])["log10_rel_top10"].mean().unstack("step")
    # Rows in the network's order (the table's, as in the other figures), not by name: MobileNetV2's
    # classifier came first and features.10-17 before features.2, so depth read out of order.
    order = {layer: i for i, layer in enumerate(dict.fromkeys(kernel["layer"]))}
    heat = heat.reindex(sorted(heat.index, key=lambda key: (order[key[0]], key[1])))
    if heat.isna().to_numpy().all():  # NaN scores: those of results without a finite element (an all-NaN output)
        _empty(path, "no score of the kernel itself: no result of it had a finite error (no element, or all NaN)", dpi, failed)
        return
    # At least 3 in tall: the colorbar's label ran off a figure of one to three rows.
    fig, ax = plt.subplots(figsize=(2.0 + min(HEAT_WIDTH, 0.5 * max(1, heat.shape[1])),
                                    max(3.0, 0.9 + 0.35 * heat.shape[0])))
    # A cell whose result held a NaN or Inf says so: its colour is the finite elements' score alone.
    bad = kernel.pivot_table(index=["layer", "computation"], columns="step", values="nonfinite", aggfunc="max")
    marks = bad.reindex(index=heat.index, columns=heat.columns).fillna(0) > 0
    # From the floor (exact match) to HEAT_TOP at least: scaled to the data alone, a kernel at 1.0 to 1.4
    # times the noise (0 to 0.15 decades) spanned the whole range, its cells as hot as a lane fault's.
    # Of the cells without a NaN/Inf: an Inf element counts as the largest float, and one such cell stretched
    # the colours to 306 decades, every other cell one flat colour. A marked cell beyond them takes the top one.
    values = heat.to_numpy(dtype=float)
    vmin, vmax = _whole_decades(values[~marks.to_numpy()], np.log10(REL_FLOOR), HEAT_TOP)
    above = bool((values[np.isfinite(values)] > vmax).any())
    sns.heatmap(heat, ax=ax, cmap="viridis", vmin=vmin, vmax=vmax,
                cbar_kws={"label": REL_LABEL, "extend": "max" if above else "neither"})
    # Not seaborn's annotations: they skip a cell without a score, the very one of an all-NaN result.
    for row, col in zip(*np.nonzero(marks.to_numpy())):
        ax.text(col + 0.5, row + 0.5, "NaN/Inf", ha="center", va="center", color="firebrick", fontsize=7)
    ax.set_title("kernel under test: layer x iteration")
    # seaborn's "step" and "layer-computation" (its index names joined): the score figure says "training step".
    ax.set(xlabel="training step", ylabel="layer - computation")
    _save(fig, path, dpi, failed)


def _whole_decades(logs: np.ndarray, *anchors: float) -> tuple[float, float]:
    """Colour limits of log10 values: their finite ones and ``anchors`` rounded out to whole
    decades, one decade at least; (-1, 0) where there is none."""
    logs = np.concatenate([logs[np.isfinite(logs)], anchors])
    if not logs.size:
        return -1.0, 0.0
    low = float(np.floor(logs.min()))
    return low, max(float(np.ceil(logs.max())), low + 1)


def _spatial_maps(own: pd.DataFrame, path: Path, dpi: int, failed: list[str], lists) -> None:
    """One error map per case: the first replayed step of the network's first layer (the table's
    order: by name, GPT-2's lm_head came first), forward pass (else input_grad, else weight_grad),
    of a result with elements (a zero-size batch's output has an empty map, and its blank panels hid
    the next layer's). One colour scale for all panels (a scale per panel made a rounding-sized
    error look as bright as a lane fault's), from the smallest nonzero block to the largest; blocks
    without error are drawn apart, as no logarithm fits them."""
    own = own[own["map_rows"] * own["map_cols"] > 0]  # NaN (a row without a map) compares False: left out too
    if own.empty:
        _empty(path, "no error map: every result was an output without elements", dpi, failed)
        return
    depth = own["layer"].map({layer: i for i, layer in enumerate(dict.fromkeys(own["layer"]))})
    first = own.assign(depth=depth).sort_values(["computation", "depth", "step"]).groupby("case", sort=True).head(1)
    cases = first.to_dict("records")
    index = sorted(first.index)
    found = dict(zip(index, lists("map", index)))
    maps = [np.asarray(found[i], dtype=float).reshape(int(r["map_rows"]), int(r["map_cols"]))
            for i, r in zip(first.index, cases)]
    # An Inf error counts as the largest float (scores.abs_error): its block stretched the shared scale
    # to 308 decades, every other panel one flat colour. Such blocks are drawn apart, above the scale.
    huge = np.finfo(np.float64).max
    logs = [np.ma.log10(np.ma.masked_invalid(np.ma.masked_less_equal(np.minimum(m, huge), 0.0))) for m in maps]
    scaled = np.concatenate([np.ma.masked_where(m >= huge, log).compressed() for m, log in zip(maps, logs)])
    vmin, vmax = _whole_decades(scaled)
    inf = any((m >= huge).any() for m in maps)
    cmap = plt.get_cmap("magma").with_extremes(bad="lightsteelblue", over="limegreen")
    cols = min(4, len(cases))
    rows = int(np.ceil(len(cases) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols + 1, 2.6 * rows), squeeze=False)
    for ax in axes.flat[len(cases):]:
        ax.axis("off")
    for ax, row, m in zip(axes.flat, cases, logs):
        image = ax.imshow(m, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        # A NaN error carries no mass in the map: the title counts it (and Inf ones), beside the case's
        # short name. Its tensor's line wrapped at a panel's width: "transformer.h.11.attn.c_attn
        # weight_grad step 120" (or a count after it) ran into the neighbouring panels' titles.
        bad = row["nonfinite"]
        where = f"{row['layer']} {row['computation']} step {row['step']}"
        ax.set_title(f"{row['case']}" + (f", {bad} NaN/Inf" if bad else "") + "\n"
                     + textwrap.fill(where, SPATIAL_TITLE_CHARS), fontsize=7)
        ax.set_xlabel("columns (channels)", fontsize=7)
        ax.set_ylabel("rows", fontsize=7)
    fig.subplots_adjust(hspace=0.6)
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.03, extend="max" if inf else "neither")
    bar.set_label("log10 |error| summed per block (same scale in every panel;\nlight blue: no error"
                  + ("; green: an Inf error)" if inf else ")"))
    _save(fig, path, dpi, failed)


def analyze(table: pd.DataFrame, context: str | Path, out: str | Path, dpi: int = 80, outcomes: list[dict] = (),
            lists=None, record: dict | None = None) -> dict:
    """``outcomes``: the playback record's, whose failed probes left no row to plot; ``lists``: see
    ``figures``; ``record``: the playback record, which says why nothing was replayed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Nothing replayed (a table without rows or columns) writes the same columns and keys as a run does:
    # a header of the five keys and a summary of {} failed a reader of several kernels' results.
    layers = per_layer(table) if len(table) else pd.DataFrame(columns=LAYER_COLUMNS)
    summary = {key: [] for key in SUMMARY_KEYS}
    if len(table):
        own, own_layers = _results(table), _results(layers)
        summary = {"ranges": ranges(own_layers), "spearman": spearman(own, summaries(context, set(own["step"]))),
                   "repeated_blocks": repeated_blocks(own_layers), "forward_backward": forward_backward(own_layers),
                   "propagation": propagation(own)}
    write_csv(out / "layers.csv", layers)
    write_json(out / "summary.json", summary)
    # Not "no recorded layer" alone: a context recording the kernel's layers at no step the replayed
    # computations apply to (the first layer's input gradient, an idle expert) was said to have none.
    unreplayed = {} if record is None else {"unreplayed": not_applicable(record)}
    figures(_results(table), out, dpi, outcomes, lists, **unreplayed)
    return summary


def _results(frame: pd.DataFrame) -> pd.DataFrame:
    """Each computation's own result: the running statistics, in layers.csv, would otherwise be
    pooled with a batch norm's output in the summaries' medians and ranges and the figures' lines."""
    return frame[~frame["tensor"].isin(RUNNING)] if "tensor" in frame else frame


def run_job(table_path: str | Path, context: str | Path, out: str | Path, dpi: int = 80,
            record: str | Path | None = None) -> dict:
    """One workflow job: tables and figures of one kernel's playback table (and its record's outcomes)."""
    record = _record(record) if record is not None else None
    return analyze(read_parquet_scalars(table_path, COLUMNS, REQUIRED), context, out, dpi,
                   (record.get("outcomes") or []) if record else [],
                   lambda column, index: iter_list_rows(table_path, column, index), record)


def _record(path: str | Path) -> dict:
    """The playback record: one line naming it where it holds no JSON object (a list ended the job in
    an AttributeError naming no file)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise PeatError(f"{path}: not a JSON object (not a playback record?)")
    return data
