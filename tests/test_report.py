"""The collated report: opened in a real headless Chromium, regenerated on upstream change,
byte-identical on rerun; Snakemake's own report; bad stage outputs give one-line errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import BIN, REPO, TEST_CONFIG, snakemake
from peat import alter_study, analyze, report
from peat.io import PeatError
from peat.report import SECTIONS, TABLES, build, compare_figure, loss_scale, training_curves

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
REPORT = Path("reports/test")


def _browser(profile: Path):
    """Headless Debian chromium driven through Debian's chromedriver (nothing downloaded); its
    profile in ``profile`` (a test's tmp_path: a mkdtemp folder was left in /tmp by every run)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian packages chromium, chromium-driver; .ci/system-packages)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (envs/requirements.txt)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--window-size=1280,2400"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def _expected_verdicts(workdir: Path) -> set[tuple[str, str, str]]:
    return {tuple(p.relative_to(workdir / "results/detect").with_suffix("").parts)
            for p in (workdir / "results/detect").glob("*/*/*.json")}


def _planned_jobs(dry_run: str) -> set[str]:
    """Rule names in the "Job stats" table of ``snakemake -n``."""
    table = dry_run.split("Job stats:", 1)[1].split("\ntotal", 1)[0].splitlines()
    return {line.split()[0] for line in table[3:] if line.strip()}


def _report_inputs(workdir: Path) -> list[str]:
    """The report rule's inputs (the union of the stages' targets), from a forced dry run."""
    out = snakemake(workdir, "-n", "--forcerun", "collate_report", str(REPORT / "index.html")).stdout
    job = out.split("rule collate_report:", 1)[1]
    return job.split("    input: ", 1)[1].split("\n", 1)[0].split(", ")


def _expected_images(workdir: Path) -> list[str]:
    """Every PNG among the report's inputs, plus the candidate-vs-golden figure it draws per
    candidate training and RFI case."""
    return [f for f in _report_inputs(workdir) if f.endswith(".png") or re.search(r"(candidate|rfi)/.*/compare\.csv$", f)]


@pytest.mark.xdist_group("workflow")
def test_index_html_in_headless_chromium(workflow_run, tmp_path):
    page = workflow_run / REPORT / "index.html"
    driver = _browser(tmp_path / "chromium-profile")
    try:
        driver.get(page.as_uri())
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight])")
        verdict_rows = driver.execute_script(
            "return Array.from(document.querySelectorAll('#verdicts tbody tr'))"
            ".map(r => Array.from(r.cells).map(c => c.textContent))")
        golden_rows = driver.execute_script(
            "return Array.from(document.querySelectorAll('#golden tbody tr')).map(r => r.cells[0].textContent)")
        links = driver.execute_script("return Array.from(document.querySelectorAll('a[href]')).map(a => a.getAttribute('href'))")
        shot = tmp_path / "report.png"
        assert driver.save_screenshot(str(shot))
    finally:
        driver.quit()
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every figure decoded in the browser, and there is one per PNG the stages produced.
    assert images and all(complete and w > 0 and h > 0 for _, complete, w, h in images), images
    assert len(images) == len(_expected_images(workflow_run))
    models = ["resnet18", "resnet18_parity", "gpt2"]
    assert {f"{m} / cpu / training curves" for m in models} <= {alt for alt, *_ in images}
    assert sorted(golden_rows) == sorted(models)
    # Verdict table: exactly one row per detector result (model x vendor x kernel).
    assert {tuple(r[:3]) for r in verdict_rows} == _expected_verdicts(workflow_run)
    assert len(verdict_rows) == len(_expected_verdicts(workflow_run))
    for row in verdict_rows:
        assert row[3] in ("pass", "fail") and float(row[5]) >= 0
    # Self-contained: the only links are in-page anchors and the CSVs beside the page.
    assert all(h.startswith("#") or (h.endswith(".csv") and (page.parent / h).is_file()) for h in links), links
    assert "http://" not in page.read_text() and "https://" not in page.read_text()


@pytest.mark.xdist_group("workflow")
def test_report_tables_as_csv_beside_the_page(workflow_run):
    out = workflow_run / REPORT
    for name, columns in TABLES.items():
        table = pd.read_csv(out / name)
        assert list(table.columns[:len(columns)]) == columns, name
    verdicts = pd.read_csv(out / "verdicts.csv")
    assert set(zip(verdicts.model, verdicts.vendor, verdicts.kernel)) == _expected_verdicts(workflow_run)
    golden = pd.read_csv(out / "golden.csv")
    for row in golden.itertuples():
        metrics = pd.read_csv(workflow_run / "results/golden" / row.model / row.vendor / "metrics.csv")
        last_val = metrics[metrics.split == "val"].iloc[-1]
        assert row.val_loss == last_val.loss and row.epochs == metrics.epoch.max()


@pytest.mark.xdist_group("workflow")
def test_kernel_source_edit_reruns_kernel_and_report_not_golden(workflow_run):
    """Dry run with an edited copy of a file kernel's source (the copy in the working directory
    takes precedence over the repository's); the copy is removed again, nothing is run."""
    kernels = yaml.safe_load((REPO / "config/test.yaml").read_text()).get("kernels") or {}
    impl = next((k["impl"] for k in kernels.values() if str(k.get("impl", "")).endswith((".py", ".cpp"))), None)
    if impl is None:
        pytest.skip("config/test.yaml has no kernel given as a source file")
    edited = workflow_run / impl
    assert not edited.exists()
    created = not edited.parent.exists()
    edited.parent.mkdir(parents=True, exist_ok=True)
    edited.write_text((REPO / impl).read_text() + "\n# edited\n")
    try:
        plan = _planned_jobs(snakemake(workflow_run, "-n").stdout)
    finally:
        edited.unlink()
        if created:
            edited.parent.rmdir()
    assert {"candidate_train", "playback", "detect", "collate_report"} <= plan, plan
    assert not plan & {"golden_train", "golden_curves", "prepare_dataset"}, plan


@pytest.mark.xdist_group("workflow")
def test_upstream_change_regenerates_report_not_golden(workflow_run):
    page = workflow_run / REPORT / "index.html"
    before = page.read_bytes()
    # An upstream stage output changes (as after a kernel source edit reruns its stage). Snakemake
    # compares small files by checksum, so the bytes must change: same JSON, other layout.
    upstream = sorted((workflow_run / "results").glob("detect/*/*/*.json")) or \
        sorted((workflow_run / "results").glob("sdc/*/*.json"))
    assert upstream, "no stage output downstream of golden training to change"
    original = upstream[0].read_text()
    upstream[0].write_text(json.dumps(json.loads(original)))
    try:
        plan = _planned_jobs(snakemake(workflow_run, "-n").stdout)
        assert plan == {"collate_report", "all"}, plan
        snakemake(workflow_run)
        assert page.read_bytes() == before  # regenerated, byte-identical: no timestamps in the page
    finally:
        upstream[0].write_text(original)
        snakemake(workflow_run)
    after = snakemake(workflow_run, "-n")
    assert "Nothing to be done" in after.stdout + after.stderr


@pytest.mark.xdist_group("workflow")
def test_an_edited_caption_reruns_the_report_alone(workflow_run, tmp_path):
    """The page quotes the RST captions, which were no inputs of its rule: an edited caption showed
    only after --forcerun collate_report. Edited in a copy of the checkout (the repository's stays
    as it is), whose files keep their times, so that by the mtime trigger only the edit is new."""
    checkout = tmp_path / "checkout"
    for part in ("workflow", "src", "config", "kernels", "envs"):
        shutil.copytree(REPO / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy2(REPO / "Snakefile", checkout / "Snakefile")
    caption = checkout / "workflow/report/alter_heatmap.rst"
    caption.write_text(caption.read_text() + "\nOne more sentence.\n")
    proc = subprocess.run([str(BIN / "snakemake"), "-n", "--snakefile", str(checkout / "Snakefile"), "--directory",
                           str(workflow_run), "--rerun-triggers", "mtime", "--configfile", str(TEST_CONFIG)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"Updated input files: {caption}" in proc.stdout, proc.stdout[-2000:]
    assert _planned_jobs(proc.stdout) == {"collate_report", "all"}, proc.stdout[-2000:]


@pytest.mark.xdist_group("workflow")
def test_missing_intermediate_outputs_are_redone(workflow_run):
    """A playback or alteration job that failed or was killed leaves no outputs (Snakemake removes
    them). Nothing redid them: the next run succeeded and the report kept the verdict of the kernel
    as it was before the edit. Moved aside and back (os.replace keeps the mtime), nothing is run."""
    for pattern, job in (("playback/*/*/*.parquet", "playback"), ("alter/*/*/cells/*/*.csv", "alter_cells")):
        found = sorted((workflow_run / "results").glob(pattern))
        if not found:
            continue
        aside = found[0].with_name(found[0].name + ".aside")
        os.replace(found[0], aside)
        try:
            plan = _planned_jobs(snakemake(workflow_run, "-n").stdout)
        finally:
            os.replace(aside, found[0])
        assert {job, "collate_report"} <= plan, plan
        assert "golden_train" not in plan, plan


@pytest.mark.xdist_group("workflow")
def test_report_dpi_sets_every_figure_of_the_page(workflow_run, tmp_path):
    """report.dpi reached the golden and candidate figures only: the Analyzer's and the alteration
    heatmap (most of the page) kept their fixed resolution."""
    config = yaml.safe_load((REPO / "config/test.yaml").read_text())
    config["report"] = {"dpi": config.get("report", {}).get("dpi", 80) + 20}
    path = tmp_path / "dpi.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))  # same key order: params compare as text
    plan = _planned_jobs(snakemake(workflow_run, "-n", "--rerun-triggers", "params", configfile=path).stdout)
    assert {"golden_curves", "analyze", "alter_summary", "collate_report"} <= plan, plan
    assert not plan & {"golden_train", "playback", "alter_cells"}, plan


@pytest.mark.xdist_group("workflow")
def test_changing_threads_reruns_golden_training_and_everything_after(workflow_run, tmp_path):
    """A CPU sum split over more threads rounds differently, and the jobs ran with Snakemake's
    threads (capped by --cores) yet no result depended on the setting: a candidate trained with 2
    threads was compared with a golden training made with 1."""
    config = yaml.safe_load((REPO / "config/test.yaml").read_text())
    config["threads"] = 2
    path = tmp_path / "threads.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    plan = _planned_jobs(snakemake(workflow_run, "-n", "--rerun-triggers", "params", configfile=path).stdout)
    assert {"golden_train", "candidate_train", "rfi", "playback", "alter_cells", "collate_report"} <= plan, plan
    assert "prepare_dataset" not in plan, plan


@pytest.mark.xdist_group("workflow")
@pytest.mark.parametrize("kernel, setting, rerun, kept", [
    ("im2col", {"timeout": 120}, "playback", "candidate_train"),
    ("welford_ln", {"train": True}, "candidate_train", "playback"),
    ("lane_fc", {"train_timeout": 7200}, "rfi", "playback"),
])
def test_a_kernel_setting_of_one_stage_reruns_only_that_stage(workflow_run, tmp_path, kernel, setting, rerun, kept):
    """The whole kernel spec was a param of its trainings and of its playback: raising a kernel's
    playback timeout reran its candidate training (a whole training), train: true its playback."""
    config = yaml.safe_load((REPO / "config/test.yaml").read_text())
    config["kernels"][kernel].update(setting)
    path = tmp_path / "kernel.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    plan = _planned_jobs(snakemake(workflow_run, "-n", "--rerun-triggers", "params", configfile=path).stdout)
    assert rerun in plan and kept not in plan, plan


@pytest.mark.xdist_group("workflow")
@pytest.mark.parametrize("kernels, playback", [
    ({"im2col": {"seed": 5, "computation": "weight_grad"}}, {}),
    ({}, {"propagate_samples": 3}),
])
def test_a_setting_no_job_reads_reruns_nothing(workflow_run, tmp_path, kernels, playback):
    """seed and computation place a kernel's injected error, yet editing them reran the candidate
    training and playback of a kernel with none; propagate_samples reran every playback where
    nothing propagates (propagate: false)."""
    config = yaml.safe_load((REPO / "config/test.yaml").read_text())
    for name, setting in kernels.items():
        config["kernels"][name].update(setting)
    config["playback"].update(playback)
    path = tmp_path / "unread.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = snakemake(workflow_run, "-n", "--rerun-triggers", "params", configfile=path).stdout
    assert "Nothing to be done" in out, out[-2000:]


@pytest.mark.xdist_group("workflow")
@pytest.mark.parametrize("setting, rerun", [
    ({"accept_reduced_precision": False}, {"detect", "collate_report", "all"}),
    ({"benchmark_seeds": 2}, set()),
])
def test_a_detector_setting_reruns_only_the_stages_that_read_it(workflow_run, tmp_path, setting, rerun):
    """The whole detect section was a param of playback and detect: accept_reduced_precision (the
    verdict's alone) reran every playback, benchmark_seeds (the on-demand benchmark's) every
    playback and detection."""
    config = yaml.safe_load((REPO / "config/test.yaml").read_text())
    config["detect"].update(setting)
    path = tmp_path / "detect.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = snakemake(workflow_run, "-n", "--rerun-triggers", "params", configfile=path).stdout
    assert (_planned_jobs(out) if "Job stats:" in out else set()) == rerun, out[-2000:]


@pytest.mark.xdist_group("workflow")
def test_the_alteration_tolerance_reruns_the_summaries_not_the_cells(workflow_run, tmp_path):
    """alter.tolerance only decides epochs_to_recover, yet it was a param of every alteration cell:
    editing it reran them all, each a resumed training (72 per model and vendor by default)."""
    config = yaml.safe_load((REPO / "config/test.yaml").read_text())
    config["alter"]["tolerance"] = config["alter"].get("tolerance", 0.02) + 0.03
    path = tmp_path / "alter.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = snakemake(workflow_run, "-n", "--rerun-triggers", "params", configfile=path).stdout
    assert _planned_jobs(out) == {"alter_summary", "collate_report", "all"}, out[-2000:]


@pytest.mark.xdist_group("workflow")
def test_snakemake_report(workflow_run):
    """README's command as written, without --cores: the bench rule's threads (workflow.cores)
    stopped it with a WorkflowError asking for --cores."""
    out = workflow_run / REPORT / "snakemake-report.html"
    cmd = [str(BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile"), "--directory", str(workflow_run),
           "--configfile", str(TEST_CONFIG), "--report", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert out.stat().st_size > 100_000
    assert "Golden training" in text
    for model in ("resnet18", "resnet18_parity", "gpt2"):
        assert f"results/golden/{model}/cpu/training_curves.png" in text


def test_training_curves_are_byte_identical(workflow_run, tmp_path):
    metrics = workflow_run / "results/golden/gpt2/cpu/metrics.csv"
    a = training_curves(metrics, tmp_path / "a.png", title="golden training of gpt2 (cpu)")
    b = training_curves(metrics, tmp_path / "b.png", title="golden training of gpt2 (cpu)")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() == (workflow_run / "results/golden/gpt2/cpu/training_curves.png").read_bytes()


def test_steps_and_epochs_are_ticked_whole(tmp_path, monkeypatch):
    """The test run's resnet18_parity (one epoch, two steps): its accuracy was ticked at epochs 0.96
    to 1.04 and its loss at steps 0.0, 0.5, ..., 2.0; a candidate's two steps too."""
    figs, png = [], report._png
    monkeypatch.setattr(report, "_png", lambda fig: figs.append(fig) or png(fig))
    metrics = tmp_path / "metrics.csv"
    pd.DataFrame({"step": [0, 1, 2], "epoch": 1, "split": ["train", "train", "val"], "loss": [1.0, 0.5, 13.2],
                  "accuracy": [float("nan"), float("nan"), 0.47]}).to_csv(metrics, index=False)
    training_curves(metrics, tmp_path / "curves.png", title="m (cpu)")
    compare = tmp_path / "compare.csv"
    pd.DataFrame({"step": [0, 1], "split": "train", "loss_golden": [2.0, 1.5],
                  "loss_candidate": [2.0, 1.6]}).to_csv(compare, index=False)
    compare_figure(compare, title="m / cpu / k")
    for ax in (ax for fig in figs for ax in fig.axes):
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)


@pytest.mark.parametrize("train, val, scale", [
    # The default ResNet-18's golden run: its first validation loss (159) flattened the training curve.
    ([2.64, 0.41, 0.0026], [159.2, 5.07, 0.40, 0.33], "log"),
    ([5.5, 3.6, 3.2], [3.3, 3.29], "linear"),  # GPT-2's: within a decade
    ([2.0, 0.0], [0.5], "linear"),  # a loss of exactly 0 has no place on a log axis
    ([2.0, float("nan"), float("inf")], [1.0], "linear"),  # non-finite losses (gaps) do not count
    ([], [], "linear"),
])
def test_loss_axis_turns_logarithmic_only_over_two_decades(train, val, scale):
    assert loss_scale(pd.Series(train, dtype=float), pd.Series(val, dtype=float)) == scale


def test_page_without_stage_outputs(tmp_path):
    page = build([], tmp_path / "out", name="empty", models=["m"], vendors=["cpu"])
    text = page.read_text()
    assert "No candidate kernels" in text and "<img" not in text
    for name, columns in TABLES.items():
        assert pd.read_csv(tmp_path / "out" / name).columns.tolist() == columns


def test_page_is_utf8_as_it_says_whatever_the_locale(tmp_path):
    """The page declares charset utf-8 but was written in the locale's encoding: under a locale
    that is not UTF-8 (here ASCII) a model named in another alphabet stopped the report with a
    UnicodeEncodeError (under Latin-1, an accented one was written as a byte that is not UTF-8)."""
    code = ("import sys; from peat.report import build; "
            "build([], sys.argv[1], name='t', models=['mod\\u00e8le_\\u03bc'], vendors=['cpu'])")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "models mod\u00e8le_\u03bc;" in (tmp_path / "index.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON (Expecting property name enclosed in double quotes at line 1)"),
    (json.dumps({"error_model": "none"}), "missing key 'verdict' (not a detector result?)"),
])
def test_bad_detector_result_is_one_line(tmp_path, content, message):
    bad = tmp_path / "results/detect/m/cpu/k.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(content)
    with pytest.raises(PeatError) as err:
        build([bad], tmp_path / "out", name="bad", models=["m"], vendors=["cpu"])
    assert str(err.value) == f"{bad}: {message}"


def test_detector_result_in_another_encoding_is_one_line(tmp_path):
    """A result re-saved as Latin-1 (or a binary file in its place) ended the report in a UnicodeDecodeError."""
    bad = tmp_path / "results/detect/m/cpu/k.json"
    bad.parent.mkdir(parents=True)
    bad.write_bytes('{"verdict": "pass", "note": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(PeatError) as err:
        build([bad], tmp_path / "out", name="bad", models=["m"], vendors=["cpu"])
    assert str(err.value) == f"{bad}: not valid JSON (byte 0xe9 at offset 32 is not UTF-8 text)"


@pytest.mark.parametrize("content, message", [
    ("a,b\n1,2\n", "needs columns step, epoch, split, loss (not a training metrics file?)"),
    # Without its metric: a KeyError ('accuracy') naming no file.
    ("step,epoch,split,loss,perplexity\n0,1,train,2.0,\n0,1,val,2.0,\n",
     "needs column accuracy, or perplexity with values (not a training metrics file?)"),
    # A damaged cell: "could not convert string to float: 'x'" from pandas, naming no file.
    ("step,epoch,split,loss,accuracy\n0,1,train,2.0,0.5\n1,1,train,x,0.5\n1,1,val,2.0,0.5\n",
     "line 3: column loss holds 'x', not a number (damaged?)"),
])
def test_bad_metrics_file_is_one_line(tmp_path, content, message):
    bad = tmp_path / "metrics.csv"
    bad.write_text(content)
    with pytest.raises(PeatError) as err:
        training_curves(bad, tmp_path / "x.png", title="x")
    assert str(err.value) == f"{bad}: {message}"
    assert not (tmp_path / "x.png").exists()


def test_verdicts_link_to_analyzer_figures(tmp_path):
    """Synthetic stage outputs: a failing verdict row links to its kernel's Analyzer figures."""
    metrics = tmp_path / "metrics.csv"
    pd.DataFrame({"step": [0, 1, 2], "epoch": [1, 1, 1], "split": ["train", "train", "val"], "loss": [2.0, 1.5, 1.7],
                  "accuracy": [0.1, 0.2, 0.3], "perplexity": [float("nan")] * 3}).to_csv(metrics, index=False)
    fig = training_curves(metrics, tmp_path / "results/analyze/gpt2/cpu/k1/bits.png", title="t", dpi=30)
    verdict = tmp_path / "results/detect/gpt2/cpu/k1.json"
    verdict.parent.mkdir(parents=True)
    verdict.write_text(json.dumps({"verdict": "fail", "error_model": "bit_flip", "confidence": 0.875, "layers": []}))
    page = build([fig.parent, verdict], tmp_path / "out", name="t", models=["gpt2"], vendors=["cpu"],
                 captions=REPO / "workflow/report", injected={"k1": "bit_flip:exponent"}).read_text()
    assert '<tr class="fail"><td class="model">gpt2</td><td class="vendor">cpu</td>' in page
    assert '<td class="kernel"><a href="#analyze-gpt2-cpu-k1">k1</a></td>' in page
    assert '<h3 id="analyze-gpt2-cpu-k1">' in page and '<td class="confidence">0.875</td>' in page
    # The playback stage's own caption, with its wildcards filled in.
    assert "Bit positions where candidate and golden" in page
    assert pd.read_csv(tmp_path / "out/verdicts.csv", keep_default_na=False).to_dict("records") == [
        {"model": "gpt2", "vendor": "cpu", "kernel": "k1", "verdict": "fail", "error_model": "bit_flip", "confidence": 0.875,
         "injected": "bit_flip:exponent", "not_injected": ""}]


def test_analyzer_figures_in_the_order_the_caption_reads_them(tmp_path):
    """Sorted by name, a run's Analyzer figures opened with the bit histograms and put the score
    against iteration, which the section's caption starts with, fourth."""
    folder = tmp_path / "results/analyze/gpt2/cpu/k1"
    folder.mkdir(parents=True)
    for name in sorted(analyze.FIGURES):
        (folder / f"{name}.png").write_bytes(report.PNG_START + report.PNG_END)  # the bytes the page checks
    page = build([folder], tmp_path / "out", name="t", models=["gpt2"], vendors=["cpu"]).read_text()
    assert re.findall(r'<img src="[^"]*" alt="gpt2 / cpu / k1 / ([^"]*)"', page) == [
        name.replace("_", " ") for name in analyze.FIGURES]


def test_golden_training_curves_carry_their_own_caption(tmp_path):
    """The golden_curves rule's caption file (Snakemake's report) captions the collated page too:
    named after the rule instead of <stage>_<figure>.rst, it was not found there."""
    metrics = tmp_path / "metrics.csv"
    pd.DataFrame({"step": [0, 1], "epoch": [1, 1], "split": ["train", "val"], "loss": [2.0, 1.7],
                  "accuracy": [0.1, 0.3], "perplexity": [float("nan")] * 2}).to_csv(metrics, index=False)
    fig = training_curves(metrics, tmp_path / "results/golden/gpt2/cpu/training_curves.png", title="t", dpi=30)
    page = build([fig], tmp_path / "out", name="t", models=["gpt2"], vendors=["cpu"],
                 captions=REPO / "workflow/report").read_text()
    caption = page.split("<figcaption>", 1)[1].split("</figcaption>", 1)[0]
    assert "Golden training of gpt2 on cpu, the trusted run every other stage compares against." in caption


def test_sdc_caption_names_the_columns_of_its_table(tmp_path):
    """The SDC section's caption said <b>step</b>; the table's column is detection_step."""
    drill = tmp_path / "results/sdc/gpt2/nan_grad.json"
    drill.parent.mkdir(parents=True)
    drill.write_text(json.dumps({"outcome": "completed", "detected": True, "check": "nonfinite", "detection_step": 2,
                                 "localized": True, "right_rank": True, "false_alarms": 0}))
    page = build([drill], tmp_path / "out", name="t", models=["gpt2"], vendors=["cpu"]).read_text()
    caption = page.split('<section id="sdc-section">', 1)[1].split("</p>", 1)[0]
    named = set(re.findall(r"<b>(\w+)</b>", caption))
    assert named and named <= set(pd.read_csv(tmp_path / "out/sdc.csv").columns), named


def test_a_drills_findings_lead_its_settings(tmp_path):
    """Behind the drill's settings, in alphabetical order, localized and right_rank (which the caption
    explains) were the 14th and 17th columns, beyond the page's width."""
    drill = tmp_path / "results/sdc/gpt2/lane_fault.json"
    drill.parent.mkdir(parents=True)
    drill.write_text(json.dumps({"audit_every": 2, "backend": "gloo", "check": "audit", "detected": True,
                                 "detection_step": 2, "drill": "lane_fault", "false_alarms": 0, "injected_rank": 1,
                                 "localized": True, "model": "gpt2", "outcome": "completed", "right_rank": True,
                                 "seed": 0, "world_size": 3}))
    page = build([drill], tmp_path / "out", name="t", models=["gpt2"], vendors=["cpu"]).read_text()
    lead = ["model", "drill", "outcome", "detected", "detection_step", "localized", "right_rank", "false_alarms"]
    assert pd.read_csv(tmp_path / "out/sdc.csv").columns[:8].tolist() == lead
    caption = page.split('<section id="sdc-section">', 1)[1].split("</p>", 1)[0]
    assert set(re.findall(r"<b>(\w+)</b>", caption)) <= set(lead)


def test_whole_numbers_beside_blanks_keep_every_digit(tmp_path):
    """A CSV column with a blank (a cell not applicable alters no value) is read as floats, and a count
    of 123456 flipped values showed as "1.235e+05", 100000 as "1e+05"."""
    study = tmp_path / "results/alter/m/cpu/sensitivity.csv"
    study.parent.mkdir(parents=True)
    study.write_text("cls,region,flips,status,altered_values\nnorm,sign,100000,not_applicable,\n"
                     "embedding,sign,123456,ok,123456\n")
    page = build([study], tmp_path / "out", name="t", models=["m"], vendors=["cpu"]).read_text()
    assert page.count("<td>123456</td>") == 2 and "e+05" not in page
    assert report._cell(100000.0) == "100000" and report._cell(0.1234567) == "0.1235" and report._cell(2.5e-7) == "2.5e-07"


def test_a_candidate_runs_outcome_leads_its_final_scores(tmp_path):
    """Behind the final validation scores (8 columns, alphabetical), a crash's message and how far the
    loss went from golden's lay beyond the page's width."""
    outcome = tmp_path / "results/candidate/gpt2/cpu/my_gemm/outcome.json"
    outcome.parent.mkdir(parents=True)
    scores = {f"final_val_{c}_{w}": 1.0 for c in ("accuracy", "loss") for w in ("candidate", "golden")}
    outcome.write_text(json.dumps({**scores, "max_abs_loss_diff": None, "message": "RuntimeError: lane 3",
                                   "nonfinite_loss": False, "seconds": 2.5, "status": "crash", "steps_trained": 3}))
    build([outcome], tmp_path / "out", name="t", models=["gpt2"], vendors=["cpu"])
    lead = ["model", "vendor", "kernel", "status", "steps_trained", "max_abs_loss_diff", "nonfinite_loss", "message"]
    assert pd.read_csv(tmp_path / "out/candidate.csv").columns[:8].tolist() == lead


def test_sdc_caption_says_what_localized_and_the_clean_drill_show():
    """It said localized was whether the faulty rank was named correctly (that is right_rank: an alarm
    naming a healthy rank is localized too) and that the clean drill must not be detected, which
    it never is (detected counts alarms from the injection on): a false alarm shows in false_alarms."""
    caption = SECTIONS["sdc"][1]
    assert "<b>right_rank</b> whether it named the faulty rank" in caption
    assert "<b>false_alarms</b> must be 0" in caption and "must not be detected" not in caption


def test_a_kernel_with_nothing_to_replay_is_not_a_green_pass(tmp_path):
    """A batch-norm kernel on a model that records no batch-norm layer: the Detector's pass
    (confidence 0, evidence applicable: false) showed as a green pass row."""
    verdict = tmp_path / "results/detect/m/cpu/bn_kernel.json"
    verdict.parent.mkdir(parents=True)
    verdict.write_text(json.dumps({"verdict": "pass", "error_model": "none", "confidence": 0.0, "layers": [],
                                   "evidence": {"applicable": False, "reason": "no recorded layer"}}))
    page = build([verdict], tmp_path / "out", name="t", models=["m"], vendors=["cpu"]).read_text()
    assert '<tr class="not_applicable">' in page and 'class="pass"' not in page
    assert pd.read_csv(tmp_path / "out/verdicts.csv")["verdict"].tolist() == ["not_applicable"]


def test_verdicts_caption_says_reduced_precision_fails_where_the_config_says_so():
    """With detect.accept_reduced_precision: false a reduced_precision row is a red fail, and the
    caption above it said "none and reduced_precision pass"."""
    caption = SECTIONS["verdicts"][1]
    assert "none and reduced_precision pass" not in caption
    assert "reduced_precision unless detect.accept_reduced_precision is false" in caption


def test_a_model_named_results_under_a_results_folder_keeps_its_row(tmp_path):
    verdict = tmp_path / "results/work/results/detect/results/cpu/k.json"  # workdir .../results/work, model 'results'
    verdict.parent.mkdir(parents=True)
    verdict.write_text(json.dumps({"verdict": "fail", "error_model": "bit_flip", "confidence": 0.5, "layers": []}))
    build([verdict], tmp_path / "out", name="t", models=["results"], vendors=["cpu"])
    rows = pd.read_csv(tmp_path / "out/verdicts.csv")
    assert rows[["model", "vendor", "kernel", "verdict"]].to_dict("records") == [
        {"model": "results", "vendor": "cpu", "kernel": "k", "verdict": "fail"}]


def test_benchmark_section_from_make_bench_results(tmp_path):
    bench = tmp_path / "reports/benchmarks/results.json"
    bench.parent.mkdir(parents=True)
    bench.write_text(json.dumps({"machine": {"cpus": 2}, "benchmarks": [
        {"name": "sdc_checks", "median": 1.05, "goal": "<= 1.02", "met": False, "samples": [1.0, 1.1]},
        {"name": "playback_efficiency", "median": 0.5, "goal": "<= 1", "met": True, "samples": [0.5]}]}))
    page = build([bench], tmp_path / "out", name="t", models=["m"], vendors=["cpu"]).read_text()
    table = pd.read_csv(tmp_path / "out/benchmarks.csv")
    assert table.columns[:4].tolist() == ["benchmark", "median", "goal", "met"]
    assert table.benchmark.tolist() == ["sdc_checks", "playback_efficiency"] and table.met.tolist() == [False, True]
    assert 'id="benchmarks-section"' in page and "<td>sdc_checks</td>" in page


def test_a_run_that_stopped_shows_how_far_it_trained_beside_its_outcome(tmp_path):
    outcome = tmp_path / "results/candidate/m/cpu/k/outcome.json"
    outcome.parent.mkdir(parents=True)
    outcome.write_text(json.dumps({"status": "timeout", "message": "no result after 20 s (killed)",
                                   "max_abs_loss_diff": 0.0, "steps_trained": 2}))
    build([outcome], tmp_path / "out", name="t", models=["m"], vendors=["cpu"])
    rows = pd.read_csv(tmp_path / "out/candidate.csv")
    assert list(rows.columns[:5]) == ["model", "vendor", "kernel", "status", "steps_trained"]
    assert rows.loc[0, "steps_trained"] == 2


def test_a_runtime_fi_case_shows_its_loss_against_golden_as_a_candidate_run_does(tmp_path):
    """README: the section shows each candidate and RFI run's training loss against golden; an RFI
    case's compare.csv was left out, its row in rfi.csv alone."""
    compare = pd.DataFrame({"step": [0, 1, 2], "split": "train", "loss_golden": [2.0, 1.5, 1.2],
                            "loss_candidate": [2.0, 1.9, 1.3]})
    files = [tmp_path / "results/candidate/m/cpu/k/compare.csv", tmp_path / "results/rfi/m/cpu/k/f0.5/compare.csv"]
    for path in files:
        path.parent.mkdir(parents=True)
        compare.to_csv(path, index=False)
    page = build(files, tmp_path / "out", name="t", models=["m"], vendors=["cpu"]).read_text()
    assert re.findall(r'<img src="[^"]*" alt="([^"]*)"', page) == [
        "m / cpu / k / training vs golden", "m / cpu / k / f0.5 / training vs golden"]
    assert '<h3 id="candidate-m-cpu-k-f0.5">' in page


@pytest.mark.parametrize("candidate, said", [
    ([2.0, 1.5, 1.2], "candidate = golden at every step"),  # no validation row differs
    ([2.0, 1.5, float("nan")], "candidate = golden at every step with both losses finite"),  # stopped at step 2
    ([float("nan")] * 3, "no step with both losses finite"),
    # A loss gone inf: its log axis of inf alone ended the report in "Data cannot be log-scaled".
    ([2.0, float("inf"), float("inf")], "candidate = golden at every step with both losses finite"),
    ([float("inf")] * 3, "no step with both losses finite"),
])
def test_a_loss_difference_panel_without_a_difference_says_why(tmp_path, monkeypatch, candidate, said):
    """A candidate training exactly as golden drew the difference panel blank, ticked -0.04..0.04:
    it read as a plot that failed to draw."""
    figs, png = [], report._png
    monkeypatch.setattr(report, "_png", lambda fig: figs.append(fig) or png(fig))
    compare = tmp_path / "compare.csv"
    pd.DataFrame({"step": [0, 1, 2], "split": "train", "loss_golden": [2.0, 1.5, 1.2],
                  "loss_candidate": candidate}).to_csv(compare, index=False)
    compare_figure(compare, title="m / cpu / k")
    right = figs[0].axes[1]
    assert [t.get_text() for t in right.texts] == [said] and not right.get_yticks().size
    pd.read_csv(compare).assign(loss_candidate=[2.0, 1.6, 1.2]).to_csv(compare, index=False)
    compare_figure(compare, title="m / cpu / k")
    assert not figs[1].axes[1].texts and figs[1].axes[1].get_yscale() == "log"


def test_a_diverged_alteration_run_is_not_shown_as_a_cell_not_measured(tmp_path):
    """The study writes a diverged run's NaN loss as "nan" and a cell not measured blank: the page showed both blank."""
    study = tmp_path / "results/alter/m/cpu/sensitivity.csv"
    study.parent.mkdir(parents=True)
    grid = dict(model="m", vendor="cpu", epoch=1, cls="weight", region="exponent", flips=1)
    alter_study._write_table(study, pd.DataFrame([
        dict(grid, seed=0, status="ok", final_accuracy=0.1, final_loss=float("nan"), diverged=True),
        dict(grid, seed=1, status="not_applicable", reason="no eligible value", diverged=False)],
        columns=list(alter_study.COLUMNS)))
    page = build([study], tmp_path / "out", name="t", models=["m"], vendors=["cpu"]).read_text()
    rows = re.findall(r"<tr>(.*?)</tr>", page[page.index('id="alter_sensitivity"'):], re.S)
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in rows]
    final_loss = alter_study.COLUMNS.index("final_loss")  # the page keeps the study's columns
    assert [c[final_loss] for c in cells] == ["nan", ""]
    assert pd.read_csv(tmp_path / "out/alter_sensitivity.csv", keep_default_na=False)["final_loss"].tolist() == ["nan", ""]


def test_a_candidate_run_that_crashed_says_so_on_its_figure(tmp_path, monkeypatch):
    """A kernel that raised at its first call: the figure drew golden's loss alone, and its empty
    difference panel said "no step with both losses finite", which reads as a candidate whose loss
    went NaN; its status (in candidate.csv, far above) was not on it."""
    figs, png = [], report._png
    monkeypatch.setattr(report, "_png", lambda fig: figs.append(fig) or png(fig))
    run = tmp_path / "results/candidate/m/cpu/k"
    run.mkdir(parents=True)
    pd.DataFrame({"step": [0, 1, 2], "split": "train", "loss_golden": [2.0, 1.5, 1.2],
                  "loss_candidate": [float("nan")] * 3}).to_csv(run / "compare.csv", index=False)
    (run / "outcome.json").write_text(json.dumps({"status": "crash", "steps_trained": 0, "message": "ValueError: x"}))
    page = build([run / "compare.csv", run / "outcome.json"], tmp_path / "out", name="t", models=["m"],
                 vendors=["cpu"]).read_text()
    assert re.findall(r'<img src="[^"]*" alt="([^"]*)"', page) == ["m / cpu / k / training vs golden (crash after 0 steps)"]
    assert figs[0].get_suptitle() == "m / cpu / k (crash after 0 steps)"


def test_each_configurations_report_keeps_its_own_log(tmp_path):
    """Every configuration's report job wrote logs/report/collate.log: a failed report's log was
    overwritten by the next run of another configuration in the same directory."""
    config = yaml.safe_load(TEST_CONFIG.read_text()) | {"name": "other"}
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = snakemake(tmp_path / "work", "-n", "reports/other/index.html", configfile=path).stdout
    job = out.split("rule collate_report:", 1)[1]
    assert job.split("    log: ", 1)[1].split("\n", 1)[0] == "logs/report/other/collate.log"


def test_a_loss_difference_panel_does_not_call_a_run_whose_validation_differs_equal(tmp_path, monkeypatch):
    """The test run's my_gemm on gpt2: training loss equal to golden's at every step, validation loss
    4.8e-07 off (its max_abs_loss_diff in the table above); the panel said candidate = golden at every step."""
    figs, png = [], report._png
    monkeypatch.setattr(report, "_png", lambda fig: figs.append(fig) or png(fig))
    compare = tmp_path / "compare.csv"
    pd.DataFrame({"step": [0, 1, 2, 2], "split": ["train", "train", "train", "val"],
                  "loss_golden": [2.0, 1.5, 1.2, 1.3],
                  "loss_candidate": [2.0, 1.5, 1.2, 1.3000005]}).to_csv(compare, index=False)
    compare_figure(compare, title="m / cpu / k")
    assert [t.get_text() for t in figs[0].axes[1].texts] == [
        "candidate = golden at every training step\n(not at validation: see max_abs_loss_diff)"]


def test_layers_a_faulty_kernels_error_never_reached_are_named_in_its_rows(tmp_path):
    """A faulty kernel's input_grad error at a layer fed by data is never injected there (outcome.json
    and the playback record list it under layers_not_injected), so its verdict and loss there come
    from golden's; the report's rows did not say so."""
    results = tmp_path / "results"
    runs = {results / "candidate/m/cpu/k/outcome.json": ["conv1"], results / "rfi/m/cpu/k/f0.5/outcome.json": ["conv1"],
            results / "candidate/m/cpu/clean/outcome.json": []}
    for path, layers in runs.items():
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"status": "ok", "error": "nan:1", "computation": "input_grad",
                                    "layers_not_injected": layers}))
    verdict, record = results / "detect/m/cpu/k.json", results / "playback/m/cpu/k.json"
    for path in (verdict, record):
        path.parent.mkdir(parents=True)
    verdict.write_text(json.dumps({"verdict": "pass", "error_model": "none", "confidence": 0.0, "layers": []}))
    record.write_text(json.dumps({"layers_not_injected": ["conv1", "layer1.0.conv1"], "computation": "input_grad"}))
    page = build([*runs, verdict, record], tmp_path / "out", name="t", models=["m"], vendors=["cpu"]).read_text()
    candidate = pd.read_csv(tmp_path / "out/candidate.csv", keep_default_na=False)
    assert dict(zip(candidate.kernel, candidate.not_injected)) == {"k": "input_grad at conv1", "clean": ""}
    assert list(candidate.columns[:5]) == ["model", "vendor", "kernel", "status", "not_injected"]
    assert pd.read_csv(tmp_path / "out/rfi.csv")["not_injected"].tolist() == ["input_grad at conv1"]
    verdicts = pd.read_csv(tmp_path / "out/verdicts.csv")
    assert verdicts["not_injected"].tolist() == ["input_grad at conv1, layer1.0.conv1"]
    assert '<td class="not_injected">input_grad at conv1, layer1.0.conv1</td>' in page
    assert "<th>not injected</th>" in page and "<td>input_grad at conv1</td>" in page
    for key in ("verdicts", "candidate"):
        assert "<b>not injected</b> names the computation and the layers" in SECTIONS[key][1]


@pytest.mark.parametrize("where, content, message", [
    ("results/detect/m/cpu/k.json", '["verdict"]', "not a JSON object (not a detector result?)"),
    ("results/candidate/m/cpu/k/outcome.json", "[1, 2]", "not a JSON object (not a run's or drill's result?)"),
    ("results/sdc/m/clean.json", "3", "not a JSON object (not a run's or drill's result?)"),
    # Another JSON object (a verdict, {}): a row of the run's keys and blanks, the outcome unsaid.
    ("results/candidate/m/cpu/k/outcome.json", '{"verdict": "pass"}', "missing key 'status' (not a run's result?)"),
    ("results/rfi/m/cpu/k/f0.5/outcome.json", "{}", "missing key 'status' (not a run's result?)"),
    ("results/sdc/m/clean.json", "{}", "missing key 'detected' (not a drill's result?)"),
    ("reports/benchmarks/results.json", "5", "not a list of benchmarks (not make bench's results.json?)"),
    ("results/golden/m/cpu/metrics.csv", "a,b\n1,2\n",
     "missing columns epoch, split, loss, accuracy, perplexity (damaged, or not the file expected?)"),
    ("results/golden/m/cpu/metrics.csv", "step,epoch,split,loss,accuracy,perplexity\n",
     "no rows (a golden training's metrics.csv has one per step)"),
    # A line cut short, or a damaged cell: int() of NaN or of "x" ended the report in a ValueError.
    ("results/golden/m/cpu/metrics.csv", "step,epoch,split,loss,accuracy,perplexity\n0,1,train,2.0,0.5,\n1,",
     "line 3: column epoch is empty, not a number (damaged?)"),
    ("results/golden/m/cpu/metrics.csv", "step,epoch,split,loss,accuracy,perplexity\n0,one,train,2.0,0.5,\n",
     "line 2: column epoch holds 'one', not a number (damaged?)"),
    ("results/candidate/m/cpu/k/compare.csv", "step,split,loss_golden,loss_candidate\n0,train,2.0,2.0\n1,train,1.5,x\n",
     "line 3: column loss_candidate holds 'x', not a number (damaged?)"),
    ("results/detect/m/cpu/gone.json", None, "no such file (an input of the report)"),
    # Another CSV as a study's table: a row of its columns beside the run's keys, nothing said.
    ("results/alter/m/cpu/sensitivity.csv", "a,b\n1,2\n", "missing columns cls, region (damaged, or not the file expected?)"),
    ("results/alter/m/cpu/absorbed.csv", "cls\nnorm\n", "missing columns region (damaged, or not the file expected?)"),
    ("results/analyze/m/cpu/k/heatmap.png", "", "not a PNG image (empty or damaged)"),
    ("results/golden/m/cpu/training_curves.png", "<html></html>", "not a PNG image (empty or damaged)"),
])
def test_a_damaged_or_missing_stage_output_is_one_line_naming_it(tmp_path, where, content, message):
    """A verdict holding a list ended the report in an AttributeError, a number in a TypeError, a
    metrics.csv of other columns in a KeyError, one of a header alone in an IndexError, none naming
    the file; an outcome.json holding a list gave a row of its run's keys alone; a missing file was
    left out without a word, its row missing from the page; an empty or damaged figure was embedded
    as it was, a broken image on the page. No page is written."""
    bad = tmp_path / where
    bad.parent.mkdir(parents=True)
    if content is not None:
        bad.write_text(content)
    with pytest.raises(PeatError) as err:
        build([bad], tmp_path / "out", name="bad", models=["m"], vendors=["cpu"])
    assert str(err.value) == f"{bad}: {message}"
    assert not (tmp_path / "out").exists()


def test_candidate_caption_says_what_an_rfi_case_names():
    """Headings read "resnet18 / cpu / lane_fc / f0.5" under a caption naming no f0.5 nor every-N-th step."""
    caption = SECTIONS["candidate"][1]
    assert "(<b>case</b>: f0.5 the first half, every4 every fourth step)" in caption


def test_alter_and_sdc_captions_say_what_their_cells_mean():
    """"nan ... (both runs diverged)" named no second run; the clean drill's detected and right_rank
    read False beside the faulty drills' True, as if it had failed."""
    assert "(both runs diverged)" not in SECTIONS["alter"][1]
    assert "either way the run counts as diverged, † in the heatmap" in SECTIONS["alter"][1]
    assert "its <b>detected</b> and <b>right_rank</b> are False, as they should be" in SECTIONS["sdc"][1]
