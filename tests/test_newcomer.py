"""What a newcomer following the README runs into: library calls made a plausible wrong way, and the
--help of each command."""

import importlib
import re
from pathlib import Path

import h5py
import pytest

from peat import cli, kernels, playback, sdc_drill
from peat.io import PeatError


def test_a_plan_refuses_a_kernel_given_by_its_impl_in_one_line(tmp_path):
    """kernel="kernels/my_gemm.py" (the impl, not the loaded kernel) ended the replay in
    AttributeError: 'str' object has no attribute 'op'."""
    with pytest.raises(PeatError, match=re.escape(
            "playback.Plan: kernel='kernels/my_gemm.py' is not a kernel; load one with peat.kernels.load(impl, op)")):
        playback.Plan(context=tmp_path / "context.h5", kernel="kernels/my_gemm.py")


def _help(main, argv, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps to the terminal: a narrow one split the lines compared
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code in (0, None)
    return capsys.readouterr().out


def test_h5diff_help_names_its_files_as_the_readme_does(capsys, monkeypatch):
    """The README writes `peat h5diff A.h5 B.h5`; --help said `a b`, with no word on either."""
    out = _help(cli.main, ["h5diff", "--help"], capsys, monkeypatch)
    assert out.startswith("usage: peat h5diff [-h] [--json OUT.json] [--positions] [--all] A.h5 B.h5\n")
    assert re.search(r"^  A\.h5 +the first file", out, re.M) and re.search(r"^  B\.h5 +the file compared", out, re.M)


def test_peat_help_says_how_to_see_a_command_s_options(capsys):
    assert cli.main(["--help"]) == 0
    assert "'peat COMMAND --help' lists a command's options." in capsys.readouterr().out


def test_sdc_drill_help_is_plain_text_with_its_launch_commands(capsys, monkeypatch):
    """--help showed the docstring's reST (``peat.sdc``) and not how the workers are launched."""
    out = _help(sdc_drill.main, ["--help"], capsys, monkeypatch)
    assert "``" not in out and "::" not in out
    assert "checked by peat.sdc." in out
    assert "\n    torchrun --standalone --nproc-per-node 3 -m peat.sdc_drill --config CFG" in out
    assert "\n    srun --ntasks 3 python -m peat.sdc_drill --config CFG" in out


def test_detector_benchmark_help_describes_seeds_and_out(capsys, monkeypatch):
    """--seeds and --out were listed with no word on either."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    flat = " ".join(_help(importlib.import_module("detector").main, ["--help"], capsys, monkeypatch).split())
    assert "--seeds SEEDS seeds per pseudo-error case, each its own draw of the fault (default 5)" in flat
    assert ("--out DIR folder of the report: cases.csv, confusion.csv, metrics.csv, summary.json, confusion.png "
            "(default reports/benchmarks/detector)") in flat


def test_a_replay_of_a_checkpoint_instead_of_a_context_fails_in_one_line(tmp_path):
    """final.h5 lies beside context.h5: replayed, it matched no recorded layer and its verdict passed as
    not applicable."""
    with h5py.File(tmp_path / "final.h5", "w") as f:
        f["model/fc.weight"] = [[1.0, 2.0]]
    with pytest.raises(PeatError, match=re.escape(
            f"{tmp_path / 'final.h5'}: not a training context (no 'layers' group, which peat's Profiler writes)")):
        playback.replay(playback.Plan(context=tmp_path / "final.h5", kernel=kernels.golden("linear")))
