"""Faults through the real workflow: kernels that crash, exit, exhaust memory or hang; bad files;
provenance and bit-identical reruns. See docs/reliability.md for the table of faults."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import pandas as pd
import pytest
import torch
import yaml

from conftest import snakemake
from peat import candidate, checkpoint, kernels, playback, provenance
from peat.io import PeatError

# A reduced config: one tiny GPT-2, one recorded linear layer, forward playback only, no
# pseudo-errors, no propagation; four kernels that fail in four ways and one that is correct.
CONFIG = {
    "name": "faults", "seed": 0, "threads": 1, "vendors": ["cpu"], "reference_vendor": "cpu",
    "datasets": {"pydoc": {"source": "pydoc", "seq_len": 32, "part": [0.0, 0.2], "val_fraction": 0.1}},
    "models": {"gpt2": {"arch": "gpt2", "dataset": "pydoc", "size": {"hidden": 32, "layers": 1, "heads": 2},
                        "epochs": 1, "batch_size": 16, "max_train_samples": 32, "max_val_samples": 16,
                        "optimizer": {"name": "adamw", "lr": 0.003}, "checkpoint_epochs": [1],
                        "record": {"layers": ["transformer.h.0.mlp.c_fc"], "every": 2}}},
    "errors": [],
    "playback": {"max_samples_per_layer": 1, "computations": ["forward"], "propagate": False, "memory_mb": 256},
}
# name -> (kernel source, detector error_model, text the recorded message must contain)
FAULTY = {
    "segv": ("import ctypes\n\n\ndef forward(x, weight, bias):\n    ctypes.string_at(0)  # null read\n",
             "crash", "killed by SIGSEGV"),
    "exits": ("import os\n\n\ndef forward(x, weight, bias):\n    os._exit(3)\n",
              "crash", "exited with code 3 without a result"),
    "hog": ("import torch\n\n\ndef forward(x, weight, bias):\n    hoard = []\n    while True:\n"
            "        hoard.append(torch.ones(2**22))\n", "oom", "can't allocate memory"),
    "hangs": ("import time\n\n\ndef forward(x, weight, bias):\n    time.sleep(600)\n",
              "timeout", "no result after 3 s (killed)"),
}
GOOD = "import torch.nn.functional as F\n\n\ndef forward(x, weight, bias):\n    return F.linear(x, weight, bias)\n"
DETECT = "results/detect/gpt2/cpu/{}.json"
PLAYBACK = "results/playback/gpt2/cpu/{}.parquet"


def write_config(workdir: Path, kernels_: dict[str, str]) -> Path:
    """Kernel files under ``workdir`` and a config naming them; returns the config path."""
    (workdir / "kernels_under_test").mkdir(parents=True, exist_ok=True)
    spec = {}
    for name, source in kernels_.items():
        (workdir / "kernels_under_test" / f"{name}.py").write_text(source)
        spec[name] = {"op": "linear", "impl": f"kernels_under_test/{name}.py", "train": False,
                      **({"timeout": 3} if name == "hangs" else {})}  # the kernel's own call limit
    config = workdir / "faults.yaml"
    config.write_text(yaml.safe_dump(CONFIG | {"kernels": spec}))
    return config


@pytest.fixture(scope="module")
def faults_run(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("faults")
    config = write_config(workdir, {"good": GOOD, **{k: v[0] for k, v in FAULTY.items()}})
    snakemake(workdir, configfile=config)
    return workdir


def verdict(workdir: Path, kernel: str) -> dict:
    return json.loads((workdir / DETECT.format(kernel)).read_text())


@pytest.mark.slow
@pytest.mark.xdist_group("faults")
@pytest.mark.parametrize("kernel", FAULTY)
def test_failing_kernel_gets_its_outcome_and_a_fail_verdict(faults_run, kernel):
    _, status, message = FAULTY[kernel]
    record = json.loads((faults_run / PLAYBACK.format(kernel)).with_suffix(".json").read_text())
    assert record["outcome"]["status"] == status and message in record["outcome"]["message"]
    assert record["outcome"]["message"].startswith("transformer.h.0.mlp.c_fc forward: ")
    got = verdict(faults_run, kernel)
    assert (got["verdict"], got["error_model"], got["confidence"]) == ("fail", status, 1.0)
    assert got["evidence"]["outcome"] == record["outcome"]
    assert pd.read_parquet(faults_run / PLAYBACK.format(kernel)).empty  # no scores made up for it


@pytest.mark.slow
@pytest.mark.xdist_group("faults")
def test_other_kernels_and_the_report_complete(faults_run):
    good = verdict(faults_run, "good")
    assert (good["verdict"], good["error_model"]) == ("pass", "none")
    assert len(pd.read_parquet(faults_run / PLAYBACK.format("good"))) > 0
    table = pd.read_csv(faults_run / "reports/faults/verdicts.csv").set_index("kernel")
    assert table["error_model"].to_dict() == {"good": "none", **{k: v[1] for k, v in FAULTY.items()}}
    assert table["verdict"].to_dict() == {"good": "pass", **{k: "fail" for k in FAULTY}}
    page = (faults_run / "reports/faults/index.html").read_text()
    assert all(f">{k}<" in page for k in ["good", *FAULTY])


@pytest.mark.slow
@pytest.mark.xdist_group("faults")
def test_results_and_report_record_provenance(faults_run):
    with h5py.File(faults_run / "results/golden/gpt2/cpu/context.h5") as f:
        context_hash, torch_version = str(f.attrs["config_hash"]), str(f.attrs["torch_version"])
    want = provenance.stamp(context_hash, "cpu")
    assert want["config_hash"] and want["torch"] == torch.__version__ == torch_version
    for kernel in ["good", *FAULTY]:
        assert verdict(faults_run, kernel)["provenance"] == want
        record = json.loads((faults_run / PLAYBACK.format(kernel)).with_suffix(".json").read_text())
        assert record["provenance"] == want
    table = pd.read_csv(faults_run / "reports/faults/verdicts.csv", dtype=str)
    for key, value in want.items():
        assert (table[f"prov_{key}"] == value).all(), key


def _without_timings(result: dict) -> dict:
    """A verdict minus wall-clock measurements, which legitimately differ between runs."""
    result["evidence"].pop("timings")
    for outcome in [result["evidence"].get("outcome", {}), *result["evidence"]["outcomes"]]:
        outcome.pop("seconds", None)
    return result


@pytest.mark.slow
@pytest.mark.xdist_group("faults")
def test_rerun_gives_bit_identical_playback_tables_and_verdicts(faults_run, tmp_path):
    chosen = ["good", "segv"]
    before = {k: ((faults_run / PLAYBACK.format(k)).read_bytes(), _without_timings(verdict(faults_run, k)))
              for k in chosen}
    snakemake(faults_run, *[DETECT.format(k) for k in chosen], "--forcerun", "playback",
              configfile=faults_run / "faults.yaml")
    for k in chosen:
        assert (faults_run / PLAYBACK.format(k)).read_bytes() == before[k][0], k
        assert _without_timings(verdict(faults_run, k)) == before[k][1], k


@pytest.mark.slow
@pytest.mark.xdist_group("faults")
def test_kernel_that_fails_to_import_fails_its_job_and_nothing_downstream_runs(faults_run):
    # Last in this file: it adds a kernel to the shared run's config. (A syntax error stops the
    # dry run: the config check parses every kernel source.)
    config = write_config(faults_run, {"good": GOOD, **{k: v[0] for k, v in FAULTY.items()},
                                       "broken": "import peat_no_such_module\n\ndef forward(x, weight, bias):\n"
                                                 "    return x\n"})
    report = faults_run / "reports/faults/verdicts.csv"
    report_before = report.read_bytes()
    proc = snakemake(faults_run, "--keep-going", configfile=config, check=False)
    assert proc.returncode != 0
    log = (faults_run / "logs/playback/gpt2/cpu/broken.log").read_text()
    # The job's log ends with the one line naming the file and the problem (above it: the traceback).
    assert log.strip().splitlines()[-1] == ("peat.io.PeatError: kernels_under_test/broken.py: import failed: "
                                            "ModuleNotFoundError: No module named 'peat_no_such_module'")
    assert "Error in rule playback" in proc.stdout + proc.stderr and "broken.log" in proc.stdout + proc.stderr
    for downstream in (PLAYBACK.format("broken"), DETECT.format("broken"), "results/analyze/gpt2/cpu/broken"):
        assert not (faults_run / downstream).exists(), downstream
    assert report.read_bytes() == report_before  # the report waits for every verdict; it did not rerun


@pytest.mark.parametrize("source", ["dataset", "context"])
def test_wrong_hdf5_layout_given_as_checkpoint_fails_naming_the_file(digits, tmp_path, source):
    path = digits if source == "dataset" else tmp_path / "context.h5"
    if source == "context":
        with h5py.File(path, "w") as f:  # the layout of a training context, not of a checkpoint
            f.create_group("layers/fc/0000000").create_dataset("O", data=[1.0])
            f.attrs.update(model="resnet18", config_hash="abc")
    with pytest.raises(PeatError) as err:
        checkpoint.load(path, torch.nn.Linear(2, 2))
    assert str(err.value) == f"{path}: not a peat checkpoint (no /model group)"


def test_checkpoint_of_another_optimizer_class_fails_naming_both(tmp_path):
    # SGD took Adam's param_groups without a word, then failed at its first step with KeyError: 'momentum'.
    model = torch.nn.Linear(2, 2)
    adam = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    adam.step()
    checkpoint.save(tmp_path / "adam.h5", model, adam, step=1, epoch=1, meta={})
    other = torch.nn.Linear(2, 2)
    before = other.weight.detach().clone()
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(PeatError) as err:
        checkpoint.load(tmp_path / "adam.h5", other, sgd)
    assert str(err.value) == f"{tmp_path / 'adam.h5'}: optimizer state is Adam's, the optimizer is SGD"
    assert torch.equal(other.weight, before) and sgd.param_groups[0]["lr"] == 0.1 and not sgd.state  # left as they were
    resumed = torch.optim.Adam(model.parameters())
    checkpoint.load(tmp_path / "adam.h5", model, resumed)
    assert torch.equal(resumed.state[model.weight]["exp_avg"], adam.state[model.weight]["exp_avg"])


def test_kernel_file_with_syntax_error_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def forward(x, weight, bias)\n    return x\n")
    with pytest.raises(PeatError) as err:
        kernels.load(str(bad), "linear")
    assert str(err.value) == f"{bad}: import failed: SyntaxError: expected ':' (bad.py, line 1)"


# Module-level code that would take the job's process down, hang it, or raise on import:
# name -> (source, what the one line says after the kernel's name).
LOAD_FAULTS = {
    "segv": ("import ctypes\nctypes.string_at(0)  # null read\n", "killed by SIGSEGV while loading the kernel"),
    "exits": ("import os\nos._exit(3)\n", "exited with code 3 while loading the kernel"),
    "hangs": ("import time\ntime.sleep(600)\n", "loading the kernel timed out after 2 s"),
    "sys_exit": ("import sys\nsys.exit(3)\n", "import failed: SystemExit: 3"),
    "syntax": ("def forward(x, weight, bias)\n    return x\n",
               "import failed: SyntaxError: expected ':' (peat_test_load_syntax.py, line 1)"),
}


def _run_job(job: str, impl: str, work: Path, timeout: float) -> None:
    """A playback, candidate-training or RFI job on kernel ``impl``, writing under ``work``."""
    kspec = {"op": "linear", "impl": impl, "timeout": timeout, "train_timeout": timeout}
    # Neither context, data nor golden run exists: the kernel must fail before any is read.
    if job == "playback":
        playback.run_job("tiny", "cpu", "k", kspec, work / "context.h5", work / "k.parquet", work / "k.json",
                         errors_=[], settings={"computations": ["forward"]}, rules={})
    else:
        candidate.train_candidate("resnet18", {"arch": "resnet18"}, "k", kspec, work / "data.h5", work / "golden",
                                  work / "out", schedule=None if job == "candidate" else "f0.5")


@pytest.mark.parametrize("importable", [False, True], ids=["file", "module"])
@pytest.mark.parametrize("job", ["playback", "candidate", "rfi"])
@pytest.mark.parametrize("fault", LOAD_FAULTS)
def test_kernel_that_does_not_load_fails_its_job_with_one_line_and_writes_nothing(tmp_path, monkeypatch, fault,
                                                                                  job, importable):
    source, what = LOAD_FAULTS[fault]
    name = f"peat_test_load_{fault}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    impl = name if importable else str(tmp_path / f"{name}.py")
    work = tmp_path / "job"
    work.mkdir()
    with pytest.raises(PeatError) as err:
        _run_job(job, impl, work, timeout=2 if fault == "hangs" else 60)  # a busy machine may take seconds
    label = f"kernel impl {name!r}" if importable else impl
    assert str(err.value) == f"{label}: {what}"
    assert list(work.iterdir()) == []  # no output, not even a partial one


def test_shipped_kernels_load_without_a_child(monkeypatch):
    monkeypatch.setattr(kernels, "run_isolated", lambda *a, **k: pytest.fail("forked for a shipped kernel"))
    for impl in ("golden", "peat.alt_kernels.im2col"):
        kernels.check_loads(impl, "conv2d", timeout=1)


def test_provenance_stamp_is_stable_and_flat():
    a, b = provenance.stamp("h", "cpu"), provenance.stamp("h", "cpu")
    assert a == b and all(isinstance(v, str) for v in a.values())
    assert set(a) == {"config_hash", "vendor", "device", "python", "platform", *provenance.PACKAGES}
    assert provenance.columns({"provenance": a})["prov_torch"] == torch.__version__
    assert provenance.columns({}) == {}


def test_killed_writer_leaves_no_result_that_looks_complete(tmp_path):
    target = tmp_path / "verdict.json"
    script = ("import os, signal\nfrom peat.io import atomic_path\n"
              f"with atomic_path({str(target)!r}) as tmp:\n"
              "    tmp.write_text('{\"verdict\": \"pa')  # killed half-way through the JSON\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir()][0].startswith(".verdict.json.")  # only the hidden partial


@pytest.mark.parametrize("write", ["with open_h5(tmp, 'w') as f:\n        f['a'] = numpy.ones(100_000)",
                                   "shutil.copyfile(source, tmp)"], ids=["hdf5", "copy"])
def test_a_full_disk_is_one_line_naming_the_target_and_leaves_nothing(tmp_path, write):
    # A file-size limit fails a write as a full disk does (same errors, errno EFBIG). h5py's
    # message was two lines naming the temporary file; a copy's named the temporary file too.
    source, target = tmp_path / "source.h5", tmp_path / "out" / "checkpoint.h5"
    source.write_bytes(bytes(200_000))
    script = ("import resource, shutil, signal, numpy\nfrom peat.io import atomic_path, open_h5\n"
              f"source = {str(source)!r}\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
              f"with atomic_path({str(target)!r}) as tmp:\n    {write}\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"OSError: [Errno 27] File too large: '{target}'"
    assert list(tmp_path.iterdir()) == [source]  # no partial file, no folder made for it


@pytest.mark.parametrize("reader", ["detect", "analyze", "training_curves", "alter_collect"])
@pytest.mark.parametrize("content", ["", "\x00" * 64], ids=["empty", "zeroed"])
def test_an_emptied_or_zeroed_input_of_a_job_is_one_line_naming_it(tmp_path, reader, content):
    # json and pandas name no file: the job's log ended in 'Expecting value: line 1 column 1 (char 0)'.
    from peat import alter_study, analyze, detect, report

    table, bad, out = tmp_path / "t.parquet", tmp_path / "input", tmp_path / "out"
    pd.DataFrame({"a": [1.0]}).to_parquet(table)
    bad.write_text(content)
    run = {"detect": lambda: detect.run_job(table, bad, out / "v.json"),
           "analyze": lambda: analyze.run_job(table, tmp_path / "context.h5", out, record=bad),
           "training_curves": lambda: report.training_curves(bad, out / "x.png", title="x"),
           "alter_collect": lambda: alter_study.collect([bad], out / "study.csv", 0.02)}[reader]
    with pytest.raises(PeatError) as err:
        run()
    assert str(err.value).startswith(f"{bad}: ") and "\n" not in str(err.value)
    assert not out.exists()


def test_playback_of_an_error_aimed_at_a_gradient_the_context_never_records_names_the_layer(digits, tmp_path,
                                                                                              capfd):
    """conv1 is fed by data: the context has no input gradient there, so a faulty kernel's nan:1
    aimed at it replayed nothing, and its verdict came from the rows it left golden."""
    from peat import train

    spec = yaml.safe_load((Path(__file__).parent.parent / "config/test.yaml").read_text())["models"]["resnet18"]
    spec |= {"epochs": 1, "max_train_samples": 32, "record": {"layers": ["conv1"], "every": 1},
             "checkpoint_epochs": []}
    train.train_model("resnet18", spec, digits, tmp_path / "golden", progress=False, resumable=False)
    kspec = {"op": "conv2d", "error": "nan:1", "computation": "input_grad", "layers": ["conv1"]}
    playback.run_job("resnet18", "cpu", "nan_dx", kspec, tmp_path / "golden/context.h5", tmp_path / "k.parquet",
                     tmp_path / "k.json", errors_=[], settings={}, rules={})
    record = json.loads((tmp_path / "k.json").read_text())
    assert (record["layers_not_injected"], record["computation"]) == (["conv1"], "input_grad")  # the report names both
    assert [line for line in capfd.readouterr().err.splitlines() if "never injected" in line] == [
        "warning: kernels.nan_dx.error 'nan:1' is never injected at layer 'conv1': the context records no input_grad "
        "there"]
