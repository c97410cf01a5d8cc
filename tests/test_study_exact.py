"""The numbers a researcher publishes from the alteration study and from candidate/RFI training,
recomputed independently of the code that makes them: the flips from the golden checkpoint's own
bits, the cell's outcome from a resumed training of a copy altered here, the routed calls from a
kernel that logs each call itself."""

from __future__ import annotations

import collections
import json
import math
import shutil
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from conftest import TEST_CONFIG
from peat import alter_study as S
from peat import candidate

torch.set_num_threads(1)

# peat alter numbers bits from the sign (bit 0) down: float32 sign 0, exponent 1-8, mantissa 9-31.
REGION_BITS = {"sign": {0}, "exponent_msb": {1}, "mantissa": set(range(9, 32))}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> tuple[dict, Path, Path]:
    """The test config's gpt2 trained to its end (2 epochs) with a checkpoint at epoch 1: spec, data, golden folder."""
    from peat.data import prepare
    from peat.train import train_model

    tmp = tmp_path_factory.mktemp("gpt2")
    config = yaml.safe_load(TEST_CONFIG.read_text())
    spec = {**config["models"]["gpt2"], "checkpoint_epochs": [1]}
    prepare("pydoc", config["datasets"]["pydoc"], tmp / "pydoc.h5")
    train_model("gpt2", spec, tmp / "pydoc.h5", tmp / "golden", record=False, progress=False)
    return spec, tmp / "pydoc.h5", tmp / "golden"


def resume(spec, data, start, out) -> pd.DataFrame:
    from peat.train import train_model

    return train_model("gpt2", spec, data, out, record=False, progress=False, start=start, resumable=False)


def datasets(path) -> dict[str, bytes]:
    with h5py.File(path) as f:
        found = {}
        f.visititems(lambda name, obj: found.update({name: obj[()].tobytes()})
                     if isinstance(obj, h5py.Dataset) and name != "history" else None)
    return found


def test_resuming_an_unaltered_checkpoint_reproduces_golden_bit_for_bit(gpt2, tmp_path):
    """The baseline "absorbed" is measured against: every later train and validation row, and the
    final weights and optimizer state (AdamW's moments and step), exactly golden's."""
    spec, data, golden = gpt2
    resumed = resume(spec, data, golden / "checkpoints" / "epoch001.h5", tmp_path)
    columns = ["step", "epoch", "split", "loss", "accuracy"]
    expected = pd.read_csv(golden / "metrics.csv")[columns]
    assert resumed[columns].equals(expected)
    assert datasets(tmp_path / "final.h5") == datasets(golden / "final.h5")


def test_a_cells_flips_and_outcome_recomputed_from_the_golden_checkpoint(gpt2, tmp_path):
    """Each logged flip is one bit of the chosen region in a conv/linear weight, from golden's value to
    the logged one; the same flips made here by hand and resumed give the cell's every number."""
    spec, data, golden = gpt2
    source = golden / "checkpoints" / "epoch001.h5"
    table = S.run_cells("gpt2", spec, "cpu", 1, "weight", ["sign", "exponent_msb"], [10], [0],
                        checkpoints=golden / "checkpoints", data=data, golden_metrics=golden / "metrics.csv",
                        run_seed=0, threads=1, config_hash="", out_csv=tmp_path / "cells.csv", log_dir=tmp_path / "logs")
    curve = pd.read_csv(golden / "metrics.csv").query("split == 'val'").set_index("epoch")
    last = curve.loc[spec["epochs"]]
    for row in table.itertuples():
        injections = json.loads((tmp_path / "logs" / f"{row.region}_n10_seed0.json").read_text())["injections"]
        altered = tmp_path / f"{row.region}.h5"
        shutil.copy(source, altered)
        made_nonfinite = 0
        with h5py.File(altered, "r+") as f:
            assert len({(i["dataset"], tuple(i["index"])) for i in injections}) == len(injections) == 10
            for i in injections:
                ds, index = f[i["dataset"]], tuple(i["index"])
                assert ds.attrs["module_type"] in ("Conv1D", "Linear") and i["dataset"].endswith(".weight")
                assert i["bit"] in REGION_BITS[row.region]
                old = np.float32(ds[index])
                assert old == np.float32(i["old"])
                new = (old.view(np.uint32) ^ np.uint32(1 << (31 - i["bit"]))).view(np.float32)
                assert new.view(np.uint32) == np.float32(i["new"]).view(np.uint32)
                made_nonfinite += bool(np.isfinite(old) and not np.isfinite(new))
                ds[index] = new
        assert (row.altered_values, row.datasets_hit) == (10, len({i["dataset"] for i in injections}))
        assert row.nonfinite_injected == made_nonfinite

        from peat.train import evaluate_checkpoint

        now = evaluate_checkpoint("gpt2", spec, data, altered)
        assert same((row.altered_accuracy, row.altered_loss), (now["accuracy"], now["loss"]))
        val = resume(spec, data, altered, tmp_path / row.region).query("split == 'val' and epoch > 1")
        final = val.iloc[-1]
        finite = np.isfinite(val["loss"].to_numpy())
        gaps = np.where(finite, np.abs(val["accuracy"].to_numpy() - curve.loc[val["epoch"], "accuracy"].to_numpy()), math.inf)
        assert row.accuracy_gaps == " ".join(repr(float(g)) for g in gaps)
        assert row.diverged == (not finite.all()) and row.resumed_epochs == len(val)
        assert same((row.final_accuracy, row.final_loss, row.golden_accuracy, row.golden_loss),
                    (final["accuracy"], final["loss"], last["accuracy"], last["loss"]))
        assert same((row.accuracy_loss_pct,), (100 * (last["accuracy"] - final["accuracy"]) / last["accuracy"],))
        change = 100 * (final["loss"] - last["loss"]) / abs(last["loss"]) if np.isfinite(final["loss"]) else math.inf
        assert same((row.loss_change_pct,), (change,))


def same(got, expected) -> bool:
    """Equal to the last bit, NaN equal to NaN (a diverged run's loss)."""
    return all(np.float64(a).tobytes() == np.float64(b).tobytes() or (np.isnan(a) and np.isnan(b))
               for a, b in zip(got, expected, strict=True))


COUNTING_KERNEL = '''
import torch
OP = "linear"

def _log(computation, weight_rows):
    with open({log!r}, "a") as f:
        f.write(f"{{computation}} {{weight_rows}}\\n")

def forward(x, weight, bias):
    _log("forward", weight.shape[0])
    return torch.nn.functional.linear(x, weight, bias)

def input_grad(grad_out, weight):
    _log("input_grad", weight.shape[0])
    return grad_out @ weight

def weight_grad(grad_out, x):
    _log("weight_grad", grad_out.shape[-1])
    return grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
'''
# The two routed layers of the tiny GPT-2 (hidden 32), told apart by their weight's output rows.
LAYERS = {"transformer.h.0.attn.c_attn": 96, "transformer.h.0.mlp.c_fc": 128}


def counted(tmp_path, gpt2, schedule):
    """Train gpt2 with both LAYERS routed through a golden-exact kernel that logs each call it gets."""
    spec, data, golden = gpt2
    log = tmp_path / f"{schedule}.calls"
    kernel = tmp_path / "counting.py"
    kernel.write_text(COUNTING_KERNEL.format(log=str(log)))
    out = tmp_path / str(schedule)
    record = candidate.train_candidate("gpt2", spec, "count", {"op": "linear", "impl": str(kernel), "layers": list(LAYERS)},
                                       data, golden, out, schedule=schedule)
    return record, collections.Counter(log.read_text().split("\n")[:-1]), out


def test_rfi_routes_exactly_the_scheduled_training_steps_to_the_kernel(gpt2, tmp_path):
    """f0.3125 of the 8 steps (2 epochs x 4) is 2.5, rounded half up: steps 0-2. The kernel itself sees
    each of their calls once per layer and computation and no validation call (those run golden)."""
    record, calls, out = counted(tmp_path, gpt2, "f0.3125")
    assert calls == {f"{c} {rows}": 3 for c in ("forward", "input_grad", "weight_grad") for rows in LAYERS.values()}
    table = pd.read_csv(out / "calls.csv")
    assert table.groupby(["layer", "computation"])["step"].apply(list).to_dict() == {
        (layer, c): [0, 1, 2] for layer in LAYERS for c in ("forward", "input_grad", "weight_grad")}
    assert (table["changed"] == 0).all() and (record["status"], record["max_abs_loss_diff"]) == ("ok", 0.0)


def test_a_candidate_computing_as_golden_trains_exactly_as_golden(gpt2, tmp_path):
    """Routed for the whole run (training and validation): golden's curve and final weights, bit for bit."""
    record, calls, out = counted(tmp_path, gpt2, None)
    assert calls["forward 96"] == 8 + 2 * 2  # 8 steps, 2 validation batches in each of 2 epochs
    assert record["max_abs_loss_diff"] == 0.0 and not record["nonfinite_loss"]
    compared = pd.read_csv(out / "compare.csv")
    assert (compared["loss_diff"] == 0).all() and (compared["accuracy_diff"] == 0).all()
    golden = gpt2[2]
    assert datasets(out / "final.h5") == datasets(golden / "final.h5")
