"""peat.propagate re-derived from docs/playback.md: the later observing points against a network
rebuilt here by hand, the convolutions' fast paths against torch's, recon_error's definition."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_gpt2_golden
from peat import checkpoint
from peat.models import build, loss_and_metrics
from peat.profiler import match_layers, read_layer, recorded_steps
from peat.propagate import Propagator, _conv, _recon_error
from peat.train import epoch_seed


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory):
    """A tiny GPT-2 trained under the Profiler: 3 steps an epoch, 2 epochs, a checkpoint after the first."""
    root = tmp_path_factory.mktemp("golden")
    spec, data = tiny_gpt2_golden(root)
    prop = Propagator(context=root / "run" / "context.h5", spec=spec, data=data,
                      checkpoints=root / "run" / "checkpoints", samples=None)
    return root, spec, prop


def rebuilt(root, spec, prop, step):
    """The network before ``step`` as docs/playback.md says: seeded build, the latest checkpoint at or
    before the step, every recorded layer's weights of that step."""
    torch.manual_seed(0)
    model = build(spec, prop.dataset.attrs, 0)
    saved = sorted((int(checkpoint_step(p)), p) for p in (root / "run" / "checkpoints").glob("epoch*.h5"))
    for s, path in saved:
        if s <= step:
            checkpoint.load(path, model)
    context = root / "run" / "context.h5"
    for name, module in match_layers(model, prop.order).items():
        if step in recorded_steps(context, name):
            attrs, (sample,) = read_layer(context, name, [step], derive=False)
            with torch.no_grad():
                module.weight.copy_(sample["W"].t() if attrs.get("transposed") else sample["W"])
                module.bias.copy_(sample["B"])
    return model.train()


def checkpoint_step(path):
    from peat.io import open_h5

    with open_h5(path) as f:
        return f.attrs["step"]


def own_forward(model, prop, layer, nxt, x, y, seed, replace=None):
    """A plain forward to the loss, ``layer``'s output replaced by ``replace(its input)``."""
    seen = {}
    hooks = [model.get_submodule(nxt).register_forward_hook(lambda m, i, o: seen.setdefault("next", o.detach()))]
    if replace is not None:
        hooks.append(model.get_submodule(layer).register_forward_hook(lambda m, i, o: replace(i[0])))
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            loss, _ = loss_and_metrics(model, prop.dataset.kind, x, y)
    finally:
        for h in hooks:
            h.remove()
    return seen["next"], loss.reshape(1)


def test_later_points_equal_a_network_rebuilt_by_hand_bit_for_bit(golden_run):
    """Golden, and a candidate (golden's output plus 1 on every 4th column), at next and loss, at
    every recorded step (exact ones, 0 and 3, and approximate ones): as a forward of the network
    rebuilt here, bit for bit."""
    root, spec, prop = golden_run
    layer, nxt = "transformer.h.0.mlp.c_fc", "transformer.h.1.ln_1"
    context = root / "run" / "context.h5"
    cases = 0
    for step in recorded_steps(context, layer):
        epoch = 1 + step // prop.per_epoch
        x, y = prop.batch(step, epoch)
        model, _ = prop.models_at(step)
        prop.readers, prop.before = None, {}
        mine = rebuilt(root, spec, prop, step)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), mine.state_dict().values()))
        seed = epoch_seed(0, epoch)
        module = mine.get_submodule(layer)

        def shifted(a, module=module):
            out = F.linear(a, module.weight.t(), module.bias).clone()
            out[..., ::4] += 1
            return out

        for replace in (None, shifted):
            theirs = prop.observe(model, layer, nxt, x, y, replace, seed=seed)
            ours = own_forward(mine, prop, layer, nxt, x, y, seed, replace)
            assert torch.equal(theirs["next"], ours[0]) and torch.equal(theirs["loss"], ours[1])
            cases += 1
    assert cases == 12


def test_recon_error_is_the_max_relative_difference_and_0_where_exact():
    recorded = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    assert _recon_error(recorded.clone(), recorded) == 0
    live = recorded.clone()
    live[1, 0] = 2.5
    assert _recon_error(live, recorded) == pytest.approx(0.5 / 4)


def test_recon_error_of_an_exact_rebuild_of_non_finite_inputs_is_0():
    """A diverged training's recorded input holds inf and NaN: an exact rebuild has them at the same
    places, and its recon_error was NaN (inf - inf), not 0."""
    recorded = torch.tensor([[1.0, float("inf")], [float("nan"), -float("inf")]])
    assert _recon_error(recorded.clone(), recorded) == 0
    live = recorded.clone()
    live[0, 0] = 1.5
    assert _recon_error(live, recorded) == 0.5
    live[0, 1] = 3.0  # inf rebuilt as a finite value: as far as can be
    assert _recon_error(live, recorded) == float("inf")


CONVS = list(itertools.product([(1, 1), (2, 3), (5, 5)], [1, 3, (1, 3)], [1, 2], [0, 1, 4], [1, 2], [1, 2],
                               [torch.float32, torch.float64], [False, True]))


def test_fast_convolutions_compute_what_torch_does_with_nan_and_inf_where_torch_has_them():
    """_conv on small maps (matrix and crop paths, float64 GEMM), stride/dilation/groups, padding
    beyond the map, channels-last, empty batches: torch's results to rounding, NaN and inf where
    torch's are, the same shape."""
    torch.manual_seed(0)
    checked = 0
    for (h, w), k, s, p, d, g, dtype, cl in CONVS:
        conv = torch.nn.Conv2d(4, 6, k, stride=s, padding=p, dilation=d, groups=g).to(dtype)
        for n, poison in ((0, None), (2, None), (2, float("nan")), (2, float("inf"))):
            x = torch.randn(n, 4, h, w, dtype=dtype)
            if poison is not None:
                x[0, 1, h - 1, 0] = poison
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            try:
                want = F.conv2d(x, conv.weight, conv.bias, s, p, d, g)
            except RuntimeError:  # a map too small for the kernel: no convolution to compare
                continue
            with torch.no_grad():
                got = _conv(conv, {}, x)
            assert got.shape == want.shape
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
            finite = want.isfinite()
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            torch.testing.assert_close(got[finite], want.detach()[finite], rtol=tol, atol=tol)
            checked += 1
    assert checked > 500


class Branchy(torch.nn.Module):
    """A downsample reading the block's input, a residual add, a layer read by two later ones, a layer
    whose output nothing reads, dropout after them all."""

    def __init__(self):
        super().__init__()
        for name in ("a", "down", "b", "c", "d", "dead", "e"):
            setattr(self, name, torch.nn.Linear(4, 4))
        self.head, self.drop = torch.nn.Linear(4, 3), torch.nn.Dropout(0.5)

    def forward(self, x):
        h = self.down(x)
        h = self.b(self.a(x)) + h
        u, v = self.c(h), self.d(h)
        self.dead(u)
        return self.head(self.drop(self.e(u + v)))


def test_next_readers_of_a_branching_network_follow_the_data_in_call_order():
    from peat.propagate import call_graph

    torch.manual_seed(0)
    order = ["a", "b", "down", "c", "d", "dead", "e", "head"]
    readers, before = call_graph(Branchy().train(), order, "image", torch.randn(5, 4), torch.randint(0, 3, (5,)), 0)
    # a's next in definition order, down, reads x; b does not read down (the add comes after it); c's first reader in call order is dead, not d.
    assert readers == {"a": "b", "down": "c", "b": "c", "c": "dead", "d": "e", "dead": None, "e": "head", "head": None}
    assert before["b"] == {"a", "down"} and before["down"] == set() and before["head"] >= {"drop", "e", "dead"}


class ConvNet(torch.nn.Module):
    def __init__(self, dropout_before):
        super().__init__()
        self.c0, self.bn, self.pd = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.Dropout(
            dropout_before)
        self.L = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.c2 = torch.nn.Conv2d(4, 4, 3, padding=2, dilation=2, stride=2)
        self.c3 = torch.nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.drop, self.fc = torch.nn.Dropout(0.5), torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.L(self.pd(torch.relu(self.bn(self.c0(x)))))
        return self.fc(self.drop(self.c3(torch.relu(self.c2(h))).mean((2, 3))))


@pytest.mark.parametrize("dropout_before", [0.0, 0.3])
def test_prefix_replay_and_fast_paths_keep_the_loss_and_give_fp64_goldens_input(dropout_before):
    """Golden's loss through a recorded prefix (replayed, or run whole where a dropout before L draws),
    _conv and channels-last after L equals a plain forward's; every run of the step draws the same
    dropout masks; the float64 twin's L gets golden's input exactly."""
    import types

    from peat.propagate import Prefix, _downstream, _fast_modules, _float64

    fake = object.__new__(Propagator)
    fake.dataset = types.SimpleNamespace(kind="image")
    for size in (1, 2, 5):
        torch.manual_seed(size)
        model, x, y = ConvNet(dropout_before).train(), torch.randn(6, 3, size, size), torch.randint(0, 3, (6,))
        torch.manual_seed(7)
        with torch.no_grad():
            plain = F.cross_entropy(model(x), y).reshape(1)
        fast = _fast_modules(model)
        twin = _float64(model, fast)
        for channels_last in (False, True):
            prefix = Prefix(model, "L")
            with _downstream(model, "L", {"c0", "bn", "pd"}, channels_last=channels_last, fast=fast, kept={}):
                runs = [fake.observe(model, "L", "c3", x, y, None, prefix=prefix, seed=7) for _ in range(3)]
                ref = fake.observe(twin, "L", "c3", x.double(), y, None, prefix=prefix.on(twin, torch.float64), seed=7)
            assert prefix.valid == (dropout_before == 0)
            assert all(torch.equal(run["loss"], plain) and torch.equal(run["next"], runs[0]["next"]) for run in runs)
            assert torch.equal(ref["A"], runs[0]["A"].double())


class Shared(torch.nn.Module):
    """A layer called twice in a step (weights reused): the Profiler records its first call."""

    def __init__(self):
        super().__init__()
        self.L, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.L(torch.relu(self.L(x))))


def test_the_live_input_of_a_layer_called_twice_is_its_first_calls_as_recorded():
    """recon_error compares L's live input with the recorded one, the first call's: the second
    call's input made an exact rebuild's recon_error the distance between two different inputs."""
    import types

    fake = object.__new__(Propagator)
    fake.dataset = types.SimpleNamespace(kind="image")
    torch.manual_seed(0)
    model, x, y = Shared().train(), torch.randn(5, 4), torch.randint(0, 3, (5,))
    seen = fake.observe(model, "L", "head", x, y, None, seed=0)
    assert torch.equal(seen["A"], x) and _recon_error(seen["A"], x) == 0


class Viewing(torch.nn.Module):
    """A convolution after L whose output is viewed, as training (default memory layout) allows."""

    def __init__(self):
        super().__init__()
        self.L, self.c = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 3, padding=1)
        self.fc = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.fc(self.c(self.L(x)).view(len(x), -1))


def test_a_model_viewing_a_convolutions_output_after_the_layer_is_followed_in_the_default_layout():
    """On the CPU the network after L ran in channels-last memory, where x.view(len(x), -1) fails:
    golden's run raised and the playback job failed for a model that trained. It runs in the
    default layout then, with golden's loss, for that layer from then on."""
    import types

    from peat.propagate import _downstream, _fast_modules

    fake = object.__new__(Propagator)
    fake.dataset, fake.contiguous = types.SimpleNamespace(kind="image"), set()
    torch.manual_seed(0)
    model, x, y = Viewing().train(), torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2,))
    with torch.no_grad():
        plain = F.cross_entropy(model(x), y).reshape(1)
    fast = _fast_modules(model)

    def downstream(channels_last):
        return _downstream(model, "L", set(), channels_last=channels_last, fast=fast, kept={})

    for _ in range(2):
        gold, channels_last, prefix = fake._golden(model, "L", "c", x, y, model.L.forward, 0, downstream)
        assert not channels_last and fake.contiguous == {"L"} and prefix.recorded
        torch.testing.assert_close(gold["loss"], plain, rtol=1e-6, atol=0)
