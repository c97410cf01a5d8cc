"""The Analyzer's tables (layers.csv, summary.json) at the edges a user meets: nothing replayed,
one layer, one step, one case, steps far from 0, scores without a finite value, names out of order."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from peat import analyze
from peat.io import PeatError
from peat.profiler import summary_dtype


def _row(case, computation, layer, step, err, **extra):
    m = np.full((2, 3), err)
    return {"case": case, "computation": computation, "layer": layer, "fop": "output", "tensor": "O", "step": step,
            **dict.fromkeys(analyze.SCORES, 1.0), "err_top10": err, "nonfinite": 0, "error": None, "status": None,
            "bits": np.arange(32) % 2, "map": m.reshape(-1), "map_rows": 2, "map_cols": 3, **extra}


def _context(path, layers, steps, w_mean=lambda layer, step: step + 1.0):
    """A context holding only per-step summaries: W and act of each layer at each step."""
    rows = [(step, 0, layer.encode(), tensor, w_mean(i, step) if tensor == b"W" else 2.0 * step + i, 1.0 + i,
             0, 0, 0, 0) for step in steps for i, layer in enumerate(layers) for tensor in (b"W", b"act")]
    with h5py.File(path, "w") as f:
        f.create_dataset("summaries", data=np.array(rows, dtype=summary_dtype([x.encode() for x in layers])))
    return path


def _strict(path):
    """summary.json as jq reads it: a NaN or Infinity is no JSON."""
    def refuse(name):
        raise ValueError(f"{path}: {name} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module", autouse=True)
def _no_figures():
    """These tests read the tables; the figures have tests of their own (test_analyze_figures.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(analyze, "figures", lambda *args, **kwargs: None)
        yield


def test_nothing_replayed_writes_the_columns_and_keys_of_a_run(tmp_path):
    """A kernel with nothing to replay wrote a summary.json of {} and a layers.csv of the five key
    columns, where a run whose every call failed wrote the five summary lists and every statistic:
    a reader of several kernels' results failed on the first such kernel."""
    context = _context(tmp_path / "c.h5", ["fc"], [0])
    failed = pd.DataFrame([_row("kernel", "forward", "fc", 0, np.nan) | {"error": "RuntimeError: x", "status": "crash"}])
    analyze.analyze(failed, context, tmp_path / "failed")
    analyze.analyze(pd.DataFrame(), context, tmp_path / "none")
    ran = analyze.analyze(pd.DataFrame([_row("kernel", "forward", "fc", 0, 1e-7)]), context, tmp_path / "ran")
    for out in ("failed", "none"):
        assert _strict(tmp_path / out / "summary.json") == dict.fromkeys(analyze.SUMMARY_KEYS, [])
        assert pd.read_csv(tmp_path / out / "layers.csv").columns.tolist() == analyze.LAYER_COLUMNS
    assert set(ran) == set(analyze.SUMMARY_KEYS)
    assert pd.read_csv(tmp_path / "ran" / "layers.csv").columns.tolist() == analyze.LAYER_COLUMNS


@pytest.mark.parametrize("content", ["[]", "3"])
def test_a_playback_record_holding_no_object_is_one_line_naming_it(tmp_path, content):
    """A record holding a list ended the analyze job in an AttributeError naming no file."""
    pd.DataFrame([_row("kernel", "forward", "fc", 0, 1e-7)]).drop(columns=["error", "status"]).to_parquet(
        tmp_path / "t.parquet")
    record = tmp_path / "record.json"
    record.write_text(content)
    with pytest.raises(PeatError) as err:
        analyze.run_job(tmp_path / "t.parquet", _context(tmp_path / "c.h5", ["fc"], [0]), tmp_path / "out",
                        record=record)
    assert str(err.value) == f"{record}: not a JSON object (not a playback record?)"


def test_layers_csv_lists_layers_in_the_networks_order(tmp_path):
    """layers.csv sorted layers by name: MobileNetV2's classifier came first and features.10 before
    features.2, as the heatmap once did."""
    names = ["features.0.0", "features.2.conv.0", "features.10.conv.0", "classifier.1"]
    table = pd.DataFrame([_row(case, computation, layer, step, 1e-7 * (i + 1)) for case in ("ref:fp64", "kernel")
                          for computation in ("weight_grad", "forward") for i, layer in enumerate(names)
                          for step in (4, 9)])
    analyze.analyze(table, _context(tmp_path / "c.h5", names, [4, 9]), tmp_path / "out")
    layers = pd.read_csv(tmp_path / "out" / "layers.csv")
    assert layers[["case", "computation"]].drop_duplicates().values.tolist() == [
        ["kernel", "forward"], ["kernel", "weight_grad"], ["ref:fp64", "forward"], ["ref:fp64", "weight_grad"]]
    for _, rows in layers.groupby(["case", "computation"]):
        assert rows["layer"].tolist() == names
        assert rows["err_top10_mean"].tolist() == pytest.approx([1e-7, 2e-7, 3e-7, 4e-7])
    assert layers["iterations"].tolist() == [2] * 16


def test_a_parquet_table_that_is_no_playback_table_is_one_line_naming_it(tmp_path):
    """Another parquet file given as the playback table (its columns none of the Analyzer's) ended
    the analyze job in a KeyError on 'layer', naming no file."""
    table = tmp_path / "foreign.parquet"
    pd.DataFrame({"a": [1, 2], "b": [3.0, 4.0]}).to_parquet(table)
    with pytest.raises(PeatError) as err:
        analyze.run_job(table, _context(tmp_path / "c.h5", ["fc"], [0]), tmp_path / "out")
    assert str(err.value) == (f"{table}: missing columns {', '.join([*analyze.KEYS, 'step', *analyze.SCORES])} "
                              "(damaged, or not the file expected?)")
    assert not (tmp_path / "out").exists()


def test_propagation_keeps_an_observing_point_reached_without_a_finite_error(tmp_path):
    """An exponent flip at the test config's layer1.0.conv2 made fc's input and the loss NaN: their NaN
    scores were dropped, and summary.json gave the case the output alone, as for a case never followed
    downstream (ref:fp64), where the error had reached the loss."""
    rows = [_row(case, "forward", "conv", 0, err, fop=fop, rel_top10=err)
            for case, fop, err in (("bit_flip:exponent", "output", 1.4), ("bit_flip:exponent", "next:fc", np.nan),
                                   ("bit_flip:exponent", "loss", np.nan), ("ref:fp64", "output", 1.0))]
    analyze.analyze(pd.DataFrame(rows), _context(tmp_path / "c.h5", ["conv"], [0]), tmp_path / "out")
    got = {r["case"]: r for r in _strict(tmp_path / "out" / "summary.json")["propagation"]}
    assert got["bit_flip:exponent"] == {"case": "bit_flip:exponent", "layer": "conv", "output": 1.4, "next:fc": None,
                                        "loss": None}
    assert got["ref:fp64"] == {"case": "ref:fp64", "layer": "conv", "output": 1.0}


def test_summary_numbers_agree_with_a_recomputation_by_hand(tmp_path):
    """The test config replays one layer at one step per kernel, so its summary.json holds no Spearman
    coefficient and no repeated block: nothing checked those numbers against scipy and numpy directly.
    A NaN score (an all-NaN result) is left out of each, an infinite one ranks highest."""
    names, steps = ["layer1.0.conv1", "layer1.1.conv1", "fc"], [0, 2, 4, 6]
    rng = np.random.default_rng(0)
    errors = {(layer, step): rng.lognormal(-15, 2) for layer in names for step in steps}
    errors["fc", 2], errors["fc", 4] = np.nan, np.inf
    table = pd.DataFrame([_row("kernel", "forward", layer, step, err) for (layer, step), err in errors.items()])
    context = _context(tmp_path / "c.h5", names, steps, w_mean=lambda i, step: float(np.sin(3 * i + step)))
    analyze.analyze(table, context, tmp_path / "out")
    got = _strict(tmp_path / "out" / "summary.json")

    scored = [(err, np.sin(3 * names.index(layer) + step)) for (layer, step), err in errors.items() if not np.isnan(err)]
    rho, p = stats.spearmanr(*zip(*scored))
    (w_mean,) = [r for r in got["spearman"] if r["against"] == "W_mean"]
    assert (w_mean["rho"], w_mean["p"], w_mean["points"]) == (pytest.approx(rho, rel=1e-12), pytest.approx(p, rel=1e-12), 11)
    means = {layer: np.nanmean([errors[layer, step] for step in steps]) for layer in names}
    (ranges,) = got["ranges"]  # xmax: fc's mean, infinite
    assert (ranges["xmin"], ranges["rmin"], ranges["rmax"]) == (pytest.approx(min(means.values()), rel=1e-12), 1.0, 1.0)
    blocks = np.array([means["layer1.0.conv1"], means["layer1.1.conv1"]])
    (role,) = got["repeated_blocks"]
    assert role["role"] == "layer*.*.conv1"
    assert role["cv"] == pytest.approx(blocks.std(ddof=1) / blocks.mean(), rel=1e-12)
