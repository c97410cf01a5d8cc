"""peat alter / peat h5diff on hand-made HDF5 files of several layouts, and the alteration study."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peat import alter as A
from peat import alter_study as S
from peat.cli import main
from peat.io import PeatError


def _bf16(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def make_mixed(path: Path) -> Path:
    """Every supported dtype and storage: peat attrs, Keras and Chainer names, chunked, big-endian, scalar."""
    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:
        w = f.create_dataset("model/conv1.weight", data=rng.standard_normal((8, 3, 3, 3), np.float32))
        w.attrs.update(module_type="Conv2d", kind="parameter")
        bn = f.create_dataset("model/bn1.weight", data=np.full(16, 1.5, np.float32))
        bn.attrs.update(module_type="BatchNorm2d", kind="parameter")
        rv = f.create_dataset("model/bn1.running_var", data=np.ones(16, np.float32))
        rv.attrs.update(module_type="BatchNorm2d", kind="buffer")
        f.create_dataset("optimizer/state/conv1.weight/momentum_buffer", data=rng.standard_normal(216).astype(np.float32))
        f.create_dataset("model_weights/dense/dense/kernel:0", data=rng.standard_normal((20, 10)).astype(np.float16))
        f.create_dataset("model_weights/dense/dense/bias:0", data=rng.standard_normal(10))  # float64
        f.create_dataset("predictor/bn2/avg_var", data=rng.random(12).astype(np.float64))
        f.create_dataset("predictor/embed/W", data=rng.standard_normal((30, 4)).astype(">f4"))  # big-endian
        bf = f.create_dataset("model/fc.weight", data=_bf16(rng.standard_normal((12, 12))))
        bf.attrs["dtype"] = "bfloat16"
        f.create_dataset("model/head.weight_bf16", data=_bf16(rng.standard_normal(40)))
        f.create_dataset("chunked/data", data=rng.standard_normal((64, 64)).astype(np.float32), chunks=(16, 16),
                         compression="gzip")
        f.create_dataset("counters/int8", data=rng.integers(-100, 100, 50).astype(np.int8))
        f.create_dataset("counters/uint16", data=rng.integers(0, 60000, 50).astype(np.uint16))
        f.create_dataset("scalar", data=np.float32(3.25))
        f.create_dataset("history", data=json.dumps([{"epoch": 1}]))  # a string: never altered
    return path


@pytest.fixture
def mixed(tmp_path) -> Path:
    return make_mixed(tmp_path / "in.h5")


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_alter(src, dst, log=None, **plan):
    return A.alter(src, dst, A.Plan(**plan), log=log, keep_records=True)


def canon(rows) -> list:
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


# --- layouts, dtypes, classes -------------------------------------------------------------------


def test_scan_reads_every_numeric_dataset_with_its_layout_and_class(mixed):
    found = {e.path: (e.layout.name, e.cls, e.offset is not None) for e in A.scan(mixed)}
    assert "/history" not in found
    assert found["/model/conv1.weight"] == ("float32", "weight", True)
    assert found["/model/bn1.weight"] == ("float32", "norm_weight", True)
    assert found["/model/bn1.running_var"][1] == "norm_stats"
    assert found["/optimizer/state/conv1.weight/momentum_buffer"][1] == "optimizer"
    assert found["/model_weights/dense/dense/kernel:0"][:2] == ("float16", "weight")
    assert found["/model_weights/dense/dense/bias:0"][:2] == ("float64", "bias")
    assert found["/predictor/bn2/avg_var"][1] == "norm_stats"
    assert found["/predictor/embed/W"][:2] == ("float32", "embedding")
    assert found["/model/fc.weight"][0] == "bfloat16"
    assert found["/model/head.weight_bf16"][0] == "bfloat16"
    assert found["/chunked/data"] == ("float32", "other", False)  # compressed: edited through h5py
    assert found["/counters/int8"][0] == "int8" and found["/counters/uint16"][0] == "uint16"
    assert found["/scalar"][0] == "float32"


@pytest.mark.parametrize("path,attrs,cls", [
    ("model/layer1.0.conv1.weight", {"module_type": "Conv2d", "kind": "parameter"}, "weight"),
    ("model/fc.bias", {"module_type": "Linear", "kind": "parameter"}, "bias"),
    ("model/ln_f.bias", {"module_type": "LayerNorm", "kind": "parameter"}, "norm_weight"),
    ("model/model.norm.weight", {"module_type": "LlamaRMSNorm", "kind": "parameter"}, "norm_weight"),
    ("model/bn1.num_batches_tracked", {"module_type": "BatchNorm2d", "kind": "buffer"}, "norm_stats"),
    ("model/transformer.wte.weight", {"module_type": "Embedding", "kind": "parameter"}, "embedding"),
    ("model/rope.inv_freq", {"module_type": b"Embedding", "kind": b"buffer"}, "other"),  # fixed-length strings
    ("model/rotary_emb.inv_freq", {"module_type": "LlamaRotaryEmbedding", "kind": "buffer"}, "other"),
    ("optimizer/state/fc.weight/exp_avg", {}, "optimizer"),
    ("model_weights/batch_normalization/batch_normalization/moving_mean:0", {}, "norm_stats"),
    ("model_weights/batch_normalization/batch_normalization/gamma:0", {}, "norm_weight"),
    ("model_weights/conv2d/conv2d/kernel:0", {}, "weight"),
    ("model_weights/embedding/embedding/embeddings:0", {}, "embedding"),
    ("optimizer_weights/Adam/conv2d/kernel/m:0", {}, "optimizer"),
    ("updater/model:main/predictor/conv1/W", {}, "weight"),
    ("updater/model:main/predictor/conv1/b", {}, "bias"),
    ("updater/model:main/predictor/bn1/gamma", {}, "norm_weight"),
    ("updater/model:main/predictor/bn1/avg_var", {}, "norm_stats"),
    ("updater/model:main/predictor/bn1/N", {}, "norm_stats"),
    ("updater/optimizer:main/predictor/conv1/W/msg", {}, "optimizer"),
    ("step", {}, "other"),
    ("layers/dense_1/vars/0", {}, "weight"),  # Keras 3 .weights.h5: variables by position
    ("layers/conv2d/vars/1", {}, "bias"),
    ("layers/batch_normalization/vars/1", {}, "norm_weight"),
    ("layers/batch_normalization/vars/3", {}, "norm_stats"),
    ("layers/functional/layers/layer_normalization/vars/0", {}, "norm_weight"),
    ("layers/embedding/vars/0", {}, "embedding"),
    ("layers/lstm/cell/vars/1", {}, "other"),  # recurrent kernel: not a kernel/bias pair
    ("optimizer/vars/3", {}, "optimizer"),
])
def test_location_class(path, attrs, cls):
    assert A.location_class(path, attrs) == cls


# --- alteration agrees exactly with h5diff and replays exactly ----------------------------------


def test_log_h5diff_and_replay_agree_exactly(mixed, tmp_path):
    before = sha(mixed)
    res = run_alter(mixed, tmp_path / "out.h5", log=tmp_path / "log.json", count=120, seed=7)
    assert sha(mixed) == before, "the input must never change"
    log = json.loads((tmp_path / "log.json").read_text())
    assert res.flips == len(log["injections"]) == 120
    d = A.diff(mixed, tmp_path / "out.h5", positions=True)
    assert canon(d["positions"]) == canon(log["injections"])
    per_ds = {r["dataset"]: r["differing"] for r in d["datasets"]}
    for name, n in pd.Series([r["dataset"] for r in log["injections"]]).value_counts().items():
        assert per_ds[name] == n
    # Replaying the log on another copy of the input gives a byte-identical file.
    A.alter(mixed, tmp_path / "replayed.h5", A.Plan(), replay=tmp_path / "log.json")
    assert sha(tmp_path / "replayed.h5") == sha(tmp_path / "out.h5")


def test_the_log_is_written_a_chunk_of_rows_at_a_time_as_one_json_dump_would(mixed, tmp_path, monkeypatch):
    # All rows were built, copied and encoded at once: about 2 GB of memory per million flips.
    from peat.io import json_text

    sizes, whole = [], A.records
    monkeypatch.setattr(A, "records", lambda done: sizes.append(sum(len(d["positions"]) for d in done)) or whole(done))
    monkeypatch.setattr(A, "LOG_CHUNK", 4)
    log, out = tmp_path / "log.json", tmp_path / "o.h5"
    for plan in ({"count": 30, "burst": 2, "seed": 3}, {"count": 1, "select": ["scalar"]}):  # bursts over datasets; a scalar
        sizes.clear()
        A.alter(mixed, out, A.Plan(**plan), log=log)
        assert 0 < max(sizes) <= 4
        text = log.read_text()
        assert text == json_text(json.loads(text))  # as write_json writes the whole log
        assert canon(json.loads(text)["injections"]) == canon(A.diff(mixed, out, positions=True)["positions"])
    A.write_log(log, {"tool": "peat alter"}, [])
    assert log.read_text() == json_text({"tool": "peat alter", "injections": []})


def test_same_seed_same_file_other_seed_other_positions(mixed, tmp_path):
    a = run_alter(mixed, tmp_path / "a.h5", count=30, seed=3).records
    b = run_alter(mixed, tmp_path / "b.h5", count=30, seed=3).records
    c = run_alter(mixed, tmp_path / "c.h5", count=30, seed=4).records
    assert sha(tmp_path / "a.h5") == sha(tmp_path / "b.h5") and a == b
    assert canon(a) != canon(c)


def test_values_are_distinct_and_each_gets_exactly_one_bit(mixed, tmp_path):
    rows = run_alter(mixed, tmp_path / "o.h5", count=400, seed=1).records
    keys = {(r["dataset"], tuple(r["index"])) for r in rows}
    assert len(keys) == 400
    assert all(isinstance(r["bit"], int) for r in rows)


@pytest.mark.parametrize("region,spans", [
    ("sign", {"float16": (0, 0), "bfloat16": (0, 0), "float32": (0, 0), "float64": (0, 0), "int8": (0, 0)}),
    ("exponent", {"float16": (1, 5), "bfloat16": (1, 8), "float32": (1, 8), "float64": (1, 11)}),
    ("mantissa", {"float16": (6, 15), "bfloat16": (9, 15), "float32": (9, 31), "float64": (12, 63),
                  "int8": (1, 7), "uint16": (0, 15)}),
    ("exponent_msb", {"float16": (1, 1), "bfloat16": (1, 1), "float32": (1, 1), "float64": (1, 1)}),
    ("exponent_other", {"float16": (2, 5), "bfloat16": (2, 8), "float32": (2, 8), "float64": (2, 11)}),
])
def test_region_bits_follow_the_documented_numbering(mixed, tmp_path, region, spans):
    rows = run_alter(mixed, tmp_path / "o.h5", count=300, region=region, seed=2).records
    dtypes = {e.path: e.layout.name for e in A.scan(mixed)}
    seen = set()
    for r in rows:
        name = dtypes[r["dataset"]]
        assert name in spans, f"{region} must not touch {name}"
        lo, hi = spans[name]
        assert lo <= r["bit"] <= hi
        seen.add(name)
    assert len(seen) >= 2


def test_sign_flip_negates_exactly(mixed, tmp_path):
    rows = run_alter(mixed, tmp_path / "o.h5", count=50, region="sign", classes=["weight"], seed=0).records
    assert all(r["new"] == -r["old"] for r in rows)


def test_float32_bit_numbering_matches_ieee(tmp_path):
    src = tmp_path / "one.h5"
    with h5py.File(src, "w") as f:
        f["x"] = np.array([1.0], np.float32)
    expect = {0: -1.0, 1: float("inf"), 2: 2.0 ** -64, 8: 0.5, 9: 1.5, 31: 1.0 + 2.0 ** -23}
    for bit, value in expect.items():
        rows = run_alter(src, tmp_path / "o.h5", count=1, bits=(bit, bit)).records
        got = rows[0]["new"]
        assert (got == "inf") if value == float("inf") else got == value, bit


def test_bfloat16_and_integers_flip_within_their_width(mixed, tmp_path):
    rows = run_alter(mixed, tmp_path / "o.h5", count=60, select=["model/fc.weight", "counters/*"], seed=5).records
    with h5py.File(tmp_path / "o.h5") as f, h5py.File(mixed) as g:
        for r in rows:
            ds = r["dataset"]
            assert r["bit"] < (16 if ds != "/counters/int8" else 8)
            stored = f[ds][tuple(r["index"])]
            if ds == "/model/fc.weight":
                assert f[ds].dtype == np.uint16
                assert np.uint32(stored) << 16 == np.array([r["new"]], np.float32).view(np.uint32)[0]
            else:
                assert stored == r["new"] and g[ds][tuple(r["index"])] == r["old"]
                width = f[ds].dtype.itemsize * 8
                raw = np.array([stored, g[ds][tuple(r["index"])]], f[ds].dtype).view(f"u{width // 8}")
                assert int(raw[0] ^ raw[1]) == 1 << (width - 1 - r["bit"])


def test_big_endian_bfloat16_is_bfloat16(tmp_path):
    src = tmp_path / "be.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("w", data=_bf16(np.ones(4)).astype(">u2")).attrs["dtype"] = "bfloat16"
    rows = run_alter(src, tmp_path / "o.h5", count=4, region="sign").records
    assert [r["new"] for r in rows] == [-1.0] * 4


def test_burst_and_mask(mixed, tmp_path):
    rows = run_alter(mixed, tmp_path / "o.h5", count=40, burst=3, select=["model/conv1.weight"], seed=1).records
    for r in rows:
        assert r["bit"] == list(range(r["bit"][0], r["bit"][0] + 3)) and r["bit"][-1] <= 31
    rows = run_alter(mixed, tmp_path / "o.h5", count=40, mask="1001", bits=(9, 20), select=["model/conv1.weight"],
                     seed=1).records
    for r in rows:
        o = r["bit"][0]
        assert r["bit"] == [o, o + 3] and 9 <= o and o + 3 <= 20
    d = A.diff(mixed, tmp_path / "o.h5", positions=True)
    assert canon(d["positions"]) == canon(rows)


def test_no_sign_change_never_touches_bit_zero(mixed, tmp_path):
    rows = run_alter(mixed, tmp_path / "o.h5", fraction=0.5, sign_change=False, seed=0).records
    assert len(rows) > 1000 and all(r["bit"] != 0 for r in rows if r["dataset"] != "/counters/uint16")
    assert all((r["old"] >= 0) == (r["new"] >= 0) for r in rows if isinstance(r["new"], (int, float)))


def test_no_nonfinite_only_picks_safe_values_and_bits(mixed, tmp_path):
    # bn1.weight is all 1.5 (exponent 127): flipping its exponent MSB would give Inf/NaN.
    with pytest.raises(PeatError) as err:
        run_alter(mixed, tmp_path / "o.h5", count=1, bits=(1, 1), nonfinite=False, select=["model/bn1.weight"])
    assert str(err.value) == f"{mixed}: 1 values to corrupt but only 0 eligible values in 1 selected dataset(s)"
    rows = run_alter(mixed, tmp_path / "o.h5", count=16, region="exponent", nonfinite=False,
                     select=["model/bn1.weight"], seed=0).records
    assert len(rows) == 16 and all(isinstance(r["new"], float) and r["bit"] != 1 for r in rows)
    rows = run_alter(mixed, tmp_path / "o.h5", fraction=1.0, region="exponent", nonfinite=False, seed=0).records
    assert all(not isinstance(r["new"], str) for r in rows)
    d = A.diff(mixed, tmp_path / "o.h5")
    assert sum(r.get("nonfinite_new", 0) for r in d["datasets"]) == 0
    # Without the option the same flip on the same values does produce Inf.
    rows = run_alter(mixed, tmp_path / "o.h5", count=16, bits=(1, 1), select=["model/bn1.weight"]).records
    assert all(r["new"] == "nan" for r in rows)  # 1.5 has a nonzero mantissa


def test_scale_multiplies_exactly(mixed, tmp_path):
    rows = run_alter(mixed, tmp_path / "o.h5", count=25, scale=-8.0, select=["model/conv1.weight"], seed=2).records
    assert all(r["new"] == -8.0 * r["old"] and r["bit"] is None for r in rows)
    log = tmp_path / "scale.json"
    run_alter(mixed, tmp_path / "o.h5", log=log, count=25, scale=3.0, seed=2)
    A.alter(mixed, tmp_path / "r.h5", A.Plan(), replay=log)
    assert sha(tmp_path / "r.h5") == sha(tmp_path / "o.h5")
    # A huge factor overflows float16/float32 values; --no-nonfinite leaves exactly those out.
    floats = sum(e.size for e in A.scan(mixed) if e.layout.is_float)
    wild = run_alter(mixed, tmp_path / "o.h5", fraction=1.0, scale=1e38).records
    tame = run_alter(mixed, tmp_path / "o.h5", fraction=1.0, scale=1e38, nonfinite=False).records
    overflowed = sum(isinstance(r["new"], str) for r in wild)
    assert len(wild) == floats and overflowed > 0 and len(tame) == floats - overflowed
    assert not any(isinstance(r["new"], str) for r in tame)



def test_scale_alters_only_values_the_factor_changes_as_h5diff_sees_them(tmp_path):
    # 0 x 4, NaN x 4 and a bfloat16 1.0 x 1.001 (rounded back to 1.0) are the values they were: each was
    # counted and logged as altered, which h5diff --positions did not list.
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f["w"] = np.array([0.0, 1.0, 0.0, 2.0, np.nan, -0.0, 3.0], np.float32)
        f["b_bf16"] = _bf16([1.0, 0.0, 1.5])
    result = run_alter(src, tmp_path / "o.h5", fraction=1.0, scale=4.0)
    assert result.flips == 5 and [(r["dataset"], r["index"], r["new"]) for r in result.records] == [
        ("/b_bf16", [0], 4.0), ("/b_bf16", [2], 6.0), ("/w", [1], 4.0), ("/w", [3], 8.0), ("/w", [6], 12.0)]
    seen = A.diff(src, tmp_path / "o.h5", positions=True)["positions"]  # bits there, a factor in the log
    assert canon({**r, "bit": None} for r in seen) == canon(result.records)
    rounded = run_alter(src, tmp_path / "o.h5", select=["b_bf16"], fraction=1.0, scale=1.001).records
    assert rounded == []  # 1.0 and 1.5 round back, 0 stays: nothing to alter, nothing counted
    with pytest.raises(PeatError, match=r": 1 values to corrupt but only 0 eligible values"):
        run_alter(src, tmp_path / "o.h5", select=["b_bf16"], count=1, scale=1.001)

def test_scale_factor_is_not_rounded_to_the_dtype_first(tmp_path):
    # 70000 overflows float16 but 0.001 x 70000 does not; 1e40 overflows float32 but 1e-30 x 1e40 does not.
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f["h"] = np.full(4, 0.001, np.float16)
        f["s"] = np.full(4, 1e-30, np.float32)
    for name, dtype, factor in (("h", np.float16, 70000.0), ("s", np.float32, 1e40)):
        rows = run_alter(src, tmp_path / "o.h5", select=[name], count=4, scale=factor, nonfinite=False).records
        assert [r["new"] for r in rows] == [float(dtype(r["old"] * factor)) for r in rows]


@pytest.mark.parametrize("old,factor,new", [
    (1.0, 1 + 2**-8 + 2**-30, 1 + 2**-7),  # just past the halfway point 1 + 2^-8: rounds up
    (1 + 2**-7, (1 + 3 * 2**-8 - 2**-30) / (1 + 2**-7), None),  # just short of 1 + 3 * 2^-8: stays, no alteration
    (-1.0, 1 + 2**-8 + 2**-30, -(1 + 2**-7)),
    (3e38, 1.5, "inf"),
])
def test_bfloat16_scale_rounds_once_to_nearest(tmp_path, old, factor, new):
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f["w_bf16"] = _bf16([old])
    if new is None:
        with pytest.raises(PeatError, match=r"1 values to corrupt but only 0 eligible values"):
            run_alter(src, tmp_path / "o.h5", count=1, scale=factor)
        return
    rows = run_alter(src, tmp_path / "o.h5", count=1, scale=factor).records
    assert rows[0]["new"] == new


def test_amounts(mixed, tmp_path):
    n = next(e.size for e in A.scan(mixed) if e.path == "/model/conv1.weight")
    rows = run_alter(mixed, tmp_path / "o.h5", fraction=0.25, select=["model/conv1.weight"]).records
    assert len(rows) == round(0.25 * n)
    p1 = run_alter(mixed, tmp_path / "o.h5", probability=0.1, select=["model/conv1.weight"], seed=9).records
    p2 = run_alter(mixed, tmp_path / "o.h5", probability=0.1, select=["model/conv1.weight"], seed=9).records
    assert p1 == p2 and 0 < len(p1) < n // 2
    assert run_alter(mixed, tmp_path / "o.h5", probability=0.0).flips == 0


def test_selection_by_regex_glob_and_class(mixed, tmp_path):
    rows = run_alter(mixed, tmp_path / "o.h5", count=50, select=["re:^model_weights/.*kernel"], seed=0).records
    assert {r["dataset"] for r in rows} == {"/model_weights/dense/dense/kernel:0"}
    rows = run_alter(mixed, tmp_path / "o.h5", count=28, classes=["norm_stats"], seed=0).records
    assert {r["dataset"] for r in rows} <= {"/model/bn1.running_var", "/predictor/bn2/avg_var"}
    rows = run_alter(mixed, tmp_path / "o.h5", count=1, select=["/scalar"], region="sign").records
    assert rows == [{"dataset": "/scalar", "index": [], "bit": 0, "old": 3.25, "new": -3.25}]


def test_in_place_alters_only_when_asked(mixed, tmp_path):
    copy = tmp_path / "copy.h5"
    copy.write_bytes(mixed.read_bytes())
    A.alter(copy, None, A.Plan(count=5), in_place=True)
    assert sha(copy) != sha(mixed)
    assert A.diff(mixed, copy)["datasets"] and sum(r.get("differing", 0) for r in A.diff(mixed, copy)["datasets"]) == 5
    os.chmod(copy, 0o620)  # a mode no umask gives a new file: the altered file keeps the input's
    A.alter(copy, None, A.Plan(count=5), in_place=True)
    assert stat.S_IMODE(copy.stat().st_mode) == 0o620


def test_in_place_through_a_symlink_alters_its_target(mixed, tmp_path):
    target, link = tmp_path / "epoch003.h5", tmp_path / "latest.h5"
    target.write_bytes(mixed.read_bytes())
    link.symlink_to(target.name)
    A.alter(link, None, A.Plan(count=5), in_place=True)
    assert link.is_symlink() and sha(target) != sha(mixed)


# --- bad input ------------------------------------------------------------------------------------


def test_bad_inputs_fail_with_one_line_naming_the_problem(mixed, tmp_path, capsys):
    with pytest.raises(PeatError) as err:
        run_alter(mixed, tmp_path / "o.h5", select=["model/conv1.wieght"])
    assert str(err.value) == (f"{mixed}: no numeric dataset matches 'model/conv1.wieght'; closest: model/conv1.weight, "
                              "model/bn1.weight, model/fc.weight, model/head.weight_bf16, model/bn1.running_var")
    with pytest.raises(PeatError) as err:
        run_alter(mixed, tmp_path / "o.h5", count=217, select=["model/conv1.weight"])
    assert str(err.value) == f"{mixed}: 217 values to corrupt but only 216 eligible values in 1 selected dataset(s)"
    with pytest.raises(PeatError) as err:
        run_alter(mixed, tmp_path / "o.h5", classes=["embedding"], select=["model/*"])
    assert str(err.value) == (f"{mixed}: no dataset of class 'embedding' among the selected ones; "
                              "present: norm_stats, norm_weight, weight")  # head.weight_bf16: a weight
    with pytest.raises(PeatError) as err:
        run_alter(mixed, mixed)
    assert str(err.value) == f"{mixed}: output is the input file; use --in-place to alter it"
    text = tmp_path / "notes.h5"
    text.write_text("not hdf5")
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(mixed.read_bytes()[:2000])
    for bad in (text, truncated, tmp_path / "missing.h5"):
        assert main(["alter", str(bad), str(tmp_path / "o.h5")]) == 2
        err = capsys.readouterr().err.strip()
        assert str(bad) in err and "\n" not in err
    assert not (tmp_path / "o.h5").exists()


def test_a_damaged_object_header_fails_the_scan_with_one_line(tmp_path):
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f["g/d"] = np.arange(10, dtype=np.float32)
        header = h5py.h5o.get_info(f["g/d"].id).addr
    data = bytearray(src.read_bytes())
    data[header:header + 16] = b"\xff" * 16
    src.write_bytes(data)
    with pytest.raises(PeatError, match=rf"^{src}: damaged HDF5 file \(Object visitation failed\)$"):
        A.scan(src)



def test_a_damaged_dataspace_fails_alter_and_h5diff_with_one_line(tmp_path, capsys):
    # h5py raises a KeyError for an object header HDF5 cannot decode: it was a traceback.
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(12345, np.float32)
    data = bytearray(src.read_bytes())
    dims = data.find((12345).to_bytes(8, "little"))  # the dataspace's first dimension
    data[dims:dims + 8] = (10**12).to_bytes(8, "little")
    src.write_bytes(data)
    for argv in (["alter", str(src), str(tmp_path / "o.h5")], ["h5diff", str(src), str(src)]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"peat {argv[0]}: error: {src}: damaged HDF5 file (Unable to synchronously open object)\n"
    assert not (tmp_path / "o.h5").exists()


def test_a_name_that_is_not_utf8_fails_with_one_line_naming_it(tmp_path, capsys):
    src = tmp_path / "latin1.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset(b"gewicht_\xe4", data=np.ones(3, np.float32))  # as a tool writing Latin-1 names does
    for argv in (["alter", str(src), str(tmp_path / "o.h5")], ["h5diff", str(src), str(src)]):
        assert main(argv) == 2
        assert capsys.readouterr().err == (f"peat {argv[0]}: error: {src}: the name b'gewicht_\\xe4' is not UTF-8 text, "
                                           "as peat reads HDF5 names\n")



def test_attributes_in_another_encoding_are_read_and_a_damaged_one_is_named(tmp_path, capsys):
    # A Latin-1 module_type was a UnicodeDecodeError traceback; a string type of an unknown encoding, a TypeError.
    src = tmp_path / "latin1.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("model/bn.weight", data=np.ones(3, np.float32)).attrs["module_type"] = np.bytes_(b"BatchNorm\xe9")
    assert [(e.path, e.cls) for e in A.scan(src)] == [("/model/bn.weight", "norm_weight")]
    data = bytearray(src.read_bytes())
    at = data.find(b"module_type\x00") + 16  # the attribute's datatype message: a fixed-length string
    assert data[at] == 0x13
    data[at + 1] = 0xA0 | data[at + 1] & 0x0F  # character set 10, which HDF5 does not define
    src.write_bytes(data)
    assert main(["alter", str(src), str(tmp_path / "o.h5")]) == 2
    assert capsys.readouterr().err == (f"peat alter: error: {src}: damaged HDF5 file (Unable to read attribute "
                                       "'module_type')\n")

def test_a_float_type_wider_than_numpy_holds_is_left_alone_and_not_compared(tmp_path):
    # A 20-bit exponent: h5py raises a ValueError reading its dtype (it was a traceback of alter and h5diff).
    src = tmp_path / "wide.h5"
    wide = h5py.h5t.IEEE_F64LE.copy()
    wide.set_fields(63, 43, 20, 0, 43)
    wide.set_ebias(2**19 - 1)
    with h5py.File(src, "w") as f:
        h5py.h5d.create(f.id, b"wide", wide, h5py.h5s.create_simple((4,)))
        f["next"] = np.arange(1, 5, dtype=np.float32)
    rows = run_alter(src, tmp_path / "o.h5", fraction=1.0, region="sign").records
    assert {r["dataset"] for r in rows} == {"/next"}
    assert A.diff(src, tmp_path / "o.h5")["not_compared"] == {"/wide": "Insufficient precision in available types to represent"}
    with pytest.raises(PeatError, match=r"'wide' names wide, which peat never alters \(a stored type peat cannot edit "
                                        r"bit for bit\)$"):
        run_alter(src, tmp_path / "o.h5", select=["wide"])

def test_a_damaged_chunk_is_reported_in_the_input_not_its_temporary_copy(tmp_path, capsys):
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        ds = f.create_dataset("c", data=np.arange(4096, dtype=np.float32), chunks=(1024,), compression="gzip")
        offset = ds.id.get_chunk_info(2).byte_offset
    data = bytearray(src.read_bytes())
    data[offset:offset + 40] = b"\xff" * 40
    src.write_bytes(data)
    assert main(["alter", str(src), str(tmp_path / "o.h5"), "--count", "4000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"peat alter: error: {src}: cannot read /c") and ".tmp" not in err


def test_read_only_input_is_never_touched(mixed, tmp_path):
    before = sha(mixed)
    os.chmod(mixed, stat.S_IRUSR)
    try:
        run_alter(mixed, tmp_path / "o.h5", count=10)
        with pytest.raises(PeatError) as err:
            A.alter(mixed, None, A.Plan(count=1), in_place=True)
        assert str(err.value) == f"{mixed}: read-only; refusing to alter it in place"
    finally:
        os.chmod(mixed, stat.S_IRUSR | stat.S_IWUSR)
    assert sha(mixed) == before



def _compact(path: Path, libver: str = "earliest") -> Path:
    """A float32 dataset stored in its object header (compact layout), with HDF5's own defaults: the
    header records modification times, which h5py's create_dataset turns off and the C library does not."""
    with h5py.File(path, "w", libver=libver) as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        h5py.h5d.create(f.id, b"w", h5py.h5t.IEEE_F32LE, h5py.h5s.create_simple((20, 20)), dcpl)
        f["w"][...] = np.random.default_rng(0).standard_normal((20, 20))
    return path


def _stamps(path, name: str) -> tuple:
    with h5py.File(path, "r") as f:
        info = h5py.h5o.get_info(f[name].id)
        return info.atime, info.mtime, info.ctime, info.btime


def test_a_compact_dataset_keeps_its_header_so_reruns_and_replays_are_byte_identical(tmp_path):
    # Rewritten through HDF5, a compact dataset's header took the time of the run: the same seed, or the
    # replay of the log a second later, gave another file.
    src, log = _compact(tmp_path / "in.h5"), tmp_path / "log.json"
    stamps = _stamps(src, "w")
    time.sleep(1.05 - time.time() % 1)  # the run in a later second than the file's creation
    A.alter(src, tmp_path / "out.h5", A.Plan(count=5, seed=1), log=log)
    assert _stamps(tmp_path / "out.h5", "w") == stamps
    A.alter(src, tmp_path / "replayed.h5", A.Plan(), replay=log)
    assert sha(tmp_path / "replayed.h5") == sha(tmp_path / "out.h5")
    assert canon(A.diff(src, tmp_path / "out.h5", positions=True)["positions"]) == canon(json.loads(log.read_text())["injections"])
    flipped = np.frombuffer(src.read_bytes(), np.uint8) != np.frombuffer((tmp_path / "out.h5").read_bytes(), np.uint8)
    assert 1 <= flipped.sum() <= 5  # the five values' bytes, nothing else


def test_a_compact_dataset_under_a_checksummed_header_is_still_altered_exactly(tmp_path):
    src = _compact(tmp_path / "in.h5", libver="latest")  # version-2 headers: HDF5 itself rewrites them
    res = run_alter(src, tmp_path / "out.h5", count=5, seed=1)
    assert canon(A.diff(src, tmp_path / "out.h5", positions=True)["positions"]) == canon(res.records)


def test_a_flip_in_a_sparse_chunked_dataset_writes_back_only_its_chunk(tmp_path):
    # The whole dataset was written back: every chunk never written (a preallocated, resizable log)
    # was allocated and filled, 400 KB of file becoming 80 MB for one flip.
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        d = f.create_dataset("buf", (4_000_000,), "f4", chunks=(100_000,), maxshape=(None,))
        d[:1000] = np.arange(1000)
    with h5py.File(src, "r") as f:
        allocated = f["buf"].id.get_num_chunks()
    res = run_alter(src, tmp_path / "out.h5", count=3, seed=1)
    with h5py.File(tmp_path / "out.h5", "r") as f:
        touched = {i[0] // 100_000 for i in (r["index"] for r in res.records)} | {0}
        assert f["buf"].id.get_num_chunks() == len(touched) > allocated
    assert canon(A.diff(src, tmp_path / "out.h5", positions=True)["positions"]) == canon(res.records)
    assert (tmp_path / "out.h5").stat().st_size < src.stat().st_size + 4 * 400_000


def test_data_stored_outside_the_file_is_never_altered(tmp_path):
    # External raw storage and virtual datasets live in other files, shared by the input and its copy.
    np.arange(100, dtype=np.float32).tofile(tmp_path / "ext.bin")
    with h5py.File(tmp_path / "vsrc.h5", "w") as f:
        f["d"] = np.arange(50, dtype=np.float32)
    layout = h5py.VirtualLayout(shape=(50,), dtype="f4")
    layout[:] = h5py.VirtualSource(tmp_path / "vsrc.h5", "d", shape=(50,))
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("ext", shape=(100,), dtype="f4", external=[(str(tmp_path / "ext.bin"), 0, 400)])
        f.create_virtual_dataset("virtual", layout)
        f["own"] = np.ones(10, np.float32)
    before = [sha(p) for p in (src, tmp_path / "ext.bin", tmp_path / "vsrc.h5")]
    rows = run_alter(src, tmp_path / "o.h5", fraction=1.0).records
    assert {r["dataset"] for r in rows} == {"/own"}
    assert [sha(p) for p in (src, tmp_path / "ext.bin", tmp_path / "vsrc.h5")] == before
    with pytest.raises(PeatError, match=r"'virtual' names virtual, which peat never alters \(its data is stored "
                                        r"outside the file\)$"):
        run_alter(src, tmp_path / "o.h5", select=["virtual"])


def test_floats_behind_a_lossy_filter_are_never_altered(tmp_path):
    # The scale-offset filter keeps 2 decimals of a float: most flips would not survive the write.
    src = tmp_path / "so.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("lossy", data=np.arange(100, dtype=np.float32) / 4, scaleoffset=2, chunks=(50,))
        f.create_dataset("ints", data=np.arange(100, dtype=np.int32), scaleoffset=0, chunks=(50,))  # lossless
    rows = run_alter(src, tmp_path / "o.h5", fraction=1.0, region="mantissa").records
    assert {r["dataset"] for r in rows} == {"/ints"}
    assert sum(r.get("differing", 0) for r in A.diff(src, tmp_path / "o.h5")["datasets"]) == len(rows) == 100
    with pytest.raises(PeatError, match=r"'lossy' names lossy, which peat never alters \(floats behind HDF5's lossy "
                                        r"scale-offset filter\)$"):
        run_alter(src, tmp_path / "o.h5", select=["lossy"])


def test_stored_types_numpy_cannot_hold_exactly_are_left_alone(tmp_path):
    # h5py reads a 3-byte float as float32 and a 12-bit integer as uint16; it cannot read a 3-byte integer.
    src = tmp_path / "odd.h5"
    with h5py.File(src, "w") as f:
        f24 = h5py.h5t.IEEE_F32LE.copy()
        f24.set_fields(23, 16, 7, 0, 16)
        f24.set_size(3)
        f24.set_ebias(63)
        u12 = h5py.h5t.STD_U16LE.copy()
        u12.set_precision(12)
        i24 = h5py.h5t.STD_I32LE.copy()
        i24.set_size(3)
        for name, tid in ((b"f24", f24), (b"u12", u12), (b"i24", i24)):
            h5py.h5d.create(f.id, name, tid, h5py.h5s.create_simple((10,)))
        f["f24"][...] = np.arange(10, dtype=np.float32)
        f["u12"][...] = np.arange(10, dtype=np.uint16)
        f["next"] = np.arange(10, dtype=np.float32)
    assert [e.path for e in A.scan(src)] == ["/next"]
    rows = run_alter(src, tmp_path / "o.h5", fraction=1.0, region="sign").records
    assert {r["dataset"] for r in rows} == {"/next"}
    with h5py.File(tmp_path / "o.h5") as f:
        assert (f["f24"][()] == np.arange(10)).all() and (f["next"][()] == -np.arange(10)).all()
    # h5diff compares what h5py can read and names what it cannot.
    d = A.diff(src, tmp_path / "o.h5")
    assert {r["dataset"]: r["differing"] for r in d["datasets"]} == {"/f24": 0, "/next": 10, "/u12": 0}
    assert list(d["not_compared"]) == ["/i24"]
    assert A.format_table(d).endswith("; not compared: /i24 (data type '<i3' not understood)")


@pytest.mark.parametrize("other", [np.zeros((10, 10), np.float16), np.zeros(100, np.float32)])
def test_replay_on_a_file_of_another_dtype_or_rank_fails_with_one_line(tmp_path, other):
    src, again = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(src, "w") as f:
        f["w"] = np.arange(100, dtype=np.float32).reshape(10, 10)
    with h5py.File(again, "w") as f:
        f["w"] = other
    log = tmp_path / "log.json"
    run_alter(src, tmp_path / "o.h5", log=log, count=20, bits=(20, 31))
    with pytest.raises(PeatError, match=r"log .* cannot be applied to /w"):
        A.alter(again, tmp_path / "r.h5", A.Plan(), replay=log)

def test_replaying_a_scale_log_on_other_values_warns(mixed, tmp_path, capsys):
    log, other = tmp_path / "scale.json", tmp_path / "other.h5"
    run_alter(mixed, tmp_path / "o.h5", log=log, count=5, scale=3.0, select=["model/conv1.weight"])
    other.write_bytes(mixed.read_bytes())
    with h5py.File(other, "r+") as f:
        f["model/conv1.weight"][...] += 1
    A.alter(other, tmp_path / "r.h5", A.Plan(), replay=log)
    assert "5 value(s) of /model/conv1.weight" in capsys.readouterr().err
    A.alter(mixed, tmp_path / "r.h5", A.Plan(), replay=log, log=tmp_path / "again.json")
    assert capsys.readouterr().err == ""
    again, first = json.loads((tmp_path / "again.json").read_text()), json.loads(log.read_text())
    assert again["scale"] == 3.0 and again["injections"] == first["injections"]  # the replay's log: the same scaling


def test_a_log_without_bits_or_named_as_the_checkpoint_fails_with_one_line(mixed, tmp_path):
    log = tmp_path / "log.json"
    run_alter(mixed, tmp_path / "o.h5", log=log, count=3)
    data = json.loads(log.read_text())
    del data["injections"][1]["bit"]
    log.write_text(json.dumps(data))
    with pytest.raises(PeatError, match=r"log.json: injection 1 needs dataset \(a path\), index \(a list of integers\), "
                                         r"bit \(an integer or a list of them\)$"):
        A.alter(mixed, tmp_path / "r.h5", A.Plan(), replay=log)
    before = sha(mixed)
    with pytest.raises(PeatError, match="that is the checkpoint itself"):
        run_alter(mixed, tmp_path / "p.h5", log=mixed, count=3)
    assert sha(mixed) == before and not (tmp_path / "p.h5").exists()



def test_a_replayed_log_is_not_overwritten_by_the_log_of_its_replay(mixed, tmp_path, capsys):
    # The new log's plan is {"replay": LOG}: the original's seed and options were lost, the log naming itself.
    log = tmp_path / "log.json"
    run_alter(mixed, tmp_path / "o.h5", log=log, count=3, seed=4)
    before = log.read_bytes()
    assert main(["alter", str(mixed), str(tmp_path / "r.h5"), "--replay", str(log), "--log", str(log)]) == 2
    assert capsys.readouterr().err == f"peat alter: error: --log {log}: that is the replayed log; name another file\n"
    assert log.read_bytes() == before and not (tmp_path / "r.h5").exists()


def test_a_replayed_log_is_not_overwritten_by_the_output_file(mixed, tmp_path, capsys):
    # The altered copy was renamed over the log it replayed: the only record of the flips became an HDF5 file.
    log = tmp_path / "log.json"
    run_alter(mixed, tmp_path / "o.h5", log=log, count=3, seed=4)
    before = log.read_bytes()
    assert main(["alter", str(mixed), str(log), "--replay", str(log)]) == 2
    assert capsys.readouterr().err == f"peat alter: error: {log}: output is the replayed log; name another output file\n"
    assert log.read_bytes() == before


def test_a_scale_log_replayed_on_integers_fails_with_one_line(tmp_path):
    # --scale alters floats only; a replay rounded 3 x 1.5 to 4 in an int64 dataset of the same name.
    src, log = tmp_path / "in.h5", tmp_path / "log.json"
    with h5py.File(src, "w") as f:
        f["n"] = np.array([3, 5, 7], np.int64)
    log.write_text(json.dumps({"scale": 1.5, "injections": [{"dataset": "/n", "index": [0]}]}))
    with pytest.raises(PeatError, match=rf"^{src}: log {log} scales /n, which holds int64 values; a scale factor "
                                        r"alters floats only$"):
        A.alter(src, tmp_path / "o.h5", A.Plan(), replay=log)
    assert not (tmp_path / "o.h5").exists()

# --- command line -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,message", [
    ("index", 5, "injection 0 needs dataset"),  # a hand-written index of a 1-D dataset, not in a list
    ("index", ["3"], "injection 0 needs dataset"),
    ("bit", None, "injection 0 needs dataset"),
    ("bit", 1.0, "injection 0 needs dataset"),
    ("dataset", ["/x"], "injection 0 needs dataset"),
    ("scale", "2", "scale '2' is not a number"),
    ("injections", {"dataset": "/x"}, "injections is not a list"),
])
def test_a_malformed_hand_written_log_fails_with_one_line(tmp_path, field, value, message):
    src, log = tmp_path / "in.h5", tmp_path / "log.json"
    with h5py.File(src, "w") as f:
        f["x"] = np.ones(8, np.float32)
    data = {"injections": [{"dataset": "/x", "index": [3], "bit": 1}]}
    (data if field in ("scale", "injections") else data["injections"][0])[field] = value
    log.write_text(json.dumps(data))
    with pytest.raises(PeatError, match=f"log.json: {message}"):
        A.alter(src, tmp_path / "o.h5", A.Plan(), replay=log)
    assert not (tmp_path / "o.h5").exists()
    data["injections"] = [{"dataset": "/x", "index": [3], "bit": [1, 2]}]
    data.pop("scale", None)
    log.write_text(json.dumps(data))
    assert A.alter(src, tmp_path / "o.h5", A.Plan(), replay=log).flips == 1


def test_a_hand_written_log_may_name_datasets_without_the_leading_slash(tmp_path):
    # As --select and h5py take them; the same value named both ways is still one value altered twice.
    src, log = tmp_path / "in.h5", tmp_path / "log.json"
    with h5py.File(src, "w") as f:
        f["g/x"] = np.ones(8, np.float32)
    log.write_text(json.dumps({"injections": [{"dataset": "g/x", "index": [3], "bit": 0}]}))
    rows = A.alter(src, tmp_path / "o.h5", A.Plan(), replay=log, keep_records=True).records
    assert rows == [{"dataset": "/g/x", "index": [3], "bit": 0, "old": 1.0, "new": -1.0}]
    log.write_text(json.dumps({"injections": [{"dataset": "g/x", "index": [3], "bit": 0},
                                              {"dataset": "/g/x", "index": [3], "bit": 1}]}))
    with pytest.raises(PeatError, match=r"alters /g/x at index \[3\] twice"):
        A.alter(src, tmp_path / "o2.h5", A.Plan(), replay=log)


def test_cli_alter_and_h5diff(mixed, tmp_path, capsys):
    out, log, js = tmp_path / "o.h5", tmp_path / "log.json", tmp_path / "diff.json"
    assert main(["alter", str(mixed), str(out), "--select", "model/*", "--select", "re:kernel", "--count", "20",
                 "--region", "mantissa", "--no-sign-change", "--seed", "4", "--log", str(log)]) == 0
    assert main(["h5diff", str(mixed), str(out), "--json", str(js)]) == 0
    table = capsys.readouterr().out
    assert "differing" in table
    result, injections = json.loads(js.read_text()), json.loads(log.read_text())["injections"]
    assert sum(r.get("differing", 0) for r in result["datasets"]) == 20 == len(injections)
    assert main(["alter", str(mixed), str(tmp_path / "r.h5"), "--replay", str(log)]) == 0
    assert sha(tmp_path / "r.h5") == sha(out)
    capsys.readouterr()
    for option in (["--seed", "4"], ["--no-sign-change"], ["--no-nonfinite"], ["--burst", "2"], ["--class", "bias"],
                   ["--mask", "11"], ["--bits", "1-3"], ["--probability", "0.5"]):  # the log decided them
        assert main(["alter", str(mixed), str(tmp_path / "r2.h5"), "--replay", str(log), *option]) == 2
        assert "--replay repeats a log: do not combine it" in capsys.readouterr().err
    assert not (tmp_path / "r2.h5").exists()
    assert main(["alter", str(mixed), str(out), "--bits", "3-1"]) == 2
    assert main(["alter", str(mixed), str(out), "--count", "1", "--fraction", "0.1"]) == 2
    assert main(["alter", str(mixed), str(out), "--scale", "-2", "--no-sign-change"]) == 2


def test_cli_output_read_in_part_ends_quietly(tmp_path):
    """`peat h5diff A B | head` printed "error: [Errno 32] Broken pipe" and exited 2, as if the files were bad."""
    import subprocess
    import sys

    for name, value in (("a.h5", 0.0), ("b.h5", 1.0)):
        with h5py.File(tmp_path / name, "w") as f:
            for i in range(3000):  # more lines than a pipe holds
                f[f"d{i}"] = np.full(4, value, np.float32)
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", f"{sys.executable} -m peat.cli h5diff a.h5 b.h5 | head -2"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert (proc.returncode, proc.stderr, len(proc.stdout.splitlines())) == (141, "", 2)
    assert proc.stdout.splitlines()[1].startswith("/d0 ")


def test_ctrl_c_ends_with_one_line_and_no_output(mixed, tmp_path, capsys, monkeypatch):
    """Ctrl-C printed a Python traceback of a dozen lines; it is one line, the shell's status 130."""
    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(A, "alter", interrupted)
    try:
        status = main(["alter", str(mixed), str(tmp_path / "o.h5")])
    except KeyboardInterrupt:
        status = "traceback"
    assert status == 130 and capsys.readouterr().err == "peat alter: interrupted; files left as they were\n"
    assert sorted(tmp_path.iterdir()) == [mixed]


def test_cli_counts_only_the_datasets_that_can_take_the_corruption(mixed, tmp_path, capsys):
    # --scale acts on floats only: the two integer counters are selected but cannot take it.
    assert main(["alter", str(mixed), str(tmp_path / "o.h5"), "--select", "counters/*", "--select",
                 "model/conv1.weight", "--scale", "2", "--count", "3"]) == 0
    assert "3 value(s) altered in 1 of 1 selected dataset(s) that can take it" in capsys.readouterr().out


def test_fraction_rounds_halves_up(mixed, tmp_path):
    # 0.5 x 5 = 2.5 values: round() would give 2 (half to even); a user reading "round" expects 3.
    five = tmp_path / "five.h5"
    with h5py.File(five, "w") as f:
        f.create_dataset("w", data=np.arange(1, 6, dtype=np.float32))
    assert run_alter(five, tmp_path / "o.h5", fraction=0.5).flips == 3
    assert run_alter(five, tmp_path / "o.h5", fraction=0.3).flips == 2  # 1.5 -> 2; round() agrees here
    many = tmp_path / "many.h5"
    with h5py.File(many, "w") as f:
        f.create_dataset("w", data=np.ones(1500, np.float32))
    assert run_alter(many, tmp_path / "o.h5", fraction=0.009).flips == 14  # 13.5, though 0.009 * 1500 < 13.5 in floats


def test_no_command_prints_the_usage_as_an_error_and_help_as_an_answer(capsys):
    """A bare ``peat`` exited 0, so a script calling it without a command went on as if it had run."""
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: peat COMMAND") and "  alter " in err
    assert main(["--help"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("usage: peat COMMAND") and "  h5diff " in out


def test_an_unknown_command_is_named_in_one_line(capsys):
    assert main(["altr", "in.h5", "out.h5"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "peat: no command 'altr'; did you mean 'alter'? commands: alter, h5diff\n"


def test_a_negative_seed_fails_with_one_line(mixed, tmp_path, capsys):
    assert main(["alter", str(mixed), str(tmp_path / "o.h5"), "--seed", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "peat alter: error: --seed -1: must be >= 0"
    assert not (tmp_path / "o.h5").exists()


def test_unwritable_outputs_fail_with_one_line(mixed, tmp_path, capsys):
    under_a_file = mixed / "o.h5"  # its parent is the input file, not a directory
    for argv in (["alter", str(mixed), str(under_a_file)],
                 ["alter", str(mixed), str(tmp_path / "o.h5"), "--log", str(under_a_file)],
                 ["h5diff", str(mixed), str(mixed), "--json", str(under_a_file)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        # Before any work: h5diff printed its whole table, then "[Errno 17] File exists", naming no option.
        label = str(under_a_file) if len(argv) == 3 else f"{argv[-2]} {under_a_file}"
        assert out == "" and err == f"peat {argv[0]}: error: {label}: {mixed} is not a directory\n"


def test_an_output_that_is_not_a_regular_file_is_refused_and_kept(mixed, tmp_path, capsys):
    """`peat alter ckpt.h5 /dev/null` renamed the altered copy over /dev/null (as root): outputs that are
    devices or pipes are refused, for --log and --json too, before any work."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for argv, label, noun in ((["alter", str(mixed), str(fifo)], f"{fifo}", "output"),
                              (["alter", str(mixed), str(tmp_path / "o.h5"), "--log", str(fifo)], f"--log {fifo}", "log"),
                              (["h5diff", str(mixed), str(mixed), "--json", str(fifo)], f"--json {fifo}", "JSON")):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == f"peat {argv[0]}: error: {label}: not a regular file; name the {noun} file\n"
        assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5", "pipe"]


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_work(mixed, tmp_path, capsys, monkeypatch):
    # Root writes anywhere: the folder's permission is what os.access answers for other users.
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(A.os, "access", lambda path, mode: Path(path) != locked)
    assert main(["h5diff", str(mixed), str(mixed), "--json", str(locked / "new" / "d.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"peat h5diff: error: --json {locked}/new/d.json: cannot write in {locked} "
                                 "(permission denied or read-only)\n")


@pytest.mark.parametrize("burst", ["0", "65", "99999999999999999999"])
def test_a_burst_wider_than_any_value_fails_with_one_line(mixed, tmp_path, capsys, burst):
    """--burst 99999999999999999999 ended in an OverflowError traceback, --burst 1000000000 built a list of
    a billion bit offsets before finding no dataset that could take it."""
    assert main(["alter", str(mixed), str(tmp_path / "o.h5"), "--burst", burst]) == 2
    assert capsys.readouterr().err == f"peat alter: error: --burst {burst}: must be in [1, 64] (no value has more bits)\n"


@pytest.mark.parametrize("count", ["0", "-1"])
def test_a_count_that_alters_nothing_fails_with_one_line_before_any_work(mixed, tmp_path, capsys, count):
    """--count 0 succeeded and wrote a copy identical to the input, and a log of no injection."""
    assert main(["alter", str(mixed), str(tmp_path / "o.h5"), "--count", count, "--log", str(tmp_path / "l.json")]) == 2
    assert capsys.readouterr().err == f"peat alter: error: --count {count}: must be >= 1\n"
    assert sorted(tmp_path.iterdir()) == [mixed]


def test_an_output_directory_fails_with_one_line_naming_it(mixed, tmp_path, capsys):
    assert main(["alter", str(mixed), str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"peat alter: error: {tmp_path}: is a directory; name the output file"
    assert sorted(tmp_path.iterdir()) == [mixed]


def test_a_log_that_cannot_be_written_leaves_no_output(mixed, tmp_path, monkeypatch):
    # Nor the output's new folders: they were left behind, empty. (A disk that fills while the log is written.)
    def full(path, *_):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(A, "write_log", full)
    before = sha(mixed)
    for out, in_place in ((tmp_path / "new" / "sub" / "o.h5", False), (None, True)):
        with pytest.raises(OSError):
            A.alter(mixed, out, A.Plan(count=5), in_place=in_place, log=tmp_path / "log.json")
    assert sorted(tmp_path.iterdir()) == [mixed] and sha(mixed) == before  # in place: the input is unaltered


def test_h5diff_statistics(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(a, "w") as f:
        f["x"] = np.array([1.0, 2.0, 4.0, 8.0], np.float32)
        f["only_a"] = np.zeros(2)
    with h5py.File(b, "w") as f:
        f["x"] = np.array([1.0, 3.0, 4.0, 6.0], np.float32)
    row = A.diff(a, b)["datasets"][0]
    assert row["differing"] == 2
    assert row["max_rel"] == 0.5 and row["mean_rel"] == 0.375
    assert row["euclidean"] == pytest.approx(np.sqrt(1 + 4))
    # 2 -> 3 flips bit 9 (the mantissa MSB); 8 -> 6 flips the two lowest exponent bits (7, 8) and bit 9.
    assert row["bits"] == {"7": 1, "8": 1, "9": 2}
    assert A.diff(a, b)["only_in_a"] == ["/only_a"]


def test_h5diff_relative_difference_of_a_zero_whose_sign_flipped_is_zero(tmp_path):
    """0.0 -> -0.0 gave 0/0: max_rel read nan, hiding the other values' relative differences."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(a, "w") as f:
        f["x"] = np.array([0.0, 2.0, 4.0], np.float32)
    with h5py.File(b, "w") as f:
        f["x"] = np.array([-0.0, 3.0, 4.0], np.float32)
    row = A.diff(a, b)["datasets"][0]
    assert row["differing"] == 2 and row["max_rel"] == 0.5 and row["mean_rel"] == 0.25



def test_h5diff_names_the_layouts_of_datasets_it_cannot_compare(tmp_path):
    """A bf16-tagged uint16 against a plain one, and float32 of the two byte orders: the status
    said "uint16 vs uint16" and "float32 vs float32"."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(a, "w") as f:
        f.create_dataset("w", data=np.arange(3, dtype=np.uint16)).attrs["dtype"] = "bfloat16"
        f["x"] = np.ones(2, "<f4")
    with h5py.File(b, "w") as f:
        f["w"] = np.arange(3, dtype=np.uint16)
        f["x"] = np.ones(2, ">f4")
    status = {r["dataset"]: r["status"] for r in A.diff(a, b)["datasets"]}
    assert status == {"/w": "differs in shape/dtype: (3,) bfloat16 (<u2) vs (3,) uint16 (<u2)",
                      "/x": "differs in shape/dtype: (2,) float32 (<f4) vs (2,) float32 (>f4)"}

def test_h5diff_summary_counts_only_differing_datasets_with_all(mixed, tmp_path, capsys):
    run_alter(mixed, tmp_path / "o.h5", count=3, select=["model/conv1.weight"])
    for flag in ([], ["--all"]):
        assert main(["h5diff", str(mixed), str(tmp_path / "o.h5"), *flag]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == "1 dataset(s) differ, 14 identical"  # /history too


def test_h5diff_compares_the_datasets_peat_never_alters(tmp_path, capsys):
    """Bools, strings and compounds were skipped: files differing only there were "0 dataset(s) differ"."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    for path, v in ((a, 0), (b, 1)):
        with h5py.File(path, "w") as f:
            f["flags"] = np.array([True, bool(v)])
            f["fixed"] = np.array([b"abc", b"xy"[v:v + 1]], "S3")
            f["text"] = np.array(["hello", "ab"[v]], dtype=h5py.string_dtype())
            f["title"] = "ab"[v]  # a scalar variable-length string
            f["pairs"] = np.array([(np.nan, v)], [("a", "f4"), ("b", "i4")])
            f["empty"] = np.zeros(0, np.float32)
            f["w"] = np.ones(4, np.float32)
    assert main(["h5diff", str(a), str(b), "--json", str(tmp_path / "d.json")]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {r["dataset"]: r for r in json.loads((tmp_path / "d.json").read_text())["datasets"]}
    assert {k: r["differing"] for k, r in rows.items()} == {"/empty": 0, "/fixed": 1, "/flags": 1, "/pairs": 1,
                                                             "/text": 1, "/title": 1, "/w": 0}
    assert rows["/flags"]["dtype"] == "bool" and rows["/text"]["dtype"] == "string" and rows["/text"]["max_rel"] == "n/a"
    assert table[-1] == "5 dataset(s) differ, 2 identical"
    assert table[1].split()[:3] == ["/fixed", "string", "1"]


def test_h5diff_json_naming_a_compared_file_or_a_directory_fails_with_one_line(mixed, tmp_path, capsys):
    """--json B.h5 replaced the checkpoint B with the comparison; --json . failed with a traceback."""
    b = tmp_path / "o.h5"
    run_alter(mixed, b, count=3)
    before = sha(b)
    assert main(["h5diff", str(mixed), str(b), "--json", str(b)]) == 2
    assert capsys.readouterr().err.strip() == f"peat h5diff: error: --json {b}: that is a compared file; name another file"
    assert sha(b) == before
    assert main(["h5diff", str(mixed), str(b), "--json", "."]) == 2
    assert capsys.readouterr().err.strip() == "peat h5diff: error: --json .: is a directory; name the JSON file"


def test_h5diff_positions_without_json_are_printed_as_the_log_writes_them(mixed, tmp_path, capsys):
    """--positions without --json listed the differing elements nowhere."""
    log = tmp_path / "log.json"
    assert main(["alter", str(mixed), str(tmp_path / "o.h5"), "--count", "5", "--seed", "2", "--log", str(log)]) == 0
    capsys.readouterr()
    assert main(["h5diff", str(mixed), str(tmp_path / "o.h5"), "--positions"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table_end = next(i for i, line in enumerate(lines) if line.endswith("identical"))
    printed = [json.loads(line) for line in lines[table_end + 1:]]
    key = lambda r: (r["dataset"], r["index"])
    assert sorted(printed, key=key) == sorted(json.loads(log.read_text())["injections"], key=key)


def test_h5diff_table_shows_the_nonfinite_values_of_b(tmp_path, capsys):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(a, "w") as f:
        f["x"] = np.ones(4, np.float32)
    run_alter(a, b, count=3, bits=(1, 1))  # the exponent MSB of 1.0: inf
    assert main(["h5diff", str(a), str(b)]) == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    assert header.split()[6] == "nonfinite" and row.split()[6] == "3"
    # No finite pair to measure: max_rel, mean_rel and euclidean read 0 (as if unchanged), now n/a.
    assert row.split()[3:6] == ["n/a"] * 3
    assert [A.diff(a, b)["datasets"][0][k] for k in ("max_rel", "mean_rel", "euclidean")] == ["n/a"] * 3


def test_h5diff_sees_a_low_bit_flip_of_a_large_int64(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    for path, value in ((a, 2**60 + 1), (b, 2**60)):  # equal once rounded to float64
        with h5py.File(path, "w") as f:
            f["n"] = np.array([value, 7], np.int64)
    row = A.diff(a, b)["datasets"][0]
    assert row["differing"] == 1 and row["bits"] == {"63": 1}  # bit 0 is printed MSB-first as 63
    assert row["euclidean"] == 1.0 and row["max_rel"] == pytest.approx(2.0 ** -60, rel=1e-9, abs=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(count=st.integers(1, 200), seed=st.integers(0, 2**31), region=st.sampled_from(A.CLI_REGIONS),
       burst=st.integers(1, 3), sign=st.booleans(), finite=st.booleans())
def test_any_plan_agrees_with_h5diff(tmp_path_factory, count, seed, region, burst, sign, finite):
    tmp = tmp_path_factory.mktemp("prop")
    src = make_mixed(tmp / "in.h5")
    plan = dict(count=count, seed=seed, region=region, burst=burst, sign_change=sign, nonfinite=finite)
    try:
        rows = run_alter(src, tmp / "o.h5", **plan).records
    except PeatError as err:
        assert "eligible" in str(err) or "can take" in str(err) or "contradicts --no-sign-change" in str(err)
        return
    assert len(rows) == count
    assert canon(A.diff(src, tmp / "o.h5", positions=True)["positions"]) == canon(rows)


# --- the study --------------------------------------------------------------------------------------


def test_compare_counts_recovery_and_divergence():
    golden = pd.DataFrame({"accuracy": [0.5, 0.6, 0.7, 0.8], "loss": [1.0, 0.9, 0.8, 0.7]}, index=[1, 2, 3, 4])
    run = pd.DataFrame({"accuracy": [0.5, 0.25, 0.69, 0.76], "loss": [1.0, 1.5, 0.8, 0.75]}, index=[1, 2, 3, 4])
    out = S.compare(run, golden, 1)
    gaps = [abs(0.25 - 0.6), abs(0.69 - 0.7), abs(0.76 - 0.8)]
    assert out["accuracy_gaps"] == " ".join(map(repr, gaps)) and not out["diverged"] and out["resumed_epochs"] == 3
    assert [S.epochs_to_recover(out["accuracy_gaps"], t) for t in (0.02, 0.05, 0.4)] == [2, 2, 1]
    assert np.isnan(S.epochs_to_recover(out["accuracy_gaps"], 0.001))
    assert out["accuracy_loss_pct"] == pytest.approx(5.0)
    run.loc[2, "loss"] = float("nan")
    run.loc[3:, "accuracy"] = 0.1
    out = S.compare(run, golden, 1)
    assert out["diverged"] and out["accuracy_gaps"].split()[0] == "inf"
    assert np.isnan(S.epochs_to_recover(out["accuracy_gaps"], 0.02)) and S.epochs_to_recover(out["accuracy_gaps"], 0.65) == 2


def test_absorbed_table():
    rows = []
    for cls, losses in {"weight": {1: [0.0, 0.5], 10: [0.2, 0.9], 100: [3.0, 0.1]},
                        "bias": {1: [2.0, 0.0], 10: [0.0, 0.0], 100: [0.0, 0.0]}}.items():
        for n, per_seed in losses.items():
            for seed, loss in enumerate(per_seed):
                rows.append(dict(cls=cls, region="sign", flips=n, seed=seed, status="ok", accuracy_loss_pct=loss,
                                 diverged=False))
    rows.append(dict(cls="bias", region="sign", flips=1000, seed=0, status="not_applicable",
                     accuracy_loss_pct=np.nan, diverged=False))
    table = S.absorbed(pd.DataFrame(rows), max_loss_pct=1.0).set_index("cls")
    assert table.loc["weight", "max_absorbed_flips"] == 10 and table.loc["weight", "first_harmful_flips"] == 100
    assert table.loc["bias", "max_absorbed_flips"] == 0 and table.loc["bias", "first_harmful_flips"] == 1
    assert table.loc["weight", "absorbed_runs"] == 5 and table.loc["bias", "runs"] == 6


def test_the_readme_names_every_column_of_the_study_tables():
    """sensitivity.csv's counts (nonfinite_injected, resumed_epochs, ...) and the sign of its relative
    changes, and most of absorbed.csv's columns, were said nowhere."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "alter.md").read_text()
    section = doc[doc.index("## Alteration study"):doc.index("<!-- /section: alter -->")]
    table = S.absorbed(pd.DataFrame(columns=["cls", "region", "flips", "status", "accuracy_loss_pct", "diverged"]), 1.0)
    missing = [c for c in (*S.COLUMNS, *table.columns) if f"`{c}`" not in section]
    assert missing == []


def test_check_config_names_the_key():
    config = {"models": {"m": {"epochs": 2, "checkpoint_epochs": [1, 2]}}, "alter": {"models": ["m"], "epochs": [2]}}
    with pytest.raises(PeatError) as err:
        S.check_config(config)
    assert str(err.value) == ("config key 'alter.epochs': epoch 2 of model 'm' is not a golden checkpoint before "
                              "the last epoch (checkpoint_epochs: [1, 2], epochs: 2)")
    config["alter"] = {"models": ["x"], "epochs": [1]}
    with pytest.raises(PeatError) as err:
        S.check_config(config)
    assert str(err.value) == "config key 'alter.models': unknown model 'x'; defined: m"
    config["alter"] = {"models": ["m"], "epochs": [1]}
    S.check_config(config)


@pytest.mark.slow
@pytest.mark.xdist_group("workflow")
def test_workflow_alteration_study(workflow_run):
    import yaml

    grid = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "test.yaml").read_text())["alter"]
    base = workflow_run / "results" / "alter" / "gpt2" / "cpu"
    table = pd.read_csv(base / "sensitivity.csv")
    assert len(table) == len(grid["classes"]) * len(grid["regions"]) * len(grid["flips"]) * len(grid["seeds"])
    assert set(table["cls"]) == set(grid["classes"]) and set(table["region"]) == set(grid["regions"])
    ok = table[table["status"] == "ok"]
    assert len(ok) and (ok["altered_values"] == ok["flips"]).all() and (ok["resumed_epochs"] == 1).all()
    golden = pd.read_csv(workflow_run / "results" / "golden" / "gpt2" / "cpu" / "metrics.csv")
    assert (ok["golden_accuracy"] == golden[golden["split"] == "val"]["accuracy"].iloc[-1]).all()
    # Every injection log matches the golden checkpoint: re-applying it and diffing gives the same rows.
    ckpt = workflow_run / "results" / "golden" / "gpt2" / "cpu" / "checkpoints" / "epoch001.h5"
    for log in sorted(base.glob("cells/epoch1/*_injections/*.json")):
        if "skipped" in json.loads(log.read_text()):  # a not_applicable cell: no flips to redo, as --replay says
            continue
        rows = json.loads(log.read_text())["injections"]
        region = log.name.split("_n")[0]
        assert all(r["bit"] == 0 for r in rows) if region == "sign" else True
        out = log.parent.parent / f".replay_{log.stem}.h5"
        A.alter(ckpt, out, A.Plan(), replay=log)
        assert canon(A.diff(ckpt, out, positions=True)["positions"]) == canon(rows)
        out.unlink()
    absorbed = pd.read_csv(base / "absorbed.csv")
    assert len(absorbed) == len(ok.groupby(["cls", "region"]))
    # Each cell's row says which stack ran it (the columns were computed from no provenance: none).
    import torch
    assert (table["prov_vendor"] == "cpu").all() and (table["prov_torch"] == torch.__version__).all()
    assert (base / "heatmap.png").read_bytes()[:4] == b"\x89PNG"


def test_userblock_and_h5py_fallback_storage(tmp_path):
    # A user block shifts every raw-data offset; compressed data cannot be memory-mapped at all.
    src = tmp_path / "ub.h5"
    with h5py.File(src, "w", userblock_size=1024) as f:
        f["x"] = np.arange(1, 9, dtype=np.float32)
        f.create_dataset("z", data=np.arange(1, 65, dtype=np.float64).reshape(8, 8), chunks=(4, 4), compression="gzip")
    rows = run_alter(src, tmp_path / "o.h5", fraction=1.0, region="sign").records
    with h5py.File(tmp_path / "o.h5") as f:
        assert (f["x"][:] == -np.arange(1, 9)).all() and (f["z"][:] == -np.arange(1, 65).reshape(8, 8)).all()
    assert len(rows) == 72


@pytest.fixture(scope="module")
def gpt2_golden(tmp_path_factory) -> tuple[dict, Path, Path]:
    """The test config's gpt2 trained to its end, with a checkpoint at epoch 1: spec, data, golden folder."""
    import yaml

    from peat.data import prepare
    from peat.train import train_model

    tmp = tmp_path_factory.mktemp("gpt2")
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "test.yaml").read_text())
    spec = {**config["models"]["gpt2"], "checkpoint_epochs": [1]}
    prepare("pydoc", config["datasets"]["pydoc"], tmp / "pydoc.h5")
    train_model("gpt2", spec, tmp / "pydoc.h5", tmp / "golden", record=False, progress=False)
    return spec, tmp / "pydoc.h5", tmp / "golden"


def test_resuming_an_unaltered_checkpoint_reproduces_golden_exactly(gpt2_golden, tmp_path):
    """The study's baseline: any difference from golden comes from the flips, not from resuming."""
    spec, data, out = gpt2_golden
    golden = S._val_curve(pd.read_csv(out / "metrics.csv"))
    row = S._cell("gpt2", spec, "cpu", out / "checkpoints" / "epoch001.h5", A.Plan(probability=0.0), golden,
                  1, data, 0, 1, "", tmp_path / "control.json")
    assert row["status"] == "ok" and row["altered_values"] == 0
    assert row["final_loss"] == row["golden_loss"] and row["final_accuracy"] == row["golden_accuracy"]
    assert row["accuracy_loss_pct"] == 0 and S.epochs_to_recover(row["accuracy_gaps"], 0) == 1 and not row["diverged"]
    # Right after the (empty) alteration, before resuming: golden's own validation at that epoch.
    assert row["altered_accuracy"] == golden.loc[1, "accuracy"] and row["altered_loss"] == golden.loc[1, "loss"]


def test_a_resumed_training_that_stops_with_an_error_is_a_diverged_cell_not_a_failed_job(gpt2_golden, tmp_path):
    # AdamW's step counter flipped negative: 1 - beta2**step < 0, whose square root torch cannot apply
    # (at -1.0, a division by zero). Drawn at random among the optimizer's values, as the study does.
    spec, data, out = gpt2_golden
    golden = S._val_curve(pd.read_csv(out / "metrics.csv"))
    row = S._cell("gpt2", spec, "cpu", out / "checkpoints" / "epoch001.h5",
                  A.Plan(select=["optimizer/state/*/step"], count=1, region="sign"), golden, 1, data, 0, 1, "",
                  tmp_path / "cell.json")
    assert row["status"] == "ok" and row["altered_values"] == 1 and row["diverged"] is True
    assert row["reason"] == ("resumed training stopped: RuntimeError: result type ComplexFloat can't be cast to "
                             "the desired output type Float")
    assert np.isnan([row["final_accuracy"], row["final_loss"], row["accuracy_loss_pct"], row["loss_change_pct"]]).all()
    assert row["accuracy_gaps"] == ""
    assert row["resumed_epochs"] == 0 and row["golden_accuracy"] == golden.loc[2, "accuracy"]
    table = pd.DataFrame([{"model": "gpt2", "vendor": "cpu", "epoch": 1, "cls": "optimizer", "region": "sign",
                           "flips": 1, "seed": 0, **row}], columns=list(S.COLUMNS))
    assert S.absorbed(table, 1.0).iloc[0][["max_absorbed_flips", "absorbed_runs", "diverged_runs"]].tolist() == [0, 0, 1]


def test_a_bfloat16_model_is_saved_as_peat_alter_reads_bfloat16_and_loads_back(tmp_path):
    # numpy has no bfloat16: saved as its bits in uint16 tagged dtype=bfloat16, so that flips are bfloat16's.
    import torch

    from peat import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    checkpoint.save(tmp_path / "g.h5", model, optimizer, step=1, epoch=1, meta={})
    layouts = {e.path: e.layout.name for e in A.scan(tmp_path / "g.h5")}
    assert layouts["/model/weight"] == layouts["/optimizer/state/weight/exp_avg"] == "bfloat16"
    assert layouts["/optimizer/state/weight/step"] == "float32"
    rows = run_alter(tmp_path / "g.h5", tmp_path / "a.h5", select=["model/*"], fraction=1.0, bits=(1, 1)).records
    assert len(rows) == 15 and {r["bit"] for r in rows} == {1}
    resumed = torch.nn.Linear(4, 3).to(torch.bfloat16)
    again = torch.optim.AdamW(resumed.parameters(), lr=0.1)
    checkpoint.load(tmp_path / "a.h5", resumed, again)
    assert resumed.weight.dtype == torch.bfloat16
    flipped = (model.weight.detach().view(torch.int16) ^ torch.tensor(0x4000, dtype=torch.int16)).view(torch.bfloat16)
    assert torch.equal(resumed.weight.view(torch.int16), flipped.view(torch.int16))
    assert [r["new"] for r in rows if r["dataset"] == "/model/weight"] == resumed.weight.float().flatten().tolist()
    for key, value in optimizer.state[model.weight].items():
        assert again.state[resumed.weight][key].dtype == value.dtype and torch.equal(again.state[resumed.weight][key], value)


def test_flips_in_a_tied_embedding_survive_loading(tmp_path):
    # GPT-2's lm_head.weight is wte.weight: one tensor, so one dataset, or flips in one copy are undone by the other.
    import torch

    from peat import checkpoint, models

    spec, attrs = {"arch": "gpt2", "size": {"hidden": 16, "layers": 1, "heads": 2}}, {"vocab_size": 50, "seq_len": 8}
    golden = models.build(spec, attrs, 0)
    checkpoint.save(tmp_path / "g.h5", golden, torch.optim.SGD(golden.parameters(), lr=0.1), step=0, epoch=0, meta={})
    rows = run_alter(tmp_path / "g.h5", tmp_path / "a.h5", classes=["embedding"], fraction=1.0, region="sign").records
    assert {r["dataset"] for r in rows} == {"/model/transformer.wte.weight", "/model/transformer.wpe.weight"}
    resumed = models.build(spec, attrs, 0)
    checkpoint.load(tmp_path / "a.h5", resumed)
    assert torch.equal(resumed.lm_head.weight, -golden.transformer.wte.weight)
    assert torch.equal(resumed.transformer.wpe.weight, -golden.transformer.wpe.weight)


def test_selecting_a_tied_weight_by_its_link_names_the_dataset_to_select(tmp_path):
    import torch

    from peat import checkpoint, models

    spec, attrs = {"arch": "gpt2", "size": {"hidden": 16, "layers": 1, "heads": 2}}, {"vocab_size": 50, "seq_len": 8}
    model = models.build(spec, attrs, 0)
    checkpoint.save(tmp_path / "g.h5", model, torch.optim.SGD(model.parameters(), lr=0.1), step=0, epoch=0, meta={})
    with pytest.raises(PeatError, match=r"'model/lm_head\.weight' names model/lm_head\.weight, a link to "
                                        r"model/transformer\.wte\.weight .*: select model/transformer\.wte\.weight$"):
        A.alter(tmp_path / "g.h5", tmp_path / "a.h5", A.Plan(select=["model/lm_head.weight"], count=1))
    assert not (tmp_path / "a.h5").exists()



def test_a_replayed_log_naming_a_tied_weight_by_its_link_names_the_dataset(tmp_path):
    # A hand-written log naming GPT-2's lm_head.weight: it said 'absent here' of a name the file has.
    from peat import checkpoint, models

    spec, attrs = {"arch": "gpt2", "size": {"hidden": 16, "layers": 1, "heads": 2}}, {"vocab_size": 50, "seq_len": 8}
    checkpoint.save(tmp_path / "g.h5", models.build(spec, attrs, 0), None, step=0, epoch=0, meta={})
    log = tmp_path / "log.json"
    log.write_text(json.dumps({"injections": [{"dataset": "model/lm_head.weight", "index": [0, 0], "bit": 0}]}))
    with pytest.raises(PeatError) as err:
        A.alter(tmp_path / "g.h5", tmp_path / "a.h5", A.Plan(), replay=log)
    assert str(err.value) == (f"{tmp_path / 'g.h5'}: log {log} names model/lm_head.weight, a link to "
                              "model/transformer.wte.weight (one tensor under two names): name model/transformer.wte.weight")
    assert not (tmp_path / "a.h5").exists()


def test_replaying_the_log_of_a_cell_that_was_not_applicable_fails_with_its_reason(mixed, tmp_path):
    # Its replay was an unaltered copy, 'altered' without a word, as if it were the cell's checkpoint.
    log = tmp_path / "cell.json"
    row = S._cell("m", {}, "cpu", mixed, A.Plan(classes=["embedding"], count=10**6), None, 1, "", 0, 1, "", log)
    assert row["status"] == "not_applicable"
    with pytest.raises(PeatError) as err:
        A.alter(mixed, tmp_path / "o.h5", A.Plan(), replay=log)
    assert str(err.value) == f"{log}: the log of a study cell that was not applicable, with no flips to redo ({row['reason']})"
    assert not (tmp_path / "o.h5").exists()

def test_a_damaged_golden_checkpoint_fails_the_cells_instead_of_reading_as_not_applicable(mixed, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "epoch001.h5").write_bytes(mixed.read_bytes()[:2000])
    metrics = tmp_path / "metrics.csv"
    pd.DataFrame({"split": ["val", "val"], "epoch": [1, 2], "accuracy": [0.5, 0.6], "loss": [1.0, 0.9]}).to_csv(metrics)
    with pytest.raises(PeatError) as err:
        S.run_cells("gpt2", {}, "cpu", 1, "weight", ["sign"], [1], [0], checkpoints=tmp_path / "ckpt", data="",
                    golden_metrics=metrics, run_seed=0, threads=1, config_hash="",
                    out_csv=tmp_path / "cells.csv", log_dir=tmp_path / "logs")
    assert str(err.value) == f"{tmp_path / 'ckpt' / 'epoch001.h5'}: not a readable HDF5 file (Unable to synchronously open file)"


def test_summary_of_cells_the_model_lacks(tmp_path):
    rows = [dict(model="m", vendor="cpu", epoch=1, cls="norm_stats", region="sign", flips=1, seed=0,
                 status="not_applicable", reason="no dataset of class 'norm_stats'")]
    pd.DataFrame(rows, columns=list(S.CELL_COLUMNS)).to_csv(tmp_path / "part.csv", index=False)
    S.summarize([tmp_path / "part.csv"], tmp_path / "s.csv", tmp_path / "a.csv", tmp_path / "h.png", 1.0, 0.02)
    table = pd.read_csv(tmp_path / "s.csv")
    assert list(table.columns) == list(S.COLUMNS) and table.loc[0, "status"] == "not_applicable"
    assert pd.read_csv(tmp_path / "a.csv").empty
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def _study_tables(cells, seeds, mixed, tmp_path, monkeypatch) -> None:
    """run_cells on ``mixed`` with ``_cell`` giving ``cells`` in turn (part.csv), then summarize it
    with a cell the model lacks (s.csv, a.csv, h.png)."""
    cells = iter(cells)
    monkeypatch.setattr(S, "_cell", lambda *args: next(cells))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "epoch001.h5").write_bytes(mixed.read_bytes())
    metrics = tmp_path / "metrics.csv"
    pd.DataFrame({"split": ["val", "val"], "epoch": [1, 2], "accuracy": [0.5, 0.5], "loss": [1.0, 0.9]}).to_csv(metrics)
    S.run_cells("m", {}, "cpu", 1, "weight", ["sign"], [1], seeds, checkpoints=tmp_path / "ckpt", data="",
                golden_metrics=metrics, run_seed=0, threads=1, config_hash="",
                out_csv=tmp_path / "part.csv", log_dir=tmp_path / "logs")
    lacks = dict(model="m", vendor="cpu", epoch=1, cls="weight", region="sign", flips=10**6, seed=0,
                 status="not_applicable", reason="too few values")
    pd.DataFrame([lacks], columns=list(S.CELL_COLUMNS)).to_csv(tmp_path / "lacks.csv", index=False)
    S.summarize([tmp_path / "part.csv", tmp_path / "lacks.csv"], tmp_path / "s.csv", tmp_path / "a.csv",
                tmp_path / "h.png", 1.0, 0.02)


def test_a_diverged_loss_reads_nan_in_the_tables_not_empty_like_an_unmeasured_one(mixed, tmp_path, monkeypatch):
    diverged = {"status": "ok", "reason": "", "altered_values": 1, "datasets_hit": 1, "nonfinite_injected": 0,
                "altered_accuracy": 0.0, "altered_loss": np.nan, "final_accuracy": 0.0, "final_loss": np.nan,
                "golden_accuracy": 0.5, "golden_loss": 0.9, "accuracy_loss_pct": 100.0, "loss_change_pct": np.inf,
                "diverged": True, "resumed_epochs": 1, "accuracy_gaps": "inf"}
    _study_tables([diverged], [0], mixed, tmp_path, monkeypatch)
    for path in (tmp_path / "part.csv", tmp_path / "s.csv"):
        row = pd.read_csv(path, keep_default_na=False).iloc[0]
        assert [str(row[name]) for name in ("altered_loss", "final_loss", "loss_change_pct")] == ["nan", "nan", "inf"]
    assert pd.read_csv(tmp_path / "s.csv", keep_default_na=False).loc[0, "epochs_to_recover"] == ""  # never recovered
    lacks_row = pd.read_csv(tmp_path / "s.csv", keep_default_na=False).iloc[1]
    assert lacks_row["status"] == "not_applicable" and lacks_row["final_loss"] == ""
    table = pd.read_csv(tmp_path / "s.csv")
    assert np.isnan(table.loc[0, "final_loss"]) and table.loc[0, "final_accuracy"] == 0.0
    assert pd.read_csv(tmp_path / "a.csv").loc[0, "diverged_runs"] == 1


def test_counts_in_the_tables_read_as_integers_beside_never_and_not_applicable(mixed, tmp_path, monkeypatch):
    cells = [{"status": "ok", "reason": "", "altered_values": 3, "datasets_hit": 2, "nonfinite_injected": 0,
                   "altered_accuracy": 0.5, "altered_loss": 1.0, "final_accuracy": 0.5, "final_loss": 0.9,
                   "golden_accuracy": 0.5, "golden_loss": 0.9, "accuracy_loss_pct": 0.0, "loss_change_pct": 0.0,
                   "diverged": False, "resumed_epochs": 1, "accuracy_gaps": gap} for gap in ("0.0", "0.5")]
    _study_tables(cells, [0, 1], mixed, tmp_path, monkeypatch)
    counts = ["altered_values", "datasets_hit", "nonfinite_injected", "epochs_to_recover", "resumed_epochs"]
    assert pd.read_csv(tmp_path / "part.csv", dtype=str, keep_default_na=False)[counts[:3] + counts[4:]].values.tolist() == [
        ["3", "2", "0", "1"], ["3", "2", "0", "1"]]
    assert pd.read_csv(tmp_path / "s.csv", dtype=str, keep_default_na=False)[counts].values.tolist() == [
        ["3", "2", "0", "1", "1"], ["3", "2", "0", "", "1"], ["", "", "", "", ""]]


def test_the_heatmap_marks_a_cell_whose_resumed_training_stopped(tmp_path):
    # No final accuracy to colour it by (S.stopped): still a diverged run, marked †, without a warning.
    import warnings

    stopped = dict(model="m", vendor="cpu", epoch=1, cls="optimizer", region="sign", flips=1, seed=0, status="ok",
                   reason="resumed training stopped: RuntimeError", altered_values=1, datasets_hit=1,
                   nonfinite_injected=0, altered_accuracy=0.5, altered_loss=1.0,
                   **S.stopped(pd.DataFrame(columns=["split", "epoch", "accuracy", "loss"]),
                               pd.DataFrame({"accuracy": [0.4, 0.5], "loss": [1.0, 0.9]}, index=[1, 2]), 1))
    pngs = []
    for diverged in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            S.heatmap(pd.DataFrame([{**stopped, "diverged": diverged}], columns=list(S.COLUMNS)), tmp_path / "h.png")
        pngs.append((tmp_path / "h.png").read_bytes())
    assert pngs[0] != pngs[1]


def test_a_hard_linked_dataset_is_altered_once_and_its_second_name_names_the_one_to_select(tmp_path):
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("b/w", data=np.arange(1, 9, dtype=np.float32))
        f["a/alias"] = f["b/w"]  # a hard link: one dataset, two names; scan lists the first
    rows = run_alter(src, tmp_path / "o.h5", fraction=1.0, region="sign").records
    assert [r["dataset"] for r in rows] == ["/a/alias"] * 8  # each value once, not once per name
    with h5py.File(tmp_path / "o.h5") as f:
        assert (f["b/w"][()] == -np.arange(1, 9, dtype=np.float32)).all()
    with pytest.raises(PeatError, match=r"'b/w' names b/w, a link to a/alias .*: select a/alias$"):
        run_alter(src, tmp_path / "p.h5", select=["b/w"])
    assert not (tmp_path / "p.h5").exists()


def test_a_log_directory_fails_with_one_line_before_any_work(mixed, tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    assert main(["alter", str(mixed), str(tmp_path / "o.h5"), "--log", str(logs)]) == 2
    assert capsys.readouterr().err.strip() == f"peat alter: error: --log {logs}: is a directory; name the log file"
    assert not (tmp_path / "o.h5").exists()


def test_an_input_another_process_holds_open_for_writing_is_named_as_locked(mixed, tmp_path, capsys):
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", f"import h5py, sys; f = h5py.File({str(mixed)!r}, 'a'); "
                               "print('open', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        for argv in (["alter", str(mixed), str(tmp_path / "o.h5")], ["h5diff", str(mixed), str(mixed)]):
            assert main(argv) == 2
            err = capsys.readouterr().err.strip()
            if "locked" not in err and os.environ.get("HDF5_USE_FILE_LOCKING", "").upper() == "FALSE":
                pytest.skip("HDF5 file locking is off")
            assert err == (f"peat {argv[0]}: error: {mixed}: locked by another process that has it open "
                           "(HDF5 file locking); retry once it is closed")
    finally:
        holder.communicate("")
    assert not (tmp_path / "o.h5").exists()


def test_too_little_space_to_rewrite_chunked_datasets_fails_with_one_line(mixed, tmp_path, monkeypatch, capsys):
    # HDF5 crashes the process (segmentation fault) closing a file whose chunk write ran out of space.
    real = A.shutil.disk_usage
    monkeypatch.setattr(A.shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    assert main(["alter", str(mixed), str(tmp_path / "o.h5"), "--select", "chunked/data"]) == 2
    assert capsys.readouterr().err.strip() == ("peat alter: error: [Errno 28] No space left on device to rewrite the "
                                               f"chunked datasets of {mixed} (0.0 MiB free, up to 1.0 MiB needed): "
                                               f"'{tmp_path}'")
    assert sorted(tmp_path.iterdir()) == [mixed]


@pytest.mark.parametrize("rows, message", [
    ([{"dataset": "/x", "index": [3], "bit": [9, 9]}], r"log\.json: injection 0 lists bit 9 twice"),
    ([{"dataset": "/x", "index": [3], "bit": 9}, {"dataset": "/x", "index": [3], "bit": 10}],
     r"log\.json alters /x at index \[3\] twice: give one injection per value \(a list of bits\)"),
])
def test_a_log_that_flips_a_bit_or_alters_a_value_twice_fails_with_one_line(tmp_path, rows, message):
    # Concatenated or hand-written logs: the same bit twice carried into the next bit, and of two
    # injections into one value only the last was applied, while the log listed both.
    src, log = tmp_path / "in.h5", tmp_path / "log.json"
    with h5py.File(src, "w") as f:
        f["x"] = np.ones(8, np.float32)
    log.write_text(json.dumps({"injections": rows}))
    with pytest.raises(PeatError, match=message):
        A.alter(src, tmp_path / "o.h5", A.Plan(), replay=log)
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.parametrize("index", [8, -1, 2**70, -(2**70)])
def test_a_log_index_outside_the_dataset_fails_with_one_line(tmp_path, index):
    """An index beyond int64 (a hand-written log) failed with numpy's OverflowError and a traceback."""
    src, log = tmp_path / "in.h5", tmp_path / "log.json"
    with h5py.File(src, "w") as f:
        f["x"] = np.ones(8, np.float32)
    log.write_text(json.dumps({"injections": [{"dataset": "/x", "index": [index], "bit": 1}]}))
    with pytest.raises(PeatError, match=r"log\.json has an index outside /x of shape \(8,\)$"):
        A.alter(src, tmp_path / "o.h5", A.Plan(), replay=log)
    assert not (tmp_path / "o.h5").exists()


def test_region_sign_with_no_sign_change_fails_with_one_line_naming_both(mixed, tmp_path, capsys):
    assert main(["alter", str(mixed), str(tmp_path / "o.h5"), "--region", "sign", "--no-sign-change"]) == 2
    assert capsys.readouterr().err.strip() == "peat alter: error: --region sign flips only sign bits: it contradicts --no-sign-change"
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.parametrize("scale", ["-2", "-0"])
def test_a_negative_scale_with_no_sign_change_fails_with_one_line(mixed, tmp_path, capsys, scale):
    """--scale -0 passed the check (-0.0 < 0 is false) and turned every positive value into -0.0."""
    assert main(["alter", str(mixed), str(tmp_path / "o.h5"), "--scale", scale, "--no-sign-change"]) == 2
    assert capsys.readouterr().err.strip() == (f"peat alter: error: --scale {float(scale)} changes every sign: "
                                               "it contradicts --no-sign-change")
    assert not (tmp_path / "o.h5").exists()


def test_selecting_a_dataset_peat_never_alters_says_why(tmp_path):
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f["empty"] = np.zeros(0, np.float32)
        f["flags"] = np.ones(4, bool)
        f["pairs"] = np.zeros(4, [("a", "f4"), ("b", "i4")])
        # Its integers were flipped as plain integers: -126 in a RED/GREEN/BLUE colour.
        f.create_dataset("colour", data=np.arange(3, dtype="i1"), dtype=h5py.enum_dtype({"RED": 0, "GREEN": 1, "BLUE": 2}))
        f["w"] = np.ones(4, np.float32)
    for name, reason in (("empty", "it has no values"), ("flags", "bool values"), ("pairs", "compound values"),
                         ("colour", "enum values")):
        with pytest.raises(PeatError, match=rf"{src}: '{name}' names {name}, which peat never alters \({reason}\)$"):
            run_alter(src, tmp_path / "o.h5", select=[name])
    with pytest.raises(PeatError, match="no numeric dataset matches 'nothing'"):
        run_alter(src, tmp_path / "o.h5", select=["nothing"])
    assert not (tmp_path / "o.h5").exists()
    assert {r["dataset"] for r in run_alter(src, tmp_path / "o.h5", count=4).records} == {"/w"}  # all of them
    log = tmp_path / "enum.json"
    log.write_text(json.dumps({"injections": [{"dataset": "/colour", "index": [1], "bit": 0, "old": 1, "new": -127}]}))
    with pytest.raises(PeatError, match=rf"{src}: log {log} names colour, which peat never alters \(enum values\)$"):
        A.alter(src, tmp_path / "o2.h5", A.Plan(), replay=log)
    assert A.diff(src, tmp_path / "o.h5")["datasets"][0]["dataset"] == "/colour"  # h5diff still compares them


def test_a_full_disk_writing_the_log_names_the_log(mixed, tmp_path, monkeypatch, capsys):
    import errno

    def full(self, mode="r", *args, **kwargs):  # a write error carries no file name
        if "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return opened(self, mode, *args, **kwargs)

    opened = Path.open
    monkeypatch.setattr(Path, "open", full)
    log = tmp_path / "logs" / "l.json"
    assert main(["alter", str(mixed), str(tmp_path / "out" / "o.h5"), "--log", str(log)]) == 2
    assert capsys.readouterr().err.strip() == f"peat alter: error: [Errno 28] No space left on device: '{log}'"
    assert sorted(tmp_path.iterdir()) == [mixed]  # no output, no log, and no folder made for them


def test_the_timing_line_shows_the_log_time_when_there_is_a_log(mixed, tmp_path, capsys):
    # Writing the log of a million flips takes seconds, far more than drawing and flipping them.
    assert main(["alter", str(mixed), str(tmp_path / "o.h5"), "--log", str(tmp_path / "l.json")]) == 0
    assert re.search(r"flips \d+\.\d{3} s, log \d+\.\d{3} s\)$", capsys.readouterr().out.strip())
    assert main(["alter", str(mixed), str(tmp_path / "o.h5")]) == 0
    assert re.search(r"flips \d+\.\d{3} s\)$", capsys.readouterr().out.strip())


def test_selecting_a_group_says_how_to_select_its_datasets(mixed, tmp_path):
    for pattern in ("model", "/model/"):
        with pytest.raises(PeatError, match=rf"{mixed}: '{pattern}' names the group model: select its datasets "
                                            r"with 'model/\*'$"):
            run_alter(mixed, tmp_path / "o.h5", select=[pattern])
    assert not (tmp_path / "o.h5").exists()


def test_selecting_an_external_link_or_a_dangling_one_says_what_it_names(tmp_path):
    other, src = tmp_path / "other.h5", tmp_path / "in.h5"
    with h5py.File(other, "w") as f:
        f["g/x"] = np.ones(3, np.float32)
    with h5py.File(src, "w") as f:
        f["w"] = np.ones(3, np.float32)
        f["ext"] = h5py.ExternalLink(str(other), "/g")
        f["dangling"] = h5py.SoftLink("/nothing")
        f["chain"] = h5py.SoftLink("/alias")
        f["alias"] = h5py.SoftLink("w")  # relative
    for pattern in ("ext", "ext/x"):
        with pytest.raises(PeatError, match=rf"'{pattern}' names {pattern}, in another file through an external link; "
                                            rf"only {src}'s own datasets are altered$"):
            run_alter(src, tmp_path / "o.h5", select=[pattern])
    with pytest.raises(PeatError, match="no numeric dataset matches 'dangling'; datasets: w$"):  # not "select nothing"
        run_alter(src, tmp_path / "o.h5", select=["dangling"])
    with pytest.raises(PeatError, match=r"'chain' names chain, a link to w .*: select w$"):
        run_alter(src, tmp_path / "o.h5", select=["chain"])
    assert not (tmp_path / "o.h5").exists()


def test_nonfinite_injected_counts_only_values_the_flips_made_nonfinite(tmp_path):
    """A study cell's nonfinite_injected counted every altered value logged as NaN/Inf, a NaN whose
    mantissa flip left it NaN too: a checkpoint holding NaN read as flips that injected them."""
    src = tmp_path / "c.h5"
    with h5py.File(src, "w") as f:
        f["w"] = np.array([np.nan] * 4 + [1.0] * 4, dtype=np.float32)
    mantissa = A.alter(src, tmp_path / "m.h5", A.Plan(count=8, region="mantissa", seed=0), keep_records=True).records
    # Every value flipped once: each NaN stays NaN (the old count: 4), each 1.0 stays finite.
    assert sum(r["new"] == "nan" for r in mantissa) == 4 and S.made_nonfinite(mantissa) == 0
    msb = A.alter(src, tmp_path / "e.h5", A.Plan(count=8, bits=(1, 1), seed=0), keep_records=True).records
    # The exponent MSB makes each 1.0 +inf and each NaN 1.5: four made non-finite.
    assert sorted(map(str, (r["new"] for r in msb))) == ["1.5"] * 4 + ["inf"] * 4 and S.made_nonfinite(msb) == 4
