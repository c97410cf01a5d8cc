"""A prepared dataset file records the settings it was prepared with (peat.data, attribute 'settings')."""

from __future__ import annotations

import hashlib
from pathlib import Path

import h5py
import pytest
import torch

from peat.data import load, prepare
from peat.io import PeatError

# As the prepare rule passes it: the config's spec with the schema's defaults filled in.
DIGITS = {"source": "digits", "image_size": 8, "val_fraction": 0.2, "labels": "class", "seq_len": 64, "seed": 0}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "digits.h5"
    prepare("digits", DIGITS, path)
    return path


def test_a_prepared_file_records_its_settings(digits, tmp_path):
    # Under srun the drill had only the data's shapes to compare: a file of another seed passed.
    assert load(digits).attrs["settings"] == DIGITS | {"part": [0.0, 1.0]}
    prepare("digits", DIGITS | {"seed": 3}, tmp_path / "seed3.h5")
    assert load(tmp_path / "seed3.h5").attrs["settings"]["seed"] == 3


def test_a_library_call_records_the_defaults_it_prepared_with(tmp_path):
    # A spec without labels or seed was prepared with 'class' and 0: the file says so.
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"abcdefgh" * 8)
    prepare("corpus", {"source": "text", "path": Path(text), "seq_len": 4, "val_fraction": 0.25}, tmp_path / "c.h5")
    assert load(tmp_path / "c.h5").attrs["settings"] == {"source": "text", "path": str(text), "seq_len": 4,
                                                         "val_fraction": 0.25, "labels": "class", "seed": 0,
                                                         "part": [0.0, 1.0]}


def test_the_same_spec_gives_a_byte_identical_file(digits, tmp_path):
    again = tmp_path / "digits.h5"
    prepare("digits", dict(reversed(DIGITS.items())), again)  # key order is not a setting
    assert sha256(again) == sha256(digits)


def test_a_file_without_recorded_settings_still_loads(digits, tmp_path):
    # Prepared by an earlier peat: no 'settings' attribute, the same data.
    old = tmp_path / "old.h5"
    old.write_bytes(digits.read_bytes())
    with h5py.File(old, "r+") as f:
        del f.attrs["settings"]
    new, loaded = load(digits), load(old)
    assert "settings" not in loaded.attrs
    assert loaded.attrs == {k: v for k, v in new.attrs.items() if k != "settings"}
    assert all(torch.equal(getattr(getattr(loaded, s), k), getattr(getattr(new, s), k))
               for s in ("train", "val") for k in ("x", "y"))


@pytest.mark.parametrize("value", ["{not json", "[1, 2]"])
def test_damaged_recorded_settings_are_one_line(digits, tmp_path, value):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(digits.read_bytes())
    with h5py.File(bad, "r+") as f:
        f.attrs["settings"] = value
    with pytest.raises(PeatError) as err:
        load(bad)
    assert str(err.value) == f"{bad}: attribute 'settings' is not a JSON object of dataset settings"
