"""peat alter / peat h5diff on HDF5 files made elsewhere: filters, references and layouts peat never writes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from peat import alter as A
from peat.cli import main
from peat.io import PeatError


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_alter(src, dst, **plan):
    return A.alter(src, dst, A.Plan(**plan), keep_records=True)


def test_integers_behind_a_scale_offset_filter_of_fixed_width_are_never_altered(tmp_path):
    """scaleoffset=3 stores 3 bits above the minimum of each chunk: a flipped high bit was clipped on the
    write, so the log named flips the output did not hold (and other values changed with them)."""
    src = tmp_path / "so.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("clipped", data=np.arange(16, dtype=np.int32) % 8, chunks=(8,), scaleoffset=3)
        f.create_dataset("ints", data=np.arange(16, dtype=np.int32), chunks=(8,), scaleoffset=0)  # lossless
    rows = run_alter(src, tmp_path / "o.h5", fraction=1.0).records
    assert {r["dataset"] for r in rows} == {"/ints"}
    with pytest.raises(PeatError, match=r"'clipped' names clipped, which peat never alters \(integers behind HDF5's "
                                        r"scale-offset filter with a fixed width of 3 bits\)$"):
        run_alter(src, tmp_path / "o.h5", select=["clipped"])


def _filter_missing_here(path: Path) -> Path:
    """A file whose /z is compressed with a filter this HDF5 lacks (32001, Blosc's id, as PyTables writes)."""
    with h5py.File(path, "w") as f:
        f.create_dataset("z", data=np.arange(32, dtype=np.float32), chunks=(8,), compression="gzip")
        f["plain"] = np.arange(4, dtype=np.float32)
    data = bytearray(path.read_bytes())
    at = data.find(b"deflate") - 8  # the filter pipeline message: id, name length, flags, values, name
    assert data[at:at + 2] == (1).to_bytes(2, "little")
    data[at:at + 2] = (32001).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    return path


def test_a_dataset_compressed_with_a_filter_this_hdf5_lacks_is_named_before_any_work(tmp_path, capsys):
    """It failed in the flips, as 'cannot read /z (Can't synchronously read data)', and only when the draw
    landed there; the default selection now leaves it out and selecting it says which filter is missing."""
    src = _filter_missing_here(tmp_path / "blosc.h5")
    before = sha(src)
    rows = run_alter(src, tmp_path / "o.h5", fraction=1.0).records
    assert {r["dataset"] for r in rows} == {"/plain"}
    assert main(["alter", str(src), str(tmp_path / "o2.h5"), "--select", "z"]) == 2
    assert capsys.readouterr().err == (f"peat alter: error: {src}: 'z' names z, which peat never alters (behind "
                                       "HDF5 filter 32001 (deflate), which this HDF5 library lacks)\n")
    assert not (tmp_path / "o2.h5").exists() and sha(src) == before


def test_h5diff_names_a_dataset_behind_a_missing_filter_as_not_compared(tmp_path, capsys):
    """h5diff stopped at the first such dataset: no table for the datasets it could read."""
    src = _filter_missing_here(tmp_path / "blosc.h5")
    assert main(["h5diff", str(src), str(src)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("0 dataset(s) differ, 1 identical; not compared: /z (behind HDF5 filter 32001 "
                       "(deflate), which this HDF5 library lacks)")


def test_h5diff_compares_references_by_what_they_point_to(tmp_path):
    """Object and region references were compared as h5py objects, which differ between two open files:
    a file against a byte copy of itself read '/refs 2 differing'."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    for path, target in ((a, "x"), (b, "y")):
        with h5py.File(path, "w") as f:
            f["x"], f["y"] = np.arange(10, dtype=np.float32), np.ones(3, np.float32)
            f["refs"] = np.array([f["x"].ref, f[target].ref, h5py.Reference()], dtype=h5py.ref_dtype)
            f["regions"] = np.array([f["x"].regionref[2:4], f["x"].regionref[{"x": 1, "y": 5}[target]:6]],
                                    dtype=h5py.regionref_dtype)
    copy = tmp_path / "copy.h5"
    copy.write_bytes(a.read_bytes())
    same = {r["dataset"]: r["differing"] for r in A.diff(a, copy)["datasets"]}
    assert same == {"/refs": 0, "/regions": 0, "/x": 0, "/y": 0}
    other = {r["dataset"]: r["differing"] for r in A.diff(a, b)["datasets"]}
    assert other == {"/refs": 1, "/regions": 1, "/x": 0, "/y": 0}


@pytest.mark.parametrize("command", ["alter", "h5diff"])
def test_a_pipe_named_as_the_input_is_refused_in_one_line(tmp_path, command):
    """A FIFO (no writer yet) blocked h5py's open forever; a subprocess, so that the old hang fails the test."""
    fifo = tmp_path / "ckpt.h5"
    os.mkfifo(fifo)
    other = tmp_path / "o.h5"
    if command == "h5diff":
        with h5py.File(other, "w") as f:
            f["w"] = np.ones(2, np.float32)
    proc = subprocess.run([sys.executable, "-m", "peat.cli", command, str(fifo), str(other)], capture_output=True,
                          text=True, timeout=20)
    assert (proc.returncode, proc.stderr) == (2, f"peat {command}: error: {fifo}: not a regular file (a pipe, "
                                                 "socket or device); name an HDF5 file\n")
    assert command == "h5diff" or not other.exists()


def test_opaque_bytes_are_named_as_such_not_as_a_compound(tmp_path, capsys):
    """A dataset of raw bytes (HDF5's opaque type, numpy's V4) was refused and compared as 'compound values'."""
    src = tmp_path / "op.h5"
    with h5py.File(src, "w") as f:
        f["blob"] = np.array([b"abcd", b"efgh"]).astype("V4")
        f["w"] = np.ones(3, np.float32)
    with pytest.raises(PeatError, match=r"'blob' names blob, which peat never alters \(opaque values\)$"):
        run_alter(src, tmp_path / "o.h5", select=["blob"])
    rows = {r["dataset"]: (r["dtype"], r["differing"]) for r in A.diff(src, src)["datasets"]}
    assert rows == {"/blob": ("opaque", 0), "/w": ("float32", 0)}


def _keras(path: Path, version: str = "2.4.0", names=(b"dense",)) -> Path:
    """A Keras 2 weights file: attributes on the root, the layer groups and a dataset, and a dimension scale
    (attributes holding references)."""
    with h5py.File(path, "w") as f:
        f.attrs.update(backend="tensorflow", keras_version=version)
        weights = f.create_group("model_weights")
        weights.attrs["layer_names"] = np.array(names)
        kernel = weights.create_dataset("dense/dense/kernel:0", data=np.arange(12, dtype=np.float32).reshape(3, 4))
        kernel.attrs["bounds"] = np.array([[0.0, np.nan], [1.0, 2.0]])
        scale = weights.create_dataset("dense/dense/units", data=np.arange(4, dtype=np.float32))
        scale.make_scale("units")
        kernel.dims[1].attach_scale(scale)
    return path


def test_h5diff_names_the_attributes_that_differ(tmp_path, capsys):
    """peat h5diff 'shows exactly what changed', yet two files differing only in attributes read
    '0 dataset(s) differ'."""
    a, b = _keras(tmp_path / "a.h5"), _keras(tmp_path / "b.h5", version="2.15.0", names=(b"dense", b"extra"))
    assert main(["h5diff", str(a), str(b)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("0 dataset(s) differ, 2 identical; attributes differ: "
                                                        "/ (keras_version), /model_weights (layer_names)")
    assert A.diff(a, b)["attributes_differ"] == {"/": ["keras_version"], "/model_weights": ["layer_names"]}
    with h5py.File(b, "a") as f:
        del f.attrs["backend"]
        f["model_weights/dense/dense/kernel:0"].attrs["bounds"] = np.array([[0.0, np.nan], [1.0, 3.0]])
    assert A.diff(a, b)["attributes_differ"] == {"/": ["backend", "keras_version"], "/model_weights": ["layer_names"],
                                                 "/model_weights/dense/dense/kernel:0": ["bounds"]}


def test_h5diff_finds_no_attribute_changes_in_a_copy_or_an_altered_file(tmp_path):
    """Equal NaNs and references (a dimension scale's) in two files are the same attribute values."""
    src = _keras(tmp_path / "in.h5")
    run_alter(src, tmp_path / "o.h5", fraction=1.0)
    result = A.diff(src, tmp_path / "o.h5")
    assert result["attributes_differ"] == {}
    assert {r["dataset"]: r["differing"] for r in result["datasets"]} == {"/model_weights/dense/dense/kernel:0": 12,
                                                                          "/model_weights/dense/dense/units": 4}


@pytest.mark.parametrize("options, message", [
    (["--select", "re:iter", "--region", "exponent"], "--region exponent: they hold int64 (optimizer_weights/Adam/iter:0)"),
    (["--select", "re:iter", "--scale", "2"], "--scale 2.0 (floats only): they hold int64 (optimizer_weights/Adam/iter:0)"),
    (["--select", "re:(iter|bias)", "--bits", "40-63"],
     "--bits 40-63: they hold float16 (model_weights/dense/dense/bias:0), int8 (optimizer_weights/Adam/iter:0)"),
    (["--select", "re:(kernel|bias)", "--region", "sign", "--burst", "2"],
     "--burst 2 in --region sign: they hold float16 (model_weights/dense/dense/bias:0 and 1 more)"),
])
def test_a_corruption_no_selected_dtype_can_take_names_what_they_hold(tmp_path, capsys, options, message):
    """It read 'no selected dataset can take this corruption (dtype, --region/--bits width)': no dataset, no dtype."""
    src = tmp_path / "k.h5"
    with h5py.File(src, "w") as f:
        f["model_weights/dense/dense/kernel:0"] = np.ones((3, 4), np.float16)
        f["model_weights/dense/dense/bias:0"] = np.ones(4, np.float16)
        f["optimizer_weights/Adam/iter:0"] = np.int64(10) if "--bits" not in options else np.int8(10)
    assert main(["alter", str(src), str(tmp_path / "o.h5"), *options]) == 2
    assert capsys.readouterr().err == f"peat alter: error: {src}: no selected dataset can take {message}\n"
    assert not (tmp_path / "o.h5").exists()
