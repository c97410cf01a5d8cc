"""Backbone: config validation, dataset prep, deterministic golden training, resume, the Profiler."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml

from conftest import DEVICES, REPO, TEST_CONFIG, needs_gpu, snakemake
from peat import checkpoint, data, models, profiler
from peat.device import for_vendor
from peat.io import PeatError
from peat import tensor_stats
from peat.profiler import DERIVED, Profiler, derive_outputs, read_layer

CONFIG = yaml.safe_load(TEST_CONFIG.read_text())
SPEC = CONFIG["models"]["resnet18"]


def write_config(tmp_path: Path, mutate) -> Path:
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    mutate(cfg)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# -- config and DAG ------------------------------------------------------------------------

def record_one_step(path: Path, model, layers: list[str], x, derived: bool = False) -> Profiler:
    """One recorded training step of ``model`` on ``x`` (loss: the sum of the squared output)."""
    prof = Profiler(path, layers, every=1, derived=derived)
    prof.attach(model)
    prof.begin_step(0, 1)
    model(x).square().sum().backward()
    prof.end_step()
    prof.close()
    return prof


def test_dry_run_of_default_config_lists_every_golden_job(tmp_path):
    proc = snakemake(tmp_path, "-n", configfile=REPO / "config" / "config.yaml")
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    golden = re.findall(r"^rule golden_train:\n(?:    .*\n)*?    wildcards: (.*)$", proc.stdout, re.M)
    assert sorted(golden) == sorted(f"model={model}, vendor=cpu" for model in default["models"])
    assert "prepare_dataset" in proc.stdout


BAD_CONFIGS = [
    (lambda c: c["models"]["resnet18"].update(arch="resnet99"), "models.resnet18.arch", "allowed: resnet18"),
    (lambda c: c["models"]["resnet18"].update(dataset="nope"), "models.resnet18.dataset", "unknown dataset 'nope'"),
    (lambda c: c.update(vendors=["intel"]), "vendors.0", "allowed: cpu, nvidia, amd"),
    (lambda c: c["models"]["resnet18"].update(epochs="two"), "models.resnet18.epochs", "is not of type 'integer'"),
    (lambda c: c["models"]["resnet18"].update(epochs=2.0), "models.resnet18.epochs", "2.0 is not of type 'integer'"),
    (lambda c: c["models"]["resnet18"].pop("record"), "models.resnet18.record", "is missing"),
    (lambda c: c["kernels"]["my_gemm"].update(layers="*.mlp.*"), "kernels.my_gemm.layers",
     "'*.mlp.*' is not of type 'array', 'null'"),  # was "is not valid under any of the given schemas"
    (lambda c: c.pop("datasets"), "datasets", "is missing"),
    (lambda c: c["datasets"].update(cifar={"source": "cifar10", "path": "/no/such/dir"}),
     "datasets.cifar.path", "/no/such/dir does not exist"),
    # A folder that exists but lacks the batches (the archive not extracted there): data preparation failed.
    (lambda c: c["datasets"].update(digits={"source": "cifar10", "path": str(REPO / "config")}), "datasets.digits.path",
     f"no CIFAR-10 python batches under {REPO / 'config'} (cifar-10-batches-py/data_batch_1 is missing)"),
    (lambda c: c["models"]["resnet18_parity"].update(init_from="ghost"), "models.resnet18_parity.init_from", "unknown model"),
    (lambda c: c["models"]["resnet18_parity"].update(init_from="gpt2"), "models.resnet18_parity.init_from",
     "'gpt2' is a gpt2, not a resnet18"),
    # Layers the base lacks failed the job after the base's training; another width loaded nothing.
    (lambda c: c["models"].update(gpt2_deep=c["models"]["gpt2"] | {
        "init_from": "gpt2", "size": {"hidden": 32, "layers": 2, "heads": 2}}),
     "models.gpt2_deep.size", "'layers': 2, 'heads': 2, 'intermediate': 128} is not the size of init_from model 'gpt2'"),
    # The checkpoint's position embeddings were skipped by the load: a fine-tuning from scratch.
    (lambda c: c["datasets"].update(long=c["datasets"]["pydoc"] | {"seq_len": 48}) or c["models"].update(
        gpt2_long=c["models"]["gpt2"] | {"init_from": "gpt2", "dataset": "long"}), "datasets.long.seq_len",
     "48 is not the seq_len of init_from model 'gpt2''s dataset (32), whose gpt2 position embeddings"),
    (lambda c: c["models"]["resnet18"].update(init_from="resnet18_parity"), "models.resnet18.init_from",
     "in a cycle (resnet18 -> resnet18_parity -> resnet18)"),
    (lambda c: c["models"].update(resnet18=c["models"]["resnet18"] | {"init_from": "resnet18_ft"},
                                  resnet18_ft=c["models"]["resnet18_parity"] | {"init_from": "resnet18_parity"}),
     "models.resnet18.init_from", "(resnet18 -> resnet18_ft -> resnet18_parity -> resnet18)"),
    (lambda c: c["models"]["resnet18"].update(checkpoint_epochs=[1, 3]), "models.resnet18.checkpoint_epochs",
     "epoch 3 is past the last epoch (2)"),
    (lambda c: c["models"]["resnet18"]["record"].update(epochs=[5]), "models.resnet18.record.epochs", "epoch 5 is past"),
    # 4 steps per epoch (128 samples, batches of 32): epoch 2 is steps 4-7. The golden job refused it, after data prep.
    (lambda c: c["models"]["resnet18"]["record"].update(epochs=[2], every=8), "models.resnet18.record.every",
     "no step of record.epochs [2] is a multiple of 8 (4 training steps per epoch, from step 0); nothing would be recorded"),
    (lambda c: c["models"]["gpt2"]["optimizer"].update(momentum=0.9), "models.gpt2.optimizer.momentum",
     "adamw takes no momentum"),
    # Error specs the schema's pattern lets through but that do not fit a float32 named no key.
    (lambda c: c["kernels"]["lane_fc"].update(error="bit_flip:signx2"), "kernels.lane_fc.error", "does not fit"),
    (lambda c: c.update(errors=["fp16", "bit_flip:exponentx9"]), "errors.1", "does not fit"),
    # Playback replays recorded layers only: it failed on this one after golden training.
    (lambda c: c["kernels"]["im2col"].update(layers=["layer1.0.conv9"]), "kernels.im2col.layers",
     "'layer1.0.conv9' is not among the layers model 'resnet18' records"),
    # A glob over layers the model has but does not record: playback failed on it after golden training.
    (lambda c: c["kernels"]["my_gemm"].update(layers=["*.attn.*"]), "kernels.my_gemm.layers",
     "'*.attn.*' matches no linear layer model 'gpt2' records (models.gpt2.record.layers: transformer.h.0.ln_1, "
     "transformer.h.0.mlp.c_fc)"),
    # Need the model's layers (peat.models.layer_ops): found only in a job, some after golden training.
    (lambda c: c["models"]["resnet18"]["record"].update(layers=["conv1", "layer1.0.conv9"]),
     "models.resnet18.record.layers", "'layer1.0.conv9' matches no conv/linear/norm layer"),
    (lambda c: c["kernels"]["im2col"].update(layers=["layer9.*"]), "kernels.im2col.layers",
     "'layer9.*' matches no conv/linear/norm layer of model 'resnet18'"),
    (lambda c: c["kernels"]["im2col"].update(layers=["fc"]), "kernels.im2col.layers",
     "'fc' matches no conv2d layer of model 'resnet18', only linear ones (fc)"),
    (lambda c: c["kernels"]["my_gemm"].update(impl="peat.alt_kernels.im2col"), "kernels.my_gemm.op",
     "linear, but peat.alt_kernels.im2col is a conv2d kernel (OP = 'conv2d')"),
    # Need the training set's size (peat.data.sizes): refused only by the drill's ranks or the golden job.
    (lambda c: c["sdc"].update(batch_size=5000), "sdc.batch_size",
     "5000 is not between sdc.world_size (3) and the 1173 training examples of dataset 'pydoc'"),
    (lambda c: c["models"]["gpt2"].update(batch_size=2000, max_train_samples=None), "models.gpt2.batch_size",
     "2000 is more than the 1173 training examples of dataset 'pydoc'"),
    # Names that are path parts: braces stopped Snakemake with a WildcardError, ".." wrote outside results/.
    # The message says what a name may hold, not the schema's regex.
    (lambda c: c["models"].update({"a{b}": c["models"].pop("resnet18_parity")}), "models",
     "'a{b}' is not a name of letters, digits and _ + - . (no leading dot or dash: names are folder names and "
     "command-line arguments)"),
    (lambda c: c["models"].update({"..": c["models"].pop("resnet18_parity")}), "models", "'..' is not a name of"),
    (lambda c: c.update(name=".."), "name", "'..' is not a name of letters"),  # the report went to reports/../
    (lambda c: c["kernels"].update({"my-gemm": c["kernels"].pop("my_gemm")}), "kernels",
     "'my-gemm' is not a kernel name of letters, digits and _"),
    # Failed only in the golden training job, with a KeyError or transformers' ValueError.
    (lambda c: c["models"]["gpt2"].update(dataset="digits"), "models.gpt2.dataset",
     "'digits' is an image dataset; gpt2 needs a text one"),
    (lambda c: c["models"]["gpt2"]["size"].update(heads=3), "models.gpt2.size.heads",
     "3 heads do not divide the hidden size 32"),
    # Heads 3 wide: llama's rotary embedding failed at the first training step (size 3 against 4).
    (lambda c: c["models"].update(llama=c["models"]["gpt2"] | {
        "arch": "llama", "size": {"hidden": 24, "layers": 1, "heads": 8}, "record": {"layers": ["*"]}}),
     "models.llama.size.heads", "8 heads of the hidden size 24 are 3 wide; llama's rotary position embedding"),
    (lambda c: c["models"]["resnet18"].update(max_train_samples=16), "models.resnet18.batch_size",
     "32 is more than max_train_samples (16)"),
    # An empty text failed in data preparation naming 'seq_len'.
    (lambda c: c["datasets"]["pydoc"].update(part=[0.5, 0.2]), "datasets.pydoc.part", "start 0.5 is not below end 0.2"),
    (lambda c: c["datasets"]["pydoc"].update(part=[0.0, 0.01]), "datasets.pydoc.part",
     "[0, 0.01] selects none of the"),
    # Settings the source does not read: the whole corpus was used, the labels stayed the next bytes.
    (lambda c: c["datasets"].update(corpus={"source": "text", "path": str(REPO / "README.md"), "part": [0.0, 0.5]}),
     "datasets.corpus.part", "source text does not read it (part applies to pydoc)"),
    (lambda c: c["datasets"]["pydoc"].update(labels="parity"), "datasets.pydoc.labels",
     "source pydoc does not read it (labels applies to digits, cifar10)"),
    # A drill's fault has no kernel operands to split: the injected rank failed at the injection step.
    (lambda c: c["sdc"].update(faults={"lane_fault": "tile:4:splitk"}), "sdc.faults.lane_fault",
     "'tile:4:splitk': split-K needs a kernel's operands, which a drill's fault does not have"),
    # numpy's global seed takes 32 bits: every training job failed in np.random.seed, naming no key.
    (lambda c: c.update(seed=2**32), "seed", "4294967296 is greater than the maximum of 4294967295"),
    # No fraction and no every-N case: the rfi kernels got no RFI job, and no word.
    (lambda c: c["rfi"].update(fractions=[]), "rfi.fractions",
     "[] and rfi.every [] leave rfi kernel 'lane_fc' no RFI case"),
]


@pytest.mark.parametrize("mutate,key,text", BAD_CONFIGS)
def test_invalid_config_stops_before_any_job_with_one_line(tmp_path, mutate, key, text):
    proc = snakemake(tmp_path, "-n", configfile=write_config(tmp_path, mutate), check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("peat:")]
    assert len(lines) == 1, proc.stderr
    assert f"config key '{key}'" in lines[0] and text in lines[0]
    assert not (tmp_path / "results").exists()


def test_a_key_given_twice_stops_with_one_line(tmp_path):
    """YAML keeps the last of two equal keys: a copied kernel block left unrenamed replaced the first."""
    text = TEST_CONFIG.read_text().replace(
        "kernels:\n", "kernels:\n  im2col: {op: conv2d, impl: peat.alt_kernels.winograd, models: [resnet18]}\n", 1)
    config = tmp_path / "twice.yaml"
    config.write_text(text)
    proc = snakemake(tmp_path, "-n", configfile=config, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("peat:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "config key 'kernels.im2col' is given twice" in lines[0]


@pytest.mark.parametrize("path, content", [
    ("results/detect/resnet18/cpu/im2col.json", '{"verdict": "pass", "error_model": "none"}'),
    # One key in common with the config (a drill's "seed", a playback record's "errors") passed the check.
    ("results/sdc/gpt2/clean.json",
     '{"outcome": "completed", "drill": "clean", "world_size": 3, "detected": false, "seed": 0}'),
])
def test_a_target_after_configfile_is_named_as_not_a_config(tmp_path, path, content):
    """``--configfile`` takes every path after it: an existing target named after it was read as a
    config, and the one line named only its keys ('<top level>': 'verdict' ... unexpected)."""
    target = tmp_path / path
    target.parent.mkdir(parents=True)
    target.write_text(content)
    proc = snakemake(tmp_path, "-n", "--configfile", str(TEST_CONFIG), str(target), configfile=None, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("peat:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"peat: {target}: not a peat config") and "before --configfile" in lines[0]


def test_an_empty_overlay_config_is_still_a_config(tmp_path):
    """It changes nothing (the SLURM test's overlay, say)."""
    empty = tmp_path / "overlay.yaml"
    empty.write_text("{}\n")
    assert snakemake(tmp_path, "-n", "--configfile", str(TEST_CONFIG), str(empty), configfile=None).returncode == 0


def test_reordered_config_keys_rerun_nothing(tmp_path):
    """Snakemake compares params as text: the same dataset spec with its keys in another order
    (or a default written out) reran data preparation, golden training and everything after it."""
    target = "results/data/digits.h5"
    snakemake(tmp_path, target)
    reordered = tmp_path / "reordered.yaml"
    reordered.write_text(TEST_CONFIG.read_text().replace(
        "digits: {source: digits, image_size: 32, val_fraction: 0.2}",
        "digits: {val_fraction: 0.2, seed: 0, image_size: 32, source: digits}"))
    assert "Nothing to be done" in snakemake(tmp_path, "-n", target, configfile=reordered).stdout


def test_an_edited_or_added_text_file_prepares_the_dataset_again(tmp_path):
    """Only the dataset's path (a setting) was tracked: after an edit to the corpus, or a file added
    to its folder, the old prepared text stayed and golden training went on with it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text to learn from. " * 40)
    config = write_config(tmp_path, lambda c: c["datasets"].update(
        corpus={"source": "text", "path": str(corpus), "seq_len": 16}))
    target = "results/data/corpus.h5"
    snakemake(tmp_path, target, configfile=config)
    assert "Nothing to be done" in snakemake(tmp_path, "-n", target, configfile=config).stdout
    (corpus / "b.txt").write_text("more text. " * 40)
    dry = snakemake(tmp_path, "-n", target, configfile=config).stdout
    assert "Nothing to be done" not in dry and str(corpus / "b.txt") in dry  # the reason names the new input


@pytest.mark.parametrize("grant", [["--cores", "1"], ["--set-threads", "golden_train=1"], ["--max-threads", "1"]])
def test_a_job_granted_fewer_cpus_than_its_threads_stops_with_one_line(tmp_path, grant):
    """Jobs ran the config's torch threads whatever Snakemake granted: `--cores 1` capped nothing on a
    shared machine, and a SLURM job lowered with --set-threads used more CPUs than it asked for.
    Fewer threads would round differently under the same config hash, so the run stops instead,
    before any job: the golden job stopped only after data preparation, its line in its log."""
    config = write_config(tmp_path, lambda c: c.update(threads=2))
    proc = snakemake(tmp_path, "results/golden/resnet18/cpu/metrics.csv", *grant, configfile=config, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("peat:")]
    assert proc.returncode != 0 and lines == [
        "peat: config key 'threads': rule golden_train runs 2 torch threads, but Snakemake granted "
        "it 1 CPUs; fewer threads would change its results, so grant 2 (--cores 2 or more, also above this "
        "machine's cores; on SLURM, no --set-threads golden_train=1) or lower 'threads' (reruns everything)"], proc.stderr
    assert not (tmp_path / "results").exists()


def test_touch_runs_no_job_so_it_needs_no_cpus(tmp_path):
    """The check before the first job refused --touch, which runs none, for the CPUs it grants."""
    config = write_config(tmp_path, lambda c: c.update(threads=2))
    (tmp_path / "results/golden/gpt2/cpu/checkpoints").mkdir(parents=True)
    (tmp_path / "results/data").mkdir()
    for name in ("results/data/pydoc.h5", *(f"results/golden/gpt2/cpu/{n}" for n in
                                            ("metrics.csv", "final.h5", "context.h5", "storage.json"))):
        (tmp_path / name).touch()
    proc = snakemake(tmp_path, "--touch", "--cores", "1", "results/golden/gpt2/cpu/final.h5", configfile=config,
                     check=False)
    assert proc.returncode == 0 and "peat:" not in proc.stderr, proc.stderr[-2000:]


def test_jobs_ask_for_the_cpus_they_use(tmp_path):
    """It asked for sdc.world_size CPUs, one per rank, while each rank runs the config's threads:
    with threads: 2 a SLURM job got half the CPUs its ranks used."""
    config = write_config(tmp_path, lambda c: c.update(threads=2))
    dry = snakemake(tmp_path, "-n", "--cores", "64", "results/sdc/gpt2/clean.json", configfile=config).stdout
    job = dry[dry.index("rule sdc_drill:"):]
    assert re.search(r"^    threads: (\d+)$", job, re.M).group(1) == "6"  # 3 ranks (the default) x 2
    # The detector benchmark replays on one thread: it held the config's CPUs idle.
    dry = snakemake(tmp_path, "-n", "--cores", "64", "detector_benchmark", configfile=config).stdout
    job = dry[dry.index("rule detector_benchmark:"):].split("\n[")[0]
    assert "resources:" in job and "threads:" not in job  # Snakemake lists threads above 1 only


def test_a_fine_tuned_models_config_hash_names_its_base():
    """The hash stamped on a model's results (checkpoints, contexts, provenance) left out init_from's
    base: resnet18_parity's results from two configs whose resnet18 differed carried one hash."""
    from peat.config import config_hash, model_hash

    config = yaml.safe_load(TEST_CONFIG.read_text())
    before = {m: model_hash(config, m) for m in config["models"]}
    config["models"]["resnet18"]["optimizer"]["lr"] = 0.5
    after = {m: model_hash(config, m) for m in config["models"]}
    assert [m for m in before if before[m] != after[m]] == ["resnet18", "resnet18_parity"]
    # A model without a base keeps the hash it had: its results are not trained again.
    spec = config["models"]["gpt2"]
    assert after["gpt2"] == config_hash({"model": spec, "dataset": config["datasets"][spec["dataset"]],
                                         "seed": config["seed"], "threads": config["threads"]})


def test_model_and_dataset_names_with_regex_characters(tmp_path):
    """Names went into the wildcard constraints as regular expressions: a model "gpt2+ln" or a
    dataset "py+doc" matched no path and the dry run died with MissingInputException."""
    def rename(cfg):
        cfg["datasets"]["py+doc"] = cfg["datasets"].pop("pydoc")
        cfg["models"]["gpt2+ln"] = cfg["models"].pop("gpt2") | {"dataset": "py+doc"}
        for spec in cfg["kernels"].values():
            spec["models"] = [{"gpt2": "gpt2+ln"}.get(m, m) for m in spec.get("models") or []] or None
        for section in ("alter", "sdc"):
            cfg[section]["models"] = ["gpt2+ln"]
    dry = snakemake(tmp_path, "-n", configfile=write_config(tmp_path, rename)).stdout
    assert "results/golden/gpt2+ln/cpu/context.h5" in dry and "results/data/py+doc.h5" in dry


def test_a_tiny_rfi_fraction_has_its_job(tmp_path):
    """Below 1e-4 the case name is f5e-05, which the case wildcard did not match: the dry run
    died with MissingInputException instead of planning the runtime-FI training."""
    dry = snakemake(tmp_path, "-n", configfile=write_config(tmp_path, lambda c: c["rfi"].update(fractions=[0.00005])))
    assert "results/rfi/resnet18/cpu/lane_fc/f5e-05/outcome.json" in dry.stdout

# -- data ----------------------------------------------------------------------------------

def test_cifar10_folder_is_checked_by_its_file_names_before_any_job(tmp_path):
    spec = {"source": "cifar10", "path": str(tmp_path), "val_fraction": 0.1}
    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    for name in data.CIFAR10_FILES[:-1]:
        (batches / name).write_bytes(b"")  # not read: sizes() only counts
    with pytest.raises(PeatError) as err:
        data.sizes("cifar", spec)
    assert str(err.value) == (f"config key 'datasets.cifar.path': no CIFAR-10 python batches under {tmp_path} "
                              "(cifar-10-batches-py/batches.meta is missing)")
    (batches / "batches.meta").write_bytes(b"")
    assert data.sizes("cifar", spec) == (54000, 6000)
    # The batches' own folder given, as unpacking the archive names it: 'cifar-10-batches-py/data_batch_1
    # is missing' under a folder holding data_batch_1 said nothing of the folder above.
    with pytest.raises(PeatError) as err:
        data.sizes("cifar", dict(spec, path=str(batches)))
    assert str(err.value) == (f"config key 'datasets.cifar.path': {batches} holds the CIFAR-10 batches themselves; "
                              f"give the folder above it, {tmp_path}")
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(b"")
    with pytest.raises(PeatError) as err:
        data.sizes("cifar", dict(spec, path=str(archive)))
    assert str(err.value) == (f"config key 'datasets.cifar.path': {archive} is a file; give the folder holding "
                              "cifar-10-batches-py/ (where cifar-10-python.tar.gz is unpacked)")
    # Every file there but damaged: preparing it said there were no batches at all.
    with pytest.raises(PeatError) as err:
        data.prepare("cifar", dict(spec, image_size=32), tmp_path / "cifar.h5")
    assert str(err.value) == (f"config key 'datasets.cifar.path': {batches / 'data_batch_1'} fails CIFAR-10's "
                              "checksum (damaged, or not the python version of the batches)")
    assert not (tmp_path / "cifar.h5").exists()


def test_an_empty_text_corpus_is_named_by_its_path(tmp_path):
    """It said 'seq_len: 64 leaves fewer than 2 sequences in the text's 0 bytes': no seq_len helps."""
    (tmp_path / "a.txt").write_bytes(b"")
    for path, what in ((tmp_path, f"the 1 .txt file(s) under {tmp_path} are"), (tmp_path / "a.txt", f"{tmp_path / 'a.txt'} is")):
        with pytest.raises(PeatError) as err:
            data.sizes("corpus", {"source": "text", "path": str(path), "seq_len": 64, "val_fraction": 0.1})
        assert str(err.value) == f"config key 'datasets.corpus.path': {what} empty"


def test_digits_and_pydoc_prepare_offline_and_split_deterministically(tmp_path):
    data.prepare("digits", {"source": "digits", "image_size": 32, "val_fraction": 0.2}, tmp_path / "d.h5")
    ds = data.load(tmp_path / "d.h5")
    assert ds.kind == "image" and ds.attrs["num_classes"] == 10
    assert ds.train.x.shape == (1438, 3, 32, 32) and ds.val.x.shape == (359, 3, 32, 32)
    data.prepare("pydoc", {"source": "pydoc", "seq_len": 32, "val_fraction": 0.1, "part": [0, 0.1]}, tmp_path / "t.h5")
    text = data.load(tmp_path / "t.h5")
    assert text.kind == "text" and text.train.x.shape[1] == 32
    assert torch.equal(text.train.x[:, 1:], text.train.y[:, :-1])  # next-byte targets
    data.prepare("pydoc", {"source": "pydoc", "seq_len": 32, "val_fraction": 0.1, "part": [0, 0.1]}, tmp_path / "t2.h5")
    assert torch.equal(data.load(tmp_path / "t2.h5").val.x, text.val.x)


def test_text_is_stored_one_byte_per_token_and_widened_per_batch(tmp_path):
    """x and y were int64 copies of the text, 16 bytes per byte of it in the file and in memory: a
    1-2 GB corpus ran preparation out of memory. Tokens are now uint8, as stored, and the loss of a
    batch, widened to int64 there, is the int64 tokens' loss; a file of int64 tokens still loads."""
    text = np.random.default_rng(0).integers(0, 256, 16 * 40 + 5, dtype=np.uint8).tobytes()  # every byte value
    (tmp_path / "t.txt").write_bytes(text)
    data.prepare("corpus", {"source": "text", "path": str(tmp_path / "t.txt"), "seq_len": 16, "val_fraction": 0.25},
                 tmp_path / "t.h5")
    with h5py.File(tmp_path / "t.h5") as f:
        stored = {key: (f[key].dtype, f[key].size) for key in ("train/x", "train/y", "val/x", "val/y")}
    assert stored == {"train/x": (np.uint8, 30 * 16), "train/y": (np.uint8, 30 * 16),
                      "val/x": (np.uint8, 10 * 16), "val/y": (np.uint8, 10 * 16)}
    ds = data.load(tmp_path / "t.h5")
    assert ds.train.x.dtype == ds.train.y.dtype == torch.uint8
    # Every sequence of the text, with its next-byte targets, in one split or the other.
    expected = {text[i * 16:(i + 1) * 16]: text[i * 16 + 1:(i + 1) * 16 + 1] for i in range(40)}
    loaded = {bytes(x.tolist()): bytes(y.tolist()) for s in (ds.train, ds.val) for x, y in zip(s.x, s.y)}
    assert loaded == expected
    with h5py.File(tmp_path / "int64.h5", "w") as old, h5py.File(tmp_path / "t.h5") as new:  # as written before
        old.attrs.update(new.attrs)
        for key in stored:
            old[key] = new[key][()].astype(np.int64)
    wide = data.load(tmp_path / "int64.h5")
    assert wide.train.x.dtype == torch.int64 and torch.equal(wide.train.x, ds.train.x.long())
    model = models.build({"arch": "gpt2", "size": {"hidden": 16, "layers": 1, "heads": 2}}, ds.attrs, seed=0)
    losses = [models.loss_and_metrics(model, "text", s.train.x[:4], s.train.y[:4])[0] for s in (ds, wide)]
    assert torch.equal(losses[0], losses[1])


def test_hdf5_open_errors_keep_hdf5s_short_reason(tmp_path):
    # The reason in parentheses was cut off: 'not a readable HDF5 file (Unable to synchronously create
    # file)' for a file another handle (a Profiler left open) still held, opened for writing.
    from peat.io import open_h5

    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(PeatError) as err:
        open_h5(tmp_path / "text.h5")
    assert str(err.value) == f"{tmp_path / 'text.h5'}: not a readable HDF5 file (Unable to synchronously open file: " \
                             "file signature not found)"
    with open_h5(tmp_path / "held.h5", "w"), pytest.raises(PeatError) as err:
        open_h5(tmp_path / "held.h5", "w")
    assert str(err.value) == (f"{tmp_path / 'held.h5'}: cannot create this HDF5 file (Unable to synchronously create "
                              "file: unable to truncate a file which is already open)")
    with pytest.raises(PeatError) as err:  # HDF5's detail here is a dump of flags: only its cause is kept
        open_h5(tmp_path / "no" / "x.h5", "w")
    assert str(err.value) == (f"{tmp_path / 'no' / 'x.h5'}: cannot create this HDF5 file ([Errno 2] Unable to "
                              "synchronously create file: No such file or directory)")
    # A folder given for a file said '[Errno 21] Unable to synchronously open file', naming no cause.
    (tmp_path / "no").mkdir()
    for mode, what in (("r", "not a readable HDF5 file ([Errno 21] Unable to synchronously open file"),
                       ("w", "cannot create this HDF5 file ([Errno 21] Unable to synchronously create file")):
        with pytest.raises(PeatError) as err:
            open_h5(tmp_path / "no", mode)
        assert str(err.value) == f"{tmp_path / 'no'}: {what}: Is a directory)"


def test_truncated_or_foreign_hdf5_fails_naming_the_file(tmp_path):
    data.prepare("digits", {"source": "digits", "image_size": 32, "val_fraction": 0.2}, tmp_path / "d.h5")
    blob = (tmp_path / "d.h5").read_bytes()
    (tmp_path / "cut.h5").write_bytes(blob[: len(blob) // 3])
    with pytest.raises(PeatError, match=r"cut\.h5: not a readable HDF5 file"):
        data.load(tmp_path / "cut.h5")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(PeatError, match=r"other\.h5: not a peat dataset"):
        data.load(tmp_path / "other.h5")
    (tmp_path / "short.txt").write_text("too short for two sequences")
    with pytest.raises(PeatError, match=r"config key 'datasets\.tiny\.seq_len': 16 leaves fewer than 2 sequences"):
        data.prepare("tiny", {"source": "text", "path": str(tmp_path / "short.txt"), "seq_len": 16, "val_fraction": 0.1},
                     tmp_path / "t.h5")
    assert not (tmp_path / "t.h5").exists()


def test_missing_gpu_vendor_fails_with_one_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(PeatError, match=r"vendor 'nvidia': no CUDA GPU visible .* run this job on a node with an NVIDIA GPU"):
        for_vendor("nvidia")


# -- golden training -------------------------------------------------------------------------

def h5_datasets(path: Path) -> dict[str, np.ndarray]:
    items = {}
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: items.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return items


def assert_bit_identical(a: Path, b: Path, skip=("history",)):
    da, db = h5_datasets(a), h5_datasets(b)
    assert da.keys() == db.keys()
    for name in da:
        if name not in skip:
            assert da[name].tobytes() == db[name].tobytes(), name


def test_golden_training_is_bit_identical(golden_twice):
    a, b = golden_twice
    for name in ("final.h5", "context.h5", "checkpoints/epoch001.h5", "checkpoints/epoch002.h5"):
        assert_bit_identical(a / name, b / name)
    ma, mb = (np.genfromtxt(p / "metrics.csv", delimiter=",", names=True) for p in (a, b))
    assert np.array_equal(ma["loss"], mb["loss"]) and np.array_equal(ma["accuracy"], mb["accuracy"])
    assert not (a / ".partial").exists()


def test_context_holds_the_promised_tensors(golden_twice):
    path = golden_twice[0] / "context.h5"
    with h5py.File(path) as f:
        assert f.attrs["model"] == "resnet18" and f.attrs["config_hash"] == "abc"
        assert f.attrs["torch_version"] == str(torch.__version__) and f.attrs["vendor"] == "cpu"
        assert sorted(f["layers"]) == ["bn1", "conv1", "fc", "layer1.0.conv2"]
        assert [f["layers/conv1"].attrs[k] for k in ("op", "groups")] == ["conv2d", 1]
        assert list(f["layers/conv1"].attrs["stride"]) == [2, 2]
        assert f["layers/bn1"].attrs["op"] == "batch_norm" and f["layers/fc"].attrs["op"] == "linear"
        steps = sorted(f["layers/fc"])
        assert steps == ["0000000", "0000002", "0000004", "0000006"]  # every: 2, 8 steps
        summaries = f["summaries"][()]
        assert set(summaries["step"]) == set(range(8))
        assert np.all(summaries["nonfinite"] == 0)
        # record.derived is off: the golden outputs are not stored, read_layer derives them
        assert not f.attrs["derived"] and set(f["layers/bn1/0000002"]) == {"A", "W", "B", "dO", "running_mean",
                                                                           "running_var"}
        assert not f["layers/conv1/0000002"].attrs["input_grad"] and f["layers/fc/0000002"].attrs["input_grad"]
        # ReLU zeros in bn1's output gradient make it worth compressing; a weight never is
        assert f["layers/bn1/0000002/dO"].compression == "lzf" and f["layers/conv1/0000002/W"].compression is None
    attrs, samples = read_layer(path, "conv1")
    s = samples[1]
    assert s["step"] == 2 and s["epoch"] == 1
    assert set(s) >= {"A", "W", "O", "dO", "dW"} and "dA" not in s  # the first conv's input needs no grad
    # The recorded output is exactly what the golden op gives on the recorded inputs.
    out = torch.nn.functional.conv2d(s["A"], s["W"], None, stride=2, padding=3)
    assert torch.equal(out, s["O"])
    grad_w = torch.nn.grad.conv2d_weight(s["A"], s["W"].shape, s["dO"], stride=2, padding=3)
    torch.testing.assert_close(grad_w, s["dW"], rtol=1e-4, atol=1e-5)
    _, fc = read_layer(path, "fc")
    assert torch.equal(fc[0]["dA"], fc[0]["dO"] @ fc[0]["W"])
    _, bn = read_layer(path, "bn1")
    assert {"running_mean", "running_var", "dA", "dB"} <= set(bn[0])
    with pytest.raises(PeatError, match=r"layer 'fc' has no recorded step 3 \(recorded: 0, 2, 4, 6\)$"):
        read_layer(path, "fc", [2, 3])  # was h5py's bare KeyError
    assert torch.equal(bn[0]["dB"], bn[0]["dO"].sum((0, 2, 3)))


def tiny_training(tmp_path: Path, record: bool, derived: bool = False) -> dict:
    """Three SGD steps of a conv/bn/linear/ln network, recorded every step; the final weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 24),
                                torch.nn.LayerNorm(24), torch.nn.ReLU(), torch.nn.Linear(24, 5))
    prof = Profiler(tmp_path / "context.h5", ["*"], every=1, meta={"vendor": "cpu"}, derived=derived) if record else None
    if prof:
        prof.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        if prof:
            prof.begin_step(step, 1)
        opt.zero_grad(set_to_none=True)
        x, y = torch.randn(16, 3, 6, 6, generator=g), torch.randint(0, 5, (16,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if prof:
            prof.end_step()
        opt.step()
    if prof:
        prof.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_recording_leaves_training_bit_identical_and_derived_outputs_match_the_stored_ones(tmp_path):
    plain = tiny_training(tmp_path / "plain", record=False)
    (tmp_path / "lean").mkdir()
    (tmp_path / "full").mkdir()
    lean, full = tiny_training(tmp_path / "lean", True), tiny_training(tmp_path / "full", True, derived=True)
    for weights in (lean, full):
        assert weights.keys() == plain.keys() and all(torch.equal(weights[k], plain[k]) for k in plain)
    lean_ctx, full_ctx = tmp_path / "lean" / "context.h5", tmp_path / "full" / "context.h5"
    stored = h5_datasets(full_ctx)
    assert set(h5_datasets(lean_ctx)) == {k for k in stored if k.rpartition("/")[2] not in DERIVED}
    with h5py.File(full_ctx) as f:
        layers = list(f["layers"])
    assert layers == ["0", "1", "3", "5", "6", "8"]
    for layer in layers:
        attrs, derived = read_layer(lean_ctx, layer)
        _, recorded = read_layer(full_ctx, layer)
        for d, r in zip(derived, recorded):
            assert set(d) == set(r)
            assert torch.equal(d["O"], r["O"]), layer  # forward outputs: bit for bit
            for key in DERIVED[1:]:  # autograd may sum in another order than the golden kernel
                if key in r:
                    torch.testing.assert_close(d[key], r[key], rtol=1e-5, atol=1e-7)
    # Summaries are the same whether or not the golden outputs are stored.
    assert stored["summaries"].tobytes() == h5_datasets(lean_ctx)["summaries"].tobytes()
    assert read_layer(lean_ctx, "0", derive=False)[1][0].keys().isdisjoint(DERIVED)


class GatedMLP(torch.nn.Module):
    """Two layers fed the same tensor (llama's gate_proj and up_proj), a third fed their product."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = torch.nn.Linear(6, 8), torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.down(torch.relu(self.gate(x)) * self.up(x))


def test_layers_fed_the_same_input_share_one_stored_copy(tmp_path):
    torch.manual_seed(0)
    model = GatedMLP()
    prof = Profiler(tmp_path / "context.h5", ["*"], every=1, meta={"vendor": "cpu"})
    prof.attach(model)
    for step in range(2):
        prof.begin_step(step, 1)
        model.zero_grad(set_to_none=True)
        model(torch.randn(5, 6)).square().sum().backward()
        prof.end_step()
    prof.close()
    with h5py.File(tmp_path / "context.h5") as f:
        for step in ("0000000", "0000001"):
            assert f[f"layers/gate/{step}/A"] == f[f"layers/up/{step}/A"]  # one dataset, two names
            assert f[f"layers/gate/{step}/A"] != f[f"layers/down/{step}/A"]
            assert f[f"layers/gate/{step}/dO"] != f[f"layers/up/{step}/dO"]
    up, gate = read_layer(tmp_path / "context.h5", "up")[1], read_layer(tmp_path / "context.h5", "gate")[1]
    assert torch.equal(up[1]["A"], gate[1]["A"]) and not torch.equal(up[0]["A"], up[1]["A"])


def profile_gated(path: Path, steps: int, first: int = 0, killed_at: int | None = None) -> Profiler:
    """GatedMLP's steps ``first``.. ``steps - 1`` recorded as training records them: two steps an
    epoch, a snapshot after each epoch but the last; ``killed_at``: stopped there, unclosed."""
    torch.manual_seed(0)
    model = GatedMLP()
    prof = Profiler(path, ["*"], every=1, meta={"vendor": "cpu"})
    prof.attach(model, first_step=first, resuming=first > 0)
    for step in range(first, steps):
        if step == killed_at:
            return prof
        prof.begin_step(step, step // 2 + 1)
        model.zero_grad(set_to_none=True)
        model(torch.randn(5, 6, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        prof.end_step()
        if step % 2 == 1 and step < steps - 1:
            prof.snapshot()
    prof.close()
    return prof


@pytest.mark.parametrize("held", [profiler.SUMMARY_ROWS_HELD, 5])
@pytest.mark.parametrize("resume_at", [4, 2])
def test_snapshots_hold_their_own_epochs_and_rebuild_a_killed_runs_context(tmp_path, monkeypatch, resume_at, held):
    """A snapshot copied the whole context so far, every epoch (quadratic in the epochs). Each now
    holds only the steps since the last; a resumed run rebuilds the context from them, whatever
    state the killed run left its open file in, and ends with the uninterrupted run's bytes
    (a resume point before the last snapshot: killed between it and the checkpoint; summary rows
    written every step, as a large model's are, ``held`` 5)."""
    monkeypatch.setattr(profiler, "SUMMARY_ROWS_HELD", held)
    profile_gated(tmp_path / "whole" / "context.h5", 6)
    killed = profile_gated(tmp_path / "resumed" / "context.h5", 6, killed_at=5)
    shards = killed.partial.with_name("context.snapshots")
    assert sorted(p.name for p in shards.iterdir()) == ["0000000.h5", "0000002.h5"]
    for shard, steps in (("0000000.h5", [0, 1]), ("0000002.h5", [2, 3])):
        with h5py.File(shards / shard) as f:
            assert [int(k) for k in f["layers/gate"]] == [int(k) for k in f["layers/down"]] == steps
            assert sorted(set(f["summaries"]["step"])) == steps
            assert f[f"layers/gate/{steps[0]:07d}/A"] == f[f"layers/up/{steps[0]:07d}/A"]  # still one dataset
    killed.file.close()  # the process dies; what it had open is garbage
    killed.partial.write_bytes(b"not an HDF5 file")
    profile_gated(tmp_path / "resumed" / "context.h5", 6, first=resume_at)
    assert_bit_identical(tmp_path / "whole" / "context.h5", tmp_path / "resumed" / "context.h5")
    # The same bytes, as README promises (HDF5's object copy laid the restored steps out otherwise).
    assert (tmp_path / "whole" / "context.h5").read_bytes() == (tmp_path / "resumed" / "context.h5").read_bytes()
    with h5py.File(tmp_path / "resumed" / "context.h5") as f:
        assert all(f[f"layers/gate/{s:07d}/A"] == f[f"layers/up/{s:07d}/A"] for s in range(6))
        assert f.attrs["naive_bytes_per_step"] > 0


def test_a_resume_without_the_snapshots_before_it_is_one_line(tmp_path):
    """A context missing the steps before the resume point would look complete."""
    killed = profile_gated(tmp_path / "context.h5", 6, killed_at=5)
    killed.file.close()
    (killed.partial.with_name("context.snapshots") / "0000000.h5").unlink()
    with pytest.raises(PeatError, match=r"context.snapshots: the Profiler's snapshots hold the steps before 0, "
                                        r"not every step before the resume point 4; delete .*\.partial"):
        profile_gated(tmp_path / "context.h5", 6, first=4)
    assert not killed.partial.exists()


def test_convs_padded_by_name_replay_and_other_paddings_are_not_taken_for_conv2d(tmp_path):
    """padding='same' was stored as the letters ['s', 'a', 'm', 'e'] (replay crashed); a
    reflect-padded conv was replayed with zero padding, a wrong golden output."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding="same"), torch.nn.Conv2d(4, 4, 3, padding="valid"),
                                torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),
                                torch.nn.Conv2d(4, 4, 2, padding="same"))
    prof = record_one_step(tmp_path / "context.h5", model, ["*"], torch.randn(2, 3, 7, 7), derived=True)
    assert list(prof.targets) == ["0", "1"]
    for layer, padding in (("0", [1, 1]), ("1", [0, 0])):
        attrs, [recorded] = read_layer(tmp_path / "context.h5", layer)
        assert attrs["padding"] == padding
        assert torch.equal(derive_outputs(recorded, attrs)["O"], recorded["O"])


def test_reading_a_layer_that_did_not_run_at_a_recorded_step(tmp_path):
    """nn.MultiheadAttention never calls its out_proj module: its samples hold W and B only, and
    read_layer, deriving the golden outputs from a missing input, raised a TypeError."""
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    with pytest.warns(UserWarning, match=r"^Profiler: layer\(s\) self_attn\.out_proj never ran"):
        record_one_step(tmp_path / "context.h5", model, ["self_attn.out_proj", "linear1"], torch.randn(3, 5, 8))
    _, [idle] = read_layer(tmp_path / "context.h5", "self_attn.out_proj")
    assert "A" not in idle and "O" not in idle and idle["W"].shape == (8, 8)
    _, [ran] = read_layer(tmp_path / "context.h5", "linear1")
    assert ran["O"].shape == (3, 5, 16)


def test_a_tied_layer_stores_its_own_weight_gradient(tmp_path):
    """GPT-2's lm_head shares its weight with wte: with derived outputs (every GPU context), the
    stored dW was the tied parameter's .grad, embedding gradient included, not the layer's."""
    model = models.build({"arch": "gpt2", "size": {"hidden": 16, "layers": 1, "heads": 2}},
                         {"vocab_size": 40, "seq_len": 8}, seed=0)
    prof = Profiler(tmp_path / "context.h5", ["lm_head", "transformer.h.0.mlp.c_fc"], every=1, derived=True)
    prof.attach(model)
    ids = torch.randint(40, (4, 8), generator=torch.Generator().manual_seed(0))
    prof.begin_step(0, 1)
    logits = model(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, 40), ids.reshape(-1)).backward()
    prof.end_step()
    prof.close()
    attrs, [sample] = read_layer(tmp_path / "context.h5", "lm_head", derive=False)
    assert torch.equal(sample["dW"], derive_outputs(sample, attrs)["dW"])
    assert not torch.equal(sample["dW"], model.lm_head.weight.grad)
    attrs, [sample] = read_layer(tmp_path / "context.h5", "transformer.h.0.mlp.c_fc", derive=False)
    assert torch.equal(sample["dW"], model.transformer.h[0].mlp.c_fc.weight.grad.t())  # untied: autograd's own


def test_layers_without_an_output_gradient_record_their_forward(tmp_path):
    """A frozen first layer (its output needs no gradient) and a head whose output misses the loss
    have no dO: registering the gradient hook raised, and deriving dW from None raised."""
    from peat import kernels

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(16, 2))
    aux = torch.nn.Linear(16, 3)
    model.add_module("aux", aux)
    model[0].requires_grad_(False)
    prof = Profiler(tmp_path / "context.h5", ["0", "2", "aux"], every=1)
    prof.attach(model)
    prof.begin_step(0, 1)
    x = torch.randn(2, 3, 4, 4)
    hidden = model[1](model[0](x))
    aux(hidden)  # computed, but not part of the loss
    model[2](hidden).sum().backward()
    prof.end_step()
    prof.close()
    for name in ("0", "aux"):
        attrs, [sample] = read_layer(tmp_path / "context.h5", name)
        assert "dO" not in sample and "dW" not in sample and "O" in sample
        assert [c for c in kernels.COMPUTATIONS if kernels.applies(c, sample)] == ["forward"]
    _, [conv] = read_layer(tmp_path / "context.h5", "0")
    assert torch.equal(conv["O"], model[0](x))
    _, [head] = read_layer(tmp_path / "context.h5", "2")
    assert torch.equal(head["dW"], model[2].weight.grad)


@pytest.mark.parametrize("derived", [False, True])
def test_a_module_called_twice_in_a_step_records_its_first_call(tmp_path, derived):
    """A from the second call and dO from the first (backward runs in reverse) made a sample
    no kernel could reproduce; the stored dW summed both calls."""
    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential()
    model.fc = fc
    prof = Profiler(tmp_path / "context.h5", ["fc"], every=1, derived=derived)
    prof.attach(model)
    prof.begin_step(0, 1)
    x = torch.randn(3, 4)
    first = fc(x)
    fc(torch.tanh(first)).square().sum().backward()
    prof.end_step()
    prof.close()
    attrs, [sample] = read_layer(tmp_path / "context.h5", "fc")
    assert torch.equal(sample["A"], x) and torch.equal(sample["O"], first)
    assert torch.allclose(sample["dW"], sample["dO"].t() @ x, rtol=1e-6, atol=1e-7)
    assert torch.allclose(sample["dB"], sample["dO"].sum(0), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(sample["dW"], fc.weight.grad)
    # Its summary describes the same call (it described the last one), as for a layer not recorded.
    with h5py.File(tmp_path / "context.h5") as f:
        [row] = f["summaries"][f["summaries"]["tensor"] == b"act"]
    assert (row["min"], row["max"]) == (first.min().item(), first.max().item())


def test_a_training_forward_between_steps_leaves_no_summary_in_the_next_step(tmp_path):
    """A training-mode forward after end_step (a user's accuracy check) put its layers' summaries
    into the next step's rows, where that step did not call them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.a, model.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    prof = Profiler(tmp_path / "context.h5", ["a"], every=1)
    prof.attach(model)
    for step in range(2):
        prof.begin_step(step, 1)
        model.a(torch.randn(3, 4)).sum().backward()
        prof.end_step()
        model(torch.randn(3, 4))  # b is called only here
    prof.close()
    with h5py.File(tmp_path / "context.h5") as f:
        rows = f["summaries"][f["summaries"]["tensor"] == b"act"]
    assert list(zip(rows["step"], rows["layer"])) == [(0, b"a"), (1, b"a")]


@pytest.mark.parametrize("derived", [False, True])
def test_a_step_with_several_backward_passes_records_their_summed_output_gradient(tmp_path, derived):
    """Two losses, each with its own backward (retain_graph=True): dO held the last one's gradient
    alone, while the layer's gradient (and its weight's .grad, stored as dW) summed both."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.fc = torch.nn.Linear(4, 3)
    prof = Profiler(tmp_path / "context.h5", ["fc"], every=1, derived=derived)
    prof.attach(model)
    prof.begin_step(0, 1)
    x = torch.randn(5, 4)
    out = model(x)
    out.retain_grad()
    out.square().sum().backward(retain_graph=True)
    out.sum().backward()
    prof.end_step()
    prof.close()
    _, [sample] = read_layer(tmp_path / "context.h5", "fc")
    assert torch.equal(sample["dO"], out.grad)
    torch.testing.assert_close(sample["dW"], model.fc.weight.grad, rtol=1e-6, atol=1e-7)


def test_gradients_accumulated_over_steps_leave_each_stored_weight_gradient_its_steps_own(tmp_path):
    """Gradient accumulation (an optimizer step every few steps): a derived context stored .grad as
    the second step's dW and dB, the sum of both steps' gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    prof = Profiler(tmp_path / "context.h5", ["0"], every=1, derived=True)
    prof.attach(model)
    for step in range(3):
        prof.begin_step(step, 1)
        if step == 2:  # as peat's training zeroes them, after begin_step
            model.zero_grad(set_to_none=True)
        model(torch.randn(5, 4)).square().sum().backward()
        prof.end_step()
    prof.close()
    attrs, samples = read_layer(tmp_path / "context.h5", "0", derive=False)
    for sample in samples:
        derived = derive_outputs(sample, attrs)
        for key in ("dW", "dB"):
            torch.testing.assert_close(sample[key], derived[key], rtol=1e-5, atol=1e-6)
    assert torch.equal(samples[2]["dW"], model[0].weight.grad)  # a step's own .grad is still autograd's


def test_a_batch_norm_in_eval_mode_without_running_statistics_records_batch_statistics(tmp_path):
    """A frozen batch norm (eval mode during training) that tracks no running statistics
    normalises with the batch's, as in training mode: it was recorded as training=False, and
    read_layer and playback raised "running_mean must be defined in evaluation mode"."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, track_running_stats=False))
    model[1].eval()
    record_one_step(tmp_path / "context.h5", model, ["1"], torch.randn(4, 3, 6, 6), derived=True)
    attrs, [sample] = read_layer(tmp_path / "context.h5", "1", derive=False)
    assert sample["training"] and "running_mean" not in sample
    derived = derive_outputs(sample, attrs)
    assert torch.equal(derived["O"], sample["O"])
    torch.testing.assert_close(derived["dA"], sample["dA"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("precision", ["autocast", "double"])
def test_a_layer_not_computed_in_float32_is_refused_naming_it(tmp_path, precision):
    """Under torch.autocast a conv computed in bfloat16: the context (dtype float32) held its
    bfloat16 output and replayed it against float32 golden, differing by 1e-2 with no word."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 2))
    prof = Profiler(tmp_path / "context.h5", ["0", "2"], every=1)
    if precision == "double":
        with pytest.raises(PeatError, match=r"^Profiler: layer '0' has torch.float64 weights; "
                                            r"the context records float32 layers only$"):
            prof.attach(model.double())
        assert not model[0]._forward_hooks
        return
    prof.attach(model)
    prof.begin_step(0, 1)
    with pytest.raises(PeatError, match=r"^Profiler: layer '0' computed in torch.bfloat16 \(under torch.autocast\?\); "
                                        r"the context records float32 layers only$"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 3, 6, 6))


class KeywordCalls(torch.nn.Module):
    """Layers called with their input as a keyword argument, as some model code does."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.b(input=torch.relu(self.norm(input=self.a(input=x))))


@pytest.mark.parametrize("derived", [False, True])
def test_layers_called_with_a_keyword_input_are_recorded(tmp_path, derived):
    """The forward hook read the input as the first positional argument: IndexError mid-training."""
    torch.manual_seed(0)
    model = KeywordCalls()
    prof = Profiler(tmp_path / "context.h5", ["*"], every=1, derived=derived)
    prof.attach(model)
    prof.begin_step(0, 1)
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    prof.end_step()
    prof.close()
    attrs, [a] = read_layer(tmp_path / "context.h5", "a")
    assert torch.equal(a["A"], x) and not a["input_grad"] and torch.equal(a["dW"], model.a.weight.grad)
    attrs, [b] = read_layer(tmp_path / "context.h5", "b", derive=False)
    assert b["input_grad"] and ("dA" in b) == derived
    if derived:
        torch.testing.assert_close(derive_outputs(b, attrs)["dA"], b["dA"], rtol=1e-6, atol=1e-7)


def test_an_unbatched_conv_input_is_refused_naming_the_layer(tmp_path):
    """nn.Conv2d takes a (C, H, W) input as a batch of one: it was recorded as is, and deriving
    its weight gradient raised "Expected 4-dimensional input" in read_layer and playback."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    prof = Profiler(tmp_path / "context.h5", ["0"], every=1)
    prof.attach(model)
    prof.begin_step(0, 1)
    with pytest.raises(PeatError, match=r"^Profiler: layer '0' got an input of shape \(3, 6, 6\); "
                                        r"a conv2d layer is recorded on batched \(N, C, H, W\) inputs$"):
        model(torch.randn(3, 6, 6))


class Checkpointed(torch.nn.Module):
    """A block under a reentrant activation checkpoint: its first forward runs without autograd,
    and again with it during the backward."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.norm = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        block = (lambda t: self.bn(self.norm(self.mid(torch.relu(t)))))
        return torch.utils.checkpoint.checkpoint(block, self.inp(x), use_reentrant=True)


@pytest.mark.parametrize("derived", [False, True])
def test_a_call_without_gradient_gives_way_to_a_later_one_with_it(tmp_path, derived):
    """The first call of a layer in a reentrant checkpoint (or under no_grad) has no output gradient:
    recorded alone, the layer's backward was silently left out of the context. A training batch norm
    keeps its first call: the later one saw the running statistics it updated."""
    torch.manual_seed(0)
    model = Checkpointed()
    record_one_step(tmp_path / "context.h5", model, ["mid", "norm", "bn"], torch.randn(5, 6), derived=derived)
    for name in ("mid", "norm"):
        attrs, [sample] = read_layer(tmp_path / "context.h5", name)
        assert "dO" in sample and sample["input_grad"] and "dA" in sample, name
        torch.testing.assert_close(sample["dW"], getattr(model, name).weight.grad, rtol=1e-5, atol=1e-7)
        if derived:
            torch.testing.assert_close(derive_outputs(sample, attrs)["dA"], sample["dA"], rtol=1e-5, atol=1e-7)
    _, [bn] = read_layer(tmp_path / "context.h5", "bn")
    assert "dO" not in bn and "O" in bn


def test_a_spectral_normed_layer_is_recorded_without_changing_training(tmp_path):
    """spectral_norm computes its weight at each access, with a power iteration in training mode:
    the Profiler's own reads (summaries, the weight at begin_step) changed training, and the recorded
    weight was one iteration behind the one the forward used (O differed by 4e-6)."""
    def train(record: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        torch.nn.utils.parametrizations.spectral_norm(model[2])
        prof = Profiler(tmp_path / "context.h5", ["2"], every=1, derived=True) if record else None
        if prof:
            prof.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(0)
        for step in range(3):
            if prof:
                prof.begin_step(step, 1)
            opt.zero_grad()
            model(torch.randn(4, 6, generator=g)).square().sum().backward()
            if prof:
                prof.end_step()
            opt.step()
        if prof:
            prof.close()
        return model.state_dict()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading .grad of the computed weight warned
        plain, recorded = train(False), train(True)
    assert all(torch.equal(plain[k], recorded[k]) for k in plain)
    attrs, samples = read_layer(tmp_path / "context.h5", "2", derive=False)
    for sample in samples:
        derived = derive_outputs(sample, attrs)
        assert torch.equal(derived["O"], sample["O"]), sample["step"]
        assert torch.equal(derived["dW"], sample["dW"])  # the computed weight's: it has no .grad


def test_a_frozen_layer_inside_the_network_stores_the_weight_gradients_read_layer_derives(tmp_path):
    """Its parameters have no .grad: a derived context held no dW, dB where one recorded without
    derived outputs gave them (read_layer derives them from A and dO)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
    model[2].requires_grad_(False)
    record_one_step(tmp_path / "context.h5", model, ["2"], torch.randn(3, 4), derived=True)
    attrs, [sample] = read_layer(tmp_path / "context.h5", "2", derive=False)
    derived = derive_outputs(sample, attrs)
    assert set(derived) == {"O", "dA", "dW", "dB"} and all(torch.equal(derived[k], sample[k]) for k in derived)


class WithEmptyLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.empty = torch.nn.Linear(4, 2), torch.nn.Linear(4, 0)  # width 0: a fully pruned head

    def forward(self, x):
        return self.fc(x) + self.empty(x).sum()


def test_summary_rows_are_written_as_they_add_up_not_held_until_the_epoch_ends(tmp_path, monkeypatch):
    """Three rows per layer and step: a long epoch's were all held in memory until its end."""
    monkeypatch.setattr(profiler, "SUMMARY_ROWS_HELD", 4, raising=False)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))  # 6 rows a step: each step written
    prof = Profiler(tmp_path / "context.h5", ["0"], every=1)
    prof.attach(model)
    for step in range(3):
        prof.begin_step(step, 1)
        model(torch.randn(5, 4)).square().sum().backward()
        prof.end_step()
        assert not prof._rows and prof.file["summaries"].shape == (6 * (step + 1),)
    prof.close()
    with h5py.File(tmp_path / "context.h5") as f:
        assert list(f["summaries"]["step"]) == [0] * 6 + [1] * 6 + [2] * 6


def test_a_layer_of_width_zero_is_summarised_as_nan_and_refused_for_recording(tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: initialising a zero-element tensor is a no-op
        model = WithEmptyLayer()
    record_one_step(tmp_path / "context.h5", model, ["fc"], torch.randn(3, 4))
    with h5py.File(tmp_path / "context.h5") as f:
        rows = f["summaries"][f["summaries"]["layer"] == b"empty"]
    assert len(rows) == 3 and all(np.isnan(rows[s]).all() for s in ("mean", "std", "min", "max", "absmax"))
    assert (rows["nonfinite"] == 0).all()
    with pytest.raises(PeatError, match=r"^config key 'record.layers': layer 'empty' has a weight of shape \(0, 4\)"):
        Profiler(tmp_path / "other.h5", ["*"]).attach(model)
    assert not list(tmp_path.rglob("other*"))


def test_summaries_name_layers_whose_names_are_longer_than_128_bytes(tmp_path):
    """The summaries' layer column held 128 bytes: a longer name was cut, matching no layer (the
    analyzer's correlations dropped it), and a cut inside a UTF-8 character did not decode."""
    from peat import analyze

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    names = ["x" + "ä" * 70, "b" * 130, "fc"]  # 141 and 130 bytes
    for name, width in zip(names, (4, 3, 3)):
        model.add_module(name, torch.nn.Linear(width, 3))
    record_one_step(tmp_path / "context.h5", model, ["*"], torch.randn(5, 4))
    assert set(analyze.summaries(tmp_path / "context.h5")["layer"]) == set(names)


def test_profiler_refuses_layers_as_a_string_and_every_below_one(tmp_path):
    # A string was taken one glob per character ('fc' -> 'f', 'c'), naming a glob the user never
    # wrote; every=0 passed, then the first begin_step divided by zero.
    from peat import kernels

    model = torch.nn.Sequential()
    model.fc = torch.nn.Linear(4, 2)
    with pytest.raises(PeatError, match=r"^config key 'record.layers': expected a list of globs, "
                                        r"got the string 'fc' \(write \['fc'\]\)$"):
        Profiler(tmp_path / "context.h5", "fc").attach(model)
    with pytest.raises(PeatError, match=r"^config key 'kernels.layers': expected a list of globs, got the string 'fc'"):
        kernels.route(model, kernels.golden("linear"), "fc")
    for every in (0, -2, 1.5, True):
        with pytest.raises(PeatError, match=rf"^Profiler: every={every!r}: record every N-th step needs an integer N >= 1$"):
            Profiler(tmp_path / "context.h5", ["fc"], every=every)
    assert not list(tmp_path.iterdir())
    Profiler(tmp_path / "context.h5", ["fc"], every=np.int64(20)).attach(model)  # any integer type


def test_profiler_refuses_epochs_that_are_no_list_of_epoch_numbers(tmp_path):
    """epochs=2 (for [2]) failed at attach in "TypeError: 'int' object is not iterable", a string at the
    first step ("'in <string>' requires string as left operand"), [0] recorded nothing without a word."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    for epochs, reason in ((2, "expected a list of epoch numbers, or None for every epoch"),
                           ("2", "expected a list of epoch numbers, or None for every epoch"),
                           ([1, 0], "epoch=0: epochs are integers from 1, as training counts them"),
                           ([1.5], "epoch=1.5: epochs are integers from 1, as training counts them")):
        with pytest.raises(PeatError, match=rf"^Profiler: epochs={re.escape(repr(epochs))}: {reason}$"):
            Profiler(tmp_path / "context.h5", ["0"], epochs=epochs)
    assert not list(tmp_path.iterdir())
    prof = Profiler(tmp_path / "context.h5", ["0"], epochs=(2, np.int64(3)))  # any iterable of integers
    prof.attach(model)
    assert prof.epochs == [2, 3] and not prof.want(0, 1) and prof.want(0, 3)
    prof.abandon()


def test_meta_that_is_no_hdf5_attribute_fails_naming_its_key_and_leaves_nothing(tmp_path):
    # It raised h5py's TypeError naming no key, with the file left open and the hooks attached:
    # the next Profiler on that path could not create the file.
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with pytest.raises(PeatError) as err:
        Profiler(tmp_path / "context.h5", ["0"], meta={"model": "mine", "optimizer": {"lr": 0.1}}).attach(model)
    assert str(err.value) == ("Profiler: meta['optimizer'] = {'lr': 0.1} cannot be an HDF5 attribute (Object dtype "
                              "dtype('O') has no native HDF5 equivalent); give a string, a number or a list of them")
    assert not list(tmp_path.iterdir()) and not model[0]._forward_hooks
    prof = Profiler(tmp_path / "context.h5", ["0"], meta={"model": "mine", "lr": 0.1, "tags": ["a", "b"]})
    prof.attach(model)
    prof.close()
    with h5py.File(tmp_path / "context.h5") as f:
        assert f.attrs["model"] == "mine" and f.attrs["lr"] == 0.1 and list(f.attrs["tags"]) == ["a", "b"]


def test_a_glob_matching_no_layer_says_which_convs_are_not_recordable(tmp_path):
    # It ended "layers are e.g. " with nothing after it, and a conv padded unevenly ('same' with an
    # even kernel) or by reflection looked absent.
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 2, padding="same"), torch.nn.ReLU())
    with pytest.raises(PeatError) as err:
        Profiler(tmp_path / "context.h5", ["0"]).attach(model)
    assert str(err.value) == ("config key 'record.layers': '0' matches no conv/linear/norm layer; there are none "
                              "(not recordable: 0: Conv2d padded unevenly or not with zeros)")
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"), torch.nn.Linear(3, 3))
    with pytest.raises(PeatError) as err:
        Profiler(tmp_path / "context.h5", ["conv*"]).attach(model)
    assert str(err.value) == ("config key 'record.layers': 'conv*' matches no conv/linear/norm layer; layers are e.g. 1 "
                              "(not recordable: 0: Conv2d padded unevenly or not with zeros)")
    with pytest.raises(PeatError) as err:
        Profiler(tmp_path / "context.h5", ["conv*"]).attach(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    assert str(err.value) == "config key 'record.layers': 'conv*' matches no conv/linear/norm layer; layers are e.g. 0"


def test_a_step_numbered_again_is_refused_at_its_begin_naming_it(tmp_path):
    """Steps counted per epoch (enumerate(loader) in each epoch) failed an epoch later, at the
    repeated step's end, in h5py's 'Unable to synchronously create group (name already exists)'."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    prof = Profiler(tmp_path / "context.h5", ["*"], every=1)
    prof.attach(model)
    for step in range(2):
        prof.begin_step(step, 1)
        model(torch.randn(2, 4)).sum().backward()
        prof.end_step()
    with pytest.raises(PeatError, match=r"^Profiler: step 0 \(epoch 2\) is not after the last step, 1; number the "
                                        r"steps across epochs \(one counter for the whole training\)$"):
        prof.begin_step(0, 2)
    prof.begin_step(2, 2)  # the next step is taken, and recorded
    model(torch.randn(2, 4)).sum().backward()
    prof.end_step()
    prof.close()
    assert profiler.recorded_steps(tmp_path / "context.h5", "0") == [0, 1, 2]


def test_profiler_calls_out_of_order_are_refused_in_one_line(tmp_path):
    """begin_step before attach (the README's loop with attach forgotten), end_step without its
    begin_step, or a step after close ended in an AttributeError about the Profiler's internals,
    or in h5py's errors on a closed file."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    prof = Profiler(tmp_path / "context.h5", ["0"], every=1)
    for call, run in (("begin_step", lambda: prof.begin_step(0, 1)), ("end_step", prof.end_step),
                      ("snapshot", prof.snapshot), ("flush", prof.flush), ("close", prof.close)):
        with pytest.raises(PeatError) as err:
            run()
        assert str(err.value) == f"Profiler: {call} before attach(model); attach the model first"
    prof.abandon()  # nothing to abandon: as after an attach that was refused
    prof.attach(model)
    with pytest.raises(PeatError) as err:
        prof.end_step()
    assert str(err.value) == "Profiler: end_step without its begin_step; call begin_step(step, epoch) first"
    with pytest.raises(PeatError) as err:
        prof.attach(model)
    assert str(err.value) == "Profiler: attach, but it is attached already; one Profiler records one model"
    prof.begin_step(0, 1)
    model(torch.randn(2, 4)).sum().backward()
    for call, run in (("close", prof.close), ("snapshot", prof.snapshot)):
        with pytest.raises(PeatError) as err:
            run()
        assert str(err.value) == (f"Profiler: {call} while step 0 is begun; call end_step first "
                                  "(or abandon, to stop as after an interruption)")
    prof.end_step()
    with pytest.raises(PeatError) as err:
        prof.end_step()
    assert str(err.value) == "Profiler: end_step without its begin_step; call begin_step(step, epoch) first"
    prof.close()
    for call, run in (("begin_step", lambda: prof.begin_step(1, 1)), ("close", prof.close),
                      ("attach", lambda: prof.attach(model))):
        with pytest.raises(PeatError) as err:
            run()
        assert str(err.value) == f"Profiler: {call} after close; a closed Profiler records no more (make a new one)"
    prof.abandon()  # closed already: nothing left to abandon
    assert profiler.recorded_steps(tmp_path / "context.h5", "0") == [0] and not model[0]._forward_hooks


def test_profiler_arguments_it_cannot_use_are_one_line_before_training(tmp_path):
    """From a user's own loop: layers=None or a list of numbers, meta given as a list, steps as
    text ended in TypeError or AttributeError tracebacks; a step of 0.5 or epoch '1' passed (the
    latter recorded nothing under epochs=[1]); a meta key the Profiler writes itself ('every') was
    overwritten without a word; a directory as the path failed at close, after the training."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    path = tmp_path / "context.h5"
    for layers in (None, [0], ["0", None]):
        with pytest.raises(PeatError) as err:
            Profiler(path, layers).attach(model)
        assert str(err.value) == f"config key 'record.layers': expected a list of globs (strings), got {layers!r}"
    with pytest.raises(PeatError) as err:
        Profiler(path, ["0"], meta=["mine"])
    assert str(err.value) == "Profiler: meta=['mine']: expected a dict of attribute names and values"
    with pytest.raises(PeatError) as err:
        Profiler(path, ["0"], meta={"model": "mine", "every": 99})
    assert str(err.value) == ("Profiler: meta['every'] is an attribute the Profiler writes itself "
                              "(dtype, every, record_epochs, derived, layers, steps, naive_bytes_per_step); "
                              "name it otherwise")
    path.mkdir()
    with pytest.raises(PeatError) as err:
        Profiler(path, ["0"]).attach(model)
    assert str(err.value) == f"Profiler: {path} is a directory; give the path of the context file to write"
    path.rmdir()
    assert not list(tmp_path.iterdir()) and not model[0]._forward_hooks
    prof = Profiler(path, ["0"], every=1, epochs=[1])
    prof.attach(model)
    for step, epoch, problem in ((0.5, 1, "step=0.5: steps are integers from 0, one counter for the whole training"),
                                 ("0", 1, "step='0': steps are integers from 0, one counter for the whole training"),
                                 (0, "1", "epoch='1': epochs are integers from 1, as training counts them"),
                                 (0, 0, "epoch=0: epochs are integers from 1, as training counts them"),
                                 (True, 1, "step=True: steps are integers from 0, one counter for the whole training")):
        with pytest.raises(PeatError) as err:
            prof.begin_step(step, epoch)
        assert str(err.value) == f"Profiler: {problem}"
    prof.begin_step(np.int64(0), torch.tensor(1))  # any integer type
    model(torch.randn(2, 4)).sum().backward()
    prof.end_step()
    prof.close()
    assert read_layer(path, "0")[1][0]["epoch"] == 1 and profiler.recorded_steps(path, "0") == [0]


def test_steps_past_ten_million_are_read_and_resumed_in_order(tmp_path):
    """Step groups and snapshots are named by 7-digit steps, sorted as text: past step 9,999,999
    (a long run, or one counting micro-batches) read_layer returned step 10,000,000 first, and a
    resumed run found its snapshots out of order and refused to resume."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    path = tmp_path / "context.h5"
    first = 9_999_998
    prof = Profiler(path, ["0"], every=1)
    prof.attach(model, first_step=first)
    for step in range(first, first + 4):
        prof.begin_step(step, 1)
        model(torch.randn(2, 4)).sum().backward()
        prof.end_step()
        if step % 2:
            prof.snapshot()
    prof.abandon()
    prof = Profiler(path, ["0"], every=1)
    prof.attach(model, first_step=first + 4, resuming=True)
    prof.begin_step(first + 4, 2)
    model(torch.randn(2, 4)).sum().backward()
    prof.end_step()
    prof.close()
    steps = list(range(first, first + 5))
    assert [sample["step"] for sample in read_layer(path, "0")[1]] == steps
    assert profiler.recorded_steps(path, "0") == steps


def test_a_lazy_layer_not_yet_run_is_refused_at_attach_naming_it(tmp_path):
    # nn.LazyLinear before its first forward: attach ended in torch's ValueError about an
    # uninitialized parameter, naming no layer.
    model = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.Linear(3, 2))
    with pytest.raises(PeatError) as err:
        Profiler(tmp_path / "context.h5", ["*"]).attach(model)
    assert str(err.value) == ("config key 'record.layers': layer '0' has an uninitialized (lazy) weight; "
                              "run the model on a batch first, which shapes it")
    assert not list(tmp_path.iterdir())
    model(torch.randn(2, 5))  # initialized: recorded
    record_one_step(tmp_path / "context.h5", model, ["*"], torch.randn(2, 5))
    assert read_layer(tmp_path / "context.h5", "0")[1][0]["W"].shape == (3, 5)


def test_a_chosen_layer_that_never_ran_is_named_at_close(tmp_path):
    """nn.MultiheadAttention computes with its out_proj's weights without calling out_proj: chosen
    from a user's transformer, it was recorded with its weights only, playback replayed none of it,
    and the kernel's verdict passed without a word about the layer."""
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    with pytest.warns(UserWarning) as caught:
        record_one_step(tmp_path / "context.h5", model, ["self_attn.out_proj", "linear1"], torch.randn(2, 3, 8))
    assert [str(w.message) for w in caught] == [
        "Profiler: layer(s) self_attn.out_proj never ran at a recorded step (a module whose weights its parent "
        "uses without calling it, as nn.MultiheadAttention's out_proj, or a branch not taken): the context holds "
        "their weights only, and playback replays none of them"]
    assert json.loads((tmp_path / "storage.json").read_text())["layers_not_run"] == ["self_attn.out_proj"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record_one_step(tmp_path / "linear1" / "context.h5", model, ["linear1"], torch.randn(2, 3, 8))
    assert json.loads((tmp_path / "linear1" / "storage.json").read_text())["layers_not_run"] == []


def test_a_step_begun_again_before_its_end_leaves_no_hook_behind(tmp_path):
    # The first begin_step's input hooks (derived=True) stayed on the module for good: each later
    # forward, the Profiler's or not, ran them.
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    prof = Profiler(tmp_path / "context.h5", ["0"], every=1, derived=True)
    prof.attach(model)
    prof.begin_step(0, 1)  # a batch skipped after its begin
    prof.begin_step(1, 1)
    model(torch.randn(2, 4)).sum().backward()
    prof.end_step()
    assert not model[0]._forward_pre_hooks
    prof.close()
    assert profiler.recorded_steps(tmp_path / "context.h5", "0") == [1]


@pytest.mark.parametrize("keys", [["a/b"], ["x", "x/y"]])
def test_a_layer_named_with_a_slash_is_refused_at_attach(tmp_path, keys):
    """A module name with '/' (a ModuleDict key) became a nested HDF5 group: 'x' and 'x/y' mixed
    their steps, and reading or resuming them failed with errors naming no layer."""
    model = torch.nn.Module()
    model.d = torch.nn.ModuleDict({key: torch.nn.Linear(4, 4) for key in keys})
    prof = Profiler(tmp_path / "context.h5", ["*"], every=1)
    with pytest.raises(PeatError) as err:
        prof.attach(model)
    assert str(err.value) == (f"config key 'record.layers': layer 'd.{keys[-1]}' has '/' in its name, which the "
                              "context (HDF5) reads as a path; rename the module or leave it out of the globs")
    assert not list(tmp_path.iterdir()) and not model.d[keys[-1]]._forward_hooks
    if "x" in keys:  # the layer named without one is recorded
        prof = Profiler(tmp_path / "context.h5", ["d.x"], every=1)
        prof.attach(model)
        prof.begin_step(0, 1)
        model.d.x(torch.randn(2, 4)).sum().backward()
        prof.end_step()
        prof.close()
        assert profiler.recorded_steps(tmp_path / "context.h5", "d.x") == [0]


def test_closed_profiler_leaves_no_empty_partial_folder(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    prof = Profiler(tmp_path / "context.h5", ["0"], every=1)
    prof.attach(model)
    prof.begin_step(0, 1)
    model(torch.randn(3, 4)).sum().backward()
    prof.end_step()
    prof.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["context.h5", "storage.json"]
    kept = tmp_path / "kept"  # training keeps its own state in .partial: the folder stays
    (kept / ".partial").mkdir(parents=True)
    (kept / ".partial" / "resume.h5").touch()
    prof = Profiler(kept / "context.h5", ["0"], every=1)
    prof.attach(model)
    prof.close()
    assert sorted(p.name for p in (kept / ".partial").iterdir()) == ["resume.h5"]


def test_a_forward_between_steps_is_not_recorded(tmp_path):
    """A forward in training mode after a recorded step's end_step (the batch accuracy after the
    update) raised KeyError: the Profiler still thought it was recording."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    prof = Profiler(tmp_path / "context.h5", ["0"], every=1)
    prof.attach(model)
    for step in range(2):
        x = torch.randn(3, 4)
        prof.begin_step(step, 1)
        model(x).square().sum().backward()
        prof.end_step()
        with torch.no_grad():
            model(x)
    prof.close()
    _, samples = read_layer(tmp_path / "context.h5", "0")
    assert [s["step"] for s in samples] == [0, 1]


_G = torch.Generator().manual_seed(0)
SPECIAL = {
    "randn": torch.randn(10_007, generator=_G),
    "offset": torch.randn(5000, generator=_G) * 1e-3 + 100.0,  # |mean| >> std
    "relu": torch.relu(torch.randn(64, 8, 5, 5, generator=_G)),
    "one": torch.tensor([2.5]),
    "nan": torch.tensor([1.0, float("nan"), 3.0]),
    "inf": torch.tensor([1.0, float("-inf"), float("inf")]),
    "strided": torch.randn(40, 30, generator=_G).t(),
    # float32 squares of these deviations underflow to 0 (or overflow): std was 0 (or inf)
    "tiny": torch.randn(1000, generator=_G) * 1e-25,
    "tiny3": torch.tensor([1e-25, 3e-25, -2e-25]),
    "subnormal": torch.randn(1000, generator=_G) * 1e-40,
    "huge": torch.randn(1000, generator=_G) * 1e25,
}


@pytest.mark.parametrize("name", list(SPECIAL))
def test_one_pass_summary_statistics_agree_with_torch(name):
    t = SPECIAL[name]
    got, want = np.asarray(tensor_stats.stats(t), dtype=np.float64), tensor_stats.stats_torch(t).double().numpy()
    # torch's float32 norm is itself off by a few 1e-6 (the float64 check below holds the C loop to 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    d = t.double()
    if torch.isfinite(d).all() and d.numel() > 1:
        # float lanes summed within blocks: about 1e-6 of the spread, like torch's float32 sum
        exact = [d.mean().item(), d.std().item()]
        np.testing.assert_allclose(got[:2], exact, rtol=1e-6, atol=1e-6 * exact[1])
        # the torch ops' std: float32 (subnormal below 2^-126) from a float32 mean (off by 2e-5 of
        # the std when |mean| >> std, as in 'offset')
        assert want[1] == pytest.approx(exact[1], rel=5e-5, abs=2.0 ** -149)
    assert got[5] == (~torch.isfinite(t)).sum().item()


def test_summary_statistics_of_finite_values_near_the_float32_maximum_are_finite():
    """A diverging layer's finite outputs near 3e38: their float32 sum overflowed, so the torch
    fallback (non-contiguous tensors such as channels-last activations, no compiler, or the C loop
    whose float deviations overflowed) summarised them as mean NaN, std NaN, none non-finite."""
    near_max = torch.tensor([3e38, -3e38] * 16)
    channels_last = (torch.randn(4, 8, 6, 6, generator=torch.Generator().manual_seed(0)) * 1e37 + 2e38) \
        .contiguous(memory_format=torch.channels_last)
    for t in (near_max, channels_last, channels_last.contiguous()):
        d = t.double()
        for row in (tensor_stats.stats(t), tensor_stats.stats_torch(t)):
            row = np.asarray(row, dtype=np.float64)
            np.testing.assert_allclose(row[:2], [d.mean().item(), d.std().item()], rtol=1e-6, atol=1e-6 * d.std().item())
            assert row[5] == 0


def test_summary_statistics_of_infinities_warn_nothing():
    """numpy's 'invalid value encountered in scalar subtract' at every layer holding -inf first (or
    +inf and -inf): a RuntimeWarning, and under -W error a golden run that ended in it."""
    for t in (torch.tensor([float("-inf"), float("inf")] * 10), torch.tensor([float("inf"), 1.0] * 10)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            row = np.asarray(tensor_stats.stats(t), dtype=np.float64)
        assert row[5] == (~torch.isfinite(t)).sum().item() and row[4] == math.inf


def test_summary_statistics_of_an_empty_tensor_are_nan_with_none_bad():
    row = np.asarray(tensor_stats.stats(torch.zeros(0, 8)), dtype=np.float64)
    assert np.isnan(row[:5]).all() and row[5] == 0


def assert_gpu_row(got: torch.Tensor, name: str) -> None:
    """A GPU row of ``SPECIAL[name]`` is the CPU's: min, max, absmax and the non-finite count
    exactly, mean and std to float32 rounding of the exact ones (float64 moments)."""
    got = got.cpu().double().numpy()
    want = np.asarray(tensor_stats.stats(SPECIAL[name]), dtype=np.float64)
    np.testing.assert_array_equal(got[2:], want[2:], err_msg=name)
    d = SPECIAL[name].double()
    exact = [d.mean().item(), d.std().item() if d.numel() > 1 else 0.0]
    np.testing.assert_allclose(got[:2], exact if torch.isfinite(d).all() else want[:2], rtol=2.0 ** -23,
                               atol=2.0 ** -149, equal_nan=True, err_msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [tensor_stats.CHUNK, 100])
def test_summary_statistics_of_many_tensors_on_a_gpu_in_one_batch_are_each_ones(device, chunk, monkeypatch):
    """The GPU's statistics read no value (that would wait for the step's queued work): torch
    code that runs on CPU tensors too. Chunks of 100 split most tensors, with a shorter last one."""
    monkeypatch.setattr(tensor_stats, "CHUNK", chunk)
    names = list(SPECIAL)
    rows = tensor_stats._stats_batch([SPECIAL[n].to(device) for n in names])
    assert rows.shape == (len(names), 6) and rows.device.type == device
    for name, row in zip(names, rows):
        assert_gpu_row(row, name)
        if device == "cuda":  # one tensor alone: a batch of one
            assert torch.equal(tensor_stats.stats(SPECIAL[name].to(device)), row)
    with_empty = tensor_stats._stats_batch([torch.zeros(0, device=device), SPECIAL["one"].to(device)])
    assert with_empty[0, :5].isnan().all() and with_empty[0, 5] == 0
    assert_gpu_row(with_empty[1], "one")
    # The Profiler's entry point: per tensor on a CPU (the C loop), batched on a GPU.
    many = tensor_stats.stats_many([SPECIAL["randn"].to(device), torch.zeros(0, device=device)])
    assert len(many) == 2 and torch.as_tensor(many[1])[:5].isnan().all()
    assert tensor_stats.stats_many([]) == []


@needs_gpu
@pytest.mark.parametrize("batch", [tensor_stats.BATCH_ELEMENTS, 100])
def test_profiler_summaries_on_a_gpu_are_the_cpus(tmp_path, monkeypatch, batch):
    """On a GPU the outputs are copied aside and summarised in batches (at the end of the step, or
    when the copies pass BATCH_ELEMENTS): the CPU's rows, in its order. The batch norm's output is
    changed in place by the ReLU after it, so a summary of the output itself would see no negative."""
    monkeypatch.setattr(profiler, "BATCH_ELEMENTS", batch)
    monkeypatch.setattr(tensor_stats, "BATCH_ELEMENTS", batch)

    def summaries(device: str) -> np.ndarray:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                    torch.nn.ReLU(inplace=True), torch.nn.Flatten(), torch.nn.Linear(288, 4)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        prof = Profiler(tmp_path / device / "context.h5", ["0"], every=1)
        prof.attach(model)
        inputs = torch.randn(3, 5, 3, 6, 6, generator=torch.Generator().manual_seed(1))
        for step, x in enumerate(inputs):
            prof.begin_step(step, 1)
            model(x.to(device)).square().sum().backward()
            prof.end_step()
            opt.step()
            opt.zero_grad()
        prof.close()
        with h5py.File(tmp_path / device / "context.h5") as f:
            return f["summaries"][:]

    cpu, gpu = summaries("cpu"), summaries("cuda")
    assert gpu[["step", "layer", "tensor"]].tolist() == cpu[["step", "layer", "tensor"]].tolist()
    assert (gpu[(gpu["layer"] == b"1") & (gpu["tensor"] == b"act")]["min"] < 0).all()
    for stat in profiler.SUMMARY_STATS:
        np.testing.assert_allclose(gpu[stat], cpu[stat], rtol=1e-4, atol=1e-6, err_msg=stat)


def test_summary_statistics_fall_back_to_torch_without_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(tensor_stats, "_LIB", [])
    assert not tensor_stats.compiled()
    row = tensor_stats.stats(SPECIAL["randn"])
    assert torch.is_tensor(row) and torch.equal(row, tensor_stats.stats_torch(SPECIAL["randn"]))


def test_storage_accounting(golden_twice):
    import json

    info = json.loads((golden_twice[0] / "storage.json").read_text())
    assert info["context_bytes"] == (golden_twice[0] / "context.h5").stat().st_size
    assert info["steps"] == 8 and info["naive_bytes"] == 8 * info["naive_bytes_per_step"]
    assert 0 < info["ratio"] < 1


def test_resume_after_sigkill_matches_uninterrupted_run(digits, golden_twice, tmp_path):
    """Kill training after its first epoch; rerunning resumes from there and ends bit-identical."""
    script = (
        "import sys, yaml; from peat.train import train_model; "
        f"spec = yaml.safe_load(open({str(TEST_CONFIG)!r}))['models']['resnet18']; "
        f"train_model('resnet18', spec, {str(digits)!r}, sys.argv[1], seed=0, threads=1, config_hash='abc')"
    )
    cmd = [sys.executable, "-c", script, str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (tmp_path / ".partial" / "resume.h5").exists() and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "final.h5").exists() and not (tmp_path / "context.h5").exists()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for name in ("final.h5", "context.h5", "checkpoints/epoch001.h5", "checkpoints/epoch002.h5"):
        assert_bit_identical(golden_twice[0] / name, tmp_path / name)


def test_a_run_interrupted_in_this_process_resumes_here(digits, golden_twice, tmp_path):
    """Ctrl-C in a notebook leaves the process alive: its Profiler kept the context open, and the
    rerun could not create it anew (HDF5 refuses a file that is open)."""
    from peat.train import train_model

    def die(step, epoch):
        if epoch == 2:
            raise KeyboardInterrupt("Ctrl-C")

    with pytest.raises(KeyboardInterrupt):
        train_model("resnet18", SPEC, digits, tmp_path, seed=0, threads=1, config_hash="abc", progress=False,
                    before_step=die)
    train_model("resnet18", SPEC, digits, tmp_path, seed=0, threads=1, config_hash="abc", progress=False)
    for name in ("final.h5", "context.h5"):
        assert_bit_identical(golden_twice[0] / name, tmp_path / name)


def test_a_run_interrupted_saving_its_final_checkpoint_resumes_in_this_process(tmp_path, monkeypatch):
    """Ctrl-C (or a full disk) while the final checkpoint was written left the Profiler's file open:
    the rerun failed with 'unable to truncate a file which is already open'."""
    from peat.train import Run, fit

    g = torch.Generator().manual_seed(0)

    def split(n):
        return data.Split(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g))

    ds = data.Dataset("image", split(16), split(4), {})
    run = Run(epochs=2, batch_size=8, optimizer={"name": "sgd", "lr": 0.1})

    def train(out):
        torch.manual_seed(0)
        return fit(torch.nn.Sequential(torch.nn.Linear(4, 3)), ds, run, out, progress=False,
                   profiler=Profiler(out / "context.h5", ["*"], every=1))

    save = checkpoint.save

    def interrupted(path, *args, **kwargs):
        if Path(path).name == "final.h5":
            raise KeyboardInterrupt("Ctrl-C")
        save(path, *args, **kwargs)

    train(tmp_path / "whole")
    monkeypatch.setattr(checkpoint, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "resumed")
    monkeypatch.setattr(checkpoint, "save", save)
    train(tmp_path / "resumed")
    for name in ("final.h5", "context.h5"):
        assert_bit_identical(tmp_path / "whole" / name, tmp_path / "resumed" / name)


def test_a_killed_run_without_a_resume_point_publishes_none_of_its_checkpoints(tmp_path, monkeypatch):
    """A run killed before its first resume point (here in its one epoch's final save) left its epoch
    checkpoint in .partial: the next run, of an edited config, started afresh and published that
    stale file (config_hash 'old') in checkpoints/ beside its own."""
    from peat.train import Run, fit

    g = torch.Generator().manual_seed(0)
    ds = data.Dataset("image", *(data.Split(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g))
                                 for n in (16, 4)), {})
    save = checkpoint.save

    def interrupted(path, *args, **kwargs):
        if Path(path).name == "final.h5":
            raise KeyboardInterrupt("killed")
        save(path, *args, **kwargs)

    def train(lr, checkpoint_epochs, config_hash):
        run = Run(epochs=1, batch_size=8, optimizer={"name": "sgd", "lr": lr}, checkpoint_epochs=checkpoint_epochs,
                  meta={"config_hash": config_hash})
        fit(torch.nn.Linear(4, 3), ds, run, tmp_path, progress=False)

    monkeypatch.setattr(checkpoint, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(0.1, [1], "old")
    assert (tmp_path / ".partial" / "epoch001.h5").exists()
    monkeypatch.setattr(checkpoint, "save", save)
    train(0.5, [], "new")
    assert list((tmp_path / "checkpoints").iterdir()) == []
    assert not (tmp_path / ".partial").exists()


def test_a_recorded_run_started_from_a_checkpoint_resumes_its_context(tmp_path):
    """fit's ``start``: the context begins at the checkpoint's step, so did its first snapshot; a
    resumed run looked for one from step 0 and refused to resume ('hold the steps before 0')."""
    from peat.train import Run, fit

    g = torch.Generator().manual_seed(0)
    ds = data.Dataset("image", *(data.Split(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g))
                                 for n in (16, 4)), {})

    def train(out, epochs, start=None, before_step=None):
        torch.manual_seed(0)
        run = Run(epochs=epochs, batch_size=8, optimizer={"name": "sgd", "lr": 0.1}, checkpoint_epochs=[1])
        return fit(torch.nn.Sequential(torch.nn.Linear(4, 3)), ds, run, out, progress=False, start=start,
                   before_step=before_step, profiler=Profiler(out / "context.h5", ["*"], every=1))

    def die(step, epoch):
        if epoch == 3:
            raise KeyboardInterrupt("killed")

    train(tmp_path / "base", 1)
    start = tmp_path / "base" / "checkpoints" / "epoch001.h5"
    train(tmp_path / "whole", 3, start=start)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "resumed", 3, start=start, before_step=die)
    train(tmp_path / "resumed", 3, start=start)
    assert_bit_identical(tmp_path / "whole" / "context.h5", tmp_path / "resumed" / "context.h5")
    assert profiler.recorded_steps(tmp_path / "resumed" / "context.h5", "0") == [2, 3, 4, 5]


def test_a_resumed_recorded_training_writes_the_uninterrupted_runs_bytes(tmp_path):
    """README: a resumed golden run produces the same bytes. The restored steps held their datasets
    open for a whole snapshot where training holds a step's: HDF5 laid the next ones out elsewhere."""
    from peat.train import Run, fit

    g = torch.Generator().manual_seed(0)
    ds = data.Dataset("image", *(data.Split(torch.randn(n, 3, 12, 12, generator=g), torch.randint(3, (n,), generator=g))
                                 for n in (40, 8)), {})

    def train(out, before_step=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, stride=2),
                                    torch.nn.Flatten(), torch.nn.Linear(8 * 5 * 5, 3))
        run = Run(epochs=3, batch_size=8, optimizer={"name": "sgd", "lr": 0.1})
        fit(model, ds, run, out, progress=False, before_step=before_step,
            profiler=Profiler(out / "context.h5", ["*"], every=1))

    def die(step, epoch):
        if epoch == 3 and step == 12:
            raise KeyboardInterrupt("killed")

    train(tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "resumed", before_step=die)
    train(tmp_path / "resumed")
    assert (tmp_path / "whole" / "context.h5").read_bytes() == (tmp_path / "resumed" / "context.h5").read_bytes()


def test_resume_of_a_model_with_dropout_matches_uninterrupted_run(digits, tmp_path):
    """The generator's state is not in the checkpoint: a resumed mobilenet_v2 (dropout before its
    classifier) drew other masks than the uninterrupted run and ended with other weights."""
    from peat.train import Run, fit

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 16), torch.nn.Dropout(0.5),
                                   torch.nn.Linear(16, 10))

    def die(step, epoch):
        if epoch == 2:
            raise KeyboardInterrupt("killed")

    ds = data.load(digits)
    run = Run(epochs=2, batch_size=32, optimizer={"name": "sgd", "lr": 0.05}, max_train_samples=64,
              max_val_samples=32)
    fit(build(), ds, run, tmp_path / "whole", progress=False)
    with pytest.raises(KeyboardInterrupt):
        fit(build(), ds, run, tmp_path / "resumed", progress=False, before_step=die)
    fit(build(), ds, run, tmp_path / "resumed", progress=False)
    assert_bit_identical(tmp_path / "whole" / "final.h5", tmp_path / "resumed" / "final.h5")

    # A resume point left by a run of other settings (an edited config) is discarded, not resumed.
    edited = dataclasses.replace(run, optimizer={"name": "sgd", "lr": 0.5}, meta={"config_hash": "edited"})
    with pytest.raises(KeyboardInterrupt):
        fit(build(), ds, edited, tmp_path / "edited", progress=False, before_step=die)
    assert (tmp_path / "edited" / ".partial" / "resume.h5").exists()
    fit(build(), ds, dataclasses.replace(run, meta={"config_hash": "current"}), tmp_path / "edited", progress=False)
    assert not (tmp_path / "edited" / ".partial").exists()
    assert_bit_identical(tmp_path / "whole" / "final.h5", tmp_path / "edited" / "final.h5")  # epoch 1 trained again


def test_fine_tuning_starts_from_the_pretrained_checkpoint(digits, golden_twice):
    ds = data.load(digits)
    parity = dict(ds.attrs, num_classes=2)
    model = models.build(CONFIG["models"]["resnet18_parity"], parity, seed=0)
    checkpoint.load(golden_twice[0] / "final.h5", model, new_head=True)
    base = h5_datasets(golden_twice[0] / "final.h5")
    assert np.array_equal(model.conv1.weight.detach().numpy(), base["model/conv1.weight"])
    assert model.fc.weight.shape == (2, 512)  # new head keeps its own init


def test_fine_tuning_refuses_a_checkpoint_that_differs_beyond_the_head(golden_twice):
    """Every mismatched entry was skipped: a wider stem (or a gpt2's position embeddings of another
    seq_len) kept its own init, a fine-tuning that silently started from scratch."""
    model = models.build(SPEC, {"num_classes": 10}, seed=0)
    model.conv1 = torch.nn.Conv2d(3, 64, 5, padding=2, bias=False)
    with pytest.raises(PeatError, match=r"final\.h5: 'conv1\.weight' has shape \(64, 3, 7, 7\), model expects "
                                        r"\(64, 3, 5, 5\) \(only the head, fc, may differ\)$"):
        checkpoint.load(golden_twice[0] / "final.h5", model, new_head=True)


def test_checkpoint_with_missing_parameters_fails_naming_them(golden_twice, tmp_path):
    broken = tmp_path / "broken.h5"
    broken.write_bytes((golden_twice[0] / "final.h5").read_bytes())
    with h5py.File(broken, "a") as f:
        del f["model/fc.weight"]
    model = models.build(SPEC, {"num_classes": 10}, seed=0)
    with pytest.raises(PeatError, match=r"broken\.h5: missing parameters: fc\.weight"):
        checkpoint.load(broken, model)


# -- the workflow as a user runs it ----------------------------------------------------------

@pytest.mark.xdist_group("workflow")
def test_test_config_workflow_runs_and_is_up_to_date_after(workflow_run):
    for model in CONFIG["models"]:
        base = workflow_run / "results" / "golden" / model / "cpu"
        for name in ("metrics.csv", "final.h5", "context.h5", "storage.json"):
            assert (base / name).exists(), f"{model}/{name}"
        assert (workflow_run / "logs" / "golden" / model / "cpu.log").stat().st_size > 0
    proc = snakemake(workflow_run, "-n")
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_seeding_makes_torch_deterministic_without_importing_inductor():
    """Every job seeds first; the public torch switch imports inductor (seconds per job)."""
    code = ("import sys, torch; from peat.device import seed_everything; seed_everything(0, 1); "
            "print(torch.are_deterministic_algorithms_enabled(), 'torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def test_every_job_computes_float32_as_ieee_float32_on_a_gpu_too():
    """Golden is float32: PyTorch's default lets cuDNN convolve float32 in TF32 on NVIDIA Ampere and
    later, which would make golden a reduced-precision kernel itself. The flags are process-wide,
    so the forked candidate and runtime-FI children keep them."""
    code = ("import torch; from peat.device import seed_everything; "
            "before = torch.backends.cudnn.allow_tf32; torch.backends.cuda.matmul.allow_tf32 = True; "
            "seed_everything(0, 1); "
            "print(before, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, "
            "torch.get_float32_matmul_precision())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "False", "highest"]


@needs_gpu
def test_after_seeding_a_float32_convolution_and_matmul_on_the_gpu_are_ieee_float32():
    """TF32 keeps 10 mantissa bits: against float64 its error is ~1e-3 of the result, IEEE float32's ~1e-6."""
    from peat.device import seed_everything

    seed_everything(0, 1)
    x, w = torch.randn(8, 64, 16, 16, device="cuda"), torch.randn(64, 64, 3, 3, device="cuda")
    a, b = torch.randn(256, 512, device="cuda"), torch.randn(512, 256, device="cuda")
    for got, want in ((torch.nn.functional.conv2d(x, w, padding=1),
                       torch.nn.functional.conv2d(x.double(), w.double(), padding=1)), (a @ b, a.double() @ b.double())):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_batch_larger_than_the_training_set_fails_instead_of_training_nothing(digits, tmp_path):
    """The last partial batch is dropped, so 10 samples in batches of 32 gave a 'golden' run of 0 steps."""
    from peat.train import train_model

    spec = dict(SPEC, max_train_samples=10, batch_size=32)
    with pytest.raises(PeatError, match=r"config key 'models\.resnet18\.batch_size': 32 is more than the 10 training"):
        train_model("resnet18", spec, digits, tmp_path, progress=False)
    assert not (tmp_path / "final.h5").exists() and not (tmp_path / ".partial" / "context.h5").exists()


def test_a_batch_too_small_for_batch_norm_names_the_batch_size(digits, tmp_path):
    """ResNet-18 on 32x32 digits ends in 1x1 maps: a batch of 1 leaves batch norm one value per
    channel, which torch refuses deep inside the first forward, without naming the setting."""
    from peat.train import train_model

    spec = dict(SPEC, batch_size=1)
    with pytest.raises(PeatError, match=r"^config key 'models\.resnet18\.batch_size': batches of 1 leave a batch norm "
                                        r"layer one value per channel in training \(Expected more than 1 value"):
        train_model("resnet18", spec, digits, tmp_path, progress=False)
    assert not (tmp_path / "final.h5").exists()


def test_a_record_schedule_without_a_step_fails_instead_of_recording_nothing(digits, tmp_path):
    """Every 10th step within epoch 2, at 4 steps per epoch (steps 4-7), is no step: the golden job
    wrote a context without one sample, and playback had nothing to replay."""
    from peat.train import train_model

    spec = dict(SPEC, record=dict(SPEC["record"], every=10, epochs=[2]))
    with pytest.raises(PeatError, match=r"config key 'models\.resnet18\.record\.every': no step of record\.epochs \[2\] "
                                        r"is a multiple of 10 \(4 training steps per epoch"):
        train_model("resnet18", spec, digits, tmp_path, progress=False)
    assert not (tmp_path / "context.h5").exists()


def test_rerun_after_dying_at_the_end_keeps_every_epoch_checkpoint(digits, golden_twice, tmp_path, monkeypatch):
    """Dying after the epoch checkpoints were moved out of .partial (before metrics.csv) lost them:
    Snakemake deletes an incomplete job's outputs, and the rerun trained only the last epoch."""
    from peat import train

    def die(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(train, "write_csv", die)
    with pytest.raises(KeyboardInterrupt):
        train.train_model("resnet18", SPEC, digits, tmp_path, seed=0, threads=1, config_hash="abc", progress=False)
    monkeypatch.undo()
    for name in ("final.h5", "context.h5", "storage.json"):  # what snakemake --rerun-incomplete removes
        (tmp_path / name).unlink()
    shutil.rmtree(tmp_path / "checkpoints")
    train.train_model("resnet18", SPEC, digits, tmp_path, seed=0, threads=1, config_hash="abc", progress=False)
    for name in ("final.h5", "checkpoints/epoch001.h5", "checkpoints/epoch002.h5"):
        assert_bit_identical(golden_twice[0] / name, tmp_path / name)
    assert not (tmp_path / ".partial").exists()


def test_a_run_killed_before_its_inputs_changed_is_not_resumed(tmp_path):
    """Only the settings were compared: a job killed after its first epoch, rerun once its inputs
    had changed (a corpus file fixed, so the dataset prepared again; init_from's base model trained
    again after an edit) under the same config, resumed the old run: epoch 1 trained on the old
    data or from the old base weights, silently."""
    from peat.train import Run, fit

    g = torch.Generator().manual_seed(0)
    old, new = (data.Dataset("image", *(data.Split(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g))
                                         for n in (16, 4)), {}) for _ in range(2))
    run = Run(epochs=2, batch_size=8, optimizer={"name": "sgd", "lr": 0.1}, meta={"config_hash": "same"})

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 3))

    def die(step, epoch):
        if epoch == 2:
            raise KeyboardInterrupt("killed")

    fit(model(0), new, run, tmp_path / "whole", progress=False)
    for name, killed_with in (("data", (model(0), old)), ("weights", (model(1), new))):
        with pytest.raises(KeyboardInterrupt):
            fit(*killed_with, run, tmp_path / name, progress=False, before_step=die)
        assert (tmp_path / name / ".partial" / "resume.h5").exists()
        fit(model(0), new, run, tmp_path / name, progress=False)
        assert_bit_identical(tmp_path / "whole" / "final.h5", tmp_path / name / "final.h5")


def test_a_diverged_golden_training_stops_naming_the_optimizer(tmp_path):
    """Golden trained on to its end with a NaN loss from its first epoch on, and every later stage
    judged kernels against it: past a NaN every kernel's output matches golden's."""
    config = write_config(tmp_path, lambda c: c["models"]["resnet18"]["optimizer"].update(lr=1e4))
    proc = snakemake(tmp_path, "results/golden/resnet18/cpu/metrics.csv", configfile=config, check=False)
    assert proc.returncode != 0
    log = (tmp_path / "logs/golden/resnet18/cpu.log").read_text().strip().splitlines()
    assert log[-1] == ("peat.io.PeatError: config key 'models.resnet18.optimizer': golden training diverged (val loss "
                       "nan at step 4, epoch 1); past a NaN every kernel's output matches golden's, so it is no "
                       "reference: lower the lr, or raise batch_size")
    assert sorted(p.name for p in (tmp_path / "results/golden/resnet18/cpu").iterdir()) == [".partial"]


def test_a_run_killed_under_other_settings_is_not_resumed(digits, golden_twice, tmp_path):
    """A job killed after its first epoch, then rerun after the config changed (another lr, so
    another config hash), resumed the old run's state: epoch 1 trained with the old lr."""
    from peat.train import train_model

    def die(step, epoch):
        if epoch == 2:
            raise KeyboardInterrupt("killed")

    other = dict(SPEC, optimizer=dict(SPEC["optimizer"], lr=0.5))
    with pytest.raises(KeyboardInterrupt):
        train_model("resnet18", other, digits, tmp_path, seed=0, threads=1, config_hash="old", progress=False,
                    before_step=die)
    assert (tmp_path / ".partial" / "resume.h5").exists()
    train_model("resnet18", SPEC, digits, tmp_path, seed=0, threads=1, config_hash="abc", progress=False)
    for name in ("final.h5", "context.h5", "checkpoints/epoch001.h5"):
        assert_bit_identical(golden_twice[0] / name, tmp_path / name)


@pytest.mark.parametrize("edit", [{"optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.9}}, {"batch_size": 16},
                                  {"record": {"layers": ["fc"], "every": 2}}, {"threads": 2}],
                         ids=["lr", "batch_size", "record", "threads"])
def test_a_library_run_killed_under_other_settings_is_not_resumed(digits, golden_twice, tmp_path, edit):
    """train_model called as a library (no config hash, or one the caller keeps): a run killed after
    its first epoch was resumed after an edit of the lr, the batch size, the recorded layers or the
    torch threads (a CPU sum split otherwise rounds otherwise), mixing its first epoch (or its
    context's) into the new settings' run."""
    from peat.train import train_model

    def die(step, epoch):
        if epoch == 2:
            raise KeyboardInterrupt("killed")

    edit = dict(edit)
    threads = edit.pop("threads", 1)
    with pytest.raises(KeyboardInterrupt):
        train_model("resnet18", dict(SPEC, **edit), digits, tmp_path, seed=0, threads=threads, config_hash="abc",
                    progress=False, before_step=die)
    assert (tmp_path / ".partial" / "resume.h5").exists()
    train_model("resnet18", SPEC, digits, tmp_path, seed=0, threads=1, config_hash="abc", progress=False)
    for name in ("final.h5", "context.h5", "checkpoints/epoch001.h5"):
        assert_bit_identical(golden_twice[0] / name, tmp_path / name)


def test_perplexity_is_exp_of_the_loss_up_to_inf():
    # It was capped at exp(50): an infinite loss showed a finite perplexity of 5.2e21.
    from peat.train import _row

    assert [_row(0, 1, "val", loss, {"correct": 0, "count": 1}, "text", 0.0)["perplexity"]
            for loss in (1.0, 60.0, 1e4, float("inf"))] == [math.exp(1.0), math.exp(60.0), math.inf, math.inf]
