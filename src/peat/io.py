"""File handling shared by every stage: atomic writes and clear errors for bad files."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import h5py


class PeatError(Exception):
    """A user-facing error: its message is one line naming the file or key at fault."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary sibling path; rename it onto ``path`` only if the block succeeds.

    A crash or kill mid-write therefore never leaves a file that looks complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_jsonable) + "\n")


def write_csv(path: str | os.PathLike, frame) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False)


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def open_h5(path: str | os.PathLike, mode: str = "r") -> h5py.File:
    """Open an HDF5 file, turning h5py's errors into one line that names the file."""
    path = Path(path)
    if mode == "r" and not path.exists():
        raise PeatError(f"{path}: no such file")
    try:
        return h5py.File(path, mode)
    except OSError as err:
        reason = str(err).split("(")[0].strip() or "unreadable"
        raise PeatError(f"{path}: not a readable HDF5 file ({reason})") from None


def require(group: h5py.Group, name: str, path) -> h5py.Dataset | h5py.Group:
    """``group[name]``, or a PeatError naming the file and the missing entry."""
    if name not in group:
        raise PeatError(f"{path}: missing '{group.name.rstrip('/')}/{name}' (wrong layout?)")
    return group[name]
