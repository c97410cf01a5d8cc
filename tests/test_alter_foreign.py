"""peat alter / peat h5diff on HDF5 files made elsewhere: filters, references and layouts peat never writes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from peat import alter as A
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
