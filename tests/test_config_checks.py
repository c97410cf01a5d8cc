"""What config checks know about models and datasets without building or preparing them
(the one-line errors themselves: BAD_CONFIGS in test_backbone.py, run through snakemake -n)."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from conftest import REPO, TEST_CONFIG, snakemake
from peat import data, models
from peat.candidate import _declared_op, _parsed
from peat.config import validate
from peat.io import PeatError
from peat.profiler import op_of

DEFAULT = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
TEST = yaml.safe_load(TEST_CONFIG.read_text())


@pytest.mark.parametrize("spec,attrs", [
    (TEST["models"]["resnet18"], {"num_classes": 2}),
    (DEFAULT["models"]["mobilenet_v2"], {"num_classes": 10}),
    (TEST["models"]["gpt2"], {"vocab_size": 256, "seq_len": 32}),
    (DEFAULT["models"]["llama"], {"vocab_size": 256, "seq_len": 64}),
], ids=lambda v: v.get("arch", ""))
def test_layer_map_is_the_trained_models_and_is_kept_on_disk(spec, attrs, tmp_path, monkeypatch):
    monkeypatch.setenv("PEAT_LAYOUT_CACHE", str(tmp_path))
    built = models.build(spec, attrs, seed=0)
    assert models.layer_ops(spec) == {n: op_of(m) for n, m in built.named_modules() if n and op_of(m)}
    assert len(list(tmp_path.glob("*.json"))) == 1

    def no_build(*args, **kwargs):
        raise AssertionError("built again")

    monkeypatch.setattr(models, "_LAYOUTS", {})
    monkeypatch.setattr(models, "build", no_build)
    assert list(models.layer_ops(spec)) == [n for n, m in built.named_modules() if n and op_of(m)]


def test_the_layer_cache_override_works_where_the_home_is_unknown(tmp_path, monkeypatch):
    """Path.home() raises without HOME for a uid with no passwd entry (a container's): the
    default was evaluated even with PEAT_LAYOUT_CACHE set, so every config check crashed."""
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setenv("PEAT_LAYOUT_CACHE", str(tmp_path))
    monkeypatch.setattr(models.Path, "home", staticmethod(no_home))
    assert models._layout_cache() == tmp_path
    # Without the override either, the checks still run (uncached) where they crashed.
    monkeypatch.delenv("PEAT_LAYOUT_CACHE")
    monkeypatch.setattr(models, "_LAYOUTS", {})
    assert models._layout_cache() is None
    assert "layer1.0.conv1" in models.layer_ops(TEST["models"]["resnet18"])


def test_a_failed_layout_cache_write_leaves_no_file(tmp_path, monkeypatch):
    """A full disk (a home over its quota) left a partial temporary file in the cache at every
    config check; the check itself still runs."""
    def full(path, text):
        with open(path, "w") as f:
            f.write(text[:10])
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("PEAT_LAYOUT_CACHE", str(tmp_path / "layouts"))
    monkeypatch.setattr(models, "_LAYOUTS", {})
    monkeypatch.setattr(models.Path, "write_text", full)
    assert "layer1.0.conv1" in models.layer_ops(TEST["models"]["resnet18"])
    assert not (tmp_path / "layouts").exists() or not list((tmp_path / "layouts").iterdir())


def test_dataset_sizes_are_those_prepare_writes(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_bytes(b"x" * 1000)
    (tmp_path / "corpus" / "b.txt").write_text("y" * 333)
    specs = {"digits": {"source": "digits", "image_size": 8, "val_fraction": 0.3},
             "pydoc": {"source": "pydoc", "seq_len": 48, "part": [0.1, 0.3], "val_fraction": 0.1},
             "corpus": {"source": "text", "path": str(tmp_path / "corpus"), "seq_len": 16, "val_fraction": 0.25}}
    for name, spec in specs.items():
        data.prepare(name, spec, tmp_path / f"{name}.h5")
        prepared = data.load(tmp_path / f"{name}.h5")
        assert data.sizes(name, spec) == (len(prepared.train.y), len(prepared.val.y)), name


def test_a_validation_split_that_leaves_no_training_example_names_val_fraction(tmp_path):
    spec = {"source": "digits", "image_size": 8, "val_fraction": 0.9999}
    message = "config key 'datasets.digits.val_fraction': 0.9999 of the 1797 examples leaves none to train on"
    for check in (lambda: data.sizes("digits", spec), lambda: data.prepare("digits", spec, tmp_path / "d.h5")):
        with pytest.raises(PeatError) as err:
            check()
        assert str(err.value) == message
    assert not (tmp_path / "d.h5").exists()


def test_a_text_folder_is_read_for_its_text_files_only(tmp_path):
    """A folder named like a text file (and a dangling link) matched *.txt: the config check counted
    the folder's own size and data preparation failed with IsADirectoryError."""
    corpus = tmp_path / "corpus"
    (corpus / "notes.txt").mkdir(parents=True)
    (corpus / "notes.txt" / "a.txt").write_bytes(b"x" * 500)
    (corpus / "gone.txt").symlink_to(tmp_path / "missing")
    spec = {"source": "text", "path": str(corpus), "seq_len": 16, "val_fraction": 0.25}
    data.prepare("corpus", spec, tmp_path / "corpus.h5")
    prepared = data.load(tmp_path / "corpus.h5")
    assert data.sizes("corpus", spec) == (len(prepared.train.y), len(prepared.val.y)) == (23, 8)


KERNEL_SOURCES = {
    # Read, never run: the exit would end the config check.
    "conv.py": ('import sys\nOP = "conv2d"\nsys.exit(1)\ndef forward(x, weight, bias):\n    return x\n', "conv2d"),
    "later.py": ('OP = "linear"\nOP: str = "layer_norm"\n', "layer_norm"),
    "computed.py": ('OP = "conv" + "2d"\n', None),
    "namespace.py": ('OP = "conv2d"\nclass linear:\n    pass\n', None),  # load() reads the class, not OP
    "star.py": ('OP = "conv2d"\nfrom peat.alt_kernels.bf16_gemm import *\n', None),
    "gemm.cpp": ('PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n  m.attr("OP") = "conv2d";\n}\n', "conv2d"),
    # Commented-out code is not compiled: the module's OP is linear.
    "commented.cpp": ('PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n  m.attr("OP") = "linear";\n'
                      '  // m.attr("OP") = "conv2d";\n  /* m.attr("OP") = "layer_norm"; */\n}\n', "linear"),
}


@pytest.mark.parametrize("name", KERNEL_SOURCES)
def test_a_kernels_declared_op_is_read_without_running_it(name, tmp_path):
    text, declared = KERNEL_SOURCES[name]
    path = tmp_path / name
    path.write_text(text)
    tree = None if name.endswith(".cpp") else _parsed(str(path), "kernels.k.impl")
    assert _declared_op(str(path), "linear", tree) == declared


@pytest.mark.parametrize("overlay,line", [
    # The overlay's one key misspelled: it was taken for a target named after --configfile.
    ("kernls:\n  mine: {op: conv2d, impl: peat.alt_kernels.im2col}\n",
     "peat: config key '<top level>': Additional properties are not allowed ('kernls' was unexpected); "
     "did you mean 'kernels' for 'kernls'?"),
    ("models:\n  gpt2:\n    optimiser: {name: sgd, lr: 0.1}\n",
     "peat: config key 'models.gpt2': Additional properties are not allowed ('optimiser' was unexpected); "
     "did you mean 'optimizer' for 'optimiser'?"),
])
def test_a_misspelled_key_in_an_overlay_is_named_with_the_key_it_means(overlay, line, tmp_path):
    path = tmp_path / "overlay.yaml"
    path.write_text(overlay)
    proc = snakemake(tmp_path, "-n", "--configfile", str(TEST_CONFIG), str(path), configfile=None, check=False)
    lines = [text for text in proc.stderr.splitlines() if text.startswith("peat:")]
    assert proc.returncode != 0 and lines == [line], proc.stderr


def test_a_relative_dataset_path_that_does_not_exist_names_the_directory_it_was_looked_for_in(tmp_path):
    """With --directory the jobs (and the check) resolve a relative path from the working directory,
    not the shell's: 'data/texts does not exist' named a folder the user could see."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text to learn from. " * 40)
    work = tmp_path / "work"
    work.mkdir()
    overlay = tmp_path / "corpus.yaml"
    overlay.write_text("datasets:\n  corpus: {source: text, path: texts, seq_len: 16}\n")
    proc = snakemake(work, "-n", "--configfile", str(TEST_CONFIG), str(overlay), configfile=None, check=False)
    lines = [text for text in proc.stderr.splitlines() if text.startswith("peat:")]
    assert proc.returncode != 0 and lines == [
        f"peat: config key 'datasets.corpus.path': texts does not exist (relative to the working directory {work})"]


def test_a_kernel_file_under_the_home_directory_is_found_as_a_dataset_path_is(tmp_path, monkeypatch):
    """impl: ~/kernels/mine.py was 'no such file (relative to <cwd> or <repo>)', where a dataset's
    path: ~/... is the user's home; the check and the jobs resolve it there now."""
    from peat import kernels
    from peat.candidate import check

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "mine.py").write_text((REPO / "kernels" / "my_gemm.py").read_text())
    assert kernels.source_files("~/kernels/mine.py") == [str(tmp_path / "kernels" / "mine.py")]
    cfg = {**TEST, "kernels": {"mine": {"op": "linear", "impl": "~/kernels/mine.py", "models": ["gpt2"]}},
           "rfi": {"kernels": []}}
    check(cfg)
    assert kernels.load("~/kernels/mine.py", "linear", name="mine") is not None


@pytest.mark.parametrize("head", [b"\xef\xbb\xbf", b"# -*- coding: latin-1 -*-\n# caf\xe9\n"])
def test_a_kernel_file_python_imports_is_read_by_the_config_check(head, tmp_path):
    """A kernel saved with a UTF-8 BOM (Windows editors) imports in Python, but the config check read
    it as UTF-8 text and refused it: 'SyntaxError: invalid non-printable character U+FEFF (line 1)'."""
    path = tmp_path / "mine.py"
    path.write_bytes(head + (REPO / "kernels" / "my_gemm.py").read_bytes())
    tree = _parsed(str(path), "kernels.mine.impl")
    assert _declared_op(str(path), "linear", tree) == "linear"


def set_key(config: dict, path: tuple, value) -> dict:
    node = config
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return config


@pytest.mark.parametrize("path,value,needs", [
    (("datasets", "digits", "val_fraction"), math.nan, "give a finite number > 0 and < 1"),
    (("datasets", "pydoc", "part", 0), math.nan, "give a finite number >= 0 and <= 1"),
    (("models", "resnet18", "optimizer", "lr"), math.nan, "give a finite number > 0"),
    (("detect", "k32"), math.nan, "give a finite number > 1"),
    # .inf where no maximum stops it: an lr of inf trained until golden's loss turned NaN, a momentum,
    # tolerance or Detector multiple of inf reached the jobs.
    (("models", "resnet18", "optimizer", "lr"), math.inf, "give a finite number > 0"),
    (("models", "resnet18", "optimizer", "momentum"), math.inf, "give a finite number >= 0"),
    (("models", "resnet18", "optimizer", "weight_decay"), math.inf, "give a finite number >= 0"),
    (("detect", "krp"), math.inf, "give a finite number > 0"),
    (("detect", "band"), math.inf, "give a finite number >= 1"),
    (("alter", "tolerance"), math.nan, "give a finite number > 0 and <= 1"),
    (("alter", "absorbed_loss_pct"), math.inf, "give a finite number > 0"),
    # The sdc section's own words (sdc_drill.check_config's, as tests/test_sdc.py has them), now the schema's.
    (("sdc", "timeout_s"), math.inf, "every collective needs a finite timeout in seconds"),
    (("sdc", "audit_tolerance"), math.inf, "a relative tolerance needs a finite number >= 0 (0 = bit-exact)"),
])
def test_a_nonfinite_number_anywhere_in_the_config_is_one_line_naming_the_key(path, value, needs):
    """YAML's .nan passed the schema's bounds: val_fraction or part ended the config check in a
    ValueError traceback (cannot convert float NaN to integer), an lr or k32 reached the jobs; .inf
    passed every key without a maximum (lr: .inf was refused only when golden training diverged)."""
    config = set_key(copy.deepcopy(TEST), path, value)
    with pytest.raises(PeatError) as err:
        validate(config, REPO / "workflow" / "schemas" / "config.schema.yaml")
    assert str(err.value) == f"config key '{'.'.join(map(str, path))}': {value!r}: {needs}"


def test_a_nonfinite_number_past_a_bound_keeps_the_bounds_words():
    # The schema's bound says it already, and says what is allowed.
    for path, value, message in ((("models", "resnet18", "optimizer", "lr"), -math.inf,
                                  "-inf is less than or equal to the minimum of 0"),
                                 (("datasets", "digits", "val_fraction"), math.inf,
                                  "inf is greater than or equal to the maximum of 1")):
        with pytest.raises(PeatError) as err:
            validate(set_key(copy.deepcopy(TEST), path, value), REPO / "workflow" / "schemas" / "config.schema.yaml")
        assert str(err.value) == f"config key '{'.'.join(map(str, path))}': {message}"


@pytest.mark.parametrize("path,value", [(("playback", "timeout"), float("inf")),
                                        (("kernels", "my_gemm", "timeout"), 1e10),
                                        (("kernels", "im2col", "train_timeout"), float("inf"))])
def test_a_time_limit_past_what_the_timer_takes_is_one_line_naming_the_key(path, value):
    """playback.timeout: .inf (meant as no limit) passed the config, and every call of every kernel's
    own computation then failed on setitimer's OverflowError (measured: the test config's my_gemm
    and welford_ln each 24 crash rows of 24), so the verdicts blamed the kernels."""
    config = copy.deepcopy(TEST)
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(PeatError) as err:
        validate(config, REPO / "workflow" / "schemas" / "config.schema.yaml")
    assert str(err.value) == f"config key '{'.'.join(path)}': {value!r} is greater than the maximum of 31536000"


@pytest.mark.parametrize("section,default", [("kernels", {}), ("errors", []), ("detect", None), ("alter", None),
                                             ("sdc", None), (("models", "gpt2", "optimizer"), None),
                                             (("models", "gpt2", "checkpoint_epochs"), [])])
def test_a_section_with_every_entry_commented_out_is_its_default(section, default):
    """'kernels:' with every kernel under it commented out is YAML's null: it stopped the run in
    "config key 'kernels': None is not of type 'object'", where leaving the key out meant none."""
    path = section if isinstance(section, tuple) else (section,)
    blank, omitted = copy.deepcopy(TEST), copy.deepcopy(TEST)
    set_key(blank, path, None)
    parent = omitted
    for key in path[:-1]:
        parent = parent[key]
    parent.pop(path[-1], None)
    schema = REPO / "workflow" / "schemas" / "config.schema.yaml"
    assert validate(blank, schema) == validate(omitted, schema)
    if default is not None:
        parent = blank
        for key in path[:-1]:
            parent = parent[key]
        assert parent[path[-1]] == default


@pytest.mark.parametrize("path,expected", [(("models",), "'object'"), (("name",), "'string'"),
                                           (("models", "gpt2", "record"), "'object'"), (("seed",), "'integer'"),
                                           (("models", "gpt2", "record", "layers"), "'array'")])
def test_a_key_left_without_a_value_says_so(path, expected):
    # "None is not of type 'object'" named Python's None, which no config file holds.
    config = set_key(copy.deepcopy(TEST), path, None)
    with pytest.raises(PeatError) as err:
        validate(config, REPO / "workflow" / "schemas" / "config.schema.yaml")
    assert str(err.value) == (f"config key '{'.'.join(path)}' has no value (YAML's null: nothing after the key, "
                              f"or every entry below it commented out); expected {expected}")


@pytest.mark.parametrize("path,allowed", [(("models", "gpt2", "arch"), "resnet18, resnet34"), (("vendors", 0), "cpu, nvidia, amd")])
def test_a_choice_left_without_a_value_says_so(path, allowed):
    # "None is not allowed" named Python's None: 'arch:' left blank, or a list item '-' with nothing after it.
    config = set_key(copy.deepcopy(TEST), path, None)
    with pytest.raises(PeatError) as err:
        validate(config, REPO / "workflow" / "schemas" / "config.schema.yaml")
    assert str(err.value).startswith(f"config key '{'.'.join(map(str, path))}' has no value (YAML's null: nothing "
                                     f"after the key, or every entry below it commented out); allowed: {allowed}")


@pytest.mark.parametrize("value", [2, 1.5])
def test_an_alter_tolerance_past_any_accuracy_difference_is_refused(value):
    """alter.tolerance is an accuracy difference (0.02 = 2 points); written as a percent (2, beside
    absorbed_loss_pct, which is one), every cell read as recovered within its first epoch."""
    config = set_key(copy.deepcopy(TEST), ("alter", "tolerance"), value)
    with pytest.raises(PeatError) as err:
        validate(config, REPO / "workflow" / "schemas" / "config.schema.yaml")
    assert str(err.value) == f"config key 'alter.tolerance': {value} is greater than the maximum of 1"
    validate(set_key(copy.deepcopy(TEST), ("alter", "tolerance"), 1), REPO / "workflow" / "schemas" / "config.schema.yaml")


@pytest.mark.parametrize("section", ["models", "datasets"])
def test_a_name_with_a_leading_dash_is_refused(section):
    """A model named '-gpt2' passed the config, then every rank of its SDC drill stopped in argparse's
    'argument --model: expected one argument': a leading dash reads as an option on a command line."""
    config = copy.deepcopy(TEST)
    config[section]["-gpt2"] = config[section].pop("gpt2" if section == "models" else "pydoc")
    with pytest.raises(PeatError) as err:
        validate(config, REPO / "workflow" / "schemas" / "config.schema.yaml")
    assert str(err.value) == (f"config key '{section}': '-gpt2' is not a name of letters, digits and _ + - . "
                              "(no leading dot or dash: names are folder names and command-line arguments)")


@pytest.mark.parametrize("section,name,read", [("models", True, "True"), ("models", 2017, "2017"),
                                               ("datasets", None, "None"), ("kernels", 1.5, "1.5")])
def test_a_name_yaml_reads_as_no_text_says_to_quote_it(section, name, read):
    # A model 'yes:' or '2017:' is a YAML boolean or number: "True is not of type 'string'" left the
    # user looking at a name that is text in the file.
    config = copy.deepcopy(TEST)
    config[section][name] = next(iter(config[section].values()))
    with pytest.raises(PeatError) as err:
        validate(config, REPO / "workflow" / "schemas" / "config.schema.yaml")
    assert str(err.value) == (f"config key '{section}': the name {read} is no text to YAML (a number, boolean or "
                              "null); write it in quotes")
