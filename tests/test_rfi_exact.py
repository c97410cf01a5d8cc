"""Frequency-based runtime FI checked against an independent re-run: a forward hook puts the faulty
kernel's forward on ResNet-18's fc at the steps the README names, golden elsewhere."""

from __future__ import annotations

import pandas as pd
import torch
import yaml

from conftest import TEST_CONFIG
from peat import candidate
from peat.train import train_model

torch.set_num_threads(1)
# config/test.yaml's resnet18, 2 epochs of 2 steps of 16 images: every3 is active at steps 0 and 3 (epoch 2's last,
# so the validation after it runs at step 3 too), golden at steps 1 and 2.
SPEC = yaml.safe_load(TEST_CONFIG.read_text())["models"]["resnet18"] | {
    "epochs": 2, "batch_size": 16, "max_train_samples": 32, "max_val_samples": 16, "checkpoint_epochs": []}
KERNEL = {"op": "linear", "error": "lane:4", "layers": ["fc"], "seed": 3}
ACTIVE = [0, 3]


def own_run(digits, out):
    """The README's RFI written out: the faulty forward on training steps ``ACTIVE`` only (backward
    golden, as the kernel computes only the forward's error), golden in validation. Returns the curve
    and, per faulty call, (step, elements changed)."""
    faulty, state, changed = candidate.build("own", KERNEL), {"step": None}, []

    def hook(module, args, golden):
        if not (module.training and state["step"] in ACTIVE):
            return None
        out = faulty.forward(args[0].detach(), module.weight.detach(), module.bias.detach())
        changed.append([state["step"], int((out != golden).sum())])
        return out + (golden - golden.detach())  # the faulty values, golden's gradient

    metrics = train_model("resnet18", SPEC, digits, out, seed=0, threads=1, record=False, progress=False,
                          prepare_model=lambda model: model.fc.register_forward_hook(hook),
                          before_step=lambda step, epoch: state.update(step=step), resumable=False)
    return metrics, changed


def test_rfi_routes_exactly_the_documented_steps_and_trains_as_golden_elsewhere(digits, tmp_path):
    golden = tmp_path / "golden"  # only compare.csv's golden columns read it
    golden.mkdir()
    pd.DataFrame({"step": [0, 1, 2, 2, 3, 4], "epoch": [1, 1, 1, 2, 2, 2], "split": ["train", "train", "val"] * 2,
                  "loss": 2.0, "accuracy": 0.1, "perplexity": float("nan"), "wall_time": 0.0}).to_csv(
        golden / "metrics.csv", index=False)
    record = candidate.train_candidate("resnet18", SPEC, "lane_fc", KERNEL, digits, golden, tmp_path / "rfi", seed=0,
                                       schedule="every3")
    assert record["status"] == "ok" and record["steps_trained"] == 4 and record["schedule"] == "every3"
    calls = pd.read_csv(tmp_path / "rfi" / "calls.csv")
    # A step is routed whole: each of the fc's three computations once, at the active steps alone.
    assert calls[["step", "computation"]].values.tolist() == [
        [step, c] for step in ACTIVE for c in ("forward", "input_grad", "weight_grad")]
    mine, changed = own_run(digits, tmp_path / "own")
    assert calls.loc[calls["computation"] == "forward", ["step", "changed"]].values.tolist() == changed
    assert all(n > 0 for _, n in changed)  # lane:4 of a 10-class fc: whole columns of the batch
    assert (calls.loc[calls["computation"] != "forward", "changed"] == 0).all()
    # The whole curve, train and validation rows, bit for bit that of the re-run.
    curve = pd.read_csv(tmp_path / "rfi" / "compare.csv")
    assert curve[["step", "epoch", "split"]].values.tolist() == mine[["step", "epoch", "split"]].values.tolist()
    assert curve["loss_candidate"].tolist() == mine["loss"].tolist()
    assert curve["accuracy_candidate"].tolist() == mine["accuracy"].tolist()
