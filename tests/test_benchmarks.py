"""Smoke run of the benchmark target (so it cannot rot) and the harness's pairing rules.

Nothing here asserts that a goal is met: timings on a shared machine are not test material.
"""

from __future__ import annotations

import json
import os
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import detector  # noqa: E402
import harness  # noqa: E402
import run as bench_run  # noqa: E402

ENTRY_KEYS = {"name", "measured_as", "repeats", "median", "min", "max", "goal", "met", "samples", "unit"}
MACHINE_KEYS = {"cores", "torch", "device", "python", "platform"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    """One quick benchmark run. A module fixture runs once per xdist worker: its users share the
    group "benchmarks", so one worker."""
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--repeats", "1", "--out", str(out),
           "--only", "kernel_interface_overhead", "checkpoint_alteration"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


@pytest.mark.xdist_group("benchmarks")
def test_smoke_run_writes_schema_and_figures(smoke):
    results = json.loads((smoke / "results.json").read_text())
    assert MACHINE_KEYS <= set(results["machine"])
    assert results["machine"]["quick"] is True
    names = [e["name"] for e in results["benchmarks"]]
    assert names == ["kernel_interface_overhead", "checkpoint_alteration"]  # the order
    for entry in results["benchmarks"]:
        assert "error" not in entry, entry.get("error")
        assert ENTRY_KEYS <= set(entry)
        assert entry["repeats"] == len(entry["samples"]) >= 1
        for value in (*entry["samples"], entry["median"], entry["min"], entry["max"]):
            assert math.isfinite(value) and value > 0
        assert entry["min"] <= entry["median"] <= entry["max"]
        assert isinstance(entry["met"], bool)
        assert (smoke / f"{entry['name']}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.xdist_group("benchmarks")
def test_smoke_alteration_sweep_covers_the_grid(smoke):
    entry = json.loads((smoke / "results.json").read_text())["benchmarks"][1]
    sweep = entry["details"]["sweep"]
    assert {(r["mb"], r["flips"]) for r in sweep} == {(4, 1000), (4, 100000), (40, 1000), (40, 100000)}
    assert all(r["done"] == r["flips"] and r["flips_per_s"] > 0 and r["mb_per_s"] > 0 for r in sweep)
    # The goal's cell is the 40 MB / 100,000 flips one.
    goal_cells = [r["seconds_beyond_copy"] for r in sweep if r["mb"] == 40 and r["flips"] == 100000]
    assert entry["samples"] == goal_cells
    # What the goal's seconds hold: no injection log is written, and the entry says so.
    assert all(r["log_s"] < 0.01 for r in sweep) and "no injection log" in entry["measured_as"]


@pytest.mark.xdist_group("benchmarks")
def test_only_merges_into_existing_results(smoke, tmp_path):
    existing = json.loads((smoke / "results.json").read_text())
    (tmp_path / "results.json").write_text(json.dumps(existing))
    # A stage that cannot be resolved is reported in its entry; the others survive.
    bench_run.BENCHMARKS["playback_efficiency"] = "stages:no_such_benchmark"
    try:
        entry = bench_run.run_one("playback_efficiency", bench_run.Settings(quick=True, repeats=1, workdir=tmp_path))
    finally:
        bench_run.BENCHMARKS["playback_efficiency"] = "stages:playback_efficiency"
    assert entry["error"].startswith("AttributeError") and entry["met"] is False and entry["repeats"] == 0
    import figures

    figures.write(tmp_path, existing["machine"], [entry], merge=True)
    merged = json.loads((tmp_path / "results.json").read_text())["benchmarks"]
    assert [e["name"] for e in merged] == ["kernel_interface_overhead", "playback_efficiency", "checkpoint_alteration"]
    assert merged[0] == existing["benchmarks"][0]
    table = figures.markdown({"benchmarks": merged}).splitlines()
    assert len(table) == 2 + 3 and table[3].startswith("| `playback_efficiency` | error: AttributeError")


def test_paired_alternates_order_and_drops_warmup():
    calls = []
    clock = iter(range(1000))

    def side(tag):
        def f():
            calls.append(tag)
            next(clock)
        return f

    s, b = harness.paired(side("s"), side("b"), repeats=3, warmup=1)
    assert calls == ["s", "b", "b", "s", "s", "b", "b", "s"]
    assert len(s.wall) == len(s.cpu) == len(b.wall) == len(b.cpu) == 3
    assert all(t >= 0 for t in s.wall + s.cpu + b.wall + b.cpu)


def test_primary_clock_is_cpu_seconds_on_the_cpu_and_wall_seconds_on_a_gpu():
    times = harness.Times(wall=[2.0, 4.0], cpu=[1.0, 3.0])
    assert harness.clock(times, "cpu") == [1.0, 3.0]
    assert harness.clock(times, "nvidia") == harness.clock(times, "amd") == [2.0, 4.0]
    assert harness.clock_note("cpu") == harness.CPU_NOTE and harness.clock_note("amd").endswith("vendor amd")
    details = harness.paired_details(times, harness.Times(wall=[1.0, 1.0], cpu=[1.0, 1.0]), ("a", "b"), scale=2.0)
    assert details["wall_ratios"] == [1.0, 2.0] and details["cpu_ratios"] == [0.5, 1.5]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_vendor_without_a_gpu_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), "--vendor", "nvidia", "--only",
                           "profiler_overhead", "--out", str(out), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1].startswith("run.py: error: --vendor: vendor 'nvidia': no CUDA GPU visible")
    assert not out.exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize("args", [["--table"], ["--merge", "none.json"]])
def test_a_missing_results_file_is_one_line(tmp_path, monkeypatch, capsys, args):
    """--table before any run, or --merge of a file that is not there, ended in a traceback."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        bench_run.main([*args, "--out", str(tmp_path / "out")])
    assert ended.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(" does not exist")
    assert not (tmp_path / "out").exists()


def test_result_json_median_and_goal_direction():
    low = harness.Result("x", "a / b", harness.Goal("<=", 1.1, "<= 1.1"), samples=[1.2, 1.0, 1.05])
    entry = low.as_json()
    assert (entry["median"], entry["min"], entry["max"], entry["repeats"], entry["met"]) == (1.05, 1.0, 1.2, 3, True)
    high = harness.Result("y", "k / w", harness.Goal(">=", 0.5, ">= 0.5"), samples=[0.4, 0.45])
    assert high.as_json()["met"] is False
    failed = harness.Result("z", "a / b", harness.Goal("<=", 2.0, "<= 2"), samples=[1.0], error="broke")
    assert failed.as_json()["met"] is False and failed.as_json()["error"] == "broke"


def test_sdc_bench_times_both_sides_in_the_same_steps_alternating(monkeypatch):
    from peat import sdc_drill

    calls, timed = [], []

    class Stub:
        def __init__(self, *args, **kwargs):
            self.ddp = self

        def finish(self):
            pass

        def costs(self):
            return {"nonfinite": 0.0, "fingerprint": 0.0, "audit": 0.0}

    def fake_timed(fn, device):
        first = len(calls)
        fn()
        timed.append(calls[first])
        return 1.0, 1.0

    monkeypatch.setattr(sdc_drill, "Trainer", Stub)
    monkeypatch.setattr(sdc_drill.sdc, "Guard", Stub)
    monkeypatch.setattr(sdc_drill, "_timed", fake_timed)
    monkeypatch.setattr(sdc_drill, "_plain_step", lambda trainer, step: calls.append(("plain", step)))
    monkeypatch.setattr(sdc_drill, "_drill_step", lambda trainer, guard, fault, step: calls.append(("guarded", step)))
    sdc_drill.benchmark({"batch_size": 4}, None, {"bench_steps": 8, "batch_size": None, "fused": None}, 0, None)
    # Every step trains both twins; the timed ones are the non-audit steps, both sides in each.
    assert sorted(calls) == sorted((side, s) for side in ("plain", "guarded") for s in range(8))
    assert sorted(s for side, s in timed if side == "plain") == sorted(s for side, s in timed if side == "guarded")
    assert {s for _, s in timed} == {1, 3, 5, 7}
    firsts = [timed[i][0] for i in range(0, len(timed), 2)]
    assert firsts == ["plain", "guarded", "plain", "guarded"]


def test_merged_entries_keep_the_machine_that_measured_them(tmp_path):
    import figures

    def header(cpu):
        return {"cpu": cpu, "cores": 2, "torch": "2.x", "quick": False}

    figures.write(tmp_path, header("Intel Xeon"), [{"name": "profiler_overhead"}, {"name": "sdc_checks"}])
    figures.write(tmp_path, header("AMD EPYC"), [{"name": "sdc_checks"}], merge=True)
    merged = json.loads((tmp_path / "results.json").read_text())
    assert {e["name"]: e["cpu"] for e in merged["benchmarks"]} == {"profiler_overhead": "Intel Xeon",
                                                                   "sdc_checks": "AMD EPYC"}
    assert merged["machine"]["cpu"] == "per entry" and merged["machine"]["cores"] == 2


@pytest.mark.parametrize(("spec", "rows", "cols", "truth"), [
    ("lane:4", [1.0] * 9, [9.0], "block_structured"),  # a depthwise conv's weight gradient: one column
    ("lane:16:row", [32.0], [1.0] * 32, "block_structured"),  # row lanes of a vector: its one row, wrong through
    ("lane:16:row", [1.0] * 256, [256.0] * 64, "periodic_lane"),  # a long view: its row_mass binned, every bin hit
    ("lane:16", [2.0], [1.0 if c in (3, 19) else 0.0 for c in range(32)], "random_value"),  # two elements
    ("lane:16", [4.0], [1.0 if c % 16 == 3 else 0.0 for c in range(64)], "periodic_lane"),
    ("lane:16", [1.0] * 8, [8.0 if c == 3 else 0.0 for c in range(8)], "periodic_lane"),  # one lane of many
])
def test_detector_benchmark_labels_a_lane_fault_by_what_it_left(spec, rows, cols, truth):
    """row_mass and col_mass are the error mass per row and column of the case's matrix view."""
    table = pd.DataFrame({"nonfinite": [0], "frac_diff": [0.5], "row_mass": [np.array(rows)],
                          "col_mass": [np.array(cols)]})
    assert detector.truth_of(spec, table) == truth


def test_scoring_memory_script_scores_the_references_and_one_candidate(tmp_path):
    """benchmarks/scoring_memory.py as a user runs it: the four references' rows and the
    candidate's, its peak measured above the inputs, the same numbers printed and written."""
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scoring_memory.py"), "--shape", "8", "16", "32",
                           "32", "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    assert result["shape"] == [8, 16, 32, 32] and result["tensor_mb"] == 0.5 and result["rows"] == 5
    assert result["peak_above_inputs_mb"] >= 0  # both rounded to 0.1 from the same peak:
    assert abs(result["peak_over_tensor"] * 0.5 - result["peak_above_inputs_mb"]) <= 0.1


def test_detector_benchmark_metrics_on_a_hand_made_example():
    """Eight cases counted by hand: four bugs (one misclassified but failed, one passed), four
    should-pass ones (two of them correct kernels, one failed by each baseline)."""
    columns = ["case", "truth", "detector", "detector_verdict", "peat_rule_of_thumb", "allclose", "correct_kernel"]
    frame = pd.DataFrame([
        ("rv:3", "random_value", "random_value", "fail", "fail", "fail", False),
        ("bit_flip:30", "bit_flip", "random_value", "fail", "pass", "fail", False),
        ("rz:3", "random_zero", "none", "pass", "pass", "fail", False),
        ("nan:1", "non_finite", "non_finite", "fail", "fail", "fail", False),
        ("rz:1", "none", "none", "pass", "pass", "pass", False),  # an injection that changed nothing
        ("fp16", "reduced_precision", "reduced_precision", "pass", "pass", "fail", False),
        ("kernel:im2col", "none", "reduced_precision", "pass", "fail", "fail", True),
        ("kernel:tf32", "reduced_precision", "none", "pass", "pass", "fail", True),
    ], columns=columns).assign(should_pass=lambda f: f["truth"].isin(["none", "reduced_precision"]))  # default rules
    confusion, per_class, summary = detector.metrics(frame)
    expected = {"detector": (3 / 4, 0 / 4, 0), "peat_rule_of_thumb": (2 / 4, 1 / 4, 1), "allclose": (4 / 4, 3 / 4, 2)}
    for method, (detection, false_alarms, on_correct) in expected.items():
        got = summary[method]
        assert (got["bug_cases"], got["should_pass_cases"]) == (4, 4)
        assert (got["binary_detection"], got["false_alarm_rate"]) == (detection, false_alarms)
        assert got["false_alarms_on_correct_kernels"] == on_correct  # the correct kernels' alarms are false alarms too
    # A correct kernel passing with either passing class is classed right; a pseudo-error is not.
    assert summary["detector"]["class_accuracy"] == 6 / 8
    assert summary["targets"]["met"] == {"binary_detection": False, "false_alarms_on_correct_kernels": True,
                                         "class_accuracy": False}
    cells = confusion.set_index(["method", "truth", "predicted"])["count"]
    assert cells["detector", "bit_flip", "random_value"] == 1 and cells["detector", "none", "reduced_precision"] == 1
    assert cells["allclose", "reduced_precision", "fail"] == 2 and cells["peat_rule_of_thumb", "none", "fail"] == 1
    assert all(confusion.groupby("method")["count"].sum() == len(frame))
    rows = per_class.set_index(["method", "class"])
    for cls, precision, recall in [("random_value", 1 / 2, 1.0), ("none", 1 / 3, 1 / 2),
                                   ("reduced_precision", 1 / 2, 1 / 2), ("non_finite", 1.0, 1.0)]:
        assert (rows.loc[("detector", cls), "precision"], rows.loc[("detector", cls), "recall"]) == (precision, recall)
    assert math.isnan(rows.loc[("detector", "bit_flip"), "precision"]) and rows.loc[("detector", "bit_flip"), "recall"] == 0
    # The baselines say pass or fail: "recall" is the share of each class they judge as it should be.
    assert rows.loc[("peat_rule_of_thumb", "none"), "recall"] == 1 / 2
    assert rows.loc[("allclose", "reduced_precision"), "recall"] == 0.0


def test_full_workflow_run_starts_from_scratch_in_a_reused_workdir(tmp_path, monkeypatch):
    """--workdir may hold an earlier session's workflow run: end_to_end must not time snakemake
    finding most of it done (and incremental_rerun must not divide by that)."""
    import workflow_runs

    settings = bench_run.Settings(quick=True, repeats=1, workdir=tmp_path)
    stale = tmp_path / "workflow" / "test" / "results" / "golden" / "done.txt"
    stale.parent.mkdir(parents=True)
    stale.write_text("an earlier session's output\n")
    seen = []
    monkeypatch.setattr(workflow_runs, "snakemake", lambda workdir, *a, **k: seen.append(stale.exists()) or 1.0)
    workdir, configfile, seconds = workflow_runs.full_run(settings)
    assert seen == [False] and seconds == 1.0
    assert workdir == stale.parents[2] and configfile.is_file()  # the private config is written after the cleanup


def test_report_table_of_results_with_no_benchmarks_keeps_its_header(tmp_path):
    # A results.json whose benchmarks list is empty gave a benchmarks.csv of one empty line,
    # which pandas cannot read back.
    from peat.report import _benchmark_table

    (tmp_path / "results.json").write_text(json.dumps({"machine": {}, "benchmarks": []}))
    _benchmark_table(tmp_path / "results.json").to_csv(tmp_path / "benchmarks.csv", index=False)
    assert list(pd.read_csv(tmp_path / "benchmarks.csv").columns) == ["benchmark"]


def test_detector_benchmark_rates_without_a_denominator_read_as_undefined(tmp_path, capsys):
    """A run with no bug case (--spec fp16 alone) or no correct kernel (--combine of such parts)
    has no detection rate and no false alarms on correct kernels to speak of: the targets said
    "not met" (detection) and "met" (0 false alarms of 0 kernels), and the printed line read "nan"."""
    frame = pd.DataFrame([("fp16", "reduced_precision", "reduced_precision", "pass", "pass", "fail", False, True),
                          ("rz:1", "none", "none", "pass", "pass", "pass", False, True)],
                         columns=["case", "truth", "detector", "detector_verdict", "peat_rule_of_thumb", "allclose",
                                  "correct_kernel", "should_pass"])
    _, per_class, summary = detector.metrics(frame)
    det = summary["detector"]
    assert (det["bug_cases"], det["should_pass_cases"], det["correct_kernel_cases"]) == (0, 2, 0)
    assert math.isnan(det["binary_detection"]) and det["false_alarm_rate"] == 0.0
    assert summary["targets"]["met"] == {"binary_detection": None, "false_alarms_on_correct_kernels": None,
                                         "class_accuracy": True}
    rows = per_class.set_index(["method", "class"])
    assert math.isnan(rows.loc[("detector", "bit_flip"), "precision"])  # no case, no prediction
    assert math.isnan(rows.loc[("detector", "bit_flip"), "recall"])
    detector.report(frame, tmp_path / "part", contexts=[], seeds=1, steps=1, smoke=False, layers=None,
                    specs=["fp16", "rz:1"], wall_s=0.0)
    written = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert written["detector"]["binary_detection"] is None and written["targets"]["met"]["binary_detection"] is None
    assert pd.read_csv(tmp_path / "part" / "metrics.csv").set_index(["method", "class"]).loc[
        ("detector", "bit_flip"), ["precision", "recall"]].isna().all()
    capsys.readouterr()
    assert detector.main(["--combine", str(tmp_path / "part"), "--out", str(tmp_path / "all")]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "nan" not in line
    assert line.startswith("2 cases: detection undefined (no bug case), false alarms 0.0000, class accuracy 1.0000; ")
    assert "PEAT rule-of-thumb detection undefined (no bug case)" in line


def _detector_part(out: Path) -> Path:
    """A finished detector benchmark run of two hand-made cases, as --combine reads it."""
    frame = pd.DataFrame([("rv:3", "random_value", "random_value", "fail", "fail", "fail", False, False),
                          ("kernel:im2col", "none", "none", "pass", "pass", "pass", True, True)],
                         columns=["case", "truth", "detector", "detector_verdict", "peat_rule_of_thumb", "allclose",
                                  "correct_kernel", "should_pass"])
    detector.report(frame, out, contexts=[str(out / "context.h5")], seeds=1, steps=1, smoke=False, layers=None,
                    specs=["rv:3"], wall_s=1.0)
    return out


@pytest.mark.parametrize(("damage", "said"), [
    ("missing", "no such folder"),
    ("summary.json", "no summary.json (not a finished detector benchmark run?)"),
    ("cases.csv", "no cases.csv (not a finished detector benchmark run?)"),
    ("torn", "not valid JSON"),
    ("foreign", "summary.json has no contexts, layers, smoke, wall_s (not a detector benchmark run's?)"),
    ("twice", "given twice"),
    ("out", "also --out: the combined report would replace its cases, and a rerun count them twice"),
])
def test_detector_benchmark_combine_of_an_unfinished_part_is_one_line(tmp_path, capsys, damage, said):
    """--combine of a part that is not there, was interrupted or copied in half ended in a
    FileNotFoundError traceback, one whose summary.json is another tool's in a KeyError; the same
    part given twice counted its cases twice."""
    good, part = _detector_part(tmp_path / "good"), tmp_path / "part"
    if damage != "missing":
        _detector_part(part)
    if damage in ("summary.json", "cases.csv"):
        (part / damage).unlink()
    elif damage == "torn":
        (part / "summary.json").write_text('{"cases": ')
    elif damage == "foreign":
        (part / "summary.json").write_text('{"cases": 2}')
    elif damage == "twice":
        part = good
    out = part if damage == "out" else tmp_path / "all"
    before = (part / "cases.csv").read_bytes() if damage == "out" else None
    capsys.readouterr()
    assert detector.main(["--combine", str(good), "--combine", str(part), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"detector benchmark: error: --combine {part}") and said in captured.err
    if damage == "out":
        assert (part / "cases.csv").read_bytes() == before
    else:
        assert not out.exists()


@pytest.mark.parametrize("repeats", ["0", "-1", "two"])
def test_repeats_below_one_are_refused_before_anything_runs(tmp_path, capsys, repeats):
    """--repeats 0 ran the default (5, quick 2) and wrote that many; --repeats -1 wrote entries
    with no sample, which --table printed as "error: None"."""
    with pytest.raises(SystemExit) as ended:
        bench_run.main(["--quick", "--repeats", repeats, "--only", "checkpoint_alteration",
                        "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work")])
    assert ended.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith(f": error: argument --repeats: {repeats!r} is not a whole number of at least 1")
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize("merge", [False, True])
def test_a_benchmark_that_fails_on_a_rerun_leaves_no_figure_of_the_earlier_numbers(tmp_path, merge):
    """A rerun into the same --out where a benchmark now fails kept its earlier <name>.png (the
    old median, "goal met" or not), which the collated report shows beside the entry's error."""
    import figures

    measured = harness.Result("profiler_overhead", "a / b", harness.Goal("<=", 1.1, "<= 1.10"), samples=[1.0, 1.2])
    figures.write(tmp_path, {"cpu": "x"}, [measured.as_json()])
    assert (tmp_path / "profiler_overhead.png").is_file()
    failed = bench_run.run_one("profiler_overhead", bench_run.Settings(quick=True, repeats=1, workdir=tmp_path,
                                                                     record_layers=["no_such_layer"]))
    assert failed["error"].startswith("PeatError") and failed["samples"] == []
    figures.write(tmp_path, {"cpu": "x"}, [failed], merge=merge)
    assert not (tmp_path / "profiler_overhead.png").exists()
    assert json.loads((tmp_path / "results.json").read_text())["benchmarks"][0]["error"] == failed["error"]


@pytest.mark.parametrize(("text", "said"), [
    ('{"machine": ', "not valid JSON"),
    ('{"a": 1}', "no 'machine' and 'benchmarks' (not a benchmarks/run.py results.json?)"),
    # Entries that were merged silently (none), or ended in a ValueError/KeyError/TypeError traceback.
    ('{"machine": {}, "benchmarks": {}}', "'benchmarks' is not a list of entries"),
    ('{"machine": [], "benchmarks": []}', "'machine' is not an object"),
    ('{"machine": {}, "benchmarks": [1]}', "benchmarks[0]: not an object"),
    ('{"machine": {}, "benchmarks": [{"median": 1}]}', "benchmarks[0]: no name"),
    ('{"machine": {}, "benchmarks": [{"name": "bogus"}]}', "benchmarks[0]: 'bogus' is no benchmark of run.py"),
    ('{"machine": {}, "benchmarks": [{"name": "end_to_end", "median": 1}]}',
     "benchmarks[0] (end_to_end): measured, but no goal, goal_value, max, met, min, repeats, samples, unit"),
    ('{"machine": {}, "benchmarks": [{"name": "end_to_end", "median": "1", "min": 1, "max": 1, "repeats": 1, '
     '"goal": "", "goal_value": 1, "met": true, "samples": [1], "unit": "s"}]}',
     "benchmarks[0] (end_to_end): median '1' is not a number"),
])
@pytest.mark.parametrize("option", ["--merge", "--table", "--only"])
def test_a_damaged_results_file_is_one_line_before_anything_runs(tmp_path, capsys, text, said, option):
    """--merge or --table of a damaged or foreign results.json, or --only into an --out holding
    one, ended in a JSONDecodeError or KeyError traceback (for --only after every benchmark ran)."""
    out = tmp_path / "out"
    out.mkdir()
    bad = (tmp_path / "other.json") if option == "--merge" else out / "results.json"
    bad.write_text(text)
    args = {"--merge": ["--merge", str(bad)], "--table": ["--table"],
            "--only": ["--quick", "--only", "checkpoint_alteration", "--workdir", str(tmp_path / "work")]}[option]
    with pytest.raises(SystemExit) as ended:
        bench_run.main([*args, "--out", str(out)])
    assert ended.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"error: {option if option != '--only' else '--out'}: {bad}: " in err and said in err
    assert sorted(p.name for p in out.iterdir()) == (["results.json"] if option != "--merge" else [])
    assert not (tmp_path / "work").exists()


def test_a_merge_into_an_out_holding_a_damaged_results_file_is_one_line(tmp_path, capsys):
    """--merge into an --out whose results.json is not one ended in a PeatError traceback."""
    other = tmp_path / "other.json"
    other.write_text('{"machine": {}, "benchmarks": []}')
    bad = tmp_path / "out" / "results.json"
    bad.parent.mkdir()
    bad.write_text('{"a": 1}')
    with pytest.raises(SystemExit) as ended:
        bench_run.main(["--merge", str(other), "--out", str(bad.parent)])
    assert ended.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: --out: {bad}: no 'machine' and 'benchmarks' (not a benchmarks/run.py results.json?)")
    assert bad.read_text() == '{"a": 1}' and sorted(p.name for p in bad.parent.iterdir()) == ["results.json"]


def test_a_merge_of_a_folder_says_it_is_a_folder(tmp_path, capsys):
    """--merge of another run's --out folder (not its results.json) said the folder did not exist."""
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(SystemExit) as ended:
        bench_run.main(["--merge", str(other), "--out", str(tmp_path / "out")])
    assert ended.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: --merge: {other} is a folder, not a results.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", ["missing", "empty"])
def test_results_without_golden_storage_files_is_refused(tmp_path, capsys, layout):
    """--results with a typo, or a folder without golden runs, silently measured context_storage on
    the benchmark's own truncated training instead of the workflow's golden runs asked for."""
    results = tmp_path / "results"
    if layout == "empty":
        (results / "golden" / "resnet18" / "cpu").mkdir(parents=True)
    with pytest.raises(SystemExit) as ended:
        bench_run.main(["--quick", "--only", "context_storage", "--results", str(results),
                        "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work")])
    assert ended.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith(f"error: --results: {results}: no golden/*/*/storage.json under it "
                        "(not the results/ folder of a finished workflow run?)")
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize("seconds", ["0", "-5", "nan", "inf", "soon"])
def test_a_workflow_timeout_that_is_no_time_is_refused(tmp_path, capsys, seconds):
    """--workflow-timeout 0 (or negative) stopped the full workflow run at once and reported
    end_to_end as a lower bound of about 0 s, failing incremental_rerun with it."""
    with pytest.raises(SystemExit) as ended:
        bench_run.main(["--quick", "--only", "end_to_end", "--workflow-timeout", seconds,
                        "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work")])
    assert ended.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith(f"error: argument --workflow-timeout: {seconds!r} is not a number of seconds above 0")
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize("shape", [["0", "4"], ["-2", "3"]])
def test_scoring_memory_refuses_an_empty_or_negative_shape(tmp_path, capsys, shape):
    """--shape 0 4 ended in a ZeroDivisionError traceback, --shape -2 3 in torch's RuntimeError."""
    import scoring_memory

    with pytest.raises(SystemExit) as ended:
        scoring_memory.main(["--shape", *shape, "--out", str(tmp_path / "m.json")])
    assert ended.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith(f"error: --shape {' '.join(shape)}: every dimension must be at least 1")
    assert not (tmp_path / "m.json").exists()


def test_scoring_memory_ratio_is_the_quotient_of_the_sizes_beside_it():
    """A 0.25 MB tensor read "tensor_mb": 0.2 (rounded to 0.1 MB) beside a peak_over_tensor of the
    true size: 4.3 MB above the inputs over 0.2 MB read as 17.1, not 21.5."""
    import scoring_memory

    result = scoring_memory.measure((4, 16, 32, 32))
    assert result["tensor_mb"] == 0.25
    assert math.isclose(result["peak_over_tensor"] * result["tensor_mb"], result["peak_above_inputs_mb"],
                        rel_tol=2e-3)


@pytest.mark.parametrize("where", ["folder", "under_a_file"])
def test_scoring_memory_refuses_an_out_it_cannot_write_before_measuring(tmp_path, capsys, monkeypatch, where):
    """--out naming a folder (or a path under a file) ended in an IsADirectoryError (NotADirectoryError)
    traceback after the measurement; a missing folder above it in a FileNotFoundError."""
    import scoring_memory

    blocker = tmp_path / "blocker"
    blocker.mkdir() if where == "folder" else blocker.write_text("")
    out = blocker if where == "folder" else blocker / "m.json"
    monkeypatch.setattr(scoring_memory, "measure", lambda shape: pytest.fail("measured before refusing --out"))
    with pytest.raises(SystemExit) as ended:
        scoring_memory.main(["--shape", "2", "3", "--out", str(out)])
    assert ended.value.code == 2
    said = "a folder, not a file" if where == "folder" else "a file, not a folder"
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: --out: {blocker}: {said}")


def test_scoring_memory_makes_the_folder_of_its_out(tmp_path, monkeypatch):
    """--out in a folder not made yet ended in a FileNotFoundError traceback after the measurement."""
    import scoring_memory

    monkeypatch.setattr(scoring_memory, "measure", lambda shape: {"shape": list(shape)})
    out = tmp_path / "new" / "m.json"
    scoring_memory.main(["--shape", "2", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == {"shape": [2, 3]}


@pytest.mark.parametrize("vendor", ["cpu", "nvidia"])
def test_figure_names_the_clock_of_the_samples(vendor):
    """On a GPU (--vendor) the samples are wall-clock ratios: the figure labelled them
    "CPU time (primary)" and the same wall-clock ratios again as "wall clock"."""
    import figures

    subject, baseline = harness.Times(wall=[3.0, 6.0], cpu=[1.0, 1.5]), harness.Times(wall=[2.0, 4.0], cpu=[1.0, 1.0])
    entry = harness.Result("profiler_overhead", "a / b", harness.Goal("<=", 1.1, "<= 1.10"),
                           samples=harness.ratios(harness.clock(subject, vendor), harness.clock(baseline, vendor)),
                           details=harness.paired_details(subject, baseline, ("recorded", "plain"))).as_json()
    frame = figures.clocks(entry)
    got = {clock: list(rows["ratio"]) for clock, rows in frame.groupby("clock", sort=False)}
    if vendor == "cpu":
        assert got == {"CPU time (primary)": [1.0, 1.5], "wall clock": [1.5, 1.5]}
    else:
        assert got == {"wall clock (primary)": [1.5, 1.5], "CPU time": [1.0, 1.5]}


def test_merged_entries_keep_the_vendor_and_device_that_measured_them(tmp_path):
    """--only --vendor nvidia into a CPU run's results.json made the header say every entry was
    measured on the GPU, the CPU entries included."""
    import figures

    cpu = {"cpu": "AMD EPYC", "cores": 2, "torch": "2.x", "quick": False, "vendor": "cpu", "device": "cpu"}
    figures.write(tmp_path, cpu, [{"name": "profiler_overhead"}, {"name": "sdc_checks"}])
    figures.write(tmp_path, cpu | {"vendor": "nvidia", "device": "NVIDIA H200"}, [{"name": "profiler_overhead"}],
                  merge=True)
    merged = json.loads((tmp_path / "results.json").read_text())
    assert {e["name"]: (e["vendor"], e["device"]) for e in merged["benchmarks"]} == {
        "profiler_overhead": ("nvidia", "NVIDIA H200"), "sdc_checks": ("cpu", "cpu")}
    assert merged["machine"]["vendor"] == merged["machine"]["device"] == "per entry"


def test_record_layers_matching_no_layer_is_refused_before_anything_runs(tmp_path, capsys):
    """A --record-layers glob matching no layer of the benchmark's model was refused only when the
    recorded training started, minutes in; now one line names it, by the Profiler's own matcher."""
    with pytest.raises(SystemExit) as ended:
        bench_run.main(["--quick", "--only", "profiler_overhead", "--record-layers", "layer1.*", "no_such*",
                        "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work")])
    assert ended.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith("error: --record-layers: 'no_such*' matches no conv/linear/norm layer of model 'resnet18'; "
                        "layers are e.g. conv1, bn1, layer1.0.conv1, layer1.0.bn1, layer1.0.conv2, layer1.0.bn2")
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_record_layers_override_the_recorded_layers_only():
    import training

    spec = training.default_config()["models"]["resnet18"]
    training.check_record_layers(["layer1.*", "fc"])  # both match: no error
    override = bench_run.Settings(quick=True, repeats=1, workdir=Path("."), record_layers=["fc"])
    assert training.recording(spec, override) == spec | {"record": spec["record"] | {"layers": ["fc"]}}
    assert spec["record"]["layers"] != ["fc"]  # the config's own spec is left as it was
    assert training.recording(spec, bench_run.Settings(quick=True, repeats=1, workdir=Path("."))) is spec


def _recorded_context(path: Path, layers: list[str]) -> Path:
    """A context of one recorded step of small linear layers named ``layers``, in a chain."""
    import torch
    from torch import nn

    from peat.profiler import Profiler

    model = nn.Sequential()
    for name in layers:
        model.add_module(name, nn.Linear(4, 4))
    prof = Profiler(path, layers, every=1, meta={"model": path.parent.name, "config_hash": "h", "vendor": "cpu"})
    prof.attach(model)
    prof.begin_step(0, 1)
    model(torch.randn(2, 4)).sum().backward()
    prof.end_step()
    prof.close()
    return path


@pytest.mark.parametrize(("globs", "unmatched"), [
    (["a"], {"two": "fc"}),
    (["fc", "z*"], {"one": "a, b"}),
    (["z*"], {"one": "a, b", "two": "fc"}),
])
def test_a_layer_glob_matching_no_layer_of_a_context_is_refused_naming_it(tmp_path, capsys, monkeypatch, globs,
                                                                          unmatched):
    """With several contexts, --layer globs matching layers of one only dropped the others from the
    results without a word (it refused only where no context matched at all)."""
    contexts = {name: _recorded_context(tmp_path / name / "context.h5", layers)
                for name, layers in (("one", ["a", "b"]), ("two", ["fc"]))}
    monkeypatch.setattr(detector, "layer_cases", lambda *a, **k: pytest.fail("a layer was replayed"))
    out = tmp_path / "out"
    args = [a for c in contexts.values() for a in ("--context", str(c))] + [a for g in globs for a in ("--layer", g)]
    assert detector.main([*args, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    assert captured.err == (f"detector benchmark: error: no recorded layer of "
                            f"{', '.join(str(contexts[n]) for n in unmatched)} matches --layer "
                            f"{' '.join(map(repr, globs))} (recorded: {'; '.join(unmatched.values())})\n")


@pytest.mark.parametrize("where", ["file", "under_a_file"])
@pytest.mark.parametrize("script", ["run", "detector"])
def test_an_out_that_is_no_folder_is_refused_before_anything_runs(tmp_path, capsys, script, where):
    """--out naming a file (or a folder under one) ended in a FileExistsError traceback when the
    results were written: after every benchmark (17 min) or every detector case had run."""
    blocker = tmp_path / "results.json"
    blocker.write_text("{}")
    out = blocker if where == "file" else blocker / "sub"
    work = tmp_path / "work"
    if script == "run":
        with pytest.raises(SystemExit) as ended:
            bench_run.main(["--quick", "--only", "checkpoint_alteration", "--workdir", str(work), "--out", str(out)])
        code = ended.value.code
    else:
        code = detector.main(["--context", str(tmp_path / "missing.h5"), "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"--out: {blocker}: a file, not a folder")
    assert blocker.read_text() == "{}" and not work.exists()


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_a_workdir_that_is_no_folder_is_refused_before_anything_runs(tmp_path, capsys, where):
    """--workdir naming a file (or a folder under one) ended in a FileExistsError (NotADirectoryError) traceback."""
    blocker = tmp_path / "work"
    blocker.write_text("")
    work = blocker if where == "file" else blocker / "sub"
    with pytest.raises(SystemExit) as ended:
        bench_run.main(["--quick", "--only", "checkpoint_alteration", "--workdir", str(work),
                        "--out", str(tmp_path / "out")])
    assert ended.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: --workdir: {blocker}: a file, not a folder")
    assert not (tmp_path / "out").exists()


@pytest.fixture
def slow_snakemake(tmp_path, monkeypatch):
    """workflow_runs' snakemake replaced by a 30 s sleep; returns whether that sleep still runs."""
    import workflow_runs

    fake = tmp_path / "bin" / "snakemake"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'pid'}\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setattr(workflow_runs, "BIN", fake.parent)

    def still_running() -> bool:
        pid = int((tmp_path / "pid").read_text())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        os.kill(pid, 9)  # not left behind by a failing test
        return True

    return still_running


def test_a_workflow_run_past_its_time_limit_is_stopped_and_says_the_limit(tmp_path, slow_snakemake):
    """A limit under a second was said as 'the 0 s limit'."""
    import workflow_runs

    with pytest.raises(workflow_runs.Unfinished, match=r"^stopped at the 0\.5 s limit after \d+ s, no job finished$"):
        workflow_runs.snakemake(tmp_path, tmp_path / "config.yaml", timeout=0.5)
    assert not slow_snakemake()


def test_an_interrupted_workflow_run_stops_its_snakemake(tmp_path, slow_snakemake):
    """snakemake runs in its own session (so the time limit can stop its jobs too), which Ctrl-C in
    the terminal does not reach: a Ctrl-C of benchmarks/run.py left the full workflow run going on
    in the background, in a scratch folder being removed under it."""
    import signal

    import workflow_runs

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            workflow_runs.snakemake(tmp_path, tmp_path / "config.yaml")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not slow_snakemake()


def test_sigterm_of_a_benchmark_run_cleans_up_as_ctrl_c_does(tmp_path):
    """SIGTERM ended benchmarks/run.py at once: no cleanup ran, so its scratch folder stayed and a
    workflow entry's snakemake (in its own session) ran on. Now it is an exit that cleans up."""
    code = (f"import sys, tempfile, time; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import run\n"
            "run.exit_on_sigterm()\n"
            f"with tempfile.TemporaryDirectory(dir={str(tmp_path)!r}) as tmp:\n"
            "    print(tmp, flush=True)\n"
            "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    scratch = Path(proc.stdout.readline().strip())
    assert scratch.is_dir()
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    assert not scratch.exists()


def test_ctrl_c_of_a_benchmark_run_is_one_line_and_130_leaving_results_as_they_were(tmp_path):
    """Ctrl-C of benchmarks/run.py printed Python's KeyboardInterrupt traceback and died of SIGINT,
    where SIGTERM exits quietly with 143 and peat's commands say one line and exit 130. A real SIGINT
    while a (stand-in, sleeping) benchmark runs: one line, 130, results.json and its figures
    untouched, the scratch folder gone."""
    import signal

    import figures

    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    figures.write(out, {"cpu": "Intel Xeon"}, [{"name": "checkpoint_alteration"}])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's command has it\n"
            f"sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import run\n"
            "def slow(settings):\n"
            "    print('started', flush=True)\n"
            "    time.sleep(60)\n"
            "run.BENCHMARKS['checkpoint_alteration'] = '__main__:slow'\n"
            f"sys.exit(run.command(['--quick', '--only', 'checkpoint_alteration', '--out', {str(out)!r}]))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"TMPDIR": str(scratch)})
    for line in proc.stdout:
        if line == "started\n":
            break
    assert any(scratch.iterdir())  # the benchmark runs, its scratch folder in place
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert proc.stderr.read() == "run.py: interrupted; results.json left as it was\n"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not any(scratch.iterdir())
