"""The shortcuts that make playback's scoring and later observing points cheaper compute exactly
what they replace: the same values, bit for bit, and the same modules patched."""

import numpy as np
import pytest
import torch
from torch import nn

from peat import scores, tensor_stats
from peat.propagate import _all_finite, _downstream, _fast, _fast_modules, _float64


def _compiled():
    if not tensor_stats.compiled():
        pytest.skip("no C compiler here")


@pytest.mark.parametrize("n", [16384, 20001])
def test_select_of_keys_below_two_to_the_sixteen_is_numpys_partition(n):
    """select counts keys below 2^16 directly when the rank's key is one of them (ULP distances near
    golden), else runs its radix rounds: np.partition's key either way, across that boundary too."""
    _compiled()
    rng = np.random.default_rng(n)
    straddle = np.where(rng.random(n) < 0.5, 65535, 65536)
    for keys in (rng.geometric(0.3, n).astype(np.uint32), straddle.astype(np.uint32), straddle.astype(np.uint64),
                 np.where(rng.random(n) < 0.01, 2**31, rng.integers(0, 9, n)).astype(np.uint32),
                 rng.integers(0, 2**32, n, dtype=np.uint32), np.zeros(n, dtype=np.uint32)):
        for i in sorted({0, n // 2 - 1, n // 2, n - 1, int(rng.integers(0, n))}):
            assert tensor_stats.select(keys, i) == np.partition(keys, i)[i], (keys.dtype, i)


def test_ascending_is_numpys_sort_and_summary_sums_it_so():
    """tensor_stats.ascending (a radix sort) is np.sort bit for bit on values >= 0: few distinct ones
    (an error's largest 10 %), spread over every binade, subnormal, all equal; it declines -0.0.
    summary's top-10 % mean, summed in that order, is the one np.sort gives."""
    _compiled()
    rng = np.random.default_rng(0)
    n = 70_000
    few = rng.integers(1, 200, n) * 2.0**-30
    for x in (few, np.abs(rng.standard_normal(n)) * 10.0 ** rng.integers(-300, 300, n), np.full(n, 3.0),
              np.full(n, 2.0**-1074), rng.integers(0, 0x7FEFFFFFFFFFFFFF, n, dtype=np.uint64).view(np.float64)):
        assert np.array_equal(tensor_stats.ascending(x).view(np.uint64), np.sort(x).view(np.uint64))
    signed = few.copy()
    signed[7] = -0.0
    assert tensor_stats.ascending(signed) is None and tensor_stats.ascending(few[:100]) is None
    err = few.reshape(700, 100)
    k = int(np.ceil(scores.TOP_FRACTION * err.size))
    assert scores.summary(err)["top10"] == float(np.sort(err.reshape(-1))[-k:].sum() / k)


def test_all_finite_is_isfinite_all_even_where_the_sum_overflows():
    big = torch.full((2, 3, 1, 1), 3e38)
    assert _all_finite(big) and not torch.isfinite(big.sum())  # finite elements, an infinite sum
    for bad in (float("nan"), float("inf"), -float("inf")):
        for base in (torch.zeros(2, 3, 1, 1), big.clone()):
            base[1, 2, 0, 0] = bad
            assert not _all_finite(base)
    assert _all_finite(torch.zeros(2, 0, 1, 1)) and _all_finite(torch.randn(4, 5, 2, 2, dtype=torch.float64))


def test_the_modules_found_fast_once_patch_what_checking_each_time_patches():
    """_fast_modules, found once per rebuilt network, picks the convolutions _fast picks one by one:
    the float64 copy and the downstream network patch the same ones either way."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 3, 3, padding=1),
                          nn.Conv2d(3, 2, 1), nn.Conv2d(2, 2, 3, padding="same"))
    with torch.no_grad():
        model[3].weight[0, 0, 0, 0] = float("inf")
    fast = _fast_modules(model)
    assert fast == {name for name, m in model.named_modules() if _fast(m)} == {"0", "2"}
    patched = (lambda net: {name for name, m in net.named_modules() if "forward" in m.__dict__})
    assert patched(_float64(model, fast)) == {"0", "2"}
    with _downstream(model, "0", set(), channels_last=True, fast=fast):
        assert patched(model) == {"2"}
    assert patched(model) == set()


def test_summary_given_the_largest_error_is_the_summary_without_it():
    """summary and top read the largest error from the caller when it is known (Diff.top): the same
    scores and the same values as finding it, with infinite errors, zeros, ties and no error."""
    rng = np.random.default_rng(3)
    n = 50_000
    base = rng.integers(0, 300, n) * 2.0**-30
    for err in (base, np.zeros(n), np.full(n, 7.0), np.where(rng.random(n) < 0.001, np.inf, base), base[:100]):
        largest = err.max(initial=0.0)
        assert scores.summary(err, largest) == scores.summary(err)
        k = max(1, n // 10)
        if np.isfinite(largest) and tensor_stats.compiled() and err.size >= k:
            assert np.array_equal(tensor_stats.top(err, k, largest), tensor_stats.top(err, k))


@pytest.mark.parametrize("n", [4096, 70_000])
def test_the_largest_ten_percent_found_sorted_are_top_sorted(n):
    """top_ascending (the keys from the k-th largest's leading bits on, sorted) is np.sort of top:
    the same values bit for bit, zeros left out, ties kept, or None (then top and ascending)."""
    _compiled()
    rng = np.random.default_rng(n)
    base = np.abs(rng.standard_normal(n)) * 10.0 ** rng.integers(-30, 5, n)
    found = 0
    for x in (base, np.where(rng.random(n) < 0.5, 0.0, base), np.zeros(n), np.full(n, 5.0),
              rng.integers(0, 50, n) * 2.0**-20, np.full(n, 2.0**-1074)):
        for k in sorted({1, 2, n // 10, n // 2, n - 1, n}):
            for largest in (None, x.max()):
                got = tensor_stats.top_ascending(x, k, largest)
                if got is not None:
                    found += 1
                    assert np.array_equal(got.view(np.uint64), np.sort(tensor_stats.top(x, k)).view(np.uint64)), k
    assert found > 50
    signed = base.copy()
    signed[3] = -0.0
    assert tensor_stats.top_ascending(signed, n // 10) is None


@pytest.mark.parametrize("arch", ["resnet18", "llama"])
def test_one_traced_forward_finds_the_call_order_a_plain_forward_has(arch):
    """call_graph's one forward with autograd (its recorded outputs cut into leaves) starts the modules
    in the order a plain forward without gradients does: started_before needs no forward of its own."""
    from peat import models
    from peat.propagate import call_graph

    if arch == "resnet18":
        model = models.build({"arch": arch}, {"num_classes": 10}, seed=0).train()
        kind, gen = "image", torch.Generator().manual_seed(1)
        x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        order = ["conv1", "layer1.0.conv1", "layer2.0.conv2", "layer2.0.downsample.0", "fc"]
    else:
        model = models.build({"arch": arch, "size": {"hidden": 16, "layers": 2, "heads": 2}},
                             {"vocab_size": 64, "seq_len": 8}, seed=0).train()
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
        kind, x, y = "text", tokens[:, :-1], tokens[:, 1:]
        order = [n for n, m in model.named_modules() if n.endswith(("input_layernorm", "q_proj", "up_proj"))]
    calls = []
    hooks = [m.register_forward_pre_hook(lambda module, inputs, name=name: calls.append(name))
             for name, m in model.named_modules() if name]
    with torch.no_grad():
        models.loss_and_metrics(model, kind, x, y)
    for h in hooks:
        h.remove()
    readers, before = call_graph(model, order, kind, x, y, seed=0)
    assert before == {layer: set(calls[:calls.index(layer)]) for layer in order}
    assert set(readers) == set(order) and any(readers.values())


def test_seeding_a_cpu_forward_draws_what_torch_manual_seed_draws():
    """_seed seeds the CPU generator alone where CUDA has not started: the same dropout masks as
    torch.manual_seed, and the same generator state after them."""
    from peat.propagate import _seed

    x = torch.ones(1000)
    torch.manual_seed(7)
    want = (torch.nn.functional.dropout(x, 0.5, training=True), torch.get_rng_state())
    torch.manual_seed(0)
    _seed(7, x)
    got = (torch.nn.functional.dropout(x, 0.5, training=True), torch.get_rng_state())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_what_downstream_keeps_computes_what_it_remade_each_time():
    """_downstream's kept caches (small-map matrices, cropped taps, channels-last weights) give the
    forwards after L the outputs that remaking them at every layer followed gave, bit for bit, are
    made once, and leave the weights as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1, stride=2),
                          nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 4, 3, padding=1, bias=False))
    fast = _fast_modules(model)
    x = torch.randn(5, 3, 4, 4)  # 4 x 4, then 2 x 2 maps: cropped taps, then one matrix product
    with _downstream(model, "0", set(), channels_last=True, fast=fast), torch.no_grad():
        fresh = model(x)
    kept, laid = {}, []
    for _ in range(2):
        with _downstream(model, "0", set(), channels_last=True, fast=fast, kept=kept), torch.no_grad():
            assert torch.equal(model(x), fresh)
            laid.append([m.weight.data.data_ptr() for m in model[1:]])
    assert laid[0] == laid[1] and all(any(isinstance(k, tuple) for k in kept[m][0]) for m in model[1:])
    assert all(m.weight.is_contiguous() and "forward" not in m.__dict__ for m in model)
