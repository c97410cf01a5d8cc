"""Checkpoint alteration: bit flips (or scaling) in any HDF5 file, an injection log, and h5diff.

Works on any HDF5 checkpoint (peat's own layout, Keras, Chainer, hand-made): every numeric
dataset is a candidate. Everything is vectorized over whole datasets: positions are drawn at
once, flips are XOR masks applied to integer views, and contiguous uncompressed datasets are
edited through a memory map of the copied file, so cost grows with the number of flips, not
with the size of the checkpoint (besides the copy).

Bit numbering (the ``hdf5_corrupter`` convention): bit 0 is the most significant bit of a value,
i.e. the sign of a float or of a signed integer; then come the exponent bits (most significant
first) and the mantissa bits; the last bit (width - 1) is the least significant. For float32,
bit 0 = sign, bits 1-8 = exponent (bit 1 its most significant bit), bits 9-31 = mantissa.

bfloat16 has no numpy/HDF5 type: a ``uint16`` dataset is read as bfloat16 when it has the
attribute ``dtype`` equal to ``bfloat16`` (or ``bf16``), or when its name ends in ``bf16`` or
``bfloat16`` (e.g. ``weight.bf16``, ``weight_bfloat16``).
"""

from __future__ import annotations

import argparse
import difflib
import errno
import fnmatch
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import h5py
import numpy as np
from numpy.lib.recfunctions import repack_fields

from .io import PeatError, atomic_path, json_text, open_h5, write_json

CLASSES = ("weight", "norm_weight", "norm_stats", "bias", "embedding", "optimizer", "other")
CLASS_HELP = {
    "weight": "conv and linear weights",
    "norm_weight": "normalization affine parameters (gamma and beta of BatchNorm/LayerNorm/RMSNorm)",
    "norm_stats": "normalization running statistics (running_mean, running_var, num_batches_tracked)",
    "bias": "biases of conv and linear layers",
    "embedding": "embedding tables",
    "optimizer": "optimizer state (momentum, Adam moments, step counters)",
    "other": "anything else numeric (buffers such as rotary frequencies, counters)",
}
CLI_REGIONS = ("sign", "exponent", "mantissa", "any")
# The study grid also splits the exponent into its most significant bit and the rest.
REGIONS = CLI_REGIONS + ("exponent_msb", "exponent_other")
BIT_NUMBERING = "bit 0 = most significant bit (sign of floats and signed integers), then exponent, then mantissa"


# ---------------------------------------------------------------------------------------------
# Value layouts


@dataclass(frozen=True)
class Layout:
    """How the bits of one element are laid out."""

    name: str
    width: int
    exponent: int = 0  # exponent bits (floats only)
    signed: bool = True
    is_float: bool = True

    @property
    def mantissa(self) -> int:
        return self.width - 1 - self.exponent if self.is_float else 0

    def region(self, region: str) -> tuple[int, int] | None:
        """Inclusive bit range of a named region in peat's numbering, or None if it has none."""
        w, e = self.width, self.exponent
        if region == "any":
            return 0, w - 1
        if region == "sign":
            return (0, 0) if self.signed else None
        if not self.is_float:
            # Integers: "mantissa" is the value bits below the sign; they have no exponent.
            return ((1 if self.signed else 0), w - 1) if region == "mantissa" else None
        return {"exponent": (1, e), "exponent_msb": (1, 1), "exponent_other": (2, e) if e > 1 else None,
                "mantissa": (e + 1, w - 1)}[region]


FLOAT_LAYOUTS = {"float16": Layout("float16", 16, 5), "bfloat16": Layout("bfloat16", 16, 8),
                 "float32": Layout("float32", 32, 8), "float64": Layout("float64", 64, 11)}


def _attr_text(attrs, key: str) -> str:
    # h5py reads a variable-length string attribute as str, a fixed-length one as bytes, which another
    # tool may have written in another encoding: only compared with tags, so undecodable bytes may go.
    try:
        value = attrs.get(key, b"")
    except (OSError, KeyError, TypeError) as err:  # TypeError: a string type HDF5 knows no encoding of
        raise OSError(f"Unable to read attribute {key!r} ({err})") from None  # scan's "damaged HDF5 file"
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def is_bfloat16(ds: h5py.Dataset) -> bool:
    tag = _attr_text(ds.attrs, "dtype")
    return ds.dtype.kind == "u" and ds.dtype.itemsize == 2 and (tag.lower() in ("bfloat16", "bf16")
                                                                 or ds.name.lower().endswith(("bf16", "bfloat16")))


def layout_of(ds: h5py.Dataset) -> Layout | None:
    """The layout of a dataset's elements, or None for non-numeric datasets (strings, compounds)."""
    try:
        dt = ds.dtype
    except (TypeError, ValueError):  # a stored type numpy has no name for: a 3-byte integer, a 20-bit exponent
        return None
    if dt.kind not in "fiu" or ds.id.get_type() != h5py.h5t.py_create(dt, logical=True):
        # Bits are edited in place: a stored element h5py converts (a 3-byte float read as
        # float32, a 12-bit integer in 16 bits) does not have the layout of its numpy view.
        return None
    if is_bfloat16(ds):
        return FLOAT_LAYOUTS["bfloat16"]
    if dt.kind == "f" and dt.itemsize in (2, 4, 8):
        return FLOAT_LAYOUTS[f"float{8 * dt.itemsize}"]
    if dt.kind in "iu":
        return Layout(dt.name, 8 * dt.itemsize, signed=dt.kind == "i", is_float=False)
    return None


def _raw_dtype(dt: np.dtype) -> np.dtype:
    """Unsigned integer type of the same width and byte order: the view flips are applied to."""
    return np.dtype(f"{dt.byteorder if dt.itemsize > 1 else '|'}u{dt.itemsize}")


def _values(raw: np.ndarray, dtype: np.dtype, layout: Layout) -> np.ndarray:
    """Raw bits -> numeric values (bfloat16 widened exactly to float32)."""
    if layout.name == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.view(dtype)


# ---------------------------------------------------------------------------------------------
# Location classes


_STATS = {"running_mean", "running_var", "num_batches_tracked", "moving_mean", "moving_variance", "avg_mean",
          "avg_var", "n_averaged"}
_NORM = re.compile(r"(norm|^bn\d*$|^bn_|_bn\d*$|^ln(_|\d|$)|batch_normalization|layernorm|^gn\d*$)")
_EMBED = re.compile(r"(embed|^wte$|^wpe$|^tok_embeddings$)")
# Keras 3 layers by their default names, whose variables 0 and 1 are the kernel and the bias.
_KERNEL_BIAS = re.compile(r"^(dense|einsum_dense|conv[123]d|conv[123]d_transpose|depthwise_conv[12]d)(_\d+)?$")


_BF16_TAG = re.compile(r"[_.-]?(bf16|bfloat16)$")


def _parts(path: str) -> list[str]:
    # Keras names end in ":0"; Chainer separates with "/" as HDF5 does; PyTorch names use ".".
    # A bfloat16 tag at the end of the name says the dtype, not the tensor: fc.weight_bf16 is a weight.
    name = _BF16_TAG.sub("", path.strip("/").lower()) or path.strip("/").lower()
    return [p.split(":")[0] for p in re.split(r"[/.]", name) if p]


def location_class(path: str, attrs) -> str:
    """Which class of model state a dataset holds (see CLASSES), from peat's attrs or its name."""
    parts = _parts(path)
    if any(p.startswith(("optimizer", "optim")) for p in parts):
        return "optimizer"
    if len(parts) >= 3 and parts[-2] == "vars" and parts[-1].isdigit():
        return _keras3_class(parts[-3], int(parts[-1]))
    leaf = parts[-1] if parts else ""
    owner = parts[:-1]
    if leaf in _STATS:
        return "norm_stats"
    module_type, kind = _attr_text(attrs, "module_type").lower(), _attr_text(attrs, "kind")
    if module_type:
        if "norm" in module_type:
            return "norm_weight"
        if kind == "buffer":
            return "other"
        if "embedding" in module_type:
            return "embedding"
        if leaf == "bias":
            return "bias"
        return "weight" if leaf == "weight" else "other"
    in_norm = any(_NORM.search(p) for p in owner)
    if leaf == "n" and in_norm:  # Chainer's batch count, its num_batches_tracked
        return "norm_stats"
    if leaf in ("gamma", "beta") or in_norm:
        return "norm_weight"
    if any(_EMBED.search(p) for p in owner) or leaf in ("embeddings", "embedding"):
        return "embedding"
    if leaf in ("bias", "b"):
        return "bias"
    if leaf in ("weight", "kernel", "w", "depthwise_kernel", "pointwise_kernel"):
        return "weight"
    return "other"


def _keras3_class(layer: str, index: int) -> str:
    """Keras 3 ``.weights.h5`` names a layer's variables by position (``layers/<layer>/vars/<i>``),
    in the order the layer creates them; a layer named otherwise than by default is ``other``."""
    if _NORM.search(layer):  # gamma, beta, then (batch norm) moving mean and variance
        return "norm_weight" if index < 2 else "norm_stats"
    if _EMBED.search(layer):
        return "embedding"
    if _KERNEL_BIAS.match(layer) and index < 2:
        return ("weight", "bias")[index]
    return "other"


# ---------------------------------------------------------------------------------------------
# Datasets of a file


@dataclass
class Entry:
    """One numeric dataset of the file and where its bytes are."""

    path: str
    shape: tuple
    dtype: np.dtype
    layout: Layout
    cls: str
    offset: int | None  # file offset of the values of a contiguous (allocated) or compact dataset without filters (memory-mappable)
    fixed: bool = False  # never altered: edits would reach other files, not survive the write or name no enum member (see _why_fixed)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def scan(path: str | os.PathLike) -> list[Entry]:
    """Every numeric dataset in the file, sorted by path."""
    entries = []
    with open_h5(path) as f:
        def visit(name, obj):
            if isinstance(name, bytes):  # h5py's fallback for a name it cannot decode
                raise UnicodeDecodeError("utf-8", name, 0, len(name), "not UTF-8")
            if isinstance(obj, h5py.Dataset):
                layout = layout_of(obj)
                if layout is not None and obj.shape is not None and obj.size > 0:
                    entries.append(Entry("/" + name, tuple(obj.shape), obj.dtype, layout,
                                         location_class(name, obj.attrs), _offset(obj), _why_fixed(obj) is not None))
        try:
            f.visititems(visit)
        except UnicodeDecodeError as err:  # a damaged name, or one another tool wrote in another encoding
            raise PeatError(f"{path}: the name {err.object!r} is not UTF-8 text, as peat reads HDF5 names") from None
        except (OSError, RuntimeError, KeyError) as err:  # h5py: KeyError for an object header it cannot read
            raise PeatError(f"{path}: damaged HDF5 file ({_h5_reason(err)})") from None
    return sorted(entries, key=lambda e: e.path)


def _h5_reason(err: Exception) -> str:
    """h5py's message up to HDF5's parenthesised detail ("Can't synchronously read data (...)")."""
    text = err.args[0] if isinstance(err, KeyError) and err.args else err  # str(KeyError) adds quotes
    return str(text).split("(")[0].strip()


def links(path: str | os.PathLike, listed: list[str]) -> dict[str, str]:
    """Second names of datasets (``/name`` -> ``/target``): soft links, and hard links other than the
    name ``scan`` lists (``listed``); ``scan`` lists each dataset once."""
    found = {}
    with open_h5(path) as f:
        ids = {f[name].id: name for name in listed}

        def visit(name, link):
            # Soft links by the dataset they resolve to (none when dangling or not to a listed dataset).
            obj = f.get(name) if isinstance(link, (h5py.SoftLink, h5py.HardLink)) and "/" + name not in listed else None
            if isinstance(obj, h5py.Dataset) and obj.id in ids:
                found["/" + name] = ids[obj.id]
        f.visititems_links(visit)
    return found


def _named(path, pattern: str) -> str | None:
    """What a literal pattern that matches no dataset names instead: a group, or something in another file."""
    name = pattern.strip("/")
    if pattern.startswith("re:") or not name:
        return None
    with open_h5(path) as f:
        link, obj = f.get(name, getlink=True), f.get(name)
        if isinstance(link, h5py.ExternalLink) or (obj is not None and obj.id.fileno != f.id.fileno):
            return f"names {name}, in another file through an external link; only {path}'s own datasets are altered"
        if isinstance(obj, h5py.Group):
            return f"names the group {name}: select its datasets with '{name}/*'"
    return None


def unalterable(path: str | os.PathLike) -> dict[str, str]:
    """Datasets peat never alters (``/name`` -> why), for the error of a pattern that names one."""
    found = {}
    with open_h5(path) as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and (why := _why_unalterable(obj)):
                found["/" + name] = why
        f.visititems(visit)
    return found


def _kind(dt: np.dtype) -> str | None:
    """What a user calls a non-numeric dtype (None: a number)."""
    if dt.kind == "O" and not h5py.check_string_dtype(dt):
        return "reference" if h5py.check_ref_dtype(dt) else "vlen"
    if dt.kind == "V" and dt.names is None:  # raw bytes (HDF5's opaque type), no fields
        return "opaque"
    return {"b": "bool", "V": "compound", "O": "string", "S": "string", "U": "string", "c": "complex"}.get(dt.kind)


def _why_unalterable(ds: h5py.Dataset) -> str | None:
    if layout_of(ds) is None:
        try:
            kind = _kind(ds.dtype)
        except (TypeError, ValueError):  # as in layout_of
            kind = None
        return f"{kind} values" if kind else "a stored type peat cannot edit bit for bit"
    if ds.shape is None or ds.size == 0:
        return "it has no values"
    return _why_fixed(ds)


def _offset(ds: h5py.Dataset) -> int | None:
    plist = ds.id.get_create_plist()
    if plist.get_nfilters():
        return None
    if plist.get_layout() == h5py.h5d.COMPACT:
        return _compact_offset(ds)
    if plist.get_layout() != h5py.h5d.CONTIGUOUS:
        return None
    # Unallocated data has no offset: HDF5's "undefined address", which h5py turns into None only
    # where there is no user block (with one, it wraps around to userblock_size - 1, inside the
    # superblock, which a flip then corrupted).
    if ds.id.get_space_status() != h5py.h5d.SPACE_STATUS_ALLOCATED:
        return None
    return ds.id.get_offset()


def _compact_offset(ds: h5py.Dataset) -> int | None:
    """File offset of a compact dataset's values, inside its object header (None: write it through h5py).

    HDF5 stamps the time of every write into the header of a compact dataset (where the file records
    times, as the C library does by default), so a copy rewritten through h5py differed from a rerun or a
    replay of the same flips. Edited in place they keep the header as it was. Only version-1 headers:
    a version-2 header holds a checksum of its bytes, which HDF5 has to recompute.
    """
    info = h5py.h5o.get_info(ds.id)
    if info.hdr.version != 1:
        return None
    # The layout message (version 3, class 0 = compact), its 2-byte size, then the values as stored.
    needle = bytes([3, 0]) + ds.id.get_storage_size().to_bytes(2, "little") + np.ascontiguousarray(ds[()]).tobytes()
    start = ds.file.userblock_size + info.addr  # HDF5 addresses count from the superblock
    with open(ds.file.filename, "rb") as f:
        f.seek(start)
        header = f.read(16 + info.hdr.space.total)  # the prefix and the first chunk (continuations lie elsewhere)
    at = header.find(needle)
    if at < 0 or header.find(needle, at + 1) >= 0:  # not in the first chunk, or not unambiguously
        return None
    return start + at + 4


def _why_fixed(ds: h5py.Dataset) -> str | None:
    """Why peat never alters a dataset it scans (None: it may): ``Entry.fixed`` and the error naming it."""
    # External storage and virtual datasets live in other files, shared by the input and its copy.
    plist = ds.id.get_create_plist()
    if plist.get_layout() == h5py.h5d.VIRTUAL or plist.get_external_count() > 0:
        return "its data is stored outside the file"
    # An enum's integers name members: most flips give an integer that names none, a value the type
    # cannot hold. (Still scanned, so that h5diff compares them.)
    if h5py.check_enum_dtype(ds.dtype) is not None:
        return "enum values"
    return _missing_filter(plist) or _lossy_filter(ds, plist)


def _missing_filter(plist) -> str | None:
    """Why a dataset cannot be read or written here: a filter (Blosc, LZ4, Zstd...) this HDF5 lacks."""
    for i in range(plist.get_nfilters()):
        code, _, _, name = plist.get_filter(i)
        if not h5py.h5z.filter_avail(code):
            return f"behind HDF5 filter {code} ({name.decode(errors='replace')}), which this HDF5 library lacks"
    return None


def _lossy_filter(ds: h5py.Dataset, plist) -> str | None:
    """The scale-offset filter rounds floats to a few decimals, and stores integers in a fixed number of
    bits above each chunk's minimum where one is given: most flips would not be stored."""
    for i in range(plist.get_nfilters()):
        code, _, values, _ = plist.get_filter(i)
        if code != h5py.h5z.FILTER_SCALEOFFSET:
            continue
        if ds.dtype.kind == "f":
            return "floats behind HDF5's lossy scale-offset filter"
        if len(values) > 1 and values[1] > 0:  # values[1]: the bit width; 0 lets HDF5 choose a lossless one
            return f"integers behind HDF5's scale-offset filter with a fixed width of {values[1]} bits"
    return None


class Unreadable(PeatError):
    """A dataset HDF5 cannot read (a damaged chunk, a filter it lacks); ``reason`` says why, for h5diff."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class Storage:
    """Read and edit whole datasets of one file: memory maps where possible, h5py otherwise."""

    def __init__(self, path, mode: str = "r", name=None):
        self.path, self.mode = Path(path), mode
        self.name = name or self.path  # in errors: the user's file, not a temporary copy of it
        self._maps: dict[str, np.memmap] = {}
        self._arrays: dict[str, np.ndarray] = {}  # h5py-read datasets (edited in memory, written on close)
        self._edited: dict[str, list[np.ndarray]] = {}  # their altered flat positions

    def raw(self, entry: Entry) -> np.ndarray:
        """Flat raw-bits view of a dataset (editable when the storage is opened with mode 'r+')."""
        if entry.offset is not None:
            if entry.path not in self._maps:
                self._maps[entry.path] = np.memmap(self.path, dtype=_raw_dtype(entry.dtype), mode=self.mode,
                                                   offset=entry.offset, shape=(entry.size,))
            return self._maps[entry.path]
        if entry.path not in self._arrays:
            with open_h5(self.path) as f:
                try:
                    data = f[entry.path][()]
                except (OSError, RuntimeError) as err:
                    why = _missing_filter(f[entry.path].id.get_create_plist()) or _h5_reason(err)
                    raise Unreadable(f"{self.name}: cannot read {entry.path} ({why})", why) from None
            self._arrays[entry.path] = np.ascontiguousarray(data).reshape(-1).view(_raw_dtype(entry.dtype))
        return self._arrays[entry.path]

    def close(self) -> None:
        # No msync: edits live in the shared page cache, visible to every later reader of the file;
        # the copy is not fsynced either, so flushing would only cost time.
        self._maps.clear()
        if self.mode == "r+" and self._edited:
            with open_h5(self.path, "r+") as f:
                writes = [(name, f[name], region) for name, done in self._edited.items()
                          for region in _regions(f[name], np.concatenate(done))]
                # Rewritten chunks may not fit where the old ones were. Checked first: HDF5 crashes the
                # process (segmentation fault) closing a file whose write ran out of space.
                need = sum(_nbytes(ds, region) for _, ds, region in writes) * 1.01 + 2**20
                free = shutil.disk_usage(self.path.parent).free
                if free < need:  # an OSError as the copy's own: the study records a PeatError as not applicable
                    raise OSError(errno.ENOSPC, f"No space left on device to rewrite the chunked datasets of {self.name} "
                                  f"({free / 2**20:.1f} MiB free, up to {need / 2**20:.1f} MiB needed)", str(self.path.parent))
                for name, ds, region in writes:
                    ds[region] = self._arrays[name].view(ds.dtype).reshape(ds.shape)[region]
        self._arrays.clear()
        self._edited.clear()

    def write(self, entry: Entry, positions: np.ndarray, new: np.ndarray) -> None:
        """Store altered raw values at flat positions (kept in memory for h5py-read datasets until close)."""
        self.raw(entry)[positions] = new
        if entry.path in self._arrays:
            self._edited.setdefault(entry.path, []).append(positions)


def _regions(ds: h5py.Dataset, positions: np.ndarray) -> list[tuple]:
    """The selections to write back for altered flat positions: each chunk holding one, or the whole dataset.

    Only those chunks where some were never written: writing the whole dataset allocates and fills them
    all (a preallocated, resizable array grew the file from 0.4 to 80 MB for one flip). Where all are
    stored, one write of the whole is faster than one per chunk.
    """
    grid = [-(-n // k) for n, k in zip(ds.shape, ds.chunks or ())]
    if ds.chunks is None or not ds.shape or ds.id.get_num_chunks() == math.prod(grid):
        return [()]
    index = np.stack(np.unravel_index(positions, ds.shape), 1) // np.array(ds.chunks)
    return [tuple(slice(c * k, min((c + 1) * k, n)) for c, k, n in zip(chunk, ds.chunks, ds.shape))
            for chunk in np.unique(index, axis=0).tolist()]


def _nbytes(ds: h5py.Dataset, region: tuple) -> int:
    return int(np.prod([s.stop - s.start for s in region], dtype=np.int64)) * ds.dtype.itemsize if region else ds.nbytes


# ---------------------------------------------------------------------------------------------
# Selection


def _match(pattern: str, path: str) -> bool:
    bare = path.lstrip("/")
    if pattern.startswith("re:"):
        return re.search(pattern[3:], bare) is not None or re.search(pattern[3:], path) is not None
    pat = pattern.lstrip("/")
    return bare == pat or fnmatch.fnmatchcase(bare, pat)


def select(entries: list[Entry], patterns: list[str], classes: list[str], source) -> list[Entry]:
    """Datasets matching any pattern (all if none) and any class (all if none); errors name the file."""
    chosen = entries
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as err:
                raise PeatError(f"--select {pattern!r}: bad regular expression ({err})") from None
        if not any(_match(pattern, e.path) for e in entries):
            raise PeatError(f"{source}: {_no_match(pattern, entries, source)}")
    if patterns:
        chosen = [e for e in chosen if any(_match(p, e.path) for p in patterns)]
    if classes:
        present = sorted({e.cls for e in chosen})
        for cls in classes:
            if cls not in present:
                raise PeatError(f"{source}: no dataset of class {cls!r} among the selected ones; present: {', '.join(present)}")
        chosen = [e for e in chosen if e.cls in classes]
    return chosen


def _no_match(pattern: str, entries: list[Entry], source) -> str:
    """Why a pattern selects no dataset: what it names instead, else the closest names."""
    named = {name: target for name, target in links(source, [e.path for e in entries]).items() if _match(pattern, name)}
    if named:  # a tied weight's second name (peat checkpoints: GPT-2's lm_head.weight)
        name, target = next(iter(named.items()))
        return (f"{pattern!r} names {name.lstrip('/')}, a link to {target.lstrip('/')} "
                f"(one tensor under two names): select {target.lstrip('/')}")
    named = _named(source, pattern)
    if named:
        return f"{pattern!r} {named}"
    never = {name: why for name, why in unalterable(source).items() if _match(pattern, name)}
    if never:  # there, but empty, not numeric, or stored where a flip would not stay in this copy
        name, why = next(iter(never.items()))
        return f"{pattern!r} names {name.lstrip('/')}, which peat never alters ({why})"
    names = [e.path.lstrip("/") for e in entries]
    close = difflib.get_close_matches(pattern.removeprefix("re:").lstrip("/"), names, n=5, cutoff=0.3)
    hint = f"closest: {', '.join(close)}" if close else f"datasets: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
    return f"no numeric dataset matches {pattern!r}; {hint}"


# ---------------------------------------------------------------------------------------------
# The plan of one alteration


@dataclass
class Plan:
    """What to corrupt and how (mirrors the command-line options)."""

    select: list[str] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    count: int | None = None
    fraction: float | None = None
    probability: float | None = None
    region: str | None = None  # default "any" unless bits/scale are given
    bits: tuple[int, int] | None = None
    burst: int = 1
    mask: str | None = None
    scale: float | None = None
    sign_change: bool = True
    nonfinite: bool = True
    seed: int = 0

    def check(self) -> None:
        amounts = [x is not None for x in (self.count, self.fraction, self.probability)]
        if sum(amounts) > 1:
            raise PeatError("give only one of --count, --fraction, --probability")
        if self.count is not None and self.count < 1:  # 0 wrote a copy identical to the input
            raise PeatError(f"--count {self.count}: must be >= 1")
        if self.fraction is not None and not 0 <= self.fraction <= 1:
            raise PeatError(f"--fraction {self.fraction}: must be in [0, 1]")
        if self.probability is not None and not 0 <= self.probability <= 1:
            raise PeatError(f"--probability {self.probability}: must be in [0, 1]")
        if self.region is not None and self.bits is not None:
            raise PeatError("give either --region or --bits, not both")
        if self.region is not None and self.region not in REGIONS:
            raise PeatError(f"--region {self.region!r}: allowed: {', '.join(CLI_REGIONS)}")
        if self.bits is not None and not 0 <= self.bits[0] <= self.bits[1] <= 63:
            raise PeatError(f"--bits {self.bits[0]}-{self.bits[1]}: need 0 <= A <= B <= 63 (bit 0 = sign)")
        if not 1 <= self.burst <= 64:  # a huge one built a list of that many bit offsets (or overflowed)
            raise PeatError(f"--burst {self.burst}: must be in [1, 64] (no value has more bits)")
        if self.seed < 0:  # numpy's generators take no negative seed
            raise PeatError(f"--seed {self.seed}: must be >= 0")
        if self.mask is not None and (self.burst != 1 or not self.mask or set(self.mask) - {"0", "1"} or "1" not in self.mask):
            raise PeatError(f"--mask {self.mask!r}: a string of 0 and 1 with at least one 1, not combined with --burst")
        if self.scale is not None and (self.mask is not None or self.burst != 1 or self.bits or self.region):
            raise PeatError("--scale replaces bit flips: do not combine it with --region, --bits, --burst or --mask")
        if self.scale is not None and not math.isfinite(self.scale):
            raise PeatError(f"--scale {self.scale}: must be finite")
        if self.region == "sign" and not self.sign_change:
            raise PeatError("--region sign flips only sign bits: it contradicts --no-sign-change")
        # copysign: -0.0 < 0 is false, yet multiplying by it negates every sign too.
        if self.scale is not None and math.copysign(1.0, self.scale) < 0 and not self.sign_change:
            raise PeatError(f"--scale {self.scale} changes every sign: it contradicts --no-sign-change")
        for cls in self.classes:
            if cls not in CLASSES:
                raise PeatError(f"--class {cls!r}: allowed: {', '.join(CLASSES)}")

    @property
    def pattern(self) -> list[int]:
        """Bit offsets (relative to the placement) flipped in one value."""
        if self.mask is not None:
            return [i for i, c in enumerate(self.mask) if c == "1"]
        return list(range(self.burst))

    @property
    def pattern_width(self) -> int:
        return len(self.mask) if self.mask is not None else self.burst

    def candidates(self, layout: Layout) -> np.ndarray:
        """XOR masks (uint64, machine bit order) one of which is applied to each chosen value."""
        if self.bits is not None:
            if self.bits[1] >= layout.width:
                return np.zeros(0, np.uint64)
            lo, hi = self.bits
        else:
            span = layout.region(self.region or "any")
            if span is None:
                return np.zeros(0, np.uint64)
            lo, hi = span
        forbidden = {0} if (not self.sign_change and layout.signed) else set()
        masks, pattern = [], self.pattern
        for start in range(lo, hi - self.pattern_width + 2):
            bits = [start + o for o in pattern]
            if not forbidden.intersection(bits):
                masks.append(sum(1 << (layout.width - 1 - b) for b in bits))
        return np.array(masks, dtype=np.uint64)


def _exponent_field(raw: np.ndarray, layout: Layout) -> np.ndarray:
    full = (1 << layout.exponent) - 1
    return ((raw >> raw.dtype.type(layout.mantissa)) & raw.dtype.type(full)).astype(np.int64)


def _nonfinite_targets(masks: np.ndarray, layout: Layout) -> np.ndarray:
    """For each mask, the exponent field that the mask turns into all ones (NaN/Inf)."""
    return ((1 << layout.exponent) - 1) ^ _exponent_field(masks, layout)


# ---------------------------------------------------------------------------------------------
# Drawing the edits


@dataclass
class Edit:
    """The edits of one dataset: flat positions and the XOR mask of each (or a scale factor)."""

    entry: Entry
    positions: np.ndarray
    xor: np.ndarray | None = None  # uint64 per position
    scale: float | None = None


def _eligible(entry: Entry, raw: np.ndarray, plan: Plan, masks: np.ndarray) -> np.ndarray | None:
    """Boolean mask of the values the corruption can alter, as asked (None: all of them)."""
    if plan.scale is not None:
        # A value the factor leaves as it was (0 x F, NaN, a bfloat16 that rounds back) is no alteration:
        # counted and logged, it was missing from h5diff.
        scaled = _scaled(raw, entry, plan.scale)
        old = _values(raw, entry.dtype, entry.layout)
        # A NaN stays one: the product only sets the quiet bit of a signalling NaN (left by an
        # earlier flip), which was counted and logged as an altered value, "nan" -> "nan".
        changed = (scaled != raw) & ~np.isnan(old)
        if plan.nonfinite:
            return changed
        return changed & np.isfinite(old) & np.isfinite(_values(scaled, entry.dtype, entry.layout))
    if plan.nonfinite or not entry.layout.is_float:
        return None
    bad = _bad_counts(masks, entry.layout)
    return bad[_exponent_field(raw, entry.layout)] < len(masks)


def _bad_counts(masks: np.ndarray, layout: Layout) -> np.ndarray:
    """Per exponent field value, how many candidate masks would make it NaN/Inf."""
    return np.bincount(_nonfinite_targets(masks, layout), minlength=1 << layout.exponent)


def draw(entries: list[Entry], storage: Storage, plan: Plan, source) -> tuple[list[Edit], int]:
    """Choose positions and masks for the whole selection, uniformly over eligible values.

    Also returns how many selected datasets can take the corruption at all (dtype, region width),
    which is what "altered in N of M datasets" should count.
    """
    rng = np.random.default_rng(plan.seed)
    selected = entries
    if plan.scale is not None:
        entries = [e for e in entries if e.layout.is_float]
        masks_of = {e.path: np.zeros(1, np.uint64) for e in entries}
    else:
        masks_of = {e.path: plan.candidates(e.layout) for e in entries}
        entries = [e for e in entries if len(masks_of[e.path])]
    if not entries:
        raise PeatError(f"{source}: no selected dataset can take {_asked(plan)}: they hold {_held(selected)}")
    # Flips change every value they are given: only --no-nonfinite needs to read values to know.
    read = plan.scale is not None or not plan.nonfinite
    eligible = {e.path: _eligible(e, storage.raw(e), plan, masks_of[e.path]) if read else None for e in entries}
    counts = np.array([e.size if eligible[e.path] is None else int(eligible[e.path].sum()) for e in entries], np.int64)
    total = int(counts.sum())
    n = _amount(plan, total, rng)
    if n > total:
        raise PeatError(f"{source}: {n} values to corrupt but only {total} eligible values in "
                        f"{len(entries)} selected dataset(s)")
    ranks = np.sort(rng.choice(total, size=n, replace=False)) if n else np.zeros(0, np.int64)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    cuts = np.searchsorted(ranks, bounds)  # ranks are sorted: each dataset's share is one slice
    edits = []
    for i in np.flatnonzero(np.diff(cuts)):
        entry = entries[i]
        local = ranks[cuts[i]:cuts[i + 1]] - bounds[i]
        ok = eligible[entry.path]
        positions = local if ok is None else np.flatnonzero(ok)[local]
        if plan.scale is not None:
            edits.append(Edit(entry, positions, scale=plan.scale))
        else:
            edits.append(Edit(entry, positions, xor=_choose_masks(entry, storage, plan, masks_of[entry.path], positions, rng)))
    return edits, len(entries)


def _asked(plan: Plan) -> str:
    """The corruption options that decide which dtypes can take it, as the user gave them."""
    if plan.scale is not None:
        return f"--scale {plan.scale} (floats only)"
    where = f"--bits {plan.bits[0]}-{plan.bits[1]}" if plan.bits else f"--region {plan.region or 'any'}"
    width = f"--mask {plan.mask} in " if plan.mask else f"--burst {plan.burst} in " if plan.burst > 1 else ""
    return width + where + ("" if plan.sign_change else " with --no-sign-change")


def _held(entries: list[Entry]) -> str:
    """What the selected datasets hold: each dtype with a dataset of it ('int64 (step and 2 more)')."""
    by_kind: dict[str, list[str]] = {}
    for e in entries:
        by_kind.setdefault(e.layout.name, []).append(e.path.lstrip("/"))
    return ", ".join(f"{kind} ({names[0]}" + (f" and {len(names) - 1} more)" if len(names) > 1 else ")")
                     for kind, names in sorted(by_kind.items()))


def _amount(plan: Plan, total: int, rng: np.random.Generator) -> int:
    if plan.fraction is not None:
        # Halves up, as a user reads "round" (round() goes to even), of the fraction as written: the
        # float 0.009 is just below 0.009, so 0.009 x 1500 = 13.5 computed in floats rounds down.
        return int((Decimal(repr(float(plan.fraction))) * total).to_integral_value(ROUND_HALF_UP))
    if plan.probability is not None:
        return int(rng.binomial(total, plan.probability))
    return 1 if plan.count is None else plan.count


def _choose_masks(entry, storage, plan, masks, positions, rng) -> np.ndarray:
    """One candidate mask per position, uniform among those that keep the value finite if asked."""
    pick = rng.integers(len(masks), size=len(positions))
    if not plan.nonfinite and entry.layout.is_float:
        field_ = _exponent_field(storage.raw(entry)[positions], entry.layout)
        constrained = np.flatnonzero(_bad_counts(masks, entry.layout)[field_] > 0)
        if len(constrained):
            valid = field_[constrained, None] != _nonfinite_targets(masks, entry.layout)[None, :]
            k = (rng.random(len(constrained)) * valid.sum(1)).astype(np.int64)
            pick[constrained] = np.argmax(np.cumsum(valid, 1) > k[:, None], axis=1)
    return masks[pick]


# ---------------------------------------------------------------------------------------------
# Applying edits and the injection log


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest-even bfloat16, returned widened to float32."""
    u = x.astype(np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    rounded = np.where(np.isnan(x), u | np.uint32(0x00400000), rounded)
    return rounded.astype(np.uint32).view(np.float32)


def _f32_round_to_odd(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd, so that rounding it again to bfloat16 is exact: rounding to
    nearest twice turns a float64 just past a bfloat16 halfway point into a float32 tie, then the wrong way."""
    f = x.astype(np.float32)
    back = f.astype(np.float64)
    inexact = np.isfinite(x) & (back != x)
    u = f.view(np.uint32)
    u = np.where(inexact & (np.abs(back) > np.abs(x)), u - np.uint32(1), u)  # truncate toward zero
    return np.where(inexact, u | np.uint32(1), u).astype(np.uint32).view(np.float32)


def apply(edits: list[Edit], storage: Storage) -> list[dict]:
    """Apply edits in place through ``storage``; return per-dataset columns for the log."""
    done = []
    for edit in edits:
        raw = storage.raw(edit.entry)
        old = raw[edit.positions].copy()
        if edit.scale is not None:
            new = _scaled(old, edit.entry, edit.scale)
        else:
            new = (old ^ edit.xor.astype(raw.dtype)).astype(raw.dtype)  # keep the file's byte order
        storage.write(edit.entry, edit.positions, new)
        done.append({"entry": edit.entry, "positions": edit.positions, "old": old, "new": new, "scale": edit.scale})
    return done


SCALE_CHUNK = 1 << 20  # values scaled at once: the exact product takes several float64 copies of them


def _scaled(old: np.ndarray, entry: Entry, factor: float) -> np.ndarray:
    """``old``'s raw values times ``factor``, a chunk at a time: at once, a 131M-value embedding's
    float64 copies peaked at 7 GB."""
    if old.size <= SCALE_CHUNK:
        return _scaled_chunk(old, entry, factor)
    flat, out = old.reshape(-1), np.empty(old.size, old.dtype)
    for start in range(0, flat.size, SCALE_CHUNK):
        out[start:start + SCALE_CHUNK] = _scaled_chunk(flat[start:start + SCALE_CHUNK], entry, factor)
    return out.reshape(old.shape)


def _scaled_chunk(old: np.ndarray, entry: Entry, factor: float) -> np.ndarray:
    # The exact product rounded once to the dtype: a factor cast to float16/float32 first overflows
    # (70000 in float16) or rounds away (1.0001 in float16) before it multiplies anything.
    with np.errstate(over="ignore", invalid="ignore"):
        x = _values(old, entry.dtype, entry.layout).astype(np.float64)
        if entry.layout.name == "float64":
            return (x * factor).astype(entry.dtype).view(old.dtype)  # in the file's byte order
        wide = _product_round_to_odd(x, factor)
        if entry.layout.name == "bfloat16":
            return (_bf16_round(_f32_round_to_odd(wide)).view(np.uint32) >> np.uint32(16)).astype(old.dtype)
        return wide.astype(entry.dtype).view(old.dtype)


def _product_round_to_odd(x: np.ndarray, factor: float) -> np.ndarray:
    """x * factor rounded to odd in float64, so that rounding it again to a narrower float is exact:
    the product rounded to nearest in float64 can land on a float32 (or float16) halfway point the
    exact one is just past, and then round the wrong way (3.0 x (1 + 178956971 x 2^-52) gave 3.0).

    ``x`` holds at most 24 significant bits (float32, float16, bfloat16 values): times each half of
    the factor's 53 (26 and 27 bits) it is exact, and their sum is the product plus what it rounds off.
    """
    mantissa, exponent = math.frexp(factor)  # [0.5, 1): neither half below overflows
    high = math.ldexp(round(math.ldexp(mantissa, 26)), -26)
    a, b = x * high, x * (mantissa - high)  # a + b == x * mantissa
    p = x * mantissa  # rounded to nearest: within a factor 2 of a, so a - p is exact
    err = (a - p) + b  # what p rounded off, exactly; NaN where x is not finite
    inexact = np.isfinite(err) & (err != 0)
    # p rounded away from zero: its neighbour toward zero; then the odd one of the two around the product.
    away = inexact & (np.signbit(err) != np.signbit(p))
    u = (p.view(np.uint64) - away.view(np.uint8)) | inexact.view(np.uint8)
    return np.ldexp(u.view(np.float64), exponent)


def _bit_list(xor: np.ndarray, width: int) -> list:
    """Per value, the flipped bits in peat's numbering: an int for one bit, a list for several."""
    shifts = (width - 1 - np.arange(width)).astype(np.uint64)
    table = ((xor.astype(np.uint64)[:, None] >> shifts) & np.uint64(1)).astype(bool)
    out = np.argmax(table, 1).tolist()
    for i in np.flatnonzero(table.sum(1) != 1):  # bursts and masks only
        out[i] = np.flatnonzero(table[i]).tolist()
    return out


def _jsonable_values(raw: np.ndarray, entry: Entry) -> list:
    vals = _values(raw, entry.dtype, entry.layout)
    if not entry.layout.is_float:
        return vals.tolist()
    with np.errstate(invalid="ignore"):  # signalling NaNs made by flips
        wide = vals.astype(np.float64)
    return [v if math.isfinite(v) else str(v) for v in wide.tolist()]


def records(done: list[dict]) -> list[dict]:
    """Injection-log rows: dataset, index, bit, old, new (old and new as numbers; NaN/Inf as strings)."""
    rows = []
    for d in done:
        e = d["entry"]
        index = np.stack(np.unravel_index(d["positions"], e.shape), 1).tolist() if e.shape else [[]] * len(d["positions"])
        bits = [None] * len(index) if d["scale"] is not None else _bit_list(d["old"] ^ d["new"], e.layout.width)
        rows += [{"dataset": e.path, "index": i, "bit": b, "old": o, "new": n}
                 for i, b, o, n in zip(index, bits, _jsonable_values(d["old"], e), _jsonable_values(d["new"], e))]
    return rows


# ---------------------------------------------------------------------------------------------
# The alteration of a file


@dataclass
class Result:
    flips: int
    datasets: int
    eligible_datasets: int
    timings: dict
    records: list[dict] | None


def _prepare_output(src: Path, dst: Path | None, in_place: bool) -> Path:
    if not src.exists():
        raise PeatError(f"{src}: no such file")
    if in_place:
        if dst is not None and dst.resolve() != src.resolve():
            raise PeatError("--in-place takes only the input file")
        if not os.access(src, os.W_OK) or not src.stat().st_mode & 0o222:  # root too respects the mode
            raise PeatError(f"{src}: read-only; refusing to alter it in place")
        return src.resolve()  # through a symlink: the renamed copy replaces its target, not the link
    if dst is None:
        raise PeatError("give an output file (or --in-place to alter the input)")
    if dst.exists() and dst.resolve() == src.resolve():
        raise PeatError(f"{dst}: output is the input file; use --in-place to alter it")
    check_output(str(dst), dst, "output")
    return dst


def check_output(label: str, path: Path, noun: str) -> None:
    """One line, before any work, for an output that cannot be renamed into place where it is named."""
    if path.is_dir():  # else the rename fails after all the work, naming only the temporary copy
        raise PeatError(f"{label}: is a directory; name the {noun} file")
    if path.exists() and not path.is_file():  # the rename would replace it: /dev/null became a checkpoint
        raise PeatError(f"{label}: not a regular file; name the {noun} file")
    folder = next(f for f in path.parents if f.exists())  # the folders made for it start at the first existing one
    if not folder.is_dir():  # else 'File exists' once the work is done
        raise PeatError(f"{label}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PeatError(f"{label}: cannot write in {folder} (permission denied or read-only)")


def alter(src, dst, plan: Plan, *, in_place: bool = False, log: str | os.PathLike | None = None,
          replay: str | os.PathLike | None = None, keep_records: bool = False) -> Result:
    """Copy ``src`` to ``dst`` (temp name, then rename) and corrupt the copy as ``plan`` says.

    ``replay`` applies the injections of a log instead of drawing new ones.
    """
    src = Path(src)
    plan.check()
    out = _prepare_output(src, Path(dst) if dst is not None else None, in_place)
    if replay is not None and out.resolve() == Path(replay).resolve():  # else the copy is renamed over the log
        raise PeatError(f"{out}: output is the replayed log; name another output file")
    if log is not None:
        _check_json_output("--log", log, [src, out], "the checkpoint itself", "log")
        if replay is not None:  # the new log would replace the replayed one's plan (seed, options) with itself
            _check_json_output("--log", log, [replay], "the replayed log", "log")
    t0 = time.perf_counter()
    entries = [e for e in scan(src) if not e.fixed]
    if not entries:
        raise PeatError(f"{src}: no numeric datasets to alter")
    reader = Storage(src, "r")
    if replay is not None:
        edits, scale = edits_from_log(replay, entries, reader, src)
        takers = len({e.entry.path for e in edits})
    else:
        edits, takers = draw(select(entries, plan.select, plan.classes, src), reader, plan, src)
        scale = plan.scale
    reader.close()
    t_select = time.perf_counter()
    with atomic_path(out) as tmp:
        shutil.copyfile(src, tmp)
        if in_place:  # the altered file replaces the input: keep who may read and write it
            shutil.copymode(src, tmp)
        t_copy = time.perf_counter()
        storage = Storage(tmp, "r+", name=src)
        done = apply(edits, storage)
        storage.close()
        t_flip = time.perf_counter()
        rows = records(done) if keep_records else None
        if log is not None:  # before the rename: a log that cannot be written leaves no output without it
            write_log(log, {"tool": "peat alter", "format": 1, "input": str(src), "bit_numbering": BIT_NUMBERING,
                            "plan": asdict(plan) if replay is None else {"replay": str(replay)},
                            "scale": scale}, done)
        t_log = time.perf_counter()
    t_end = time.perf_counter()
    n = int(sum(len(e.positions) for e in edits))
    timings = {"select": t_select - t0, "copy": t_copy - t_select, "flip": t_flip - t_copy,
               "rename": t_end - t_log, "log": t_log - t_flip, "total": t_end - t0}
    return Result(n, len({e.entry.path for e in edits}), takers, timings, rows)


def _check_json_output(option: str, path, files: list, what: str, noun: str) -> None:
    """One line, before any work, for a JSON output that would replace one of ``files`` or is a directory."""
    if Path(path).resolve() in {Path(p).resolve() for p in files}:
        raise PeatError(f"{option} {path}: that is {what}; name another file")
    check_output(f"{option} {path}", Path(path), noun)


LOG_CHUNK = 50_000  # injection-log rows encoded at a time (about 10 MB of JSON)


def write_log(path, header: dict, done: list[dict]) -> None:
    """``write_json(path, {**header, "injections": records(done)})``, the same bytes, encoded ``LOG_CHUNK``
    rows at a time: all rows at once took about 2 GB of memory per million."""
    marker = "\0injections"
    head, tail = json_text({**header, "injections": marker}).split(json.dumps(marker))
    with atomic_path(path) as tmp, tmp.open("w") as f:
        f.write(head + "[")
        first = True
        for d in done:
            for i in range(0, len(d["positions"]), LOG_CHUNK):
                part = slice(i, i + LOG_CHUNK)
                rows = records([{**d, "positions": d["positions"][part], "old": d["old"][part], "new": d["new"][part]}])
                # A list alone is encoded one level less deep than under "injections": the rows get 2 more spaces.
                f.write(("\n" if first else ",\n") + "  " + json_text(rows)[2:-3].replace("\n", "\n  "))
                first = False
        f.write(("]" if first else "\n  ]") + tail)


def edits_from_log(log, entries: list[Entry], storage: Storage, source) -> tuple[list[Edit], float | None]:
    """Edits that repeat a log exactly: same datasets, positions and bits (or scale factor), and
    that factor (None: bit flips)."""
    rows, scale = _read_log(log)
    by_path = {e.path: e for e in entries}
    groups: dict[str, list[dict]] = {}
    for row in rows:  # a hand-written name may leave out the leading "/", as --select and h5py allow
        groups.setdefault("/" + row["dataset"].lstrip("/"), []).append(row)
    edits = []
    for name, group in sorted(groups.items()):
        entry = by_path.get(name)
        if entry is None:
            if why := unalterable(source).get(name):  # else "absent here" of a dataset that is there
                raise PeatError(f"{source}: log {log} names {name.lstrip('/')}, which peat never alters ({why})")
            if target := links(source, list(by_path)).get(name):  # a tied weight's second name, as --select says
                raise PeatError(f"{source}: log {log} names {name.lstrip('/')}, a link to {target.lstrip('/')} "
                                f"(one tensor under two names): name {target.lstrip('/')}")
            close = difflib.get_close_matches(name, list(by_path), n=3, cutoff=0.3)
            raise PeatError(f"{source}: log {log} names {name!r}, absent here; closest: {', '.join(close) or 'none'}")
        if any(len(r["index"]) != len(entry.shape) for r in group):
            raise PeatError(f"{source}: log {log} cannot be applied to {name}: its indices do not have the "
                            f"{len(entry.shape)} dimension(s) of shape {entry.shape}")
        # Checked before numpy holds them: an index beyond int64 would fail there with an OverflowError.
        if any(not 0 <= i < n for r in group for i, n in zip(r["index"], entry.shape)):
            raise PeatError(f"{source}: log {log} has an index outside {name} of shape {entry.shape}")
        index = np.array([r["index"] for r in group], np.int64).reshape(len(group), len(entry.shape))
        positions = np.ravel_multi_index(index.T, entry.shape) if entry.shape else np.zeros(len(group), np.int64)
        _, first, seen = np.unique(positions, return_index=True, return_counts=True)
        if (seen > 1).any():  # only the last would be applied, and the log would list both
            raise PeatError(f"{source}: log {log} alters {name} at index {group[first[seen > 1][0]]['index']} twice: "
                            "give one injection per value (a list of bits)")
        if scale is not None:
            if not entry.layout.is_float:  # as --scale draws: a product rounded to an integer is no scaling
                raise PeatError(f"{source}: log {log} scales {name}, which holds {entry.layout.name} values; "
                                "a scale factor alters floats only")
            edits.append(Edit(entry, positions, scale=scale))
        else:
            bits = [r["bit"] if isinstance(r["bit"], list) else [r["bit"]] for r in group]
            if any(not 0 <= b < entry.layout.width for bs in bits for b in bs):
                raise PeatError(f"{source}: log {log} cannot be applied to {name}: it flips bits beyond the "
                                f"{entry.layout.width} bits of {entry.layout.name}")
            xor = np.array([sum(1 << (entry.layout.width - 1 - b) for b in bs) for bs in bits], np.uint64)
            edits.append(Edit(entry, positions, xor=xor))
        _warn_if_different(storage, entry, positions, group, source, log)
    return edits, scale


def _read_log(log) -> tuple[list[dict], float | None]:
    """A log's injections and scale factor, each row checked for the fields a replay reads."""
    try:
        data = json.loads(Path(log).read_text())
        rows, scale = data["injections"], data.get("scale")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PeatError(f"{log}: not a peat alter injection log ({type(err).__name__}: {err})") from None
    if "skipped" in data:  # else its replay is an unaltered copy that reads as the cell's altered checkpoint
        raise PeatError(f"{log}: the log of a study cell that was not applicable, with no flips to redo "
                        f"({data['skipped']})")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise PeatError(f"{log}: scale {scale!r} is not a number")
    if not isinstance(rows, list):
        raise PeatError(f"{log}: injections is not a list")
    for i, row in enumerate(rows):
        if not _well_formed(row, bit=scale is None):
            raise PeatError(f"{log}: injection {i} needs dataset (a path), index (a list of integers)"
                            + ("" if scale is not None else ", bit (an integer or a list of them)"))
        if scale is None and isinstance(row["bit"], list) and len(set(row["bit"])) < len(row["bit"]):
            twice = next(b for b in row["bit"] if row["bit"].count(b) > 1)  # its mask would carry into the next bit
            raise PeatError(f"{log}: injection {i} lists bit {twice} twice")
    return rows, scale


def _well_formed(row, bit: bool) -> bool:
    """Whether a (perhaps hand-written) log row has the fields a replay reads, of the right types."""
    def ints(v):
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)

    return (isinstance(row, dict) and isinstance(row.get("dataset"), str) and ints(row.get("index"))
            and (not bit or ints(row.get("bit")) and row["bit"] != [] or ints([row.get("bit")])))


def _warn_if_different(storage, entry, positions, group, source, log) -> None:
    have = _jsonable_values(storage.raw(entry)[positions], entry)
    # A hand-written log may leave out the old values: nothing to compare then.
    differ = sum(1 for h, r in zip(have, group) if "old" in r and h != r["old"] and not (h == r["old"] == "nan"))
    if differ:
        print(f"peat alter: warning: {differ} value(s) of {entry.path} in {source} differ from the 'old' values "
              f"in {log}; they are altered the same way anyway", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# h5diff


def diff(a, b, *, positions: bool = False) -> dict:
    """Per dataset of two HDF5 files: differing elements, relative differences, distance, bits.

    Datasets ``scan`` leaves out (bools, strings, compounds, empty ones) are compared element by
    element; those that cannot be read or compared are named in ``not_compared``, never skipped.
    """
    ea, eb = {e.path: e for e in scan(a)}, {e.path: e for e in scan(b)}
    na, nb = set(ea) | set(unalterable(a)), set(eb) | set(unalterable(b))
    sa, sb = Storage(a), Storage(b)
    rows, listing, not_compared = [], [], {}
    for name in sorted(na & nb):
        if name not in ea or name not in eb:
            row = _diff_other(a, b, name)
            if "not_compared" in row:
                not_compared[name] = row["not_compared"]
            else:
                rows.append(row)
            continue
        x, y = ea[name], eb[name]
        if x.shape != y.shape or x.dtype != y.dtype or x.layout != y.layout:
            rows.append({"dataset": name, "status": f"differs in shape/dtype: {_typed(x)} vs {_typed(y)}"})
            continue
        try:
            ra, rb = sa.raw(x), sb.raw(y)
        except Unreadable as err:
            not_compared[name] = err.reason
            continue
        where = np.flatnonzero(ra != rb)
        rows.append(_diff_row(x, ra, rb, where))
        if positions and len(where):
            listing += records([{"entry": x, "positions": where, "old": ra[where], "new": rb[where], "scale": None}])
    sa.close()
    sb.close()
    out = {"a": str(a), "b": str(b), "bit_numbering": BIT_NUMBERING, "datasets": rows,
           "only_in_a": sorted(na - nb), "only_in_b": sorted(nb - na), "not_compared": not_compared,
           "attributes_differ": attribute_changes(a, b)}
    if positions:
        out["positions"] = listing
    return out


def attribute_changes(a, b) -> dict[str, list[str]]:
    """Per object (group or dataset) in both files, the attributes that differ or are in one file only."""
    changes = {}
    with open_h5(a) as fa, open_h5(b) as fb:
        def compare(name, obj):
            other = fb.get(name) if name else fb
            if other is None or type(other) is not type(obj):  # only in A: h5diff lists its datasets already
                return
            names = set(obj.attrs) | set(other.attrs)
            differ = sorted(k for k in names if _attr_value(obj, k) != _attr_value(other, k))
            if differ:
                changes["/" + name] = differ
        compare("", fa)
        fa.visititems(compare)
    return changes


def _attr_value(obj, key: str):
    """An attribute's value in a form equal between files for equal values (None: absent)."""
    if key not in obj.attrs:
        return None
    try:
        return _comparable(obj.attrs[key], obj.file)
    except (OSError, TypeError, ValueError, KeyError) as err:  # a type h5py cannot read: equal if it fails alike
        return ("unreadable", _h5_reason(err))


def _comparable(value, f: h5py.File):
    # Bytes for numbers (equal NaNs are equal, as h5diff compares datasets); references by their targets.
    if isinstance(value, h5py.Reference):
        return _targets(f, np.array([value], object))[0]
    if isinstance(value, (np.ndarray, np.void)) and value.dtype.hasobject:  # vlen arrays, references, in fields
        items = value.reshape(-1) if isinstance(value, np.ndarray) else value
        return (value.dtype.str, np.shape(value), tuple(_comparable(v, f) for v in items))
    if isinstance(value, (np.ndarray, np.generic)):
        return (value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, h5py.Empty):
        return ("empty", str(value.dtype))
    return value


def _typed(entry: Entry) -> str:
    # The layout and the stored type: a bf16-tagged uint16 against a plain one, or float32 of the
    # other byte order, would otherwise read "uint16 vs uint16", "float32 vs float32".
    return f"{entry.shape} {entry.layout.name} ({np.dtype(entry.dtype).str})"


def _diff_row(entry: Entry, ra: np.ndarray, rb: np.ndarray, where: np.ndarray) -> dict:
    # Integers in extended precision: float64 rounds int64 above 2^53, so a low-bit flip there
    # would show no difference (x86's long double holds 64 bits of mantissa).
    wide = np.longdouble if np.dtype(entry.dtype).kind in "iu" else np.float64
    with np.errstate(invalid="ignore"):  # signalling NaNs made by flips
        va = _values(ra[where], entry.dtype, entry.layout).astype(wide)
        vb = _values(rb[where], entry.dtype, entry.layout).astype(wide)
    finite = np.isfinite(va) & np.isfinite(vb)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        delta = np.abs(vb[finite] - va[finite])
        # inf where the old value was zero; 0 for 0.0 vs -0.0, equal numbers whose 0/0 (NaN) max() would return
        rel = np.where(delta == 0, 0.0, delta / np.abs(va[finite]))
        scale_ = delta.max() if len(delta) else 0.0  # scaled: squares of flipped float64 overflow
        euclid = scale_ * np.sqrt(((delta / scale_) ** 2).sum()) if scale_ and np.isfinite(scale_) else scale_
    flipped = (ra[where] ^ rb[where]).astype(np.uint64)
    w = entry.layout.width
    hist = {b: int(((flipped >> np.uint64(w - 1 - b)) & np.uint64(1)).sum()) for b in range(w)}
    if len(rel):
        stats = (_num(rel.max()), _num(rel[np.isfinite(rel)].mean()) if np.isfinite(rel).any() else _num(np.inf),
                 _num(euclid))
    else:  # nothing differs (0), or every differing pair holds a NaN/Inf, where 0 would read as unchanged
        stats = ("n/a" if len(where) else 0.0,) * 3
    return {
        "dataset": entry.path, "dtype": entry.layout.name, "class": entry.cls, "elements": entry.size,
        "differing": int(len(where)), "nonfinite_new": int((~np.isfinite(vb)).sum()),
        **dict(zip(("max_rel", "mean_rel", "euclidean"), stats)),
        "bits": {str(b): c for b, c in hist.items() if c},
    }


def _diff_other(a, b, name: str) -> dict:
    """A row for a dataset ``scan`` leaves out in A or B: differing elements, numeric columns n/a."""
    with open_h5(a) as fa, open_h5(b) as fb:
        da, db = fa[name], fb[name]
        try:
            if da.shape != db.shape or da.dtype != db.dtype:
                return {"dataset": name, "status": f"differs in shape/dtype: {da.shape} {da.dtype} vs {db.shape} {db.dtype}"}
            # h5py reads a null dataspace as h5py.Empty and a scalar string as bytes: arrays of the stored dtype.
            va, vb = (np.zeros(0, d.dtype) if d.shape is None else np.asarray(d[()], d.dtype).reshape(-1) for d in (da, db))
            if h5py.check_ref_dtype(da.dtype):  # h5py's reference objects of two open files never compare equal
                va, vb = _targets(da.file, va), _targets(db.file, vb)
            where = np.flatnonzero(_unequal(va, vb))
        except (OSError, RuntimeError, TypeError, ValueError) as err:
            why = _missing_filter(da.id.get_create_plist()) or _missing_filter(db.id.get_create_plist())
            return {"not_compared": why or _h5_reason(err) or type(err).__name__}
        kind = _kind(da.dtype) or da.dtype.name
        nonfinite = int((~np.isfinite(vb[where])).sum()) if da.dtype.kind in "fc" else 0
    return {"dataset": name, "dtype": kind, "class": location_class(name, da.attrs), "elements": len(va),
            "differing": int(len(where)), "nonfinite_new": nonfinite, "max_rel": "n/a", "mean_rel": "n/a",
            "euclidean": "n/a", "bits": {}}


def _targets(f: h5py.File, refs: np.ndarray) -> np.ndarray:
    """What each reference points to, comparable between files: the object's name, with a region
    reference's selection (HDF5's encoding of it); None for a null reference."""
    out = np.empty(len(refs), object)
    for i, ref in enumerate(refs):
        if ref:
            name = h5py.h5r.get_name(ref, f.id)
            region = isinstance(ref, h5py.RegionReference)
            out[i] = (name, h5py.h5r.get_region(ref, f.id).encode()) if region else name
    return out


def _unequal(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per element, whether two readings differ: bit for bit (as numeric datasets are compared, so
    identical NaNs are equal) where numpy holds the bytes, by value for variable-length ones."""
    if x.dtype.hasobject:
        return np.array([not np.array_equal(p, q) for p, q in zip(x, y)], bool)
    if x.dtype.names:  # the padding between fields holds whatever the reading buffer held
        x, y = repack_fields(x), repack_fields(y)
    if not len(x):
        return np.zeros(0, bool)
    return (np.ascontiguousarray(x).view(np.uint8).reshape(len(x), -1)
            != np.ascontiguousarray(y).view(np.uint8).reshape(len(y), -1)).any(1)


def _num(x):
    x = float(x)
    return x if math.isfinite(x) else str(x)


def format_table(result: dict, all_rows: bool = False) -> str:
    rows = [r for r in result["datasets"] if all_rows or r.get("differing", 1)]
    lines = [f"{'dataset':48s} {'dtype':8s} {'differing':>10s} {'max_rel':>10s} {'mean_rel':>10s} {'euclidean':>10s} "
             f"{'nonfinite':>10s}  bits"]
    for r in rows:
        if "status" in r:
            lines.append(f"{r['dataset']:48s} {r['status']}")
            continue
        bits = " ".join(f"{b}:{c}" for b, c in r["bits"].items())
        lines.append(f"{r['dataset']:48s} {r['dtype']:8s} {r['differing']:>10d} {_fmt(r['max_rel'])} "
                     f"{_fmt(r['mean_rel'])} {_fmt(r['euclidean'])} {r['nonfinite_new']:>10d}  {bits}")
    same = sum(1 for r in result["datasets"] if r.get("differing") == 0)
    attrs, sep = result.get("attributes_differ", {}), ", "
    lines.append(f"{len(result['datasets']) - same} dataset(s) differ, {same} identical"
                 + (f"; only in A: {', '.join(result['only_in_a'])}" if result["only_in_a"] else "")
                 + (f"; only in B: {', '.join(result['only_in_b'])}" if result["only_in_b"] else "")
                 + (f"; not compared: {', '.join(f'{k} ({v})' for k, v in result['not_compared'].items())}"
                    if result["not_compared"] else "")
                 + (f"; attributes differ: {', '.join(f'{k} ({sep.join(v)})' for k, v in attrs.items())}" if attrs else ""))
    return "\n".join(lines)


def _fmt(x) -> str:
    return f"{x:>10.3g}" if isinstance(x, float) else f"{x:>10s}"


# ---------------------------------------------------------------------------------------------
# Command line


def _bits(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected A-B (bit 0 = sign)")
    lo = int(m.group(1))
    return lo, int(m.group(2) or lo)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="peat alter", description=__doc__.split("\n\n")[0],
                                epilog=f"Bit numbering: {BIT_NUMBERING}. Classes: " +
                                "; ".join(f"{k}: {v}" for k, v in CLASS_HELP.items()))
    p.add_argument("input", help="HDF5 file to corrupt (never modified unless --in-place)")
    p.add_argument("output", nargs="?", help="altered copy to write")
    g = p.add_argument_group("where")
    g.add_argument("--select", action="append", default=[], metavar="PATTERN",
                   help="dataset path, glob, or re:REGEX (repeatable; default: every numeric dataset)")
    g.add_argument("--class", dest="classes", action="append", default=[], choices=CLASSES, metavar="CLASS",
                   help=f"location class (repeatable): {', '.join(CLASSES)}")
    g = p.add_argument_group("how many (default: --count 1)")
    g.add_argument("--count", type=int, metavar="N", help="exactly N values")
    g.add_argument("--fraction", type=float, metavar="F", help="this fraction of the eligible values")
    g.add_argument("--probability", type=float, metavar="P", help="each eligible value independently with probability P")
    g = p.add_argument_group("which bits (default: --region any, one bit per value)")
    g.add_argument("--region", choices=CLI_REGIONS)
    g.add_argument("--bits", type=_bits, metavar="A-B", help="bit range, inclusive; bit 0 = sign (most significant)")
    g.add_argument("--burst", type=int, default=1, metavar="K", help="flip K adjacent bits per value")
    g.add_argument("--mask", metavar="BITS", help="bit pattern such as 101, placed at a random offset in the range")
    g.add_argument("--scale", type=float, metavar="F", help="multiply the chosen values by F instead of flipping bits")
    g.add_argument("--no-sign-change", action="store_true", help="never flip the sign bit")
    g.add_argument("--no-nonfinite", action="store_true", help="never produce NaN or Inf")
    g = p.add_argument_group("reproducibility and output")
    g.add_argument("--seed", type=int, metavar="S", help="random seed (default 0)")
    g.add_argument("--log", metavar="LOG.json", help="write the injection log (dataset, index, bit, old, new)")
    g.add_argument("--replay", metavar="LOG.json", help="apply the injections of a log instead of drawing new ones")
    g.add_argument("--in-place", action="store_true", help="alter the input file itself")
    return p


def cli_alter(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # Every option but the files and --in-place says what to alter and how, which a replayed log decides.
    files = {"input", "output", "log", "replay", "in_place"}
    if args.replay is not None and any(v != parser.get_default(k) for k, v in vars(args).items() if k not in files):
        raise PeatError("--replay repeats a log: do not combine it with selection, corruption or seed options")
    plan = Plan(select=args.select, classes=args.classes, count=args.count, fraction=args.fraction,
                probability=args.probability, region=args.region, bits=args.bits, burst=args.burst, mask=args.mask,
                scale=args.scale, sign_change=not args.no_sign_change, nonfinite=not args.no_nonfinite,
                seed=0 if args.seed is None else args.seed)
    result = alter(args.input, args.output, plan, in_place=args.in_place, log=args.log, replay=args.replay)
    t = result.timings
    print(f"peat alter: {result.flips} value(s) altered in {result.datasets} of {result.eligible_datasets} "
          f"selected dataset(s) that can take it -> {args.input if args.in_place else args.output} "
          f"({t['total']:.3f} s: copy {t['copy']:.3f} s, draw {t['select']:.3f} s, flips {t['flip']:.3f} s"
          + (f", log {t['log']:.3f} s)" if args.log else ")"))
    return 0


def cli_h5diff(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="peat h5diff", description="Compare two HDF5 files dataset by dataset.",
                                epilog=f"Bit numbering: {BIT_NUMBERING}.")
    p.add_argument("a", metavar="A.h5", help="the first file, e.g. the checkpoint peat alter read")
    p.add_argument("b", metavar="B.h5", help="the file compared with it, e.g. peat alter's output")
    p.add_argument("--json", metavar="OUT.json", help="also write the comparison as JSON")
    p.add_argument("--positions", action="store_true",
                   help="list every differing element (dataset, index, bit, old, new), as in the injection log: "
                        "in the JSON with --json, else printed after the table, one JSON object a line")
    p.add_argument("--all", action="store_true", help="show identical datasets in the table too")
    args = p.parse_args(argv)
    if args.json is not None:
        _check_json_output("--json", args.json, [args.a, args.b], "a compared file", "JSON")
    result = diff(args.a, args.b, positions=args.positions)
    print(format_table(result, args.all))
    if args.json:
        write_json(args.json, result)
    elif args.positions:  # else --positions computed them for nothing
        for entry in result["positions"]:
            print(json.dumps(entry, sort_keys=True))
    return 0
