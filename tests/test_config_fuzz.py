"""Property-based: every invalid config is rejected with a message naming the key at fault."""

from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, TEST_CONFIG
from peat.config import validate
from peat.io import PeatError

SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
VALID = yaml.safe_load(TEST_CONFIG.read_text())
OWN_SECTIONS = ("name", "seed", "threads", "vendors", "reference_vendor", "datasets", "models")


def leaves(node, path=()):
    """Every (path, value) in the parts of the config this backbone's schema describes."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*path, key), value
            yield from leaves(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield (*path, i), value


PATHS = [p for p, _ in leaves(VALID) if p[0] in OWN_SECTIONS]


def wrong_value(value):
    """A value of a type the schema never allows at this place."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return "not-a-number"
    if isinstance(value, str):
        return {"oops": 1}
    if isinstance(value, list):
        return "not-a-list"
    return ["not-an-object"]


def get(cfg, path):
    for key in path[:-1]:
        cfg = cfg[key]
    return cfg


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), action=st.sampled_from(["retype", "unknown_key"]))
def test_invalid_config_names_the_key(path, action):
    cfg = copy.deepcopy(VALID)
    parent = get(cfg, path)
    if action == "retype":
        parent[path[-1]] = wrong_value(parent[path[-1]])
        expected = ".".join(map(str, path))
    else:
        target = parent[path[-1]]
        if not isinstance(target, dict) or path[-2:-1] in (("datasets",), ("models",)) or path == ("datasets",) or path == ("models",):
            return  # maps of user-chosen names accept any key
        target["surprise_key"] = 1
        expected = "surprise_key"
    try:
        validate(cfg, SCHEMA)
    except PeatError as err:
        message = str(err)
        assert "\n" not in message
        assert expected in message, (path, action, message)
    else:
        raise AssertionError(f"accepted invalid config: {action} at {path}")


@pytest.mark.parametrize("where", ["errors", "kernel"])
def test_a_bad_error_spec_is_named_with_the_specs_allowed_not_a_regex(where):
    cfg = copy.deepcopy(VALID)
    if where == "errors":
        cfg["errors"] = ["fp16", "bitflip:exponent"]
        key = "errors.1"
    else:
        cfg["kernels"]["lane_fc"]["error"] = "bitflip:exponent"
        key = "kernels.lane_fc.error"
    with pytest.raises(PeatError) as err:
        validate(cfg, SCHEMA)
    assert str(err.value).startswith(f"config key '{key}': 'bitflip:exponent' is not a pseudo-error spec: fp16,")
    assert "bit_flip:WHERE" in str(err.value) and "^(" not in str(err.value)


def test_every_pattern_of_the_schema_is_said_in_words():
    # A name with a space or a brace was refused with the schema's regex ("does not match '^[A-Za-z...").
    def patterns(node):
        if isinstance(node, dict):
            if "pattern" in node:
                yield node
            for value in node.values():
                yield from patterns(value)
        elif isinstance(node, list):
            for value in node:
                yield from patterns(value)

    found = list(patterns(yaml.safe_load(SCHEMA.read_text())))
    assert len(found) >= 6 and all(node.get("pattern_means") for node in found)


@pytest.mark.parametrize("mutate,expected", [
    (lambda c: c.update(slurm={"cpu_partition": "a b"}),
     "config key 'slurm.cpu_partition': 'a b' is not a partition name of letters, digits and _ . -"),
    (lambda c: c.update(slurm={"vendors": {"nvidia": {"gres": "a100:1"}}}),
     "config key 'slurm.vendors.nvidia.gres': 'a100:1' is not a GPU request gpu[:TYPE][:COUNT], such as"),
    (lambda c: c["datasets"].update({"my data": c["datasets"].pop("digits")}),
     "config key 'datasets': 'my data' is not a name of letters, digits and _ + - ."),
])
def test_a_bad_name_is_said_in_words(mutate, expected):
    cfg = copy.deepcopy(VALID)
    mutate(cfg)
    with pytest.raises(PeatError) as err:
        validate(cfg, SCHEMA)
    assert str(err.value).startswith(expected)


def test_valid_configs_pass_and_get_defaults():
    for name in ("test.yaml", "config.yaml"):
        cfg = yaml.safe_load((REPO / "config" / name).read_text())
        validate(cfg, SCHEMA)
        assert cfg["models"]["resnet18"]["optimizer"]["name"] == "sgd"
        assert all("every" in m["record"] for m in cfg["models"].values())


def test_a_section_of_the_wrong_type_is_not_dumped_into_the_line():
    """The message held the value's whole repr: models given as a list printed every model's spec."""
    cfg = copy.deepcopy(VALID)
    cfg["models"] = list(cfg["models"].values())
    with pytest.raises(PeatError) as err:
        validate(cfg, SCHEMA)
    assert str(err.value).startswith("config key 'models': [{'arch': 'resnet18'")
    assert str(err.value).endswith(" ...] is not of type 'object'") and len(str(err.value)) < 120


def test_a_gpu_only_study_is_told_that_reference_vendor_defaults_to_cpu():
    """vendors: [nvidia] alone was refused as "'cpu' is not in 'vendors'", a value the config never wrote."""
    cfg = copy.deepcopy(VALID)
    cfg["vendors"] = ["nvidia"]
    del cfg["reference_vendor"]
    with pytest.raises(PeatError, match=r"^config key 'reference_vendor': 'cpu' \(the default\) is not in 'vendors' "
                                        r"\(nvidia\): set it to one of them, whose golden context every vendor replays$"):
        validate(cfg, SCHEMA)


@pytest.mark.parametrize("mutate,key,expected", [
    (lambda c: c["models"]["gpt2"]["optimizer"].update(lr="3e-3"), "models.gpt2.optimizer.lr",
     "'3e-3' is not of type 'number' (YAML reads 3e-3 as text; write 3.0e-3)"),
    (lambda c: c["alter"].update(tolerance="2E2"), "alter.tolerance", "(YAML reads 2E2 as text; write 2.0E+2)"),
    (lambda c: c["models"]["gpt2"].update(max_train_samples="1e3"), "models.gpt2.max_train_samples",
     "'1e3' is not of type 'integer', 'null' (YAML reads 1e3 as text; write 1000)"),
])
def test_a_number_in_exponent_notation_yaml_reads_as_text_is_told_how_to_write_it(mutate, key, expected):
    """PyYAML (YAML 1.1) reads lr: 1e-3 as the string '1e-3'; the line said only that it is not a
    number, which it looks like."""
    cfg = copy.deepcopy(VALID)
    mutate(cfg)
    with pytest.raises(PeatError) as err:
        validate(cfg, SCHEMA)
    assert str(err.value).startswith(f"config key '{key}': ") and str(err.value).endswith(expected)
    written = expected.rsplit("write ", 1)[1].rstrip(")")
    assert isinstance(yaml.safe_load(written), (int, float))


@pytest.mark.parametrize("section", ["datasets", "models", "kernels"])
def test_a_name_yaml_reads_as_a_number_is_named_not_a_crash(section):
    """kernels: {123: ...} passed the schema (a pattern checks strings only) and the Snakefile ended
    in a TypeError joining the kernel names into its wildcard constraint."""
    cfg = copy.deepcopy(VALID)
    name = next(iter(cfg[section]))
    cfg[section][123] = cfg[section].pop(name)
    with pytest.raises(PeatError, match=rf"^config key '{section}': the name 123 is no text to YAML \(a number, "
                                        r"boolean or null\); write it in quotes$"):
        validate(cfg, SCHEMA)
