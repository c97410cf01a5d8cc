"""peat alter / h5diff checked against an independent reading of the README (h5py and numpy only).

Every plan is applied to one small file holding every dtype and storage peat alters; the output is
then compared with the input element by element, from the README's bit table, without peat's code.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest

from peat import alter as A
from peat import alter_study as S
from peat.io import PeatError

# The README's table: (width, sign, exponent range, mantissa range) in peat's numbering (bit 0 = MSB).
FIELDS = {
    "float16": (16, (0, 0), (1, 5), (6, 15)),
    "bfloat16": (16, (0, 0), (1, 8), (9, 15)),
    "float32": (32, (0, 0), (1, 8), (9, 31)),
    "float64": (64, (0, 0), (1, 11), (12, 63)),
}
CLASS_OF = {  # what the README's class list says of each dataset below
    "/model/conv1.weight": "weight", "/model/bn1.weight": "norm_weight", "/model/bn1.running_var": "norm_stats",
    "/model/emb.weight": "embedding", "/model/fc.bias": "bias", "/model/fc.weight_bf16": "weight",
    "/optimizer/state/0/exp_avg": "optimizer", "/optimizer/state/0/step": "optimizer",
}


def _bf16(x) -> np.ndarray:
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def make_source(path: Path) -> Path:
    """Every dtype and storage: contiguous, chunked+gzip, scalar, one element, nested, big-endian, specials."""
    rng = np.random.default_rng(5)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 65504.0, 1.0, -2.5, 3e38], np.float32)
    with h5py.File(path, "w") as f:
        f.attrs["note"] = "root attr"
        w = f.create_dataset("model/conv1.weight", data=rng.standard_normal((4, 3, 3, 3), np.float32))
        w.attrs.update(module_type="Conv2d", kind="parameter")
        bn = f.create_dataset("model/bn1.weight", data=np.concatenate([special, np.ones(6, np.float32)]))
        bn.attrs.update(module_type="BatchNorm2d", kind="parameter")
        rv = f.create_dataset("model/bn1.running_var", data=rng.random(16).astype(np.float32))
        rv.attrs.update(module_type="BatchNorm2d", kind="buffer")
        with np.errstate(over="ignore"):  # 3e38: inf in float16
            half = special.astype(np.float16)
        emb = f.create_dataset("model/emb.weight", data=np.concatenate([half, rng.standard_normal(30).astype(np.float16)]))
        emb.attrs.update(module_type="Embedding", kind="parameter")
        b = f.create_dataset("model/fc.bias", data=np.concatenate([special.astype(np.float64), rng.standard_normal(7)]))
        b.attrs.update(module_type="Linear", kind="parameter")
        bf = f.create_dataset("model/fc.weight_bf16", data=_bf16(np.concatenate([special, rng.standard_normal(20)])))
        bf.attrs.update(module_type="Linear", kind="parameter")
        f["model"].attrs["epoch"] = 3
        f.create_dataset("optimizer/state/0/exp_avg", data=rng.standard_normal((32, 8)).astype(np.float32),
                         chunks=(8, 8), compression="gzip", shuffle=True)
        f.create_dataset("optimizer/state/0/step", data=np.int64(12))  # scalar
        f.create_dataset("counters/i8", data=rng.integers(-128, 128, 9).astype(np.int8))
        f.create_dataset("counters/u8", data=rng.integers(0, 256, 9).astype(np.uint8))
        f.create_dataset("counters/i32be", data=rng.integers(-1000, 1000, 6).astype(">i4"))
        f.create_dataset("counters/u16", data=rng.integers(0, 60000, 5).astype(np.uint16))
        f.create_dataset("one", data=np.array([7.5], np.float32))
        f.create_dataset("empty", data=np.zeros(0, np.float32))
        f.create_dataset("deep/a/b/c/x", data=rng.standard_normal(5).astype(">f8"), chunks=(2,), compression="gzip")
        f["deep/a"].attrs["tag"] = np.arange(3)
        f.create_dataset("history", data=json.dumps([{"epoch": 1}]))
    return path


def _compact(f: h5py.File, name: str, data: np.ndarray) -> None:
    """A compact dataset (its values in the object header), which h5py's high-level API cannot make."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.COMPACT)
    # No modification time, as h5py's own datasets: HDF5 stamps one into a version-2 header at each
    # write, so that two runs of the same plan differ (the README's exception to byte-identical reruns).
    dcpl.set_obj_track_times(False)
    space = h5py.h5s.create_simple(data.shape)
    ds = h5py.h5d.create(f.id, name.encode(), h5py.h5t.py_create(data.dtype), space, dcpl=dcpl)
    ds.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data))


def make_storages(path: Path, **kw) -> Path:
    """Storage peat edits otherwise: a user block, compact, partly written chunks, lossless filters."""
    rng = np.random.default_rng(6)
    with h5py.File(path, "w", **kw) as f:
        f.attrs["made_by"] = "not peat"
        _compact(f, "compact_f32", rng.standard_normal(12).astype(np.float32))
        _compact(f, "compact_i16", rng.integers(-300, 300, 7).astype(np.int16))
        part = f.create_dataset("partial", shape=(40, 6), maxshape=(None, 6), chunks=(8, 6), dtype=np.float32,
                                fillvalue=0.5)
        part[:8] = rng.standard_normal((8, 6))  # 4 of 5 chunks never written
        f.create_dataset("so_int", data=rng.integers(0, 1000, 30).astype(np.int32), scaleoffset=0)
        f.create_dataset("fletcher", data=rng.standard_normal(20), chunks=(5,), fletcher32=True)
        f.create_dataset("never_written", shape=(6,), dtype=np.float32, fillvalue=2.0)
        f.create_dataset("plain", data=rng.standard_normal((3, 5)).astype(np.float32))
        f["wide/u64"] = rng.integers(0, 2**64 - 1, 6, dtype=np.uint64, endpoint=True)
        f["wide/i64be"] = rng.integers(-2**63, 2**63 - 1, 6, dtype=np.int64).astype(">i8")
        f["wide/f16be"] = rng.standard_normal(6).astype(">f2")
        f.create_dataset("wide/be_bf16", data=_bf16(rng.standard_normal(6)).astype(">u2"))
        f["z_hard_link"] = f["plain"]  # one dataset, three names: altered once
        f["z_soft_link"] = h5py.SoftLink("/plain")
    return path


STORAGE_PLANS = [dict(count=1), dict(count=30, seed=1), dict(count=60, seed=2, region="mantissa"),
                 dict(fraction=0.25, seed=3, bits=(1, 1)), dict(count=10, burst=3, no_nonfinite=True, seed=4),
                 dict(count=20, scale=-0.5, seed=5), dict(count=5, select=["partial"], seed=6),
                 dict(count=4, select=["compact_f32", "compact_i16"], seed=7), dict(count=2, select=["never_written"]),
                 dict(fraction=1.0, bits=(0, 0), seed=8)]
KINDS = {"userblock": {"userblock_size": 512}, "latest": {"libver": "latest"}, "track_order": {"track_order": True}}


@pytest.mark.parametrize("spec", STORAGE_PLANS, ids=[json.dumps(p, sort_keys=True) for p in STORAGE_PLANS])
def test_plan_alters_every_storage_exactly(tmp_path, spec):
    check_plan(make_storages(tmp_path / "in.h5"), tmp_path, spec)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", STORAGE_PLANS[:3], ids=[json.dumps(p, sort_keys=True) for p in STORAGE_PLANS[:3]])
def test_plan_alters_files_of_every_layout_exactly(tmp_path, kind, spec):
    check_plan(make_storages(tmp_path / "in.h5", **KINDS[kind]), tmp_path, spec)


def test_a_never_written_dataset_of_a_file_with_a_user_block(tmp_path):
    """HDF5's undefined address of unallocated data wraps around to userblock_size - 1 there: peat
    took it for the values' offset and wrote the flip into the superblock (the output would not open)."""
    src = tmp_path / "in.h5"
    with h5py.File(src, "w", userblock_size=512) as f:
        f.create_dataset("w", shape=(4,), dtype=np.float32, fillvalue=1.0)
        f["v"] = np.arange(3, dtype=np.float32)
    A.alter(src, tmp_path / "out.h5", A.Plan(count=1, select=["w"], bits=(0, 0)))
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert sorted(f["w"][()].tolist()) == [-1.0, 1.0, 1.0, 1.0] and f["v"][()].tolist() == [0.0, 1.0, 2.0]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("src") / "in.h5")


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --- an independent reading of a file ----------------------------------------------------------


def kind_of(ds: h5py.Dataset) -> str | None:
    """The README's layout name of a dataset, or None where peat never alters it."""
    dt = ds.dtype
    if ds.shape is None or ds.size == 0 or dt.kind not in "fiu":
        return None
    if dt.kind == "u" and dt.itemsize == 2 and (ds.attrs.get("dtype") in ("bfloat16", "bf16")
                                                 or ds.name.lower().endswith(("bf16", "bfloat16"))):
        return "bfloat16"
    return f"{'float' if dt.kind == 'f' else dt.kind + 'nt' if dt.kind == 'i' else 'uint'}{8 * dt.itemsize}"


def width_of(kind: str) -> int:
    return FIELDS[kind][0] if kind in FIELDS else int(kind.lstrip("uint"))


def region_bits(kind: str, region: str) -> tuple[int, int] | None:
    w = width_of(kind)
    if region == "any":
        return 0, w - 1
    if kind in FIELDS:
        return dict(zip(("sign", "exponent", "mantissa"), FIELDS[kind][1:]))[region]
    signed = kind.startswith("int")
    return {"sign": (0, 0) if signed else None, "exponent": None, "mantissa": (1 if signed else 0, w - 1)}[region]


def read_all(path) -> dict:
    """Per numeric dataset: (kind, shape, flat unsigned bits in native order)."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and (kind := kind_of(obj)):
                data = np.asarray(obj[()])
                data = data.astype(data.dtype.newbyteorder("="))
                out["/" + name] = (kind, obj.shape, data.reshape(-1).view(f"u{data.dtype.itemsize}").copy())
        f.visititems(visit)
    return out


def everything_else(path) -> dict:
    """Every attribute of every object and every non-numeric dataset, as bytes/values."""
    out = {}
    with h5py.File(path, "r") as f:
        def add(name, obj):
            for k, v in obj.attrs.items():
                out[f"{name}@{k}"] = repr(v)
            if isinstance(obj, h5py.Dataset) and kind_of(obj) is None:
                out[name] = repr(obj[()]) if obj.shape is not None else "null"
            out[f"{name}#type"] = type(obj).__name__
        add("/", f)
        f.visititems(add)
    return out


def value(bits: int, kind: str) -> float | int:
    """A stored element's value, from its bits (bfloat16 is the upper half of a float32)."""
    w = width_of(kind)
    if kind == "bfloat16":
        return float(np.array([bits << 16], np.uint32).view(np.float32)[0])
    if kind in FIELDS:
        return float(np.array([bits], f"u{w // 8}").view(f"f{w // 8}")[0])
    return int(np.array([bits], f"u{w // 8}").view(kind)[0])


def as_logged(x):
    return x if not isinstance(x, float) or math.isfinite(x) else str(x)


def flipped_bits(xor: int, width: int) -> list[int]:
    return [b for b in range(width) if xor >> (width - 1 - b) & 1]


def changes(a, b) -> dict:
    """(dataset, index) -> (kind, old bits, new bits) for every element that differs bit for bit."""
    ra, rb = read_all(a), read_all(b)
    assert ra.keys() == rb.keys()
    out = {}
    for name, (kind, shape, x) in ra.items():
        y = rb[name][2]
        for pos in np.flatnonzero(x != y):
            index = list(np.unravel_index(pos, shape)) if shape else []
            out[(name, tuple(int(i) for i in index))] = (kind, int(x[pos]), int(y[pos]))
    return out


# --- what a plan should do, from the README ------------------------------------------------------


def candidates(kind: str, plan: A.Plan) -> list[int]:
    """Every XOR mask the plan may apply to a value of this kind (none: not eligible)."""
    w = width_of(kind)
    span = plan.bits if plan.bits else region_bits(kind, plan.region or "any")
    if span is None or span[1] >= w:
        return []
    pattern = [i for i, c in enumerate(plan.mask) if c == "1"] if plan.mask else list(range(plan.burst))
    size = len(plan.mask) if plan.mask else plan.burst
    signed = kind in FIELDS or kind.startswith("int")
    masks = []
    for start in range(span[0], span[1] - size + 2):
        bits = [start + o for o in pattern]
        if not plan.sign_change and signed and 0 in bits:
            continue
        masks.append(sum(1 << (w - 1 - b) for b in bits))
    return masks


def finite(bits: int, kind: str) -> bool:
    """Not NaN or Inf: an exponent field of all ones (integers always are)."""
    if kind not in FIELDS:
        return True
    w, _, (lo, hi), _ = FIELDS[kind]
    ones = (1 << (hi - lo + 1)) - 1
    return (bits >> (w - 1 - hi)) & ones != ones


def eligible_values(path, plan: A.Plan, classes: dict) -> dict:
    """(dataset, flat position) -> its candidate masks, for every value the plan may alter."""
    out = {}
    for name, (kind, _, bits) in read_all(path).items():
        if plan.select and name not in {"/" + p.lstrip("/") for p in plan.select}:
            continue
        if plan.classes and classes.get(name, "other") not in plan.classes:
            continue
        if plan.scale is not None:
            for pos, x in enumerate(bits.tolist()):
                new = scaled_bits(int(x), kind, plan.scale) if kind in FIELDS else None
                if new is not None and new != x and (plan.nonfinite or finite(int(x), kind) and finite(new, kind)):
                    out[(name, pos)] = [new ^ int(x)]
            continue
        masks = candidates(kind, plan)
        for pos, x in enumerate(bits.tolist()):
            ok = masks if plan.nonfinite else [m for m in masks if finite(int(x) ^ m, kind)]
            if ok:
                out[(name, pos)] = ok
    return out


PRECISION = {"float16": (11, 15), "bfloat16": (8, 127), "float32": (24, 127), "float64": (53, 1023)}


def rounded(x: Fraction, kind: str) -> float:
    """x rounded once to the nearest value of a float kind, ties to even (IEEE 754), as a float."""
    if x == 0:
        return float(x)
    digits, emax = PRECISION[kind]
    e = max(abs(x.numerator).bit_length() - x.denominator.bit_length(), 1 - emax)  # within 1 of log2|x|
    while abs(x) >= Fraction(2) ** (e + 1):
        e += 1
    while e > 1 - emax and abs(x) < Fraction(2) ** e:
        e -= 1
    ulp = Fraction(2) ** (e - digits + 1)
    q = round(x / ulp) * ulp  # round() of a Fraction: halves to even
    top = (2 - Fraction(2) ** (1 - digits)) * Fraction(2) ** emax
    return (-1.0 if x < 0 else 1.0) * (math.inf if abs(q) > top else float(abs(q)))  # an underflow keeps its sign


def scaled_bits(bits: int, kind: str, factor: float) -> int | None:
    """The bits of a value multiplied by factor, the product rounded once (None: a NaN stays one)."""
    v = value(bits, kind)
    if math.isnan(v):
        return None
    new = v * factor if math.isinf(v) or v == 0 else rounded(Fraction(v) * Fraction(factor), kind)
    if kind == "bfloat16":
        return int(np.array([new], np.float32).view(np.uint32)[0]) >> 16
    w = width_of(kind)
    return int(np.array([new], f"f{w // 8}").view(f"u{w // 8}")[0])


def expected_count(plan: A.Plan, total: int) -> int | None:
    if plan.fraction is not None:
        return int((Decimal(str(plan.fraction)) * total).to_integral_value(ROUND_HALF_UP))
    if plan.probability is not None:  # a binomial draw: checked through the log, but for 0 and 1
        return {0: 0, 1: total}.get(plan.probability)
    return plan.count or 1


PLANS = [
    dict(count=1), dict(count=40, seed=3), dict(count=5, region="sign"), dict(count=30, region="exponent", seed=1),
    dict(count=30, region="mantissa", seed=2), dict(count=12, bits=(1, 1)), dict(count=9, bits=(2, 8), seed=4),
    dict(count=8, bits=(9, 31)), dict(count=4, bits=(40, 63)), dict(count=20, burst=3, seed=5),
    dict(count=20, mask="101", region="mantissa", seed=6), dict(count=10, mask="11", bits=(0, 3), seed=7),
    dict(count=25, no_sign=True, seed=8), dict(count=25, burst=2, no_sign=True, region="any", seed=9),
    dict(count=60, no_nonfinite=True, seed=10), dict(count=30, no_nonfinite=True, region="exponent", seed=11),
    dict(count=15, no_nonfinite=True, bits=(1, 1), seed=12), dict(count=10, burst=4, no_nonfinite=True, seed=13),
    dict(fraction=0.1, seed=14), dict(fraction=0.5, region="sign", seed=15), dict(fraction=1.0, bits=(0, 0)),
    dict(probability=0.2, seed=16), dict(probability=1.0, region="sign"), dict(probability=0.0),
    dict(fraction=0.0), dict(fraction=0.001, seed=2), dict(fraction=0.003, seed=2), dict(count=3, classes=["weight"], bits=(1, 1)),
    dict(count=6, classes=["optimizer"], seed=17), dict(count=4, classes=["norm_weight", "bias"], seed=18),
    dict(count=5, classes=["embedding"], region="exponent"), dict(count=2, classes=["norm_stats"]),
    dict(count=7, select=["optimizer/state/0/exp_avg"], region="mantissa"), dict(count=1, select=["one"]),
    dict(count=1, select=["optimizer/state/0/step"]), dict(count=3, select=["deep/a/b/c/x"], bits=(1, 1)),
    dict(count=9, select=["counters/i8"], region="mantissa"), dict(count=6, select=["counters/i32be"], bits=(0, 31)),
    dict(count=5, select=["counters/u16"], region="any", burst=16), dict(count=9, select=["counters/u8"], seed=19),
    dict(count=12, select=["model/fc.bias"], region="exponent", no_nonfinite=True, seed=20),
    dict(count=30, select=["model/fc.weight_bf16"], region="exponent", seed=21),
    dict(count=30, select=["model/emb.weight"], no_nonfinite=True, region="any", burst=2, seed=22),
    dict(count=8, scale=-3.0), dict(count=8, scale=1e30, select=["model/emb.weight"], seed=23),
    dict(count=10, scale=1.01, select=["model/fc.weight_bf16"], seed=24),
    dict(count=6, scale=1e300, no_nonfinite=True, seed=25),
]


def make_plan(spec: dict) -> A.Plan:
    spec = dict(spec)
    sign, nonfinite = not spec.pop("no_sign", False), not spec.pop("no_nonfinite", False)
    return A.Plan(sign_change=sign, nonfinite=nonfinite, **spec)


def check_plan(src: Path, tmp: Path, spec: dict) -> None:
    plan = make_plan(spec)
    out, log = tmp / "out.h5", tmp / "log.json"
    before = sha(src)
    result = A.alter(src, out, plan, log=log, keep_records=True)
    assert sha(src) == before
    injections = json.loads(log.read_text())["injections"]
    eligible = eligible_values(src, plan, CLASS_OF)
    want = expected_count(plan, len(eligible))
    got = changes(src, out)
    # Every injected value differs bit for bit; each once.
    assert len(got) == len(injections) == result.flips
    assert want is None or len(got) == want
    assert everything_else(src) == everything_else(out)
    logged = {}
    for row in injections:
        key = (row["dataset"], tuple(row["index"]))
        assert key not in logged, f"{key} injected twice"
        logged[key] = row
    assert got.keys() <= logged.keys()
    shapes = {name: shape for name, (_, shape, _) in read_all(src).items()}
    for key, row in logged.items():
        kind, old, new = got[key] if key in got else (None, None, None)
        assert key in got, f"{key}: logged, yet identical in the output"
        pos = int(np.ravel_multi_index(key[1], shapes[key[0]])) if key[1] else 0
        assert row["old"] == as_logged(value(old, kind)) and row["new"] == as_logged(value(new, kind))
        assert (key[0], pos) in eligible and (old ^ new) in eligible[(key[0], pos)], (spec, row)
        if plan.scale is not None:
            assert row["bit"] is None
            continue
        bits = flipped_bits(old ^ new, width_of(kind))
        assert row["bit"] == (bits[0] if len(bits) == 1 else bits)
        if not plan.nonfinite:
            assert finite(new, kind)
    # The same seed gives the same file; the log's replay too.
    A.alter(src, tmp / "again.h5", plan)
    assert sha(tmp / "again.h5") == sha(out)
    A.alter(src, tmp / "replayed.h5", A.Plan(), replay=log)
    assert sha(tmp / "replayed.h5") == sha(out)
    # --in-place alters the input the same way, keeping its mode.
    inplace = tmp / "inplace.h5"
    shutil.copyfile(src, inplace)
    inplace.chmod(0o640)
    A.alter(inplace, None, plan, in_place=True)
    assert sha(inplace) == sha(out) and inplace.stat().st_mode & 0o777 == 0o640
    header = json.loads(log.read_text())
    assert {k: header[k] for k in ("tool", "format", "input", "scale")} == {
        "tool": "peat alter", "format": 1, "input": str(src), "scale": plan.scale}
    assert header["plan"]["seed"] == plan.seed and header["bit_numbering"].startswith("bit 0 = most significant")
    # h5diff reports the same elements and bits.
    d = A.diff(src, out, positions=True)
    # A scaled value's log row has no bit (None); h5diff names the bits that changed.
    unbit = (lambda r: {**r, "bit": None}) if plan.scale is not None else (lambda r: r)
    canon = lambda rows: sorted(json.dumps(unbit(r), sort_keys=True) for r in rows)  # noqa: E731
    assert canon(d["positions"]) == canon(injections)
    per = {r["dataset"]: r for r in d["datasets"] if "differing" in r}
    for name in {k[0] for k in got}:
        keys = [k for k in got if k[0] == name]
        assert per[name]["differing"] == len(keys)
        hist: dict[str, int] = {}
        for k in keys:
            kind, old, new = got[k]
            for bit in flipped_bits(old ^ new, width_of(kind)):
                hist[str(bit)] = hist.get(str(bit), 0) + 1
        assert per[name]["bits"] == dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        assert {k: per[name][k] for k in STATS} == diff_stats([got[k] for k in keys]), name


STATS = ("max_rel", "mean_rel", "euclidean", "nonfinite_new")


def diff_stats(pairs: list) -> dict:
    """h5diff's numeric columns, from the README's words, over (kind, old bits, new bits) pairs that differ."""
    values = [(Fraction(a), Fraction(b)) if isinstance(a, int) else (a, b)
              for a, b in ((value(x, k), value(y, k)) for k, x, y in pairs)]
    fin = [(a, b) for a, b in values if math.isfinite(a) and math.isfinite(b)]
    rel = [0.0 if a == b else math.inf if a == 0 else big_float(abs(Fraction(b) - Fraction(a)) / abs(Fraction(a)))
           for a, b in fin]
    out = {"nonfinite_new": sum(not math.isfinite(b) for _, b in values)}
    if not fin:
        return {**out, "max_rel": "n/a", "mean_rel": "n/a", "euclidean": "n/a"}
    finite_rel = [r for r in rel if math.isfinite(r)]
    deltas = [abs(Fraction(b) - Fraction(a)) for a, b in fin]
    top = max(deltas)
    euclid = top and big_float(top) * math.sqrt(float(sum((d / top) ** 2 for d in deltas)))
    logged = lambda x: pytest.approx(x, rel=1e-12) if math.isfinite(x) else str(x)  # noqa: E731
    return {**out, "max_rel": logged(max(rel)), "euclidean": logged(euclid),
            "mean_rel": logged(sum(finite_rel) / len(finite_rel) if finite_rel else math.inf)}


def big_float(x: Fraction) -> float:
    try:
        return float(x)
    except OverflowError:  # beyond float64: h5diff's float64 arithmetic reads inf
        return math.inf


@pytest.mark.parametrize("spec", PLANS, ids=[json.dumps(p, sort_keys=True) for p in PLANS])
def test_plan_alters_exactly_what_the_readme_says(source, tmp_path, spec):
    check_plan(source, tmp_path, spec)


# Factors whose exact product with the value lies just past a halfway point of the dtype, and whose
# product rounded to float64 lands on it: (kind, value, factor, the correctly rounded product).
TIES = [("float32", 3.0, 1 + (2**29 + 1) // 3 * 2.0**-52, 3 + 2.0**-22),
        ("float16", 5.0, 1 + (2**43 + 2) // 5 * 2.0**-52, 5 + 2.0**-8),
        ("bfloat16", 3.0, 1 + (2**45 + 1) // 3 * 2.0**-52, 3 + 2.0**-6),
        ("float32", -3.0, 1 + (2**29 + 1) // 3 * 2.0**-52, -3 - 2.0**-22)]


@pytest.mark.parametrize("kind,old,factor,new", TIES)
def test_scale_rounds_the_exact_product_once(tmp_path, kind, old, factor, new):
    """The product was rounded to float64, then to the dtype: twice, the second time from a tie
    the first one made, the wrong way; the value stayed as it was and counted as not eligible."""
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        if kind == "bfloat16":
            f.create_dataset("w", data=_bf16([old])).attrs["dtype"] = "bfloat16"
        else:
            f["w"] = np.array([old], kind)
    assert rounded(Fraction(old) * Fraction(factor), kind) == new  # the reference agrees
    A.alter(src, tmp_path / "out.h5", A.Plan(count=1, scale=factor), log=tmp_path / "log.json")
    assert json.loads((tmp_path / "log.json").read_text())["injections"][0]["new"] == new


def chi2(observed: list[int], expected: list[float]) -> float:
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected))


def loose_bound(dof: int) -> float:
    """Far above the chi-square quantiles a uniform draw reaches (mean dof, sd sqrt(2 dof))."""
    return dof + 6 * math.sqrt(2 * dof)


def test_positions_and_bits_are_uniform(tmp_path):
    """Positions uniform over all eligible values (datasets in proportion to their size), each
    value once; the bit uniform over the region."""
    src = tmp_path / "in.h5"
    sizes = {"a": 10, "b": 90, "c": 900}
    with h5py.File(src, "w") as f:
        for name, n in sizes.items():
            f[name] = np.linspace(-2, 2, n, dtype=np.float32)
    per_set, per_bit = dict.fromkeys(sizes, 0), [0] * 32
    for seed in range(20):
        out = tmp_path / f"o{seed}.h5"
        A.alter(src, out, A.Plan(fraction=0.1, seed=seed))
        got = changes(src, out)
        assert len(got) == 100
        for (name, _), (_, old, new) in got.items():
            per_set[name.lstrip("/")] += 1
            (bit,) = flipped_bits(old ^ new, 32)
            per_bit[bit] += 1
    assert chi2(list(per_set.values()), [2000 * n / 1000 for n in sizes.values()]) < loose_bound(2)
    assert chi2(per_bit, [2000 / 32] * 32) < loose_bound(31)


def test_no_nonfinite_draws_uniformly_among_the_flips_that_stay_finite(tmp_path):
    """1.0 (float32): its exponent MSB gives inf, each other exponent bit a finite value."""
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f["x"] = np.ones(700, np.float32)
    out = tmp_path / "o.h5"
    A.alter(src, out, A.Plan(count=700, region="exponent", nonfinite=False, seed=3))
    per_bit = [0] * 9
    for _, old, new in changes(src, out).values():
        (bit,) = flipped_bits(old ^ new, 32)
        per_bit[bit] += 1
    assert per_bit[:2] == [0, 0] and sum(per_bit) == 700
    assert chi2(per_bit[2:], [100] * 7) < loose_bound(6)


BAD = [  # options after IN OUT, and a word of the one line that must say why
    (["--count", "0"], "--count"), (["--count", "-3"], "--count"), (["--fraction", "1.5"], "--fraction"),
    (["--probability", "-0.1"], "--probability"), (["--bits", "5-3"], "--bits"), (["--bits", "0-64"], "--bits"),
    (["--bits", "x"], "--bits"), (["--region", "sign", "--bits", "0-0"], "--region"), (["--burst", "0"], "--burst"),
    (["--burst", "65"], "--burst"), (["--mask", "102"], "--mask"), (["--mask", "000"], "--mask"),
    (["--mask", "11", "--burst", "2"], "--mask"), (["--scale", "nan"], "--scale"),
    (["--scale", "2", "--region", "sign"], "--scale"), (["--region", "sign", "--no-sign-change"], "--no-sign-change"),
    (["--scale", "-2", "--no-sign-change"], "--no-sign-change"), (["--class", "bogus"], "--class"),
    (["--seed", "-1"], "--seed"), (["--count", "2", "--fraction", "0.1"], "--fraction"),
    (["--select", "nothing_here"], "nothing_here"), (["--select", "re:("], "re:("),
    (["--select", "one", "--count", "2"], "eligible"), (["--select", "empty"], "no values"),
    (["--select", "history"], "string"), (["--select", "deep/a"], "group"),
    (["--select", "counters/u8", "--region", "exponent"], "--region exponent"),
    (["--select", "model/emb.weight", "--bits", "16-16"], "--bits 16-16"),
    (["--select", "counters/i8", "--mask", "1000000001"], "--mask"),
    (["--select", "counters/u8", "--scale", "2"], "--scale"),
    (["--select", "model/bn1.weight", "--count", "17", "--bits", "1-1", "--no-nonfinite"], "eligible"),
    (["--class", "norm_stats", "--select", "model/fc.bias"], "norm_stats"),
    (["--count", "100000"], "eligible"),
    (["--select", "model/emb.weight", "--region", "exponent", "--burst", "6"], "--burst 6 in --region exponent"),
    (["--select", "model/fc.weight_bf16", "--region", "exponent", "--mask", "100000001"], "--mask 100000001"),
    (["--select", "counters/u8", "--region", "sign"], "--region sign"), (["--replay", "missing.json"], "missing.json"),
    (["--replay", "log.json", "--seed", "1"], "--replay"),
]


@pytest.mark.parametrize("options,word", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_one_line_before_any_write(source, tmp_path, capsys, monkeypatch, options, word):
    from peat.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "log.json").write_text(json.dumps({"injections": [], "scale": None}))
    before = sha(source), sorted(tmp_path.iterdir())
    try:
        rc = main(["alter", str(source), str(tmp_path / "out.h5"), *options])
    except SystemExit as exit_:  # argparse's own refusals (after its usage line)
        rc = exit_.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("peat alter: error:") and word in err[-1], err
    assert len([line for line in err if "error" in line]) == 1 and "Traceback" not in "\n".join(err)
    assert (sha(source), sorted(tmp_path.iterdir())) == before  # no output, no hidden copy


def test_replay_on_other_values_warns_and_flips_the_same_bits(source, tmp_path, capsys):
    """The log decides: the same datasets, indices and bits, whatever the other file holds."""
    log, other = tmp_path / "log.json", tmp_path / "other.h5"
    A.alter(source, tmp_path / "o.h5", A.Plan(count=25, seed=4, burst=2), log=log)
    shutil.copyfile(source, other)
    with h5py.File(other, "r+") as f:
        f["model/conv1.weight"][...] = f["model/conv1.weight"][()] + 1
    capsys.readouterr()
    A.alter(other, tmp_path / "r.h5", A.Plan(), replay=log)
    first, again = changes(source, tmp_path / "o.h5"), changes(other, tmp_path / "r.h5")
    assert first.keys() == again.keys()
    assert all(first[k][1] ^ first[k][2] == again[k][1] ^ again[k][2] for k in first)
    hit = sum(k[0] == "/model/conv1.weight" for k in first)
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == ([f"peat alter: warning: {hit} value(s) of /model/conv1.weight in {other} differ from the "
                       f"'old' values in {log}; they are altered the same way anyway"] if hit else [])


# --- the study's tables, recomputed from their definitions ----------------------------------------


def study_cells(rng: np.random.Generator, n: int) -> list[tuple]:
    """(golden curve, resumed curve) pairs: accuracies in hundredths (a validation set of 100), as
    a real run's correct / total, so that gaps and losses meet the thresholds exactly."""
    cells = []
    for _ in range(n):
        epochs = [1, 2, 3, 4]
        golden = pd.DataFrame({"accuracy": rng.integers(40, 90, 4) / 100, "loss": rng.uniform(0.2, 2, 4)}, index=epochs)
        run = pd.DataFrame({"accuracy": [golden.loc[e, "accuracy"] - rng.integers(-3, 4) / 100 for e in epochs],
                            "loss": rng.uniform(0.2, 2, 4)}, index=epochs)
        if rng.random() < 0.2:
            run.loc[rng.integers(2, 5), "loss"] = rng.choice([np.nan, np.inf])
        cells.append((golden, run))
    return cells


def hundredths(x: float) -> Fraction:
    return Fraction(round(x * 100), 100)


def test_compare_and_epochs_to_recover_follow_their_definitions():
    tolerance = 0.02
    for golden, run in study_cells(np.random.default_rng(0), 200):
        out = S.compare(run, golden, 1)
        g, f = hundredths(golden.loc[4, "accuracy"]), hundredths(run.loc[4, "accuracy"])
        assert out["accuracy_loss_pct"] == pytest.approx(float(100 * (g - f) / g), abs=1e-9)
        losses = run.loc[2:, "loss"]
        assert out["diverged"] == (not np.isfinite(losses).all())
        assert out["loss_change_pct"] == (pytest.approx(100 * (losses[4] - golden.loc[4, "loss"]) / golden.loc[4, "loss"])
                                          if np.isfinite(losses[4]) else math.inf)
        gaps = [abs(hundredths(run.loc[e, "accuracy"]) - hundredths(golden.loc[e, "accuracy"]))
                if np.isfinite(run.loc[e, "loss"]) else math.inf for e in (2, 3, 4)]
        within = [n for n, gap in enumerate(gaps, 1) if gap <= Fraction("0.02")]
        got = S.epochs_to_recover(out["accuracy_gaps"], tolerance)
        assert (got if within else "never") == (within[0] if within else "never" if np.isnan(got) else got), gaps


def absorbed_reference(rows: list[dict], max_loss_pct: Fraction) -> dict:
    """absorbed.csv per (cls, region), from the README's words, with exact accuracies."""
    out = {}
    for key in sorted({(r["cls"], r["region"]) for r in rows}):
        runs = [r for r in rows if (r["cls"], r["region"]) == key]
        ok = lambda r: r["exact_loss_pct"] < max_loss_pct and not r["diverged"]  # noqa: E731
        counts = sorted({r["flips"] for r in runs})
        harmful = [n for n in counts if not all(ok(r) for r in runs if r["flips"] == n)]
        absorbed_counts = [n for n in counts if not harmful or n < harmful[0]]
        out[key] = {"max_absorbed_flips": max(absorbed_counts, default=0),
                    "first_harmful_flips": harmful[0] if harmful else None, "runs": len(runs),
                    "absorbed_runs": sum(map(ok, runs)), "diverged_runs": sum(r["diverged"] for r in runs)}
    return out


def test_absorbed_follows_its_definition():
    rng = np.random.default_rng(1)
    rows = []
    for cls in ("weight", "bias", "optimizer"):
        for region in ("sign", "mantissa"):
            for flips in (1, 10, 100):
                for seed in (0, 1):
                    golden, run = study_cells(rng, 1)[0]
                    # A validation set of 20: golden's final accuracy k / 20, the run's j samples fewer (or more),
                    # so that the loss meets the limits exactly: 1 of 10 is 10 %, 2 of 20 too.
                    k, j = (10, 1) if not rows else (rng.integers(10, 21), rng.integers(-1, 4))
                    golden.loc[4, "accuracy"], run.loc[4, "accuracy"] = k / 20, (k - j) / 20
                    cell = S.compare(run, golden, 1)
                    g, f = (Fraction(round(x * 20), 20) for x in (golden.loc[4, "accuracy"], run.loc[4, "accuracy"]))
                    rows.append(dict(cls=cls, region=region, flips=flips, seed=seed, status="ok",
                                     accuracy_loss_pct=cell["accuracy_loss_pct"], diverged=cell["diverged"],
                                     exact_loss_pct=100 * (g - f) / g))
    rows.append(dict(cls="bias", region="sign", flips=1000, seed=0, status="not_applicable", accuracy_loss_pct=np.nan,
                     diverged=False, exact_loss_pct=None))
    for max_loss in ("5", "10", "1"):
        table = S.absorbed(pd.DataFrame(rows), float(max_loss)).set_index(["cls", "region"])
        want = absorbed_reference([r for r in rows if r["status"] == "ok"], Fraction(max_loss))
        got = {key: {k: (None if pd.isna(v) else int(v)) for k, v in table.loc[key].items() if k != "max_loss_pct"}
               for key in want}
        assert got == want


def test_classes_follow_the_readme(source):
    """fc.weight_bf16, the README's example of a bfloat16 dataset marked by its name, was class
    "other": --class weight never reached it."""
    assert {e.path: e.cls for e in A.scan(source) if e.path in CLASS_OF} == CLASS_OF
    assert [A.location_class(name, {}) for name in ("predictor/l1/W_bf16", "model/head.weight.bf16",
                                                    "model/ln_f.bias_bfloat16", "model/wte.weight_bf16")] == [
        "weight", "weight", "norm_weight", "embedding"]


def test_h5diff_against_an_independent_comparison(tmp_path):
    """Datasets only in one file, shape/dtype changes, bitwise element differences (-0.0, NaN
    payloads, identical NaNs), and attributes by value, on files changed by hand."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    base = np.array([0.0, 1.0, np.nan, 2.0, -3.0], np.float32)
    other = base.copy()
    other[0], other[3] = -0.0, 2.5
    other.view(np.uint32)[2] ^= 1  # another NaN: differs bit for bit
    for path, x, extra in ((a, base, "only_a"), (b, other, "only_b")):
        with h5py.File(path, "w") as f:
            f.attrs.update(same=1.5, changed=1 if path == a else 2, nan=np.nan)
            f.attrs[extra] = 0
            f.create_dataset("g/x", data=x).attrs["unit"] = "m" if path == a else "cm"
            f["g"].attrs["steps"] = np.arange(3, dtype=np.int64 if path == a else np.int32)
            f["g/same"] = np.full(3, np.nan, np.float64)
            f["g/reshaped"] = np.zeros(4 if path == a else 5, np.int16)
            f[extra + "_data"] = np.ones(2)
    d = A.diff(a, b)
    rows = {r["dataset"]: r for r in d["datasets"]}
    assert (d["only_in_a"], d["only_in_b"]) == (["/only_a_data"], ["/only_b_data"])
    assert rows["/g/x"]["differing"] == 3 and rows["/g/x"]["bits"] == {"0": 1, "10": 1, "31": 1}  # 2.0 -> 2.5: the second mantissa bit
    assert rows["/g/x"]["max_rel"] == 0.25 and rows["/g/x"]["nonfinite_new"] == 1
    assert rows["/g/same"]["differing"] == 0 and rows["/g/reshaped"]["status"].startswith("differs in shape/dtype")
    assert d["attributes_differ"] == {"/": ["changed", "only_a", "only_b"], "/g": ["steps"], "/g/x": ["unit"]}


@pytest.mark.parametrize("chunk", [A.SCALE_CHUNK, 7])
@pytest.mark.parametrize("factor", [3.0, 1 / 3, -1.0000001, 1 + 2.0**-30, 7e4, 1e-5, 0.5 + 2.0**-40, 65519 / 65504, -1e-300])
def test_scale_matches_the_exactly_rounded_product_for_every_value(tmp_path, monkeypatch, factor, chunk):
    """Random float16/float32/bfloat16/float64 values, subnormals and values near the overflow
    threshold among them: each scaled value is its exact product rounded once (or not eligible),
    in one piece and a chunk at a time (a big dataset's products are computed so)."""
    monkeypatch.setattr(A, "SCALE_CHUNK", chunk)
    rng = np.random.default_rng(int(abs(math.frexp(factor)[0]) * 2**20))
    x = rng.standard_normal(300) * np.exp2(rng.integers(-30, 30, 300))
    near = np.array([65504, 65519, 65520, 6.1e-5, 6e-8, 3e-8, 1.17e-38, 1e-45, 3.4e38])
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f, np.errstate(over="ignore"):
        for kind in ("float16", "float32", "float64"):
            f[kind] = np.concatenate([x, near, -near]).astype(kind)
        f.create_dataset("w_bf16", data=_bf16(np.concatenate([x, near, -near])))
    check_plan(src, tmp_path, dict(fraction=1.0, scale=factor))


@pytest.mark.parametrize("kind,bits", [("float32", [0x7F800001, 0x3F800000]), ("float16", [0x7C01, 0x3C00]),
                                       ("bfloat16", [0x7F81, 0x3F80])])
def test_scale_never_counts_a_nan(tmp_path, kind, bits):
    """A signalling NaN (an earlier flip's) times F is a quiet NaN: its bits changed, so it was
    drawn, counted and logged as scaled ("nan" -> "nan"); the README: NaN is not eligible."""
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        raw = np.array(bits, np.uint16 if kind == "bfloat16" else f"u{np.dtype(kind).itemsize}")
        ds = f.create_dataset("x", data=raw if kind == "bfloat16" else raw.view(kind))
        if kind == "bfloat16":
            ds.attrs["dtype"] = "bfloat16"
    with pytest.raises(PeatError, match="2 values to corrupt but only 1 eligible"):
        A.alter(src, tmp_path / "o.h5", A.Plan(count=2, scale=2.0))
    result = A.alter(src, tmp_path / "o.h5", A.Plan(count=1, scale=2.0), keep_records=True)
    assert [(r["old"], r["new"]) for r in result.records] == [(1.0, 2.0)]


@pytest.mark.parametrize("tag", ["bf16", np.bytes_(b"bfloat16"), "BFloat16"])
def test_load_reads_bfloat16_as_peat_alter_does(tmp_path, tag):
    """A bfloat16 tensor tagged "bf16", or with a fixed-length string, is bfloat16 to peat alter,
    which flips its bits so; checkpoint.load read its bits as integers (1.0 -> 16256.0)."""
    torch = pytest.importorskip("torch")
    from peat import checkpoint as C

    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    C.save(tmp_path / "c.h5", model, None, step=1, epoch=1, meta={})
    with h5py.File(tmp_path / "c.h5", "r+") as f:
        f["model/weight"].attrs["dtype"] = tag
    assert next(e for e in A.scan(tmp_path / "c.h5") if e.path == "/model/weight").layout.name == "bfloat16"
    other = torch.nn.Linear(3, 2).to(torch.bfloat16)
    C.load(tmp_path / "c.h5", other)
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)


def test_load_reads_big_endian_tensors(tmp_path):
    """peat alter edits big-endian datasets in their byte order; checkpoint.load failed on them
    (torch: a byte order other than the native one) or, for bfloat16, swapped their bytes."""
    torch = pytest.importorskip("torch")
    from peat import checkpoint as C

    for dtype in (torch.float32, torch.bfloat16):
        model = torch.nn.Linear(3, 2).to(dtype)
        C.save(tmp_path / "c.h5", model, None, step=1, epoch=1, meta={})
        with h5py.File(tmp_path / "c.h5", "r+") as f:
            for name in ("weight", "bias"):
                ds = f[f"model/{name}"]
                data, attrs = ds[()], dict(ds.attrs)
                del f[f"model/{name}"]
                f.create_dataset(f"model/{name}", data=data.astype(data.dtype.newbyteorder(">"))).attrs.update(attrs)
        other = torch.nn.Linear(3, 2).to(dtype)
        C.load(tmp_path / "c.h5", other)
        assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
