"""The training context against training itself, checked independently of the Profiler's own hooks:
which steps a resumed run records, and what it refuses."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from peat.io import PeatError
from peat.profiler import Profiler, read_layer

NAMES = ["0", "1", "3"]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(step))


def train(profiler: Profiler, net: nn.Module, steps, *, snapshot_after: int | None = None, kill_at: int | None = None,
          first_step: int = 0, resuming: bool = False) -> None:
    """Three steps an epoch, numbered across epochs; ``kill_at`` abandons that step half-way."""
    profiler.attach(net, first_step=first_step, resuming=resuming)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in steps:
        profiler.begin_step(step, step // 3 + 1)
        net(batch(step)).square().mean().backward()
        if step == kill_at:
            profiler.abandon()
            return
        profiler.end_step()
        optimizer.step()
        optimizer.zero_grad()
        if step == snapshot_after:
            profiler.snapshot()
    profiler.close()


def test_a_resume_with_another_every_is_refused_naming_the_snapshot(tmp_path):
    path = tmp_path / "context.h5"
    train(Profiler(path, NAMES, every=2), model(), range(6), snapshot_after=2, kill_at=4)
    with pytest.raises(PeatError, match=r"context\.snapshots/0000000\.h5: .*every=2, not 3") as err:
        train(Profiler(path, NAMES, every=3), model(), range(3, 6), first_step=3, resuming=True)
    assert "\n" not in str(err.value)
    assert not path.exists() and not (tmp_path / ".partial" / "context.h5").exists()
    # the killed run's snapshot is kept: a resume with its settings still finds it
    train(Profiler(path, NAMES, every=2), model(), range(3, 6), first_step=3, resuming=True)
    assert [s["step"] for s in read_layer(path, "0", derive=False)[1]] == [0, 2, 4]


def test_numpy_integer_settings_snapshot_and_resume(tmp_path):
    """every and epochs take numpy integers; the settings a snapshot keeps were JSON of them, a TypeError."""
    path = tmp_path / "context.h5"
    train(Profiler(path, NAMES, every=np.int64(2), epochs=np.arange(1, 2)), model(), range(6), snapshot_after=2,
          kill_at=4)
    train(Profiler(path, NAMES, every=2, epochs=[1]), model(), range(3, 6), first_step=3, resuming=True)
    assert [s["step"] for s in read_layer(path, "0", derive=False)[1]] == [0, 2]  # epoch 1: steps 0-2


def test_a_resume_recording_other_layers_is_refused(tmp_path):
    path = tmp_path / "context.h5"
    train(Profiler(path, NAMES, every=1), model(), range(6), snapshot_after=2, kill_at=4)
    with pytest.raises(PeatError, match=r"0000000\.h5: .*layers="):
        train(Profiler(path, ["0"], every=1), model(), range(3, 6), first_step=3, resuming=True)


def damaged(tmp_path, edit) -> str:
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    path = tmp_path / "context.h5"
    train(Profiler(path, ["0", "1"]), net, range(1))
    with h5py.File(path, "a") as f:
        edit(f)
    return str(path)


@pytest.mark.parametrize("edit, layer, says", [
    (lambda f: f.__delitem__("layers/0/0000000/W"),
     "0", "layers/0/0000000 lacks W"),
    (lambda f: f["layers/1"].attrs.__delitem__("op"), "1", "layer '1' has op None"),
    (lambda f: f["layers/1"].attrs.__delitem__("normalized_shape"), "1", "lacks its attribute 'normalized_shape'"),
], ids=["no_weight", "no_op", "no_hyper_parameter"])
def test_a_damaged_context_is_read_with_one_line_naming_the_file_and_what_it_lacks(tmp_path, edit, layer, says):
    path = damaged(tmp_path, edit)
    with pytest.raises(PeatError, match=re.escape(f"{path}: ") + ".*" + re.escape(says)) as err:
        read_layer(path, layer)
    assert "\n" not in str(err.value)


def test_a_conv2ds_derived_bias_gradient_is_trainings_own_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.Tanh(),
                        nn.Conv2d(6, 6, 3, padding=2, dilation=2, groups=6))
    path, grads = tmp_path / "context.h5", []
    profiler = Profiler(path, ["0", "2"])
    profiler.attach(net)
    for step in range(3):
        profiler.begin_step(step, 1)
        net(torch.randn(4, 3, 9, 9, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        grads.append({name: net.get_submodule(name).bias.grad.clone() for name in ("0", "2")})
        profiler.end_step()
        net.zero_grad()
    profiler.close()
    for name in ("0", "2"):
        for sample in read_layer(path, name)[1]:
            assert torch.equal(sample["dB"], grads[sample["step"]][name]), (name, sample["step"])
