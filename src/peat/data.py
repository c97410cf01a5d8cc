"""Dataset prep: real, learnable data, written to HDF5. ``digits`` and ``pydoc`` ship with
installed packages (scikit-learn, CPython); ``cifar10`` and ``text`` read local files (``path``),
never downloaded.

Every prepared dataset is one HDF5 file with ``/train/x``, ``/train/y``, ``/val/x``,
``/val/y`` and root attributes ``kind`` ("image" or "text"), ``source``, ``name``, plus
``num_classes`` (images) or ``vocab_size`` and ``seq_len`` (text), and ``settings``: the dataset's config
spec it was prepared from, as JSON (``load`` gives it as a dict; files prepared before have none). Text is byte-level
tokenized: token = byte value, stored and loaded as uint8 (x and y: 2 bytes per byte of text);
``models.loss_and_metrics`` widens each batch to int64 (int64 tokens, 16 bytes per byte of text,
ran a 1-2 GB corpus out of memory). Files prepared before hold int64 tokens: they load as stored
and train to the same results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .io import PeatError, atomic_path, open_h5, require

IMAGE_MEAN, IMAGE_STD = 0.5, 0.5
# Examples in the fixed image sets (scikit-learn's digits; CIFAR-10's train and test batches, which
# torchvision reads only when all are there): ``sizes`` counts them without loading the images.
IMAGE_COUNTS = {"digits": 1797, "cifar10": 60000}
CIFAR10_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
# What prepare takes for a setting a spec leaves out (a library call's: the workflow's has the schema's
# defaults filled in): recorded with the spec, so that a file tells every setting its bytes came from.
DEFAULTS = {"labels": "class", "seed": 0, "part": [0.0, 1.0]}
SETTINGS_ATTR = "settings"


@dataclass
class Split:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Dataset:
    kind: str
    train: Split
    val: Split
    attrs: dict


def prepare(name: str, spec: dict, out: str | Path) -> None:
    """Build dataset ``name`` from its config ``spec`` and write it atomically to ``out``."""
    source = spec["source"]
    if source in ("digits", "cifar10"):
        x, y, attrs = _digits(spec) if source == "digits" else _cifar10(name, spec)
        kind = "image"
    else:
        tokens = _pydoc_bytes(name, spec) if source == "pydoc" else _text_bytes(name, spec)
        x, y, attrs = _sequences(name, tokens, spec["seq_len"])
        kind = "text"
    order = np.random.default_rng(settings(spec)["seed"]).permutation(len(x))
    n_val = _val_count(name, len(x), spec["val_fraction"])
    val, train = order[:n_val], order[n_val:]
    with atomic_path(out) as tmp, open_h5(tmp, "w") as f:
        f.attrs.update(kind=kind, source=source, name=name, **attrs)
        # Keys sorted: the same config gives a byte-identical file. A path (pathlib, a library call's) as text.
        f.attrs[SETTINGS_ATTR] = json.dumps(settings(spec), sort_keys=True, default=str)
        for split, idx in (("train", np.sort(train)), ("val", np.sort(val))):
            f.create_dataset(f"{split}/x", data=x[idx], compression="gzip", shuffle=True)
            f.create_dataset(f"{split}/y", data=y[idx], compression="gzip", shuffle=True)


def settings(spec: dict) -> dict:
    """``spec`` with ``DEFAULTS`` filled in: the settings a dataset is prepared with."""
    return DEFAULTS | spec


def sizes(name: str, spec: dict) -> tuple[int, int]:
    """(train, val) example counts that ``prepare`` writes for ``spec``, without preparing it: config
    checks need them before any job (text is read or, from local files, only measured)."""
    source = spec["source"]
    if source in IMAGE_COUNTS:
        if source == "cifar10":  # a folder without the batches passed here, then failed data preparation
            _cifar10_root(name, spec)
        n = IMAGE_COUNTS[source]
    else:
        length = _pydoc_bytes(name, spec).size if source == "pydoc" else _text_length(name, spec)
        n = _sequence_count(name, length, spec["seq_len"])
    n_val = _val_count(name, n, spec["val_fraction"])
    return n - n_val, n_val


def local_files(name: str, spec: dict) -> list[Path]:
    """The files ``prepare`` reads from ``path`` (none for the sets that ship with packages): the
    workflow's inputs, so that editing or adding one prepares the dataset again; only the path, a
    setting, was tracked, and golden training went on with the old text."""
    if spec["source"] == "text":
        return _text_files(name, spec)
    if spec["source"] == "cifar10":
        return _cifar10_files(_cifar10_root(name, spec))
    return []


def _val_count(name: str, n: int, fraction: float) -> int:
    n_val = max(1, int(round(n * fraction)))
    if n_val >= n:  # else the config check named the batch size, larger than "0 training examples"
        raise PeatError(f"config key 'datasets.{name}.val_fraction': {fraction} of the {n} examples leaves none "
                        "to train on")
    return n_val


def load(path: str | Path) -> Dataset:
    with open_h5(path) as f:
        if "kind" not in f.attrs:
            raise PeatError(f"{path}: not a peat dataset (no 'kind' attribute)")
        # As stored: labels are int64, tokens uint8 (int64 in older files), widened per batch.
        splits = {s: Split(*(torch.from_numpy(require(f, f"{s}/{k}", path)[()]) for k in ("x", "y")))
                  for s in ("train", "val")}
        attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
    if SETTINGS_ATTR in attrs:
        attrs[SETTINGS_ATTR] = _recorded_settings(path, attrs[SETTINGS_ATTR])
    return Dataset(attrs["kind"], splits["train"], splits["val"], attrs)


def _recorded_settings(path, text) -> dict:
    try:
        found = json.loads(text)
    except (TypeError, ValueError):
        found = None
    if not isinstance(found, dict):  # damaged or written by another tool: a traceback from every drill rank
        raise PeatError(f"{path}: attribute {SETTINGS_ATTR!r} is not a JSON object of dataset settings")
    return found


def _images(x: np.ndarray, size: int) -> np.ndarray:
    """(N, C, H, W) in [0, 1] -> (N, 3, size, size) normalized float32."""
    t = torch.from_numpy(x).float()
    if t.shape[1] == 1:
        t = t.expand(-1, 3, -1, -1)
    t = torch.nn.functional.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)
    return ((t - IMAGE_MEAN) / IMAGE_STD).contiguous().numpy()


def _labels(y: np.ndarray, spec: dict) -> tuple[np.ndarray, int]:
    if settings(spec)["labels"] == "parity":
        return (y % 2).astype(np.int64), 2
    return y.astype(np.int64), int(y.max()) + 1


def _digits(spec: dict):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0)[:, None].astype(np.float32)
    y, classes = _labels(bunch.target, spec)
    return _images(x, spec["image_size"]), y, {"num_classes": classes}


def _cifar10(name: str, spec: dict):
    from torchvision.datasets import CIFAR10

    root = _cifar10_root(name, spec)
    try:  # files there but damaged: torchvision's checksums refuse them
        sets = [CIFAR10(root, train=t, download=False) for t in (True, False)]
    except RuntimeError:
        raise PeatError(f"config key 'datasets.{name}.path': {_cifar10_damaged(root)} fails CIFAR-10's checksum "
                        "(damaged, or not the python version of the batches)") from None
    x = np.concatenate([s.data for s in sets]).transpose(0, 3, 1, 2).astype(np.float32) / 255.0
    y, classes = _labels(np.concatenate([np.asarray(s.targets) for s in sets]), spec)
    return _images(x, spec["image_size"]), y, {"num_classes": classes}


def _cifar10_root(name: str, spec: dict) -> Path:
    """The folder holding ``cifar-10-batches-py/``, checked by file names only (no reading)."""
    root = _local_path(name, spec)
    if root.is_file():  # the archive as downloaded: 'cifar-10-batches-py/... is missing' under a file
        raise PeatError(f"config key 'datasets.{name}.path': {root} is a file; give the folder holding "
                        "cifar-10-batches-py/ (where cifar-10-python.tar.gz is unpacked)")
    missing = [f for f in _cifar10_files(root) if not f.is_file()]
    if missing and all((root / f.name).is_file() for f in missing):
        raise PeatError(f"config key 'datasets.{name}.path': {root} holds the CIFAR-10 batches themselves; "
                        f"give the folder above it, {root.parent}")
    if missing:
        raise PeatError(f"config key 'datasets.{name}.path': no CIFAR-10 python batches under {root} "
                        f"(cifar-10-batches-py/{missing[0].name} is missing)")
    return root


def _cifar10_damaged(root: Path) -> Path:
    """The first batch file under ``root`` whose MD5 is not CIFAR-10's (else the folder): the files are
    all there (``_cifar10_root``), and the line said there were none."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    sums = dict(CIFAR10.train_list + CIFAR10.test_list) | {CIFAR10.meta["filename"]: CIFAR10.meta["md5"]}
    return next((f for f in _cifar10_files(root) if not check_integrity(str(f), sums[f.name])),
                root / "cifar-10-batches-py")


def _cifar10_files(root: Path) -> list[Path]:
    return [root / "cifar-10-batches-py" / f for f in CIFAR10_FILES]


def _pydoc_bytes(name: str, spec: dict) -> np.ndarray:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    lo, hi = settings(spec)["part"]
    chosen = keys[int(lo * len(keys)):int(hi * len(keys))]
    if not chosen:  # a part narrower than one topic: the empty text failed naming seq_len
        raise PeatError(f"config key 'datasets.{name}.part': [{lo:g}, {hi:g}] selects none of the {len(keys)} "
                        "pydoc topics; widen it")
    text = "\n\n".join(topics[k] for k in chosen)
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


TEXT_SEPARATOR = b"\n\n"


def _text_bytes(name: str, spec: dict) -> np.ndarray:
    return np.frombuffer(TEXT_SEPARATOR.join(f.read_bytes() for f in _text_files(name, spec)), dtype=np.uint8)


def _text_length(name: str, spec: dict) -> int:
    """Bytes of ``_text_bytes`` from the files' sizes."""
    files = _text_files(name, spec)
    return sum(f.stat().st_size for f in files) + len(TEXT_SEPARATOR) * (len(files) - 1)


def _text_files(name: str, spec: dict) -> list[Path]:
    root = _local_path(name, spec)
    # Files only: a folder named like one (or a dangling link) failed data preparation, its size counted.
    files = sorted(f for f in root.rglob("*.txt") if f.is_file()) if root.is_dir() else [root]
    if not files:
        raise PeatError(f"config key 'datasets.{name}.path': no .txt files under {root}")
    if not any(f.stat().st_size for f in files):  # else the line named seq_len, which no value fixes
        what = f"{root} is" if files == [root] else f"the {len(files)} .txt file(s) under {root} are"
        raise PeatError(f"config key 'datasets.{name}.path': {what} empty")
    return files


def _local_path(name: str, spec: dict) -> Path:
    if "path" not in spec:
        raise PeatError(f"config key 'datasets.{name}.path' is missing (source {spec['source']} reads local files)")
    root = Path(spec["path"]).expanduser()
    if not root.exists():
        raise PeatError(f"config key 'datasets.{name}.path': {root} does not exist")
    return root


def _sequences(name: str, tokens: np.ndarray, seq_len: int):
    """Sequence i is ``tokens[i * seq_len:(i + 1) * seq_len]``, its targets the same shifted by one byte:
    views of the uint8 bytes, so that only a split's rows are ever copied."""
    n = _sequence_count(name, len(tokens), seq_len)
    x = tokens[:n * seq_len].reshape(n, seq_len)
    y = tokens[1:n * seq_len + 1].reshape(n, seq_len)
    return x, y, {"vocab_size": 256, "seq_len": seq_len}


def _sequence_count(name: str, length: int, seq_len: int) -> int:
    """Sequences of ``seq_len`` tokens, each with its next-token targets, in ``length`` bytes."""
    n = (length - 1) // seq_len
    if n < 2:
        raise PeatError(f"config key 'datasets.{name}.seq_len': {seq_len} leaves fewer than 2 sequences "
                        f"in the text's {length} bytes")
    return n
