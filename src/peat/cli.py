"""The ``peat`` command: one sub-command per user-facing tool.

Each sub-command lives in the module of its concern as ``cli_<command>(argv) -> int`` (or
``cli(argv)``), e.g. ``peat.alter.cli_alter`` and ``peat.alter.cli_h5diff``.
"""

from __future__ import annotations

import difflib
import importlib
import os
import signal
import sys

from .io import PeatError

COMMANDS = {
    "alter": ("peat.alter", "flip bits in an HDF5 checkpoint (peat alter IN.h5 OUT.h5 ...)"),
    "h5diff": ("peat.alter", "compare two HDF5 files dataset by dataset"),
}


def interrupted(prog: str, kept: str = "files left as they were") -> int:
    """Ctrl-C's one line on stderr and its exit status (a shell's for a command ended by SIGINT).
    For tools that rename their outputs into place only once complete, so that no traceback is
    needed to say what is left; ``kept`` says what that is (peat's commands, benchmarks/run.py)."""
    print(f"{prog}: interrupted; {kept}", file=sys.stderr)
    return 128 + signal.SIGINT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        # Asked for, the usage is the answer; without a command it is an error (exit 2, as argparse).
        out = sys.stdout if argv else sys.stderr
        print("usage: peat COMMAND [options]\n\ncommands:", file=out)
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:10s} {text}", file=out)
        print("\n'peat COMMAND --help' lists a command's options.", file=out)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(f"peat: no command {argv[0]!r}; {hint}commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    handler = getattr(module, f"cli_{argv[0]}", None) or module.cli
    try:
        return int(handler(argv[1:]) or 0)
    except BrokenPipeError:  # a reader that stopped early (| head): no error of ours, as for any Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the exit's flush raises again
        return 128 + 13  # a shell's status for a writer ended by SIGPIPE
    except KeyboardInterrupt:
        return interrupted(f"peat {argv[0]}")
    except (PeatError, OSError) as err:  # OSError: an output that cannot be written (no directory, read-only, full)
        print(f"peat {argv[0]}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
