"""What config checks know about models and datasets without building or preparing them
(the one-line errors themselves: BAD_CONFIGS in test_backbone.py, run through snakemake -n)."""

from __future__ import annotations

from peat import data


def test_dataset_sizes_are_those_prepare_writes(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_bytes(b"x" * 1000)
    (tmp_path / "corpus" / "b.txt").write_text("y" * 333)
    specs = {"digits": {"source": "digits", "image_size": 8, "val_fraction": 0.3},
             "pydoc": {"source": "pydoc", "seq_len": 48, "part": [0.1, 0.3], "val_fraction": 0.1},
             "corpus": {"source": "text", "path": str(tmp_path / "corpus"), "seq_len": 16, "val_fraction": 0.25}}
    for name, spec in specs.items():
        data.prepare(name, spec, tmp_path / f"{name}.h5")
        prepared = data.load(tmp_path / f"{name}.h5")
        assert data.sizes(name, spec) == (len(prepared.train.y), len(prepared.val.y)), name
