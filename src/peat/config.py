"""Config validation with one-line errors, and the config hash stamped on every result."""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from pathlib import Path

import jsonschema
import yaml

from .data import sizes
from .io import PeatError
from .models import IMAGE_ARCHS, language_size, layer_ops
from .profiler import check_records_a_step, match_names

# The workflow's config schema: peat runs from its checkout (the Makefile installs it with pip install -e .).
SCHEMA = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"
# Sources prepared as images (peat.data.prepare); the others are byte-level text.
IMAGE_SOURCES = ("digits", "cifar10")
# The dataset settings each source reads (peat.data); source, val_fraction and seed apply to all.
SOURCE_KEYS = {"path": ("cifar10", "text"), "labels": IMAGE_SOURCES, "image_size": IMAGE_SOURCES,
               "seq_len": ("pydoc", "text"), "part": ("pydoc",)}


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def _short(value, limit: int = 60) -> str:
    """repr() of a config value, cut: a whole section given as a list was dumped into the line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 5]} ...{text[-1]}"


def _number_as_text(value, types) -> str:
    """YAML 1.1 (PyYAML, as Snakemake reads a config file) takes 1e-3 for text: a float needs a dot
    and a signed exponent. The bare type error left a user looking at a number."""
    match = re.fullmatch(r"([-+]?(?:\d+\.?\d*|\.\d+))([eE])([-+]?)(\d+)", value) if isinstance(value, str) else None
    if match is None:
        return ""
    mantissa, e, sign, exponent = match.groups()
    if "integer" in types and float(value).is_integer():
        spelled = str(int(float(value)))
    elif "number" in types:
        spelled = f"{mantissa if '.' in mantissa else mantissa + '.0'}{e}{sign or '+'}{exponent}"
    else:
        return ""
    return f" (YAML reads {value} as text; write {spelled})"


def _misspelled(keys, known) -> dict:
    """Unknown key -> the known key it most likely misspells."""
    close = {key: difflib.get_close_matches(str(key), list(known), n=1) for key in keys if key not in known}
    return {key: match[0] for key, match in close.items() if match}


def _did_you_mean(instance, known) -> str:
    guesses = _misspelled(instance, known) if isinstance(instance, dict) else {}
    return "".join(f"; did you mean {match!r} for {key!r}?" for key, match in guesses.items())


def _no_value(key: str) -> str:
    """"None is not of type/allowed" named Python's None, which no config file holds."""
    return (f"config key '{key}' has no value (YAML's null: nothing after the key, or every entry below it "
            "commented out)")


def _message(err: jsonschema.ValidationError) -> str:
    key = _key(err.absolute_path)
    if err.validator == "type":
        types = err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
        if "propertyNames" in err.schema_path:  # a key, whose text YAML took for a number ('2017:') or boolean ('yes:')
            return (f"config key '{key}': the name {err.instance!r} is no text to YAML (a number, boolean or null); "
                    "write it in quotes")
        if err.instance is None:
            return f"{_no_value(key)}; expected {', '.join(map(repr, types))}"
        return (f"config key '{key}': {_short(err.instance)} is not of type {', '.join(map(repr, types))}"
                f"{_number_as_text(err.instance, types)}")
    if err.validator == "enum" and err.instance is None:
        return f"{_no_value(key)}; allowed: {', '.join(map(str, err.validator_value))}"
    if err.validator == "enum":
        return f"config key '{key}': {err.instance!r} is not allowed; allowed: {', '.join(map(str, err.validator_value))}"
    if err.validator == "required":
        missing = err.message.split("'")[1]
        return f"config key '{_key([*err.absolute_path, missing])}' is missing"
    if err.validator == "additionalProperties":
        return f"config key '{key}': {err.message}{_did_you_mean(err.instance, err.schema.get('properties', {}))}"
    if err.validator in ("oneOf", "anyOf") and err.context and all(
            e.validator == "type" and not e.relative_path for e in err.context):  # said only "not valid under any"
        return f"config key '{key}': {_short(err.instance)} is not of type {', '.join(repr(e.validator_value) for e in err.context)}"
    if err.validator == "finite":  # its message names the value and what the key needs
        return f"config key '{key}': {err.message}"
    if err.validator == "pattern" and "pattern_means" in err.schema:  # the schema's own word for a long regex
        return f"config key '{key}': {err.instance!r} is not {err.schema['pattern_means']}"
    return f"config key '{key}': {err.message}"


def section_defaults(section: str) -> dict:
    """The schema's defaults of the keys of one config ``section``: what validation fills in."""
    keys = yaml.safe_load(SCHEMA.read_text())["properties"][section]["properties"]
    return {key: spec["default"] for key, spec in keys.items() if "default" in spec}


def validate(config: dict, schema_path: str | Path) -> dict:
    """Validate ``config`` in place (filling schema defaults) and cross-check references.

    Raises PeatError with one line naming the offending key and what is allowed.
    """
    schema = yaml.safe_load(Path(schema_path).read_text())
    # Validation writes the default in: a message about it must say the config never wrote it.
    defaulted = isinstance(config, dict) and "reference_vendor" not in config
    validator_cls = _with_defaults(jsonschema.Draft202012Validator)
    errors = sorted(validator_cls(schema).iter_errors(config), key=lambda e: (len(e.absolute_path), e.path))
    if errors:
        raise PeatError(_message(jsonschema.exceptions.best_match(errors)))
    _cross_check(config, defaulted, schema["properties"]["datasets"]["additionalProperties"]["properties"])
    return config


def check_unique_keys(path: str | Path) -> None:
    """No key twice in one mapping of a config file: YAML keeps the last without a word, so a
    copied model or kernel block left unrenamed silently replaced the first."""
    _unique_keys(yaml.compose(Path(path).read_text()), [], path)


def check_is_config(path: str | Path, schema_path: str | Path) -> None:
    """``--configfile`` takes every path after it: a target named after it (an existing
    results/.../x.json) was read as a config and surfaced only as unknown top-level keys, naming
    no file."""
    content = yaml.safe_load(Path(path).read_text())
    if content is None or content == {}:  # an empty overlay (the SLURM test's, say) changes nothing
        return
    known = yaml.safe_load(Path(schema_path).read_text())["properties"]
    # A result may share a key with the config (a drill's JSON its "seed", a playback record its
    # "errors"): a config's top-level keys are mostly config keys, a result's mostly not. A
    # misspelled one ("kernls") counts as the config key it means: an overlay of that one key was
    # taken for a target, and the schema names the key.
    ours = content.keys() & known.keys() | _misspelled(content, known).keys() if isinstance(content, dict) else set()
    if not isinstance(content, dict) or len(ours) < len(content.keys() - ours):
        raise PeatError(f"{path}: not a peat config (few or no config keys at its top level); --configfile reads "
                        "every path after it, so name targets before --configfile")


def _unique_keys(node, at: list, path) -> None:
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            if key.value in seen:
                raise PeatError(f"config key '{_key([*at, key.value])}' is given twice in {path} "
                                f"(again at line {key.start_mark.line + 1}); rename or remove one")
            seen.add(key.value)
            _unique_keys(value, [*at, key.value], path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _unique_keys(item, [*at, i], path)


def _with_defaults(cls):
    """A validator that also fills in ``default`` values, as Snakemake's validate() does."""
    validate_properties = cls.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and (name not in instance or instance[name] is None and _section(sub)):
                    instance[name] = json.loads(json.dumps(sub["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    validate_type = cls.VALIDATORS["type"]

    def finite_numbers(validator, types, instance, schema):
        yield from validate_type(validator, types, instance, schema)
        needs = _finite_needed(instance, types, schema)
        if needs:
            yield jsonschema.ValidationError(f"{instance!r}: {needs}", validator="finite")

    # JSON Schema counts 2.0 as an integer; YAML loads it as a float, which range() refuses in the job.
    integers = cls.TYPE_CHECKER.redefine(
        "integer", lambda checker, instance: isinstance(instance, int) and not isinstance(instance, bool))
    return jsonschema.validators.extend(cls, {"properties": set_defaults, "type": finite_numbers},
                                        type_checker=integers)


# A bound that refuses a value of this sign, in the words "give a finite number ..." use.
_BOUNDS = {"exclusiveMinimum": (-1, ">"), "minimum": (-1, ">="), "exclusiveMaximum": (1, "<"), "maximum": (1, "<=")}


def _finite_needed(value, types, schema: dict) -> str:
    """What a key of type number needs where YAML's .nan or .inf gave it none: .nan passes every
    bound of the schema (each comparison is false), .inf every key without a maximum (an lr of .inf
    trained until golden's loss turned NaN). Empty where the value is finite, no number is meant,
    or one of the key's bounds refuses it already (and says what is allowed). A key's own
    ``finite_means`` words it (sdc's)."""
    if not isinstance(value, float) or math.isfinite(value) or "number" not in (
            types if isinstance(types, list) else [types]):
        return ""
    if any(sign * value > 0 for bound, (sign, _) in _BOUNDS.items() if bound in schema):
        return ""
    bounds = " and ".join(f"{word} {schema[bound]}" for bound, (_, word) in _BOUNDS.items() if bound in schema)
    return schema.get("finite_means") or f"give a finite number{' ' + bounds if bounds else ''}"


def _section(schema: dict) -> bool:
    """A key holding entries (a mapping or a list) that null does not mean otherwise: written with
    every entry commented out ('kernels:' and nothing below), YAML reads it as null, which stopped
    the run where leaving the key out gave the default."""
    types = schema.get("type", [])
    types = types if isinstance(types, list) else [types]
    return "null" not in types and bool({"object", "array"} & set(types))


def _cross_check(config: dict, reference_defaulted: bool = False, dataset_keys: dict | None = None) -> None:
    datasets, models = config["datasets"], config["models"]
    for name, spec in datasets.items():
        _check_dataset(name, spec, dataset_keys or {})
    for name, model in models.items():
        if model["dataset"] not in datasets:
            raise PeatError(
                f"config key 'models.{name}.dataset': unknown dataset {model['dataset']!r}; "
                f"defined: {', '.join(datasets)}"
            )
        _check_kind(name, model, datasets[model["dataset"]])
        _check_init_from(name, models, datasets)
        _check_schedule(name, model)
        _check_batch(name, model, datasets[model["dataset"]])
        # A glob matching no layer failed the golden training job, which records these layers.
        match_names(list(layer_ops(model)), model["record"]["layers"], f"models.{name}.record.layers")
    _check_init_cycles(models)
    ref = config.get("reference_vendor", "cpu")
    if ref not in config["vendors"]:
        default = " (the default)" if reference_defaulted else ""
        raise PeatError(f"config key 'reference_vendor': {ref!r}{default} is not in 'vendors' "
                        f"({', '.join(config['vendors'])}): set it to one of them, whose golden context every "
                        "vendor replays")


def _check_dataset(name: str, spec: dict, keys: dict) -> None:
    # A setting the source does not read was dropped without a word (part of a text corpus: the
    # whole corpus). The schema's default, which validation writes in, changes nothing and passes.
    for key, sources in SOURCE_KEYS.items():
        if key in spec and spec["source"] not in sources and spec[key] != keys.get(key, {}).get("default"):
            raise PeatError(f"config key 'datasets.{name}.{key}': source {spec['source']} does not read it "
                            f"({key} applies to {', '.join(sources)})")
    if spec["source"] in ("cifar10", "text"):
        path = spec.get("path")
        if path is None:
            raise PeatError(f"config key 'datasets.{name}.path' is missing (source {spec['source']} reads local files)")
        if not Path(path).expanduser().exists():
            # Relative to where jobs run, which --directory moves away from the shell's directory.
            where = "" if Path(path).expanduser().is_absolute() else f" (relative to the working directory {Path.cwd()})"
            raise PeatError(f"config key 'datasets.{name}.path': {path} does not exist{where}")
    part = spec.get("part")
    if part and part[0] >= part[1]:  # an empty text failed in data preparation, naming seq_len
        raise PeatError(f"config key 'datasets.{name}.part': start {part[0]:g} is not below end {part[1]:g}")


def _check_init_from(name: str, models: dict, datasets: dict) -> None:
    """A base model whose checkpoint this one can start from: otherwise the job failed, or silently
    started from scratch, only after the base model's training."""
    model, base = models[name], models[name].get("init_from")
    if base is None:
        return
    if base not in models:
        raise PeatError(f"config key 'models.{name}.init_from': unknown model {base!r}; defined: {', '.join(models)}")
    if base == name:
        raise PeatError(f"config key 'models.{name}.init_from': a model cannot start from itself")
    if models[base]["arch"] != model["arch"]:
        raise PeatError(f"config key 'models.{name}.init_from': {base!r} is a {models[base]['arch']}, "
                        f"not a {model['arch']}")
    if model["arch"] in IMAGE_ARCHS:
        return
    # Layers the base lacks failed the job; other widths were skipped by the checkpoint load.
    own, theirs = language_size(model.get("size")), language_size(models[base].get("size"))
    if own != theirs:
        raise PeatError(f"config key 'models.{name}.size': {own} is not the size of init_from model "
                        f"{base!r} ({theirs}), whose checkpoint it starts from")
    # One learned position embedding per position: the checkpoint's would not load.
    lengths = [datasets.get(models[m]["dataset"], {}).get("seq_len") for m in (name, base)]
    if model["arch"] in ("gpt2", "bert") and None not in lengths and lengths[0] != lengths[1]:
        raise PeatError(f"config key 'datasets.{model['dataset']}.seq_len': {lengths[0]} is not the seq_len "
                        f"of init_from model {base!r}'s dataset ({lengths[1]}), whose {model['arch']} "
                        "position embeddings it starts from")


def _check_kind(name: str, model: dict, dataset: dict) -> None:
    """An image model on an image dataset, a language model on text: the golden job failed on a KeyError."""
    kind = "image" if dataset["source"] in IMAGE_SOURCES else "text"
    wants = "image" if model["arch"] in IMAGE_ARCHS else "text"
    if kind != wants:
        kinds = {"image": "an image", "text": "a text"}
        raise PeatError(f"config key 'models.{name}.dataset': {model['dataset']!r} is {kinds[kind]} dataset; "
                        f"{model['arch']} needs {kinds[wants]} one")


def _check_init_cycles(models: dict) -> None:
    """No models that start from each other (a -> b -> a): Snakemake would stop at its own cyclic
    dependency error, which names no config key. Every init_from is a known model by now."""
    for name in models:
        chain, base = [name], models[name].get("init_from")
        while base is not None and base not in chain:
            chain.append(base)
            base = models[base].get("init_from")
        if base == name:
            raise PeatError(f"config key 'models.{name}.init_from': models start from each other in a cycle "
                            f"({' -> '.join(chain + [name])})")


def _check_schedule(name: str, model: dict) -> None:
    """Epoch lists within the training, and optimizer settings the optimizer takes: otherwise the
    job would save or record nothing, or fail only once it starts."""
    last = model["epochs"]
    for key, epochs in (("checkpoint_epochs", model.get("checkpoint_epochs")),
                        ("record.epochs", (model.get("record") or {}).get("epochs"))):
        late = [e for e in epochs or [] if e > last]
        if late:
            raise PeatError(f"config key 'models.{name}.{key}': epoch {late[0]} is past the last epoch ({last})")
    limit = model.get("max_train_samples")
    if limit is not None and model["batch_size"] > limit:  # no full batch: the training would stop at once
        raise PeatError(f"config key 'models.{name}.batch_size': {model['batch_size']} is more than "
                        f"max_train_samples ({limit})")
    size = language_size(model.get("size"))
    hidden, heads = size["hidden"], size["heads"]
    if model["arch"] not in IMAGE_ARCHS and hidden % heads:
        raise PeatError(f"config key 'models.{name}.size.heads': {heads} heads do not divide the hidden size {hidden}")
    # Rotary embeddings turn pairs of a head's dimensions: an odd width failed at the first training step.
    if model["arch"] == "llama" and hidden // heads % 2:
        raise PeatError(f"config key 'models.{name}.size.heads': {heads} heads of the hidden size {hidden} are "
                        f"{hidden // heads} wide; llama's rotary position embedding needs an even head width")
    optimizer = model.get("optimizer") or {}
    if optimizer.get("name") == "adamw" and "momentum" in optimizer:
        raise PeatError(f"config key 'models.{name}.optimizer.momentum': adamw takes no momentum (sgd does)")


def _check_batch(name: str, model: dict, dataset: dict) -> None:
    """A batch no larger than the training set (max_train_samples is checked with the schedule):
    the golden job refused it only once it had started, after data preparation."""
    n_train = sizes(model["dataset"], dataset)[0]
    if model["batch_size"] > n_train:
        raise PeatError(f"config key 'models.{name}.batch_size': {model['batch_size']} is more than the "
                        f"{n_train} training examples of dataset {model['dataset']!r}")
    n_train = min(n_train, model.get("max_train_samples") or n_train)
    # As peat.train.fit checks it, before any job: the golden job refused it after data preparation.
    check_records_a_step(f"models.{name}.record.every", model["record"]["every"], model["record"].get("epochs"),
                         n_train // model["batch_size"])


def config_hash(obj) -> str:
    """Short stable hash of a JSON-able config fragment (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_hash(config: dict, model: str) -> str:
    """What a model's golden results depend on: its spec, its dataset, the seed and the torch
    threads (a CPU sum split over more threads rounds differently), and a fine-tuned model's base
    (init_from), whose final weights it starts from."""
    spec = config["models"][model]
    parts = {"model": spec, "dataset": config["datasets"][spec["dataset"]], "seed": config["seed"],
             "threads": config["threads"]}
    if spec.get("init_from"):  # only then: every other model keeps its hash, and its results
        parts["base"] = model_hash(config, spec["init_from"])
    return config_hash(parts)
