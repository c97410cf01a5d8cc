"""File handling shared by every stage: atomic writes and clear errors for bad files."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import numbers
import os
import re
from pathlib import Path

import h5py


class PeatError(Exception):
    """A user-facing error: its message is one line naming the file or key at fault."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary sibling path; rename it onto ``path`` only if the block succeeds.

    A crash or kill mid-write therefore never leaves a file that looks complete, and a block that
    fails no folder that was made for it (``peat alter`` left an empty output folder when its log failed).
    """
    path = Path(path)
    made = list(itertools.takewhile(lambda f: not f.exists(), path.parents))  # deepest first, as they must be removed
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
        made.clear()  # they hold the file now
    except OSError as err:
        # A failed write (disk full) names no file, a failed copy (shutil) the hidden temporary
        # one, gone by the time the user reads the message: both name the target instead.
        if err.errno is not None and (err.filename is None or str(tmp) in (str(err.filename), str(err.filename2))):
            reason = os.strerror(err.errno) if _h5_write_error(err) else err.strerror
            raise OSError(err.errno, reason, str(path)) from err
        raise
    finally:
        tmp.unlink(missing_ok=True)
        for folder in made:
            with contextlib.suppress(OSError):  # not empty: another writer has put a file there since
                folder.rmdir()


def _h5_write_error(err: OSError) -> re.Match | None:
    """h5py's reason for a failed write: two lines of write-call details, the cause ('No space left
    on device') and the file's name deep inside, no ``filename``; the errno's own words say it plainly."""
    return re.search(r"filename = '([^']*)'.*?errno = ", str(err.strerror), re.S)


def os_error_line(err: OSError) -> str:
    """``[Errno 28] No space left on device: '<file>'``, also from h5py's message."""
    found = _h5_write_error(err)
    name = err.filename or (found.group(1) if found else None)
    return f"[Errno {err.errno}] {os.strerror(err.errno)}" + (f": '{name}'" if name else "")


def write_json(path: str | os.PathLike, obj) -> None:
    """``json_text(obj)``, written atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json_text(obj))


def read_json(path: str | os.PathLike):
    """A JSON file's content; an empty or damaged file is a PeatError naming it (json's own error names no file)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PeatError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except UnicodeDecodeError as err:  # a binary or re-encoded file: JSON is UTF-8
        raise PeatError(f"{path}: not valid JSON ({not_utf8(err)})") from None


def not_utf8(err: UnicodeDecodeError) -> str:
    """Where a file read as text stopped being UTF-8, for a one-line error naming the file."""
    return f"byte {err.object[err.start]:#04x} at offset {err.start} is not UTF-8 text"


def read_csv(path: str | os.PathLike, required: tuple[str, ...] = (), **kwargs):
    """``pandas.read_csv``, with the ``required`` columns; an empty or damaged file is a PeatError
    naming it (pandas' own error, or a KeyError on a missing column, names no file)."""
    import pandas as pd  # here: most stages that import io never read a CSV

    try:
        table = pd.read_csv(path, **kwargs)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PeatError(f"{path}: not a readable CSV file ({reason})") from None
    _require(path, table.columns, required)
    return table


def _require(path, columns, required) -> None:
    missing = [column for column in required if column not in columns]
    if missing:
        raise PeatError(f"{path}: missing columns {', '.join(missing)} (damaged, or not the file expected?)")


def read_parquet_scalars(path: str | os.PathLike, columns=None, required=()):
    """A parquet table without its list columns (a playback table's ``bits``, ``row_mass``,
    ``col_mass``, ``map``: 80 % of its memory in pandas, one object array per row), or only those of
    ``columns`` it has. Indexed by row position, for ``iter_list_rows``. One line naming the file
    where a table with rows lacks a ``required`` column (another parquet file given in its place
    ended the job in a KeyError naming none; a table of nothing has neither rows nor columns)."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as err:  # pyarrow's own message names no file ("file size is 0 bytes")
        raise PeatError(f"{path}: not a readable parquet table ({err})") from None
    names = [f.name for f in schema if not pa.types.is_list(f.type) and not pa.types.is_large_list(f.type)]
    if columns is not None:
        names = [c for c in columns if c in names]
    table = pd.read_parquet(path, columns=names).reset_index(drop=True)
    if len(table):
        _require(path, table.columns, required)
    return table


def iter_list_rows(path: str | os.PathLike, column: str, positions, batch: int = 1024):
    """The numpy arrays of list ``column`` at the increasing row ``positions``, read ``batch`` rows at
    a time: a whole ``map`` column (up to 1,024 floats a row) is 8 KB a row held at once."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    wanted = np.asarray(positions, dtype=np.int64)
    start = 0
    # Buffered, not pre-buffered: the column chunk (a whole file's maps in one row group) is not read at once.
    source = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    for rows in source.iter_batches(batch_size=batch, columns=[column]):
        lo, hi = np.searchsorted(wanted, [start, start + rows.num_rows])
        if hi > lo:
            lists = rows.column(0).take(pa.array(wanted[lo:hi] - start))
            flat = lists.flatten().to_numpy(zero_copy_only=False)
            yield from np.split(flat, np.cumsum(lists.value_lengths().to_numpy(zero_copy_only=False))[:-1])
        start += rows.num_rows
        if hi == len(wanted):
            return


def json_text(obj) -> str:
    """Strict JSON (``jq``, ``JSON.parse``): NaN/inf become null, as a bare NaN would fail those readers."""
    return json.dumps(json_safe(obj), indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_csv(path: str | os.PathLike, frame) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False)


def json_safe(obj):
    """``obj`` as plain JSON values, NaN/inf floats as None (JSON has no NaN).

    Done before encoding, not in ``json.dumps(default=)``: floats inside an array or a numpy
    scalar would reach the encoder unconverted.
    """
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, (str, int, type(None))):  # bool is an int
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy scalars and arrays, tensors
        return json_safe(obj.tolist())
    if hasattr(obj, "item"):
        return json_safe(obj.item())
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def check_int(label: str, value, least: int, means: str) -> None:
    """``value`` an integer of any type (numpy's too; a bool is no count) >= ``least``, else one
    line: ``{label}={value!r}: {means}``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise PeatError(f"{label}={value!r}: {means}")


def open_h5(path: str | os.PathLike, mode: str = "r") -> h5py.File:
    """Open an HDF5 file, turning h5py's errors into one line that names the file."""
    path = Path(path)
    if mode == "r" and not path.exists():
        raise PeatError(f"{path}: no such file")
    # A FIFO with no writer yet blocks h5py's open forever (and HDF5 cannot seek in a pipe or socket).
    if path.exists() and not path.is_file() and not path.is_dir():  # a folder: h5py's own 'Is a directory'
        raise PeatError(f"{path}: not a regular file (a pipe, socket or device); name an HDF5 file")
    try:
        return h5py.File(path, mode)
    except OSError as err:
        if "unable to lock file" in str(err):  # a valid file that a running job (training, a writer) holds open
            raise PeatError(f"{path}: locked by another process that has it open (HDF5 file locking); "
                            "retry once it is closed") from None
        what = "not a readable" if mode != "w" and path.exists() else "cannot create this"
        raise PeatError(f"{path}: {what} HDF5 file ({_h5_reason(str(err))})") from None


def _h5_reason(message: str) -> str:
    """h5py's reason in a few words: 'Unable to ... file', plus HDF5's own detail where it is short
    ('file signature not found', 'unable to truncate a file which is already open'), or the system's
    reason inside a dump of flags ('Is a directory')."""
    head, _, rest = message.partition("(")
    head, detail = head.strip() or "unreadable", rest.rpartition(")")[0]
    if "=" in detail:  # a dump of call details: only the system's reason in it ('Is a directory') tells the cause
        found = re.search(r"error message = '([^']*)'", detail)
        detail = found.group(1) if found else ""
    return f"{head}: {detail}" if detail else head


def require(group: h5py.Group, name: str, path) -> h5py.Dataset | h5py.Group:
    """``group[name]``, or a PeatError naming the file and the missing entry."""
    if name not in group:
        raise PeatError(f"{path}: missing '{group.name.rstrip('/')}/{name}' (wrong layout?)")
    return group[name]
