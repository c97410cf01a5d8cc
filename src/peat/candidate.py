"""Candidate-kernel training and frequency-based runtime FI (PEAT's RFI) for configured kernels.

Both are golden training with some layers routed through a kernel (``kernels.route``):
candidate training routes them for the whole run; RFI only during part of it (the first
``fraction`` of the steps, or every N-th step), records the error of the kernel's output
against golden on the same inputs at every routed call, and keeps training on the result so
that the growth of errors over consecutive calls can be analysed. Training runs in a child
process (``kernels.run_isolated``): a kernel that raises, segfaults or hangs gives an
``outcome.json`` with its status instead of a failed workflow. A kernel that does not load
(``kernels.check_loads``) fails its job instead, with one line, as in playback.
"""

from __future__ import annotations

import ast
import copy
import csv
import io
import fnmatch
import math
import re
import shutil
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch

from . import errors, kernels, provenance
from .device import for_vendor
from .io import PeatError, read_csv, write_csv, write_json
from .models import layer_ops
from .profiler import hyper_params, layer_input, match_names

# Ops each architecture contains (llama normalises with LlamaRMSNorm: rms_norm).
ARCH_OPS = {"resnet18": {"conv2d", "batch_norm", "linear"}, "resnet34": {"conv2d", "batch_norm", "linear"},
            "resnet50": {"conv2d", "batch_norm", "linear"}, "mobilenet_v2": {"conv2d", "batch_norm", "linear"},
            "efficientnet_b0": {"conv2d", "batch_norm", "linear"}, "llama": {"linear", "rms_norm"},
            "gpt2": {"linear", "layer_norm"}, "bert": {"linear", "layer_norm"}}
CURVES = ("loss", "accuracy", "perplexity")


# -- configuration ---------------------------------------------------------------------------
def models_for(config: dict, name: str) -> list[str]:
    """Models a configured kernel applies to: its ``models`` (default all) that contain its op."""
    spec = config["kernels"][name]
    wanted = spec.get("models") or list(config["models"])
    _known_models(config, wanted, f"kernels.{name}.models")
    applies = [m for m in wanted if spec["op"] in ARCH_OPS[config["models"][m]["arch"]]]
    lacking = [m for m in wanted if m not in applies]
    if spec.get("models") and lacking:  # named on purpose: such a model would silently get no job
        raise PeatError(f"config key 'kernels.{name}.models': model {lacking[0]!r} "
                        f"({config['models'][lacking[0]]['arch']}) has no {spec['op']} layer")
    if not applies:  # by default: no candidate, RFI or playback job, and no word
        archs = ", ".join(f"{m} ({config['models'][m]['arch']})" for m in wanted)
        raise PeatError(f"config key 'kernels.{name}.op': no model has a {spec['op']} layer ({archs or 'no model'}); "
                        "the kernel would run no job")
    return applies


def _known_models(config: dict, names, key: str) -> None:
    for model in names:
        if model not in config["models"]:
            raise PeatError(f"config key '{key}': unknown model {model!r}; defined: {', '.join(config['models'])}")


def rfi_cases(rfi: dict) -> list[str]:
    """Case names: ``f0.25`` (active in the first quarter of the steps), ``every4`` (every 4th step)."""
    return [f"f{f:g}" for f in rfi.get("fractions", [])] + [f"every{n}" for n in rfi.get("every", [])]


def check(config: dict) -> None:
    """Cross-check the kernels, errors and rfi sections (the schema checks their shapes)."""
    for name, spec in config.get("kernels", {}).items():
        where = (spec["op"], spec.get("computation", "forward"))
        if spec.get("error") and _parse(spec["error"], f"kernels.{name}.error").mode == "splitk" \
                and where not in errors.SPLITK:  # every call would raise: each of its jobs a crash
            raise PeatError(f"config key 'kernels.{name}.error': {spec['error']!r}: split-K applies to "
                            f"{errors.SPLITK_WHERE}, not the {' '.join(where)}")
        replayed = config.get("playback", {}).get("computations", kernels.COMPUTATIONS)
        if why := errors.never_replayed(spec.get("error"), where[1], replayed):
            raise PeatError(f"config key 'kernels.{name}.computation': {why}; "
                            "add it there or inject into a replayed computation")
        try:
            sources = kernels.source_files(spec.get("impl", "golden"))
        except PeatError as err:
            raise PeatError(f"config key 'kernels.{name}.impl': {err}") from None
        tree = _parsed(sources[0], f"kernels.{name}.impl") if sources and sources[0].endswith(".py") else None
        declared = _declared_op(sources[0], spec["op"], tree) if sources else None
        if declared not in (None, spec["op"]):  # load() refused it in the job, after golden training
            raise PeatError(f"config key 'kernels.{name}.op': {spec['op']}, but {spec['impl']} is a {declared} "
                            f"kernel (OP = {declared!r})")
        if tree is not None and not _may_define(tree, spec["op"]):
            named = f" (def {spec['op']} is not one of them: name it after the computation)" \
                if _op_function(tree, spec["op"]) else ""
            raise PeatError(f"config key 'kernels.{name}.impl': {spec['impl']} defines none of "
                            f"{', '.join(kernels.COMPUTATIONS)} for op {spec['op']!r}{named}")
        if tree is not None:
            _check_signatures(tree, spec["op"], sources[0], f"kernels.{name}.impl")
        for model in models_for(config, name):
            _check_recorded(config, name, model)
            _check_layers(config, name, model)
    for i, spec in enumerate(config.get("errors", [])):
        _parse(spec, f"errors.{i}")
    chosen = config.get("rfi", {}).get("models") or []
    _known_models(config, chosen, "rfi.models")
    _check_fractions(config.get("rfi", {}).get("fractions", []))
    for name in config.get("rfi", {}).get("kernels", []):
        if name not in config.get("kernels", {}):
            raise PeatError(f"config key 'rfi.kernels': unknown kernel {name!r}; defined: "
                            f"{', '.join(config.get('kernels', {})) or 'none'}")
        if not rfi_cases(config["rfi"]):  # it would get no RFI job, and no word
            raise PeatError(f"config key 'rfi.fractions': [] and rfi.every [] leave rfi kernel {name!r} no RFI case; "
                            "give a fraction or an every-N step, or remove it from rfi.kernels")
        applies = models_for(config, name)
        if chosen and not set(applies) & set(chosen):  # it would get no RFI job, and no word
            raise PeatError(f"config key 'rfi.models': none of them runs rfi kernel {name!r} "
                            f"(it applies to {', '.join(applies)})")


def _check_fractions(fractions) -> None:
    """The job runs the fraction its case name spells (``rfi_cases``, 6 significant digits): one
    with more ran another fraction, and two that shared a name made one job, without a word."""
    for fraction in fractions:
        if float(f"{fraction:g}") != fraction:
            raise PeatError(f"config key 'rfi.fractions': {fraction!r} has more than 6 significant digits; its case "
                            f"f{fraction:g} would run {fraction:g}")


def _parsed(path: str, key: str) -> ast.Module:
    """A Python kernel source's syntax tree, read without running it; code that does not parse
    failed every job of its kernel, the first only after golden training."""
    try:
        # Bytes, as Python reads a module: a UTF-8 BOM (a Windows editor's) or a coding cookie is the
        # file's encoding, where text decoded as UTF-8 made a BOM an "invalid non-printable character".
        return ast.parse(Path(path).read_bytes(), filename=path)
    except (SyntaxError, ValueError) as err:  # ValueError: a null byte, before Python 3.12
        where = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
        raise PeatError(f"config key '{key}': {path}: {type(err).__name__}: {getattr(err, 'msg', err)}{where}") from None


def _declared_op(path: str, op: str, tree: ast.Module | None) -> str | None:
    """The ``OP`` a kernel source sets to a literal, read without running it (``tree``: a Python
    source's, from ``_parsed``; None: a C++ source, which would compile for a minute); None where only
    running it could tell, or where ``load`` does not read OP: a namespace per op (a class or object
    bound to the op's name, a C++ submodule)."""
    if tree is None:
        text = re.sub(r"//[^\n]*|/\*.*?\*/", "", Path(path).read_text(errors="replace"), flags=re.S)  # not compiled
        if f'def_submodule("{op}"' in text:
            return None
        found = re.findall(r'\.attr\(\s*"OP"\s*\)\s*=\s*"(\w+)"', text)
        return found[-1] if found else None
    declared = None
    for node in tree.body:
        bound = _bound_names(node)
        if "*" in bound or (op in bound and not isinstance(node, ast.FunctionDef)):
            return None
        if "OP" in bound:
            value = getattr(node, "value", None)
            literal = isinstance(value, ast.Constant) and isinstance(value.value, str)
            declared = value.value if literal and isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    return declared


# Names through which a module binds names it does not spell out: a star import, a module-level
# __getattr__, globals()[op] = ... (peat.alt_kernels.compiled), setattr, vars(), exec.
_DYNAMIC = {"*", "__getattr__", "globals", "setattr", "vars", "exec", "__dict__"}


def _may_define(tree: ast.Module, op: str) -> bool:
    """Whether a Python kernel source may define one of the computations: False only where none
    of their names, the op's namespace or a way to bind names dynamically appears in it, as with a
    misspelt ``def fwd``, which load() refused in the job, after golden training. What another
    op's namespace holds (``class conv2d: def forward``, ``conv2d = SimpleNamespace(forward=...)``)
    is not looked at: load() never reads it for ``op``."""
    names = {*kernels.COMPUTATIONS, op, *_DYNAMIC}
    others = set(kernels.OPS) - {op}
    outside = [top for top in tree.body if not _binds_only(top, others)]
    for node in (node for top in outside for node in ast.walk(top)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # A function named like the op is no namespace (load reads a routine's module): def linear(...)
            # alone passed here and load() refused it in the job, after golden training.
            found = {node.name} - {op}
        elif isinstance(node, ast.ClassDef):
            found = {node.name}
        elif isinstance(node, ast.alias):
            found = {node.asname or node.name.split(".")[-1]}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # not OP = "linear"
            found = {node.value} & set(kernels.COMPUTATIONS)  # setattr(module, "forward", ...)
        elif isinstance(node, ast.Attribute):  # F.linear(...) defines nothing
            found = {node.attr} if isinstance(node.ctx, ast.Store) or node.attr == "__dict__" else set()
        else:
            found = {getattr(node, "id", None), getattr(node, "arg", None)}
        if found & names:
            return True
    return False


def _binds_only(top: ast.stmt, names: set[str]) -> bool:
    """Whether a top-level statement binds only some of ``names``: a class, or an assignment to plain names."""
    if isinstance(top, ast.ClassDef):
        return top.name in names
    targets = top.targets if isinstance(top, ast.Assign) else [top.target] if isinstance(top, ast.AnnAssign) else []
    return bool(targets) and all(isinstance(t, ast.Name) and t.id in names for t in targets)


def _op_function(tree: ast.Module, op: str) -> bool:
    """Whether a kernel source defines a top-level function named like its op (``def linear``)."""
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == op for n in tree.body)


def _check_signatures(tree: ast.Module, op: str, path: str, key: str) -> None:
    """Each computation a kernel source surely defines can take the arguments peat passes
    (``kernels.CALLS``): a forward without ``bias``, or with a misspelt hyper-parameter, was each of
    its calls' TypeError, a ``crash`` found only after golden training."""
    package = Path(path).parent
    if Path(path).name == "__init__.py" and ((package / f"{op}.py").exists() or (package / op).is_dir()):
        return  # importing its submodule named like the op binds that as the namespace load reads
    for computation, func in _computations(tree, op).items():
        positional, keywords = kernels.CALLS[op][computation]
        if why := _unbindable(func.args, positional, keywords):
            call = ", ".join([*positional, *(["*", *keywords] if keywords else [])])
            # A namespace class's function is called on the class: self gets peat's first tensor.
            method = func not in tree.body and [a.arg for a in func.args.posonlyargs + func.args.args][:1] == ["self"]
            hint = " (on the class, not an instance: a @staticmethod without self)" if method else ""
            raise PeatError(f"config key '{key}': {path}:{func.lineno}: def {computation}({_params(func.args)}) {why}; "
                            f"peat calls {computation}({call}){hint}")


def _computations(tree: ast.Module, op: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """The computations of ``op`` that ``kernels.load`` surely takes from these plain ``def``s: in the
    module, or in a plain class named like the op, each name bound there and nowhere else in the
    source. Whatever else could bind them or change what they take (a decorator, an assignment or
    import, an attribute store such as ``ns.forward = ...`` or ``forward.__defaults__ = ...`` anywhere,
    ``global``, a base class, a dynamic binding) leaves them unread: the kernel may well work."""
    if _binds_dynamically(tree):
        return {}
    others = set(kernels.OPS) - {op}  # what another op's namespace binds inside it is not this op's
    scope = [top for top in tree.body if not _binds_only(top, others)]
    body, plain = tree.body, [[]]
    if holder := _bindings(scope, op):
        namespace = holder[0]
        if len(holder) > 1 or namespace not in tree.body or not isinstance(namespace, _DEFS) \
                or namespace.decorator_list:
            return {}
        if isinstance(namespace, ast.ClassDef):  # else a function named like the op: load reads the module
            if namespace.bases or namespace.keywords:
                return {}
            # As a class attribute a staticmethod is its function; a plain method is too (no instance binds it).
            body, plain = namespace.body, [[], ["staticmethod"]]
    read = {}
    for computation in kernels.COMPUTATIONS:
        found = _bindings(scope, computation)
        if len(found) == 1 and found[0] in body and isinstance(found[0], _FUNCS) \
                and [ast.unparse(d) for d in found[0].decorator_list] in plain:
            read[computation] = found[0]
    return read


_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_DEFS = (*_FUNCS, ast.ClassDef)


def _bindings(scope: list[ast.stmt], name: str) -> list[ast.AST]:
    """Every node under these statements that may bind ``name`` or change what it holds."""
    return [node for top in scope for node in ast.walk(top)
            if isinstance(node, _DEFS) and node.name == name
            or isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load)
            or isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and name in (node.attr, getattr(node.value, "id", None))
            or isinstance(node, ast.alias) and (node.asname or node.name).split(".")[0] == name
            or isinstance(node, ast.Global) and name in node.names]


def _binds_dynamically(tree: ast.Module) -> bool:
    """Whether the source may bind names it does not spell (``_DYNAMIC``; ``locals()`` in a class body)."""
    spelled = ({getattr(node, attr, None) for attr in ("id", "attr", "name")} for node in ast.walk(tree))
    return any(names & (_DYNAMIC | {"locals"}) for names in spelled)


def _unbindable(params: ast.arguments, positional: tuple[str, ...], keywords: tuple[str, ...]) -> str | None:
    """Why a function of ``params`` cannot take ``positional`` by position and ``keywords`` by name,
    bound as Python binds a call; None where it can."""
    ordered = [a.arg for a in params.posonlyargs + params.args]
    if len(positional) > len(ordered) and params.vararg is None:
        return f"cannot take the {positional[len(ordered)]} argument peat passes"
    filled = dict(zip(ordered, positional))  # parameter: what peat passes there
    by_name = {a.arg for a in params.args + params.kwonlyargs}  # not positional-only
    for keyword in keywords:
        if keyword in filled and keyword not in {a.arg for a in params.posonlyargs}:
            return f"gets two values for {keyword}: peat passes {filled[keyword]} in its place and {keyword} by name"
        if keyword in by_name - filled.keys():
            filled[keyword] = keyword
        elif params.kwarg is None:
            return f"cannot take the {keyword} argument peat passes (by name)"
    defaulted = ordered[len(ordered) - len(params.defaults):] + \
        [a.arg for a, d in zip(params.kwonlyargs, params.kw_defaults) if d is not None]
    missing = [p for p in ordered + [a.arg for a in params.kwonlyargs] if p not in filled and p not in defaulted]
    return f"requires {missing[0]}, which peat does not pass" if missing else None


def _params(params: ast.arguments) -> str:
    """A signature as written, without its annotations (one line)."""
    bare = copy.deepcopy(params)
    for arg in (*bare.posonlyargs, *bare.args, *bare.kwonlyargs, bare.vararg, bare.kwarg):
        if arg is not None:
            arg.annotation = None
    return ast.unparse(bare)


def _bound_names(node: ast.stmt) -> set[str]:
    """Names a top-level statement binds (``*`` for a star import)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    targets = {ast.Assign: lambda n: n.targets, ast.AnnAssign: lambda n: [n.target],
               ast.AugAssign: lambda n: [n.target]}.get(type(node), lambda n: [])(node)
    return {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}


def _check_layers(config: dict, name: str, model: str) -> None:
    """Each of a kernel's layer globs matches a layer of its op in the model (from the config,
    ``models.layer_ops``): a glob matching nothing crashed the candidate training after golden
    training; one matching only layers of another op failed so too, or beside other globs was
    skipped without a word. Playback replays recorded layers only, so each glob must also match
    one the model records: it failed there after golden training (and candidate training)."""
    spec, key = config["kernels"][name], f"kernels.{name}.layers"
    ops = layer_ops(config["models"][model])
    recorded = config["models"][model]["record"]["layers"]
    for pattern in spec.get("layers") or []:
        hits = match_names(list(ops), [pattern], key, where=f" of model {model!r}")
        if not any(ops[n] == spec["op"] for n in hits):
            others = sorted({ops[n] for n in hits})
            raise PeatError(f"config key '{key}': {pattern!r} matches no {spec['op']} layer of model {model!r}, "
                            f"only {'/'.join(others)} ones ({', '.join(hits[:4])})")
        if not any(ops[n] == spec["op"] and any(fnmatch.fnmatchcase(n, g) for g in recorded) for n in hits):
            raise PeatError(f"config key '{key}': {pattern!r} matches no {spec['op']} layer model {model!r} "
                            f"records (models.{model}.record.layers: {', '.join(recorded)})")


def _check_recorded(config: dict, name: str, model: str) -> None:
    """A layer a kernel names outright (no glob) must be one its model records: playback replays
    recorded layers only, and failed on it after golden training."""
    recorded = config["models"][model]["record"]["layers"]
    for layer in config["kernels"][name].get("layers") or []:
        if not re.search(r"[*?[]", layer) and not any(fnmatch.fnmatchcase(layer, g) for g in recorded):
            raise PeatError(f"config key 'kernels.{name}.layers': {layer!r} is not among the layers model "
                            f"{model!r} records (models.{model}.record.layers: {', '.join(recorded)})")


def _parse(spec: str, key: str) -> errors.ErrorModel:
    # The schema's pattern cannot tell that a burst does not fit its bits (bit_flip:signx2).
    try:
        return errors.parse(spec)
    except PeatError as err:
        raise PeatError(f"config key '{key}': {err}") from None


def build(name: str, spec: dict) -> kernels.Kernel:
    """The configured kernel: ``impl`` (default golden), made faulty by ``error`` if given."""
    kernel = kernels.load(spec.get("impl", "golden"), spec["op"], name=name)
    if spec.get("error"):
        kernel = errors.faulty(kernel, spec["error"], spec.get("computation", "forward"), seed=spec.get("seed", 0))
        kernel.name = name
    return kernel


def target_layers(spec: dict, context: str | Path | None) -> list[str] | None:
    """The kernel's ``layers`` globs, else the recorded layers of its op, else None (all of the op)."""
    if spec.get("layers"):
        return list(spec["layers"])
    recorded = kernels.layer_ops(context, None, spec["op"]) if context else []
    return recorded or None


# -- runs ------------------------------------------------------------------------------------
class PartialRows:
    """A table's rows as they are made (the training curve, RFI's calls), appended to ``path`` and
    flushed row by row (O(1) a row), so that a run that crashes, is killed or times out leaves its rows
    up to the last one. A kill in the middle of a write leaves at most a torn last line, without its
    newline: ``read`` drops it, so a reader never sees a half-written row."""

    def __init__(self, path: Path):
        self.path, self.file, self.writer, self.header = path, None, None, None

    def add(self, row: dict) -> None:
        if self.file is None:  # on the first row: a run that makes none (no RFI calls) leaves no file
            self.file = open(self.path, "w", newline="")
            self.writer = csv.writer(self.file, lineterminator="\n")
            self.header = list(row)
            self.writer.writerow(self.header)
        self.writer.writerow([row[k] for k in self.header])
        self.file.flush()  # on disk row by row: a run killed later keeps it

    def __enter__(self) -> PartialRows:
        return self

    def __exit__(self, *_) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    @staticmethod
    def read(path: Path) -> pd.DataFrame | None:
        """The complete rows (None: no file, or not even its header complete); numbers as written."""
        text = path.read_text() if path.exists() else ""
        complete = text[:text.rfind("\n") + 1]
        return pd.read_csv(io.StringIO(complete)) if complete else None


def _routed_training(name, spec, kernel_name, kspec, layers, data_path, out_dir, train_kw, schedule=None):
    """Child process body: route, train, return (metrics, per-call errors); the routed layers are in
    ``PARTIAL_LAYERS``, the curve and the calls so far in ``PARTIAL_CURVE`` and ``PARTIAL_CALLS``."""
    from .train import train_model

    kernel = build(kernel_name, kspec)
    calls, state = [], {"step": 0, "epoch": 0}
    scheduled = schedule_predicate(schedule, state, _total_steps(spec, data_path)) if schedule else None
    curve, calls_so_far = PartialRows(Path(out_dir) / PARTIAL_CURVE), PartialRows(Path(out_dir) / PARTIAL_CALLS)

    def record_call(row):  # returned with the result; on disk in case the run does not finish
        calls.append(row)
        calls_so_far.add(row)

    def prepare(model):
        # RFI schedules training steps; validation passes in between run golden.
        active = (lambda: model.training and scheduled()) if scheduled else None
        chosen = kernels.select(model, kernel.op, layers, key=f"kernels.{kernel_name}.layers")
        modules = dict(model.named_modules())
        for layer in chosen:  # one kernel per layer under RFI, so each call's error names its layer
            routed_kernel = kernel if schedule is None else \
                monitored(kernel, layer, record_call, state, hyper_params(modules[layer]))
            kernels.route(model, routed_kernel, [layer], active=active)
            if kspec.get("error") and kspec.get("computation") in ("input_grad", "weight_grad"):
                _warn_uninjected(modules[layer], layer, kernel_name, kspec, Path(out_dir) / PARTIAL_UNINJECTED)
        # On disk before training: a run that crashes or times out still names what it routed.
        (Path(out_dir) / PARTIAL_LAYERS).write_text("".join(f"{layer}\n" for layer in chosen))

    def before_step(step, epoch):
        state.update(step=step, epoch=epoch)

    with curve, calls_so_far:
        metrics = train_model(name, spec, data_path, out_dir, prepare_model=prepare, before_step=before_step,
                              progress=False, on_row=curve.add, **train_kw)
    # Plain containers: the parent reads them back with torch.load(weights_only=True).
    return {"metrics": metrics.to_dict("list"), "calls": pd.DataFrame(calls).to_dict("list")}


def _warn_uninjected(module, layer: str, kernel_name: str, kspec: dict, listed: Path) -> None:
    """One line, at the layer's first training forward, where its ``error`` can never be injected:
    autograd computes no input gradient for an input that needs none (the first layer, fed by data)
    nor a weight gradient for a frozen weight, so the run trained clean and read as the error absorbed.
    A warning, not a failure: the kernel's other layers still get it."""
    computation = kspec["computation"]

    def check(mod, args, kwargs):
        if not (mod.training and torch.is_grad_enabled()):
            return  # validation: no backward at all
        handle.remove()
        x = layer_input(f"layer {layer!r}", kspec["op"], args, kwargs, "routed")
        needed = mod.weight is not None and mod.weight.requires_grad if computation == "weight_grad" else torch.is_tensor(x) and x.requires_grad
        if not needed:
            why = "its weight is frozen (or absent)" if computation == "weight_grad" else \
                "its input needs no gradient (data, or only frozen layers before it)"
            errors.warn_never_injected(kernel_name, kspec["error"], layer,
                                       f"the backward pass computes no {computation} there, as {why}")
            with listed.open("a") as f:
                f.write(f"{layer}\n")

    handle = module.register_forward_pre_hook(check, with_kwargs=True)


def _preload(spec: dict) -> None:
    """Import the model library here, once: forked children inherit it instead of importing again."""
    from .models import IMAGE_ARCHS

    __import__("torchvision" if spec["arch"] in IMAGE_ARCHS else "transformers")
    from . import train  # noqa: F401


def _total_steps(spec: dict, data_path) -> int:
    from .data import load

    data = load(data_path)
    n = len(data.train.y) if spec.get("max_train_samples") is None else min(len(data.train.y), spec["max_train_samples"])
    return (n // spec.get("batch_size", 32)) * spec["epochs"]


def schedule_predicate(schedule: str, state: dict, total_steps: int):
    """``active()`` for an RFI case name: ``f<fraction>`` or ``every<N>``."""
    if schedule.startswith("every"):
        period = int(schedule[5:])
        return lambda: state["step"] % period == 0
    # Halves up, as a user reads "round" (round() goes to even: f0.25 of 10 steps routed 2), of the
    # fraction as written: the float 0.7 is just below 0.7, so 0.7 x 45 = 31.5 in floats rounded down.
    last = max(1, int((Decimal(schedule[1:]) * total_steps).to_integral_value(ROUND_HALF_UP)))
    return lambda: state["step"] < last


def monitored(kernel: kernels.Kernel, layer: str, on_row: Callable[[dict], None], state: dict,
              attrs: dict | None = None) -> kernels.Kernel:
    """``kernel`` that also compares each output with golden on the same inputs: ``on_row`` gets one
    row per call. ``attrs``: the layer's (``profiler.hyper_params``)."""
    # Every computation is routed through the kernel here: what it leaves to golden must be
    # golden as PyTorch computes it on this layer (a transposed one's weight gradient), or
    # calls.csv showed the other product's rounding as the kernel's error.
    kernel, golden = kernels.on_layer(kernel, attrs), kernels.golden(kernel.op, attrs)
    counters = dict.fromkeys(kernels.COMPUTATIONS, 0)

    def wrap(computation):
        func, reference = kernel.computation(computation), golden.computation(computation)

        def run(*args, **kwargs):
            clones = {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
            # Golden first: a kernel that writes into its inputs must be scored against golden on
            # the inputs it was given. Clones: golden batch norm must not update stats twice.
            with torch.no_grad():
                ref = reference(*args, **clones)
            out = func(*args, **kwargs)
            # A result of another shape, dtype or device is left to the router, which stops it as shape_mismatch.
            if not kernels.wrong_result(out, ref.shape, ref.dtype, ref.device):
                on_row({"step": state["step"], "epoch": state["epoch"], "layer": layer,
                        "computation": computation, "call": counters[computation], **error_scores(out, ref)})
            counters[computation] += 1
            return out

        return run

    return kernels.Kernel(name=kernel.name, op=kernel.op, custom=kernels.COMPUTATIONS, source=kernel.source,
                          **{c: wrap(c) for c in kernels.COMPUTATIONS})


def error_scores(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """PEAT's scores of one call's error: max, mean, mean of the top 10%, variance; plus non-finite count."""
    out, ref = out.detach().double().flatten(), ref.detach().double().flatten()
    diff = (out - ref).abs()
    # Golden's own NaN or inf reproduced is no error (inf - inf is NaN), as in playback's
    # scores.abs_error: after a diverged step every later call has non-finite inputs.
    diff[(out == ref) | (out.isnan() & ref.isnan())] = 0
    finite = diff[torch.isfinite(diff)]
    top = torch.topk(finite, max(1, finite.numel() // 10)).values if finite.numel() else finite
    stat = (lambda f: float(f(finite))) if finite.numel() else (lambda f: float("nan"))
    return {"max": stat(torch.max), "mean": stat(torch.mean), "top10": float(top.mean()) if top.numel() else float("nan"),
            "var": stat(lambda t: t.var(unbiased=False)), "nonfinite": int(diff.numel() - finite.numel()),
            "changed": int((diff != 0).sum())}


def compare(golden: pd.DataFrame, candidate: pd.DataFrame | None) -> pd.DataFrame:
    """Golden and candidate curves side by side (train steps and validation points) with differences."""
    keys = ["step", "epoch", "split"]
    base = golden[keys + list(CURVES)]
    if candidate is None or candidate.empty:
        candidate = pd.DataFrame(columns=keys + list(CURVES))
    merged = base.merge(candidate[keys + list(CURVES)], on=keys, how="left", suffixes=("_golden", "_candidate"))
    for curve in CURVES:
        merged[f"{curve}_diff"] = merged[f"{curve}_candidate"].astype(float) - merged[f"{curve}_golden"]
    return merged


def _summary(frame: pd.DataFrame, metrics: pd.DataFrame | None) -> dict:
    val = frame[frame["split"] == "val"]
    last = val.iloc[-1] if len(val) else None
    out = {}
    if last is not None:
        out |= {f"final_val_{c}_{w}": float(last[f"{c}_{w}"]) for c in ("loss", "accuracy") for w in ("golden", "candidate")}
    # Judged on the candidate's own rows: after a crash, the steps it never reached are NaN in the merge.
    losses = metrics["loss"].to_numpy(float) if metrics is not None else np.zeros(0)
    out["nonfinite_loss"] = bool(not np.isfinite(losses).all() and not frame["loss_golden"].isna().any())
    # A loss gone NaN has no maximum difference (null): skipping its steps gave that of the
    # steps before, 0.0 where the NaN came from a weight gradient, as if it trained as golden.
    out["max_abs_loss_diff"] = math.nan if out["nonfinite_loss"] else float(frame["loss_diff"].abs().max())
    out["steps_trained"] = int((metrics["split"] == "train").sum()) if metrics is not None else 0
    return out


def train_candidate(model: str, spec: dict, kernel_name: str, kspec: dict, data_path, golden_dir, out_dir, *,
                    vendor: str = "cpu", seed: int = 0, threads: int = 1, init=None, config_hash: str = "",
                    schedule: str | None = None) -> dict:
    """Candidate training (``schedule`` None) or one RFI case; writes outcome.json and compare.csv
    (and, for an RFI case, calls.csv)."""
    out_dir, golden_dir = Path(out_dir), Path(golden_dir)
    # Here, not in the training child, where a missing GPU would become the kernel's crash.
    for_vendor(vendor)
    # A kernel that does not load fails the job with one line and writes nothing, as in playback
    # (the training child below would record it as a crash, and downstream jobs would run on it).
    kernels.check_loads(kspec.get("impl", "golden"), kspec["op"], timeout=kspec.get("train_timeout", 3600))
    # A rerun means the kernel changed: never resume from what an older version left behind.
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    layers = target_layers(kspec, golden_dir / "context.h5")
    # Read before training: a damaged golden curve is one line naming it, not a traceback after hours.
    golden = read_csv(golden_dir / "metrics.csv", required=("step", "epoch", "split", *CURVES))
    record = {"model": model, "vendor": vendor, "kernel": kernel_name, "op": kspec["op"],
              "impl": kspec.get("impl", "golden"), "error": kspec.get("error"),
              "computation": kspec.get("computation", "forward") if kspec.get("error") else None, "schedule": schedule,
              "layers_requested": layers}
    # A rerun starts afresh (above) and no rule reads a candidate's or an RFI case's epoch
    # checkpoints: their results are curves, calls and final weights. So neither is written.
    train_kw = dict(vendor=vendor, seed=seed, threads=threads, init=init, config_hash=config_hash,
                    record=schedule is None, resumable=False)
    spec = dict(spec, checkpoint_epochs=[])
    _preload(spec)
    outcome = kernels.run_isolated(_routed_training, model, spec, kernel_name, kspec, layers, data_path, out_dir,
                                   train_kw, schedule, timeout=kspec.get("train_timeout", 3600))
    listed = out_dir / PARTIAL_LAYERS
    routed = listed.read_text().splitlines() if listed.exists() else []  # none: it failed before routing
    uninjected = out_dir / PARTIAL_UNINJECTED
    uninjected = uninjected.read_text().splitlines() if uninjected.exists() else []
    # A run that did not finish keeps its curve and calls up to where it stopped.
    metrics, calls = ((pd.DataFrame(outcome.value["metrics"]), pd.DataFrame(outcome.value["calls"])) if outcome.ok
                      else (PartialRows.read(out_dir / PARTIAL_CURVE), PartialRows.read(out_dir / PARTIAL_CALLS)))
    frame = compare(golden, metrics)
    write_csv(out_dir / "compare.csv", frame)
    if schedule is not None:
        write_csv(out_dir / "calls.csv", calls if calls is not None and not calls.empty
                  else pd.DataFrame(columns=CALL_COLUMNS))
    for partial in PARTIALS:  # compare.csv, calls.csv and outcome.json hold them now
        (out_dir / partial).unlink(missing_ok=True)
    # train.fit makes the folder golden training declares as an output; with no epoch checkpoint
    # written (above) it would be left here empty.
    if (out_dir / "checkpoints").is_dir():
        (out_dir / "checkpoints").rmdir()
    record |= outcome.record() | {"layers": routed, "layers_not_injected": uninjected} | _summary(frame, metrics)
    record["provenance"] = provenance.stamp(config_hash, vendor)
    write_json(out_dir / "outcome.json", record)
    return record


PARTIAL_CURVE, PARTIAL_CALLS, PARTIAL_LAYERS = ".curve.csv", ".calls.csv", ".layers"  # in the run's folder while it trains
PARTIAL_UNINJECTED = ".uninjected"
PARTIALS = (PARTIAL_CURVE, PARTIAL_CALLS, PARTIAL_LAYERS, PARTIAL_UNINJECTED)
CALL_COLUMNS = ["step", "epoch", "layer", "computation", "call", "max", "mean", "top10", "var", "nonfinite", "changed"]
