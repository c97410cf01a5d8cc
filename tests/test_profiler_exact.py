"""The recorded context against what each layer saw, taken by hooks of this file's own (not the
Profiler's) in a training loop of its own: A, W, B, running statistics and dO bit for bit, W and
running statistics as they were before the step's optimizer update."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import prune as pruning

from peat.profiler import Profiler, derive_outputs, read_layer


class Witness:
    """Every training-mode call of the named modules in a step: its input, output, output gradient,
    and the weight and bias the forward used (read in the forward hook, after any pre-hook made them)."""

    def __init__(self, model: nn.Module, names: list[str]):
        self.model, self.steps = model, {}
        for name in names:
            getattr_path(model, name).register_forward_hook(self._hook(name))

    def begin(self, step: int) -> None:
        self.now = self.steps[step] = {}
        for name, module in self.model.named_modules():
            if getattr(module, "running_mean", None) is not None:
                self.now[name, "stats"] = (module.running_mean.clone(), module.running_var.clone())

    def _hook(self, name: str):
        def hook(module, args, out):
            call = {"A": args[0].detach().clone(), "O": out.detach().clone()}
            for key in ("weight", "bias"):
                if getattr(module, key, None) is not None:
                    call[key[0].upper()] = getattr(module, key).detach().clone()
            self.now.setdefault(name, []).append(call)
            if out.requires_grad:
                out.register_hook(lambda grad: call.__setitem__("dO", grad.clone()))
        return hook


def getattr_path(model: nn.Module, name: str) -> nn.Module:
    return dict(model.named_modules())[name]


def train(model: nn.Module, batches, profiler: Profiler | None = None, witness: Witness | None = None) -> dict:
    """SGD with momentum over ``batches``, one step each; the final weights."""
    if profiler is not None:
        profiler.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, x in enumerate(batches):
        if profiler is not None:
            profiler.begin_step(step, 1)
        if witness is not None:
            witness.begin(step)
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        if profiler is not None:
            profiler.end_step()
        optimizer.step()
    if profiler is not None:
        profiler.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_recorded_as_seen(path, witness: Witness, names: list[str]) -> None:
    for name in names:
        attrs, samples = read_layer(path, name, derive=False)
        assert [s["step"] for s in samples] == sorted(witness.steps), name
        for sample in samples:
            first = witness.steps[sample["step"]][name][0]  # a layer called twice: its first call
            seen = {k: first[k] for k in ("A", "W", "B", "dO") if k in first}
            if attrs.get("transposed"):  # GPT-2's Conv1D, stored as nn.Linear's weight
                seen["W"] = seen["W"].t()
            if (name, "stats") in witness.steps[sample["step"]]:
                seen["running_mean"], seen["running_var"] = witness.steps[sample["step"]][name, "stats"]
            for key, tensor in seen.items():
                assert torch.equal(sample[key], tensor), (name, sample["step"], key)
            assert torch.equal(derive_outputs(sample, attrs)["O"], first["O"]), (name, sample["step"])


class Mixed(nn.Module):
    """Grouped, depthwise, strided, dilated and 'same' convs, batch and layer norm, a transposed
    GPT-2 Conv1D, two linears fed one input (llama's gate and up), a linear called twice."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8),
                                   nn.Conv2d(8, 6, 3, padding="same", dilation=(1, 2), bias=False))
        self.proj, self.norm = Conv1D(12, 6), nn.LayerNorm(12)
        self.gate, self.up, self.down = nn.Linear(12, 10), nn.Linear(12, 10), nn.Linear(10, 10)

    def forward(self, x):
        h = self.convs(x).mean((2, 3))
        h = self.norm(self.proj(h))
        h = self.down(torch.relu(self.gate(h)) * self.up(h))
        return self.down(torch.tanh(h))


def test_recorded_tensors_are_what_each_layer_saw_and_recording_changes_no_weight(tmp_path):
    names = ["convs.0", "convs.1", "convs.3", "convs.4", "proj", "norm", "gate", "up", "down"]
    batches = [torch.randn(3, 4, 9, 9, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    torch.manual_seed(0)
    plain = train(Mixed(), batches)
    torch.manual_seed(0)
    model = Mixed()
    witness = Witness(model, names)
    recorded = train(model, batches, Profiler(tmp_path / "context.h5", names), witness)
    assert all(torch.equal(plain[k], recorded[k]) for k in plain)
    assert len(witness.steps[0]["down"]) == 2
    assert_recorded_as_seen(tmp_path / "context.h5", witness, names)


def prune(module: nn.Module) -> None:
    pruning.l1_unstructured(module, "weight", amount=0.3)
    pruning.l1_unstructured(module, "bias", amount=0.3)


@pytest.mark.parametrize("compute", [prune, torch.nn.utils.weight_norm, torch.nn.utils.spectral_norm],
                         ids=["prune", "weight_norm", "spectral_norm"])
def test_a_weight_a_forward_pre_hook_computes_is_recorded_as_that_forward_used_it(tmp_path, compute):
    """torch.nn.utils.prune and the older weight_norm and spectral_norm set ``module.weight`` in a
    forward pre-hook: read at begin_step it was the last step's, from the weights before the last
    optimizer update (spectral_norm's even at step 0), and golden's O differed from training's by up to
    0.6; reading its .grad (none: it is no leaf) warned every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm's deprecation
        compute(model[2])
    witness = Witness(model, ["2"])
    batches = [torch.randn(4, 5, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, batches, Profiler(tmp_path / "context.h5", ["2"]), witness)
    assert_recorded_as_seen(tmp_path / "context.h5", witness, ["2"])


def test_storage_counts_the_steps_a_run_started_from_a_checkpoint_ran(tmp_path):
    """fit's ``start``: a run from step 2 to 6 counted a naive dump of steps 0-5, six steps where it
    ran four, so storage.json's ratio read a third smaller than the context's."""
    from peat import data
    from peat.io import read_json
    from peat.train import Run, fit

    g = torch.Generator().manual_seed(0)
    ds = data.Dataset("image", *(data.Split(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g))
                                 for n in (16, 4)), {})

    def train(out, epochs, start=None):
        torch.manual_seed(0)
        run = Run(epochs=epochs, batch_size=8, optimizer={"name": "sgd", "lr": 0.1}, checkpoint_epochs=[1])
        fit(nn.Sequential(nn.Linear(4, 3)), ds, run, out, progress=False, start=start,
            profiler=Profiler(out / "context.h5", ["*"]))
        return read_json(out / "storage.json")

    whole = train(tmp_path / "base", 3)
    started = train(tmp_path / "started", 3, start=tmp_path / "base" / "checkpoints" / "epoch001.h5")
    assert (whole["steps"], started["steps"]) == (6, 4)
    per_step = whole["naive_bytes_per_step"]
    assert started["naive_bytes_per_step"] == per_step and started["naive_bytes"] == 4 * per_step
    assert started["context_bytes"] == (tmp_path / "started" / "context.h5").stat().st_size


@pytest.mark.parametrize("derived", [False, True])
def test_a_call_under_inference_mode_gives_way_to_the_graded_one(tmp_path, derived):
    """A target computed under torch.inference_mode in a training step (a teacher's pass of the same
    model): its input has no version counter, and the Profiler's hook stopped training with
    'Inference tensors do not track version counter', naming no layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    witness = Witness(model, ["0", "2"])
    profiler = Profiler(tmp_path / "context.h5", ["0", "2"], derived=derived)
    profiler.attach(model)
    profiler.begin_step(0, 1)
    witness.begin(0)
    x = torch.randn(3, 4)
    with torch.inference_mode():
        target = model(x)
    (model(x) - target.clone()).square().sum().backward()
    profiler.end_step()
    profiler.close()
    for name in ("0", "2"):
        [_, graded] = witness.steps[0][name]
        _, [sample] = read_layer(tmp_path / "context.h5", name, derive=False)
        assert all(torch.equal(sample[k], graded[k]) for k in ("A", "dO")), name


def test_a_users_forward_hook_that_replaces_the_output_leaves_the_layers_own_recorded(tmp_path):
    """A forward hook registered before attach that returns another output (here twice the layer's):
    the Profiler's hook saw that one, and stored it as O with the gradient of it as dO, which no op
    on the recorded A and W gives (O off by 1.1, training's dW twice the one A and dO give)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    model[0].register_forward_hook(lambda module, args, out: out * 2)
    witness = Witness(model, [])
    model[0].register_forward_hook(witness._hook("0"), prepend=True)  # the layer's own output
    train(model, [torch.randn(3, 4)], Profiler(tmp_path / "context.h5", ["0"], derived=True), witness)
    assert_recorded_as_seen(tmp_path / "context.h5", witness, ["0"])
    attrs, [sample] = read_layer(tmp_path / "context.h5", "0", derive=False)
    assert torch.equal(sample["O"], witness.steps[0]["0"][0]["O"])
    torch.testing.assert_close(derive_outputs(sample, attrs)["dW"], sample["dW"], rtol=1e-6, atol=1e-7)


def test_weights_that_functional_call_swaps_in_are_recorded(tmp_path):
    """torch.func.functional_call (MAML's adapted weights): the Profiler took the module's own
    weights at begin_step, not those the forward used (O off by 0.5)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    witness = Witness(model, ["0", "2"])
    profiler = Profiler(tmp_path / "context.h5", ["0", "2"])
    profiler.attach(model)
    profiler.begin_step(0, 1)
    witness.begin(0)
    adapted = {name: p * 0.5 for name, p in model.named_parameters()}
    torch.func.functional_call(model, adapted, (torch.randn(3, 4),)).square().sum().backward()
    profiler.end_step()
    profiler.close()
    assert_recorded_as_seen(tmp_path / "context.h5", witness, ["0", "2"])
