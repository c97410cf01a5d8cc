"""The alteration study's driver (peat.alter_study.run_cells): what it checks before its first cell."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from peat import alter_study as S
from peat import checkpoint
from peat.io import PeatError

SPEC = {"epochs": 3}


def golden(tmp_path: Path, **columns) -> Path:
    """A golden run's folder: an epoch-1 checkpoint of a tiny model and metrics.csv (a train and a
    val row per epoch of 3, overridden by ``columns``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    (tmp_path / "checkpoints").mkdir()
    checkpoint.save(tmp_path / "checkpoints" / "epoch001.h5", model, torch.optim.SGD(model.parameters(), lr=0.1),
                    step=4, epoch=1, meta={})
    table = {"step": [3, 4, 7, 8, 11, 12], "epoch": [1, 1, 2, 2, 3, 3], "split": ["train", "val"] * 3,
             "loss": [1.0, 0.9, 0.8, 0.7, 0.6, 0.5], "accuracy": [0.5, 0.55, 0.6, 0.65, 0.7, 0.75],
             "perplexity": [float("nan")] * 6, "wall_time": [0.1] * 6} | columns
    pd.DataFrame(table).to_csv(tmp_path / "metrics.csv", index=False)
    return tmp_path


def run(folder: Path, cls: str = "weight") -> pd.DataFrame:
    return S.run_cells("tiny", SPEC, "cpu", 1, cls, ["sign"], [1], [0], checkpoints=folder / "checkpoints",
                       data=folder / "no-data.h5", golden_metrics=folder / "metrics.csv", run_seed=0,
                       threads=1, config_hash="", out_csv=folder / "cells.csv", log_dir=folder / "logs")


@pytest.mark.parametrize("columns, problem", [
    # Cut short (a copy from a shorter run, a hand edit): a KeyError once the first cell had trained.
    ({"split": ["train", "val", "train", "val", "train", "train"]},
     "no validation row of epoch 3; the study compares epochs 2 to 3 with golden's"),
    ({"epoch": [1, 1, 2, 2, 2, 2]}, "2 validation rows of epoch 2, one expected"),
    ({"accuracy": [0.5, 0.55, 0.6, "x", 0.7, 0.75]}, "validation accuracy of epoch 2 is 'x', not a finite number"),
    ({"loss": [1.0, 0.9, 0.8, 0.7, 0.6, None]}, "validation loss of epoch 3 is nan, not a finite number"),
    ({"epoch": [1, 1, 2, 2, 3, "three"]}, "validation epoch 'three' is not an epoch number"),
])
def test_a_damaged_golden_metrics_file_fails_before_the_first_cell_naming_it(tmp_path, columns, problem):
    folder = golden(tmp_path, **columns)
    with pytest.raises(PeatError) as err:
        run(folder)
    assert str(err.value) == f"{folder / 'metrics.csv'}: {problem} (damaged, or not this model's golden run?)"
    assert not (folder / "logs").exists() and not (folder / "cells.csv").exists()


def test_golden_metrics_without_a_column_the_study_reads_fails_naming_it(tmp_path):
    folder = golden(tmp_path)
    pd.read_csv(folder / "metrics.csv").drop(columns="loss").to_csv(folder / "metrics.csv", index=False)
    with pytest.raises(PeatError) as err:
        run(folder)
    assert str(err.value) == f"{folder / 'metrics.csv'}: missing columns loss (damaged, or not the file expected?)"


def test_sound_golden_metrics_pass_to_the_cells(tmp_path):
    # A class the tiny model lacks: its cell is not applicable, decided without training.
    table = run(golden(tmp_path), cls="embedding")
    assert table["status"].tolist() == ["not_applicable"]


def test_a_cell_compares_with_the_checked_golden_curve(tmp_path):
    """The checked curve is what the cells compare with: a real golden gpt2 of the test config."""
    import yaml

    from peat.data import prepare
    from peat.train import train_model

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "test.yaml").read_text())
    spec = {**config["models"]["gpt2"], "checkpoint_epochs": [1]}
    prepare("pydoc", config["datasets"]["pydoc"], tmp_path / "pydoc.h5")
    train_model("gpt2", spec, tmp_path / "pydoc.h5", tmp_path / "golden", record=False, progress=False)
    table = S.run_cells("gpt2", spec, "cpu", 1, "bias", ["mantissa"], [1], [0], checkpoints=tmp_path / "golden" / "checkpoints",
                        data=tmp_path / "pydoc.h5", golden_metrics=tmp_path / "golden" / "metrics.csv",
                        run_seed=0, threads=1, config_hash="", out_csv=tmp_path / "cells.csv", log_dir=tmp_path / "logs")
    metrics = pd.read_csv(tmp_path / "golden" / "metrics.csv")
    last = metrics[(metrics["split"] == "val") & (metrics["epoch"] == spec["epochs"])].iloc[0]
    row = table.iloc[0]
    assert row["status"] == "ok" and row["resumed_epochs"] == spec["epochs"] - 1
    assert (row["golden_accuracy"], row["golden_loss"]) == (last["accuracy"], last["loss"])


def test_without_the_models_epochs_the_files_last_epoch_bounds_the_check(tmp_path):
    # run_cells called with a spec lacking epochs (a library caller): every epoch up to the file's last.
    folder = golden(tmp_path, split=["train", "train", "train", "train", "train", "val"])
    with pytest.raises(PeatError) as err:
        S.run_cells("tiny", {}, "cpu", 1, "weight", ["sign"], [1], [0], checkpoints=folder / "checkpoints",
                    data=folder / "no-data.h5", golden_metrics=folder / "metrics.csv", run_seed=0,
                    threads=1, config_hash="", out_csv=folder / "cells.csv", log_dir=folder / "logs")
    assert str(err.value) == (f"{folder / 'metrics.csv'}: no validation row of epoch 2; the study compares epochs 2 "
                              "to 3 with golden's (damaged, or not this model's golden run?)")
    (tmp_path / "sound").mkdir()
    assert list(S.golden_curve(golden(tmp_path / "sound") / "metrics.csv", 1).index) == [1, 2, 3]
