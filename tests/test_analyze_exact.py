"""The Analyzer's tables (layers.csv, summary.json) recomputed independently of peat.analyze, from the
definitions in docs/playback.md, on a real playback table (a tiny GPT-2 trained here, its two blocks' c_fc
replayed with a split-K GEMM, followed to the next layer and the loss), and at the edges a user meets.

Compared exactly: counts, the layers' order, every list's keys and fields. Compared to float64 rounding
(a relative 1e-12): every value computed from the scores (means summed here with math.fsum, by pandas in
its own order; ranges and medians of those means; ratios; Spearman's rho and p, scipy on the same points
in another order), and standard deviations also to 4 ulps of their mean's size: pandas' online variance
loses that much to cancellation (frac_diff near 1 varying by 2^-18 read 3.8146972656157e-06 for 2^-18).
summary.json holds null for a NaN or infinite value (JSON has neither)."""

from __future__ import annotations

import json
import math
import re

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from peat import analyze, kernels, playback
from test_analyze_edge import _context, _row

torch.set_num_threads(1)

SCORES = ("err_max", "err_mean", "err_top10", "err_var", "rel_top10", "ulp_median", "frac_diff")  # docs/playback.md's list
RUNNING = ("running_mean", "running_var")
KEYS = ("case", "computation", "layer", "fop", "tensor")
REL = 1e-12
# GPT-2's blocks: both c_fc recorded, so the repeated-block pattern has a role of two layers.
LAYERS = ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]


# -- docs/playback.md's definitions, written here without peat.analyze ----------------------------
def scored(table: pd.DataFrame) -> pd.DataFrame:
    """Rows of calls that returned (a failed call has an ``error``), their scores as floats (None: NaN)."""
    own = table[table["error"].isna()] if "error" in table else table
    return own.astype(dict.fromkeys(SCORES, float))


def own_result(table: pd.DataFrame) -> pd.DataFrame:
    """Each computation's own result at the kernel's output: no running statistics, no later point."""
    return table[(table["fop"] == "output") & ~table["tensor"].isin(RUNNING)]


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std (ddof 1) of the values that are not NaN; NaN where undefined."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return math.nan, math.nan
    if any(math.isinf(v) for v in kept):
        return math.fsum(kept) / len(kept), math.nan
    # Finite values near the largest float64 (an Inf element's score) have a finite mean and std,
    # which their plain sum and squares overflow: scaled by their largest then.
    top = max(abs(v) for v in kept)
    scale = top if top > 1e150 else 1.0
    kept = [v / scale for v in kept]
    mean = math.fsum(kept) / len(kept)
    if len(kept) < 2:
        return mean * scale, math.nan
    return mean * scale, math.sqrt(math.fsum((v - mean) ** 2 for v in kept) / (len(kept) - 1)) * scale


def expected_layers(table: pd.DataFrame) -> dict[tuple, dict]:
    out = {}
    for key, rows in scored(table).groupby(list(KEYS), sort=False):
        entry = {"iterations": len(rows), "unscored": int(rows["err_top10"].isna().sum())}
        for score in SCORES:
            entry[f"{score}_mean"], entry[f"{score}_std"] = mean_std(rows[score].tolist())
        out[key] = entry
    return out


def expected_ranges(layers: dict[tuple, dict]) -> dict[tuple, dict]:
    """Over layers at the output, per case and computation: range of the per-layer means."""
    groups: dict[tuple, list[dict]] = {}
    for (case, comp, _layer, fop, tensor), entry in layers.items():
        if fop == "output" and tensor not in RUNNING:
            groups.setdefault((case, comp), []).append(entry)
    out = {}
    for key, entries in groups.items():
        x = [e["err_top10_mean"] for e in entries if not math.isnan(e["err_top10_mean"])]
        r = [e["err_var_mean"] for e in entries if not math.isnan(e["err_var_mean"])]
        out[key] = {"xmin": min(x, default=None), "xmax": max(x, default=None),
                    "rmin": min(r, default=None), "rmax": max(r, default=None)}
    return out


def context_summaries(context) -> dict[tuple, float]:
    """(layer, step, statistic) -> value: W and output activation mean and variance (std squared)."""
    with h5py.File(context) as f:
        rows = f["summaries"][()]
    out = {}
    for row in rows:
        tensor = row["tensor"].decode()
        if tensor not in ("W", "act"):
            continue
        key = (row["layer"].decode(), int(row["step"]))
        assert (*key, f"{tensor}_mean") not in out, f"two summaries of {key} {tensor}"
        out[(*key, f"{tensor}_mean")] = float(row["mean"])
        out[(*key, f"{tensor}_var")] = float(row["std"]) ** 2
    return out


def expected_spearman(table: pd.DataFrame, context) -> dict[tuple, dict]:
    summary = context_summaries(context)
    out = {}
    for (case, comp), rows in own_result(scored(table)).groupby(["case", "computation"]):
        for against in ("W_mean", "W_var", "act_mean", "act_var"):
            points = [(err, summary[(layer, step, against)]) for layer, step, err
                      in zip(rows["layer"], rows["step"], rows["err_top10"])
                      if not math.isnan(err) and (layer, step, against) in summary]
            if len(points) < 3 or len({e for e, _ in points}) < 2 or len({s for _, s in points}) < 2:
                continue
            rho, p = stats.spearmanr([e for e, _ in points], [s for _, s in points])
            out[(case, comp, against)] = {"rho": float(rho), "p": float(p), "points": len(points)}
    return out


def role(layer: str) -> str:
    """docs/playback.md's block role: the first run of indices ('layer2.1.', 'h.3.' -> its digits) as '*'."""
    parts = layer.split(".")
    index = [bool(re.fullmatch(r"(layer)?\d+", p)) for p in parts[:-1]]
    if True not in index:
        return layer
    start = index.index(True)
    end = start
    while end < len(index) and index[end]:
        end += 1
    return ".".join([*parts[:start], *(re.sub(r"\d+", "*", p) for p in parts[start:end]), *parts[end:]])


def expected_blocks(layers: dict[tuple, dict]) -> dict[tuple, dict]:
    groups: dict[tuple, dict] = {}
    for (case, comp, layer, fop, tensor), entry in layers.items():
        if case == "kernel" and fop == "output" and tensor not in RUNNING:
            groups.setdefault((role(layer), comp), {})[layer] = entry["err_top10_mean"]
    out = {}
    for key, blocks in groups.items():
        if len(blocks) < 2:
            continue
        mean, std = mean_std(list(blocks.values()))
        out[key] = {"blocks": blocks, "cv": 0.0 if mean == 0 else std / mean}
    return out


def expected_forward_backward(layers: dict[tuple, dict]) -> dict[str, dict]:
    per: dict[str, dict[str, list]] = {}
    for (case, comp, _layer, fop, tensor), entry in layers.items():
        if fop == "output" and tensor not in RUNNING:
            per.setdefault(case, {}).setdefault(comp, []).append(entry["rel_top10_mean"])
    out = {}
    for case, comps in per.items():
        medians = {comp: float(np.nanmedian(v)) if not np.isnan(v).all() else None for comp, v in comps.items()}
        back = [medians.get(c) for c in ("input_grad", "weight_grad") if medians.get(c) is not None]
        forward = medians.get("forward")
        ratio = forward / max(back) if forward is not None and back and max(back) > 0 else None
        out[case] = {"median_rel_top10": medians, "forward_over_backward": ratio}
    return out


def expected_propagation(table: pd.DataFrame) -> dict[tuple, dict]:
    forward = scored(table)
    forward = forward[(forward["computation"] == "forward") & ~forward["tensor"].isin(RUNNING)]
    out = {}
    for (case, layer), rows in forward.groupby(["case", "layer"]):
        later = rows[rows["fop"] != "output"]
        at_output = rows[rows["fop"] == "output"]
        if len(later):  # the output beside the later points at the steps followed downstream
            at_output = at_output[at_output["step"].isin(set(later["step"]))]
        entry = {}
        for fop, part in pd.concat([at_output, later]).groupby("fop"):
            values = part["rel_top10"].dropna()
            entry[fop] = float(np.median(values)) if len(values) else None
        out[(case, layer)] = entry
    return out


# -- comparison ------------------------------------------------------------------------------------
def close(a, b, scale: float = 0.0) -> bool:
    """``a`` written, ``b`` recomputed; ``scale``: the size of the values ``b`` was computed from."""
    if a is None:  # JSON's null
        return b is None or not math.isfinite(b)
    if b is None or math.isnan(a) or math.isnan(b):
        return b is not None and math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= REL * abs(b) + 4 * np.finfo(float).eps * abs(scale)


def strict_json(path) -> dict:
    def refuse(name):
        raise ValueError(f"{path}: {name} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def mismatches(table: pd.DataFrame, context, out) -> list[str]:
    """Every difference between the Analyzer's tables in ``out`` and the recomputation, one line each."""
    bad = []
    csv = pd.read_csv(out / "layers.csv", keep_default_na=False, na_values=[""], dtype=dict.fromkeys(KEYS, str))
    layers = expected_layers(table)
    written = {tuple(r[k] for k in KEYS): r for r in csv.to_dict("records")}
    if set(written) != set(layers):
        bad.append(f"layers.csv keys: extra {set(written) - set(layers)}, missing {set(layers) - set(written)}")
    for key in set(written) & set(layers):
        for column, value in layers[key].items():
            scale = layers[key][column.replace("_std", "_mean")] if column.endswith("_std") else 0.0
            if not close(float(written[key][column]), float(value), scale if math.isfinite(scale) else 0.0):
                bad.append(f"layers.csv {key} {column}: {written[key][column]!r}, recomputed {value!r}")
    network = list(dict.fromkeys(scored(table)["layer"]))
    for key, rows in csv.groupby(["case", "computation", "fop", "tensor"]):
        if rows["layer"].tolist() != [x for x in network if x in set(rows["layer"])]:
            bad.append(f"layers.csv {key}: layers {rows['layer'].tolist()} not in the network's order")
    summary = strict_json(out / "summary.json")
    bad += compare("ranges", {(r["case"], r["computation"]): {k: r[k] for k in ("xmin", "xmax", "rmin", "rmax")}
                              for r in summary["ranges"]}, expected_ranges(layers))
    bad += compare("spearman", {(r["case"], r["computation"], r["against"]): {k: r[k] for k in ("rho", "p", "points")}
                                for r in summary["spearman"]}, expected_spearman(table, context))
    bad += compare("repeated_blocks", {(r["role"], r["computation"]): {"blocks": r["blocks"], "cv": r["cv"]}
                                       for r in summary["repeated_blocks"]}, expected_blocks(layers))
    bad += compare("forward_backward", {r["case"]: {k: r[k] for k in ("median_rel_top10", "forward_over_backward")}
                                        for r in summary["forward_backward"]}, expected_forward_backward(layers))
    bad += compare("propagation", {(r["case"], r["layer"]): {k: v for k, v in r.items() if k not in ("case", "layer")}
                                   for r in summary["propagation"]}, expected_propagation(table))
    return bad


def compare(name: str, written: dict, expected: dict) -> list[str]:
    if set(written) != set(expected):
        return [f"{name} keys: extra {set(written) - set(expected)}, missing {set(expected) - set(written)}"]
    bad = []
    for key, entry in expected.items():
        flat_w, flat_e = flatten(written[key]), flatten(entry)
        if set(flat_w) != set(flat_e):
            bad.append(f"{name} {key}: fields {sorted(flat_w)}, recomputed {sorted(flat_e)}")
            continue
        bad += [f"{name} {key} {field}: {flat_w[field]!r}, recomputed {value!r}"
                for field, value in flat_e.items() if not close(flat_w[field], value)]
    return bad


def flatten(entry: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in entry.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


# -- a real playback table -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 trained 6 steps (both blocks' c_fc recorded at each), replayed with a split-K GEMM and
    three pseudo-errors, 2 steps a layer followed downstream, and analysed (without figures): table,
    context, Analyzer's folder."""
    from peat.data import prepare
    from peat.propagate import Propagator
    from peat.train import train_model

    root = tmp_path_factory.mktemp("gpt2")
    data = root / "pydoc.h5"
    prepare("pydoc", {"source": "pydoc", "seq_len": 16, "part": [0.0, 0.05], "val_fraction": 0.1}, data)
    spec = {"arch": "gpt2", "dataset": "pydoc", "size": {"hidden": 16, "layers": 2, "heads": 2}, "epochs": 2,
            "batch_size": 8, "max_train_samples": 24, "max_val_samples": 8, "optimizer": {"name": "adamw", "lr": 0.01},
            "checkpoint_epochs": [1], "record": {"layers": LAYERS, "every": 1}}
    train_model("gpt2", spec, data, root / "run", config_hash="h", progress=False)
    context = root / "run" / "context.h5"
    follow = Propagator(context=context, spec=spec, data=data, checkpoints=root / "run" / "checkpoints", samples=2)
    plan = playback.Plan(context=context, kernel=kernels.load("peat.alt_kernels.splitk_gemm", "linear"),
                         errors=["lane:4", "nan:1", "inf:1"], meta={"model": "gpt2", "vendor": "cpu", "kernel": "splitk"},
                         propagate=follow)
    table, _ = playback.replay(plan)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(analyze, "figures", lambda *args, **kwargs: None)
        analyze.analyze(table, context, root / "out")
    return table, context, root / "out"


def test_a_real_tables_every_column_and_summary_match_their_definitions(gpt2):
    table, context, out = gpt2
    assert mismatches(table, context, out) == []
    # Not a comparison of empty lists: every summary holds what this table gives it.
    summary = strict_json(out / "summary.json")
    assert {(r["role"], r["computation"]) for r in summary["repeated_blocks"]} == {
        ("transformer.h.*.mlp.c_fc", c) for c in ("forward", "input_grad", "weight_grad")}
    assert {r["layer"]: sorted(set(r) - {"case", "layer"}) for r in summary["propagation"] if r["case"] == "kernel"} == {
        LAYERS[0]: ["loss", f"next:{LAYERS[1]}", "output"], LAYERS[1]: ["loss", "output"]}
    assert {r["points"] for r in summary["spearman"] if r["case"] == "kernel"} == {12}
    layers = pd.read_csv(out / "layers.csv")
    assert dict(layers.groupby("fop")["iterations"].unique().map(list)) == {
        "output": [6], f"next:{LAYERS[1]}": [2], "loss": [2]}
    assert set(layers["case"]) == {"kernel", "lane:4", "nan:1", "inf:1", "ref:fp16", "ref:bf16", "ref:tf32", "ref:fp64"}


def test_the_output_beside_later_points_is_the_median_of_the_steps_followed(gpt2):
    """Not of all six replayed steps: the two followed downstream (0 and 5 of 0-5)."""
    table, _, out = gpt2
    rows = table[(table["case"] == "lane:4") & (table["layer"] == LAYERS[0]) & (table["computation"] == "forward")]
    assert sorted(set(rows.loc[rows["fop"] == "loss", "step"])) == [0, 5]
    at = rows[(rows["fop"] == "output") & rows["step"].isin([0, 5])]["rel_top10"]
    entry = next(r for r in strict_json(out / "summary.json")["propagation"]
                 if (r["case"], r["layer"]) == ("lane:4", LAYERS[0]))
    assert close(entry["output"], (at.iloc[0] + at.iloc[1]) / 2)


# -- the edges a user meets ------------------------------------------------------------------------
@pytest.fixture
def analysed(tmp_path, monkeypatch):
    """Analyse rows (no figures) over a context of ``layers`` x ``steps``: layers.csv, summary.json, and
    the recomputation's mismatches."""
    monkeypatch.setattr(analyze, "figures", lambda *args, **kwargs: None)

    def run(rows, layers, steps):
        table = pd.DataFrame(rows)
        context = _context(tmp_path / "c.h5", layers, steps)
        analyze.analyze(table, context, tmp_path / "out")
        return (pd.read_csv(tmp_path / "out" / "layers.csv"), strict_json(tmp_path / "out" / "summary.json"),
                mismatches(table, context, tmp_path / "out"))
    return run


def stds(layers: pd.DataFrame) -> pd.DataFrame:
    return layers[[f"{score}_std" for score in SCORES]]


def test_a_layer_replayed_at_one_step_has_empty_stds_and_no_spearman(analysed):
    """Two layers at one step: two points, under the three a correlation needs."""
    layers, summary, bad = analysed([_row("kernel", "forward", x, 0, e) for x, e in (("a", 1e-7), ("b", 2e-7))],
                                    ["a", "b"], [0])
    assert bad == []
    assert stds(layers).isna().all().all() and layers["iterations"].tolist() == [1, 1]
    assert summary["spearman"] == [] and summary["ranges"] == [{
        "case": "kernel", "computation": "forward", "xmin": 1e-7, "xmax": 2e-7, "rmin": 1.0, "rmax": 1.0}]


def test_constant_scores_have_zero_stds_and_no_spearman(analysed):
    layers, summary, bad = analysed([_row("kernel", "forward", "a", s, 1e-7) for s in range(4)], ["a"], range(4))
    assert bad == []
    assert (stds(layers) == 0).all().all() and summary["spearman"] == []


def test_failed_calls_are_left_out_of_every_table(analysed):
    """A crash at one of four steps leaves three iterations; a layer whose every call crashed has no row,
    and no point in the correlations (its failure is the Detector's and the figures' to name)."""
    rows = [_row("kernel", "forward", "a", s, 1e-7 * (s + 1)) for s in range(4)]
    rows[2] |= {"error": "RuntimeError: boom", "status": "crash", **dict.fromkeys(SCORES, np.nan)}
    rows += [_row("kernel", "forward", "b", s, np.nan) | {"error": "RuntimeError: boom", "status": "crash"}
             for s in range(4)]
    layers, summary, bad = analysed(rows, ["a", "b"], range(4))
    assert bad == []
    assert layers[["layer", "iterations", "unscored"]].values.tolist() == [["a", 3, 0]]
    assert layers["err_top10_mean"].tolist() == [(1e-7 + 2e-7 + 4e-7) / 3]
    assert [r["points"] for r in summary["spearman"]] == [3, 3]


def test_non_finite_scores_inf_mean_empty_std_null_range_and_ranked_highest(analysed):
    """Layer a: an infinite top-10 % error at step 1 (a mean over Inf elements) and a result without a
    finite error at step 2 (NaN scores)."""
    rows = [_row("kernel", "forward", "a", s, e, nonfinite=int(not 0 < e < 1)) for s, e in
            enumerate([1e-7, np.inf, np.nan, 3e-7])]
    rows += [_row("kernel", "forward", "b", s, 1e-7 * (s + 1)) for s in range(4)]
    layers, summary, bad = analysed(rows, ["a", "b"], range(4))
    assert bad == []
    a = layers.set_index("layer").loc["a"]
    assert (a["err_top10_mean"], a["unscored"], a["iterations"]) == (np.inf, 1, 4) and np.isnan(a["err_top10_std"])
    assert summary["ranges"][0]["xmin"] == 2.5e-7 and summary["ranges"][0]["xmax"] is None
    assert {r["points"] for r in summary["spearman"]} == {7}  # the NaN left out, the Inf kept


def test_a_layer_replayed_forward_only_and_a_forward_only_kernel(analysed):
    """Layer a has no input gradient (a first layer): the medians over layers of each computation hold
    the layers replayed in it; a kernel replayed in forward alone has no ratio."""
    rows = [_row("kernel", c, x, s, 1e-7 * (s + 1), rel_top10=r * (s + 1)) for s in range(3)
            for x, r, comps in (("a", 2.0, ["forward", "weight_grad"]), ("b", 4.0, ["forward", "input_grad", "weight_grad"]))
            for c in comps]
    layers, summary, bad = analysed(rows, ["a", "b"], range(3))
    assert bad == []
    assert summary["forward_backward"] == [{"case": "kernel", "forward_over_backward": 6.0 / 8.0, "median_rel_top10": {
        "forward": 6.0, "input_grad": 8.0, "weight_grad": 6.0}}]
    forward = [r for r in rows if r["computation"] == "forward"]
    layers, summary, bad = analysed(forward, ["a", "b"], range(3))
    assert bad == [] and summary["forward_backward"][0]["forward_over_backward"] is None


def test_scores_at_the_largest_float_have_it_as_their_mean_not_an_empty_cell(analysed):
    """An Inf element's error counts as the largest float64, so inf:1 made every step's err_max that
    finite value: their sum overflowed, and layers.csv wrote an empty err_max_mean (pandas' compensated
    sum turned NaN; inf here) beside an err_max_std of 0, at 4 iterations, none unscored; a layer norm's
    weight gradient (top-10 % errors of 6e307) had an empty err_top10_mean, and ranges' xmin/xmax null."""
    top = [2.0 ** e for e in (1020, 1021, 1022, 1023)]
    rows = [_row("kernel", "forward", "a", s, top[s], err_max=np.finfo(float).max) for s in range(4)]
    layers, summary, bad = analysed(rows, ["a"], range(4))
    assert bad == []
    a = layers.iloc[0]
    assert (a["err_max_mean"], a["err_max_std"], a["iterations"], a["unscored"]) == (np.finfo(float).max, 0, 4, 0)
    assert a["err_top10_mean"] == 15 * 2.0 ** 1018  # (1/8 + 1/4 + 1/2 + 1) / 4 of 2^1023
    assert a["err_top10_std"] == pytest.approx(2.0 ** 1023 * np.std([1 / 8, 1 / 4, 1 / 2, 1], ddof=1), rel=1e-15)
    assert summary["ranges"][0]["xmin"] == summary["ranges"][0]["xmax"] == 15 * 2.0 ** 1018


def test_repeated_blocks_of_errors_near_the_largest_float_have_their_spread(analysed):
    """A kernel whose own errors reach the largest float64 (a few Inf elements) in two blocks, 2^1022 and
    2^1023: their std overflowed, and the blocks' cv was null (infinite), where it is sqrt(2)/3."""
    rows = [_row("kernel", "forward", f"h.{i}.fc", 0, 2.0 ** (1022 + i)) for i in range(2)]
    _, summary, bad = analysed(rows, ["h.0.fc", "h.1.fc"], [0])
    assert bad == []
    assert summary["repeated_blocks"][0]["cv"] == pytest.approx(np.sqrt(2) / 3, rel=1e-15)


@pytest.mark.parametrize("layer, expected", [
    ("layer1.0.conv2", "layer*.*.conv2"), ("layer4.1.downsample.0", "layer*.*.downsample.0"),
    ("transformer.h.11.mlp.c_fc", "transformer.h.*.mlp.c_fc"), ("model.layers.3.self_attn.q_proj", "model.layers.*.self_attn.q_proj"),
    ("features.2.0.block.0.1", "features.*.*.block.0.1"), ("features.3.conv.1.0", "features.*.conv.1.0"),
    # MobileNetV2's stem and head convolutions share a role by name; a list's own elements have none.
    ("features.0.0", "features.*.0"), ("features.18.0", "features.*.0"), ("blocks.1", "blocks.1"), ("fc", "fc"),
])
def test_block_roles_are_the_names_with_their_first_run_of_indices_as_stars(layer, expected):
    assert role(layer) == analyze.block_role(layer) == expected


def test_rows_holding_none_as_scores_are_unscored_iterations(analysed):
    """Score columns of None (object dtype, as pandas makes them of rows holding no score) are NaN
    scores: the scaling against overflow ended such a table's job in a TypeError (no isfinite)."""
    rows = [_row("kernel", "forward", "a", s, None) | dict.fromkeys(SCORES) for s in range(2)]
    layers, summary, bad = analysed(rows, ["a"], range(2))
    assert bad == []
    assert layers[["iterations", "unscored"]].values.tolist() == [[2, 2]]
    assert layers[[f"{score}_{stat}" for score in SCORES for stat in ("mean", "std")]].isna().all().all()
