"""The kernel interface: golden ops, user kernels, replaying one recorded computation, routing.

PEAT splits every layer into three computations, each a separate GPU kernel in practice:
``forward``, ``input_grad`` and ``weight_grad``. A kernel is a Python module (file path,
dotted import, or a C++ source compiled on first use) defining any of these functions for
one op; a missing one falls back to the golden implementation (PyTorch's own op).

Signatures (all tensors; weights in ``nn.Linear`` / ``nn.Conv2d`` convention):

    linear      forward(x, weight, bias)
                input_grad(grad_out, weight)
                weight_grad(grad_out, x)
    conv2d      forward(x, weight, bias, *, stride, padding, dilation, groups)
                input_grad(grad_out, weight, *, input_shape, stride, padding, dilation, groups)
                weight_grad(grad_out, x, *, weight_shape, stride, padding, dilation, groups)
    batch_norm  forward(x, weight, bias, *, running_mean, running_var, training, momentum, eps)
                    (when training, updates running_mean/running_var in place, as F.batch_norm does)
                input_grad(grad_out, x, weight, *, running_mean, running_var, training, eps)
                weight_grad(grad_out, x, *, running_mean, running_var, training, eps)
    layer_norm  forward(x, weight, bias, *, normalized_shape, eps)
                input_grad(grad_out, x, weight, *, normalized_shape, eps)
                weight_grad(grad_out, x, *, normalized_shape, eps)
    rms_norm    forward(x, weight, bias, *, normalized_shape, eps)
                    (bias is always None: RMSNorm has none; it is passed so that every forward is
                    called as ``forward(x, weight, bias, ...)``. weight is None without affine)
                input_grad(grad_out, x, weight, *, normalized_shape, eps)
                weight_grad(grad_out, x, *, normalized_shape, eps)

rms_norm is ``y = weight * x / sqrt(mean(x^2 over normalized_shape) + eps)``: ``torch.nn.RMSNorm``
(``F.rms_norm``; its eps None is recorded as float32's epsilon, as it uses) and transformers'
``LlamaRMSNorm`` (recorded with ``variant: llama``, whose golden repeats its ops one by one: float32
statistics, the weight applied after rounding back to the input's dtype). Golden's gradients are
autograd's through that same forward.

The bias gradient is always golden (a plain reduction of ``grad_out``). A module with
top-level functions should say which op it serves (``OP = "conv2d"``); a module serving
several ops defines a namespace per op instead (``class linear: forward = ...``).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import errno
import fnmatch
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import io
import numbers
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from .io import PeatError, os_error_line
from .profiler import layer_input

OPS = ("linear", "conv2d", "batch_norm", "layer_norm", "rms_norm")
COMPUTATIONS = ("forward", "input_grad", "weight_grad")
# The recorded tensor each computation reproduces (see the context file in docs/design.md).
TARGET = {"forward": "O", "input_grad": "dA", "weight_grad": "dW"}
CPP_SUFFIXES = (".cpp", ".cc", ".cxx", ".cu")
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Kernel:
    """One op's three computations; ``custom`` lists those the kernel defines itself."""

    name: str
    op: str
    forward: Callable
    input_grad: Callable
    weight_grad: Callable
    custom: tuple[str, ...] = ()
    source: str | None = None  # the file it came from (a workflow input), None for golden
    meta: dict = field(default_factory=dict)

    def computation(self, computation: str) -> Callable:
        if computation not in COMPUTATIONS:
            raise PeatError(f"unknown computation {computation!r}; allowed: {', '.join(COMPUTATIONS)}")
        return getattr(self, computation)


def require(kernel, where: str) -> None:
    """One line for a kernel named by its impl (kernel="kernels/my_gemm.py"), which failed later
    with an AttributeError ('str' object has no attribute 'op'); ``where`` names the call."""
    if not isinstance(kernel, Kernel):
        raise PeatError(f"{where}: kernel={kernel!r} is not a kernel; load one with "
                        "peat.kernels.load(impl, op), e.g. kernels.load('kernels/my_gemm.py', 'linear')")


# -- golden ops ---------------------------------------------------------------------------
def _linear_weight_grad(grad_out, x):
    return grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _transposed_weight_grad(grad_out, x):
    """``_linear_weight_grad`` of a layer that stores its weight transposed (GPT-2's ``Conv1D``,
    y = x W + b): PyTorch computes x^T dO there, not (dO^T x)^T, and some BLAS (MKL on AMD CPUs)
    round the two products differently."""
    return (x.reshape(-1, x.shape[-1]).t() @ grad_out.reshape(-1, grad_out.shape[-1])).t()


def _conv_input_grad(grad_out, weight, *, input_shape, stride, padding, dilation, groups):
    return torch.nn.grad.conv2d_input(list(input_shape), weight, grad_out, stride, padding, dilation, groups)


def _conv_weight_grad(grad_out, x, *, weight_shape, stride, padding, dilation, groups):
    return torch.nn.grad.conv2d_weight(x, list(weight_shape), grad_out, stride, padding, dilation, groups)


def _bn_forward(x, weight, bias, *, running_mean, running_var, training, momentum, eps):
    return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


def _bn_backward(grad_out, x, weight, running_mean, running_var, training, eps, mask, stats=()):
    training = bool(training or running_mean is None)
    # The statistics autograd saves (``stats`` when the golden forward kept them, else recomputed),
    # so golden routing is bit-identical to PyTorch.
    if not stats:
        stats = torch.ops.aten.native_batch_norm(x, None, None, None, None, True, 0.0, eps)[1:] \
            if training else (None, None)
    mean, invstd = stats
    if weight is None:
        weight = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    return torch.ops.aten.native_batch_norm_backward(
        grad_out, x, weight, running_mean, running_var, mean, invstd, training, eps, mask)


def _bn_input_grad(grad_out, x, weight, *, running_mean, running_var, training, eps):
    return _bn_backward(grad_out, x, weight, running_mean, running_var, training, eps, [True, False, False])[0]


def _bn_weight_grad(grad_out, x, *, running_mean, running_var, training, eps):
    return _bn_backward(grad_out, x, None, running_mean, running_var, training, eps, [False, True, False])[1]


def _ln_forward(x, weight, bias, *, normalized_shape, eps):
    return F.layer_norm(x, list(normalized_shape), weight, bias, eps)


def _ln_backward(grad_out, x, weight, normalized_shape, eps, mask, stats=()):
    mean, rstd = stats or torch.ops.aten.native_layer_norm(x, list(normalized_shape), None, None, eps)[1:]
    if weight is None and not (mask[1] or mask[2]):  # no affine: PyTorch's own call (a weight of ones rounds differently)
        return torch.ops.aten.native_layer_norm_backward(grad_out, x, list(normalized_shape), mean, rstd, None, None,
                                                         mask)
    if weight is None:  # the weight grad alone (playback): the op needs a weight to give one
        weight = torch.ones(list(normalized_shape), dtype=x.dtype, device=x.device)
    return torch.ops.aten.native_layer_norm_backward(grad_out, x, list(normalized_shape), mean, rstd, weight,
                                                     torch.zeros_like(weight), mask)


def _ln_input_grad(grad_out, x, weight, *, normalized_shape, eps):
    return _ln_backward(grad_out, x, weight, normalized_shape, eps, [True, False, False])[0]


def _ln_weight_grad(grad_out, x, *, normalized_shape, eps):
    return _ln_backward(grad_out, x, None, normalized_shape, eps, [False, True, False])[1]


def _rms_torch(x, weight, bias=None, *, normalized_shape, eps):
    """torch.nn.RMSNorm's forward (``bias``: always None, see the signatures above)."""
    return F.rms_norm(x, list(normalized_shape), weight, eps)


def _rms_llama(x, weight, bias=None, *, normalized_shape, eps):
    """transformers' LlamaRMSNorm.forward op for op (its normalized shape is the last dimension):
    statistics in float32, or in float64 for the reference (a float64 input stays float64)."""
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.to(dtype)
    return h if weight is None else weight * h


RMS_VARIANTS = {"torch": _rms_torch, "llama": _rms_llama}  # hyper_params' "variant" of an rms_norm layer


def _rms_backward(forward, grad_out, x, weight, normalized_shape, eps, mask):
    """(input, weight, bias) gradients where ``mask`` says: autograd's backward through ``forward``,
    so a routed layer's gradients are bit-identical to the module's own. A weight grad asked without
    a weight (playback's weight_grad has none) uses ones: the weight does not enter its own gradient."""
    with torch.inference_mode(False), torch.enable_grad():
        if weight is None and mask[1]:
            weight = torch.ones(list(normalized_shape), dtype=x.dtype, device=x.device)
        x, weight, grad_out = (_leaf(t, m) for t, m in zip((x, weight, grad_out), (mask[0], mask[1], False)))
        out = forward(x, weight, None, normalized_shape=normalized_shape, eps=eps)
        wanted = [t for t, m in zip((x, weight), mask) if m]
        grads = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
    return next(grads) if mask[0] else None, next(grads) if mask[1] else None, None


def _leaf(t, grad: bool):
    """``t`` as a new autograd leaf; a copy where it was made under inference_mode (playback's
    operands), which autograd cannot save for the backward."""
    if t is None:
        return None
    return (t.clone() if t.is_inference() else t).detach().requires_grad_(grad)


def _rms_computations(forward) -> dict:
    def input_grad(grad_out, x, weight, *, normalized_shape, eps):
        return _rms_backward(forward, grad_out, x, weight, normalized_shape, eps, [True, False, False])[0]

    def weight_grad(grad_out, x, *, normalized_shape, eps):
        return _rms_backward(forward, grad_out, x, None, normalized_shape, eps, [False, True, False])[1]

    return dict(forward=forward, input_grad=input_grad, weight_grad=weight_grad)


_RMS_GOLDEN = {variant: _rms_computations(forward) for variant, forward in RMS_VARIANTS.items()}


GOLDEN = {
    "linear": dict(forward=F.linear, input_grad=lambda grad_out, weight: grad_out @ weight,
                   weight_grad=_linear_weight_grad),
    "conv2d": dict(forward=lambda x, weight, bias, **hp: F.conv2d(x, weight, bias, **hp),
                   input_grad=_conv_input_grad, weight_grad=_conv_weight_grad),
    "batch_norm": dict(forward=_bn_forward, input_grad=_bn_input_grad, weight_grad=_bn_weight_grad),
    "layer_norm": dict(forward=_ln_forward, input_grad=_ln_input_grad, weight_grad=_ln_weight_grad),
    "rms_norm": _RMS_GOLDEN["torch"],
}


def _rms_variant(attrs: dict | None) -> str:
    variant = (attrs or {}).get("variant", "torch")
    if variant not in RMS_VARIANTS:
        raise PeatError(f"rms_norm layer: unknown variant {variant!r}; known: {', '.join(RMS_VARIANTS)}")
    return variant


def _check_op(op: str, key: str = "op") -> None:
    if op not in OPS:
        raise PeatError(f"{key}: unknown op {op!r}; allowed: {', '.join(OPS)}")


def golden(op: str, attrs: dict | None = None) -> Kernel:
    """PyTorch's own op (float32 inputs give the golden result, float64 the reference); ``attrs``:
    the layer's (recorded or routed), for a layer storing its weight transposed or an rms_norm's variant."""
    _check_op(op)
    own = {"weight_grad": _transposed_weight_grad} if op == "linear" and (attrs or {}).get("transposed") else {}
    if op == "rms_norm":
        own = _RMS_GOLDEN[_rms_variant(attrs)]
    return Kernel(name="golden", op=op, **(GOLDEN[op] | own))


def on_layer(kernel: Kernel, attrs: dict) -> Kernel:
    """``kernel`` with the computations it leaves to golden computed as golden does on a layer of
    ``attrs`` (a transposed layer's weight gradient, see ``golden``); ``kernel`` itself where that changes nothing."""
    gold = golden(kernel.op, attrs)
    fallback = {}
    for c in COMPUTATIONS:
        func, base, own = kernel.computation(c), GOLDEN[kernel.op][c], gold.computation(c)
        if own is not base and (c not in kernel.custom or hasattr(func, "inner")):
            if (rebased := _rebased(func, base, own)) is not func:
                fallback[c] = rebased
    return dataclasses.replace(kernel, **fallback) if fallback else kernel


def _rebased(func: Callable, base: Callable, own: Callable) -> Callable:
    """``func`` with golden's ``base`` replaced by ``own``, also beneath an error injected into its
    result (``peat.errors.faulty`` of golden: a deliberately faulty kernel's fault alone differs)."""
    if func is base:
        return own
    inner = getattr(func, "inner", None)
    if inner is None:
        return func
    rebased = _rebased(inner, base, own)
    return func if rebased is inner else func.around(rebased)


# -- loading user kernels -------------------------------------------------------------------
def load(impl: str, op: str, name: str | None = None) -> Kernel:
    """A kernel from ``impl``: "golden", a .py file, a C++ source, or a dotted import."""
    _check_op(op)
    # A file by its stem; a dotted import by its last part (Path would take ".im2col" for a suffix).
    name = name or (Path(impl).stem if impl.endswith((".py", *CPP_SUFFIXES)) else impl).split(".")[-1]
    if impl == "golden":
        return dataclasses.replace(golden(op), name=name)
    if not shipped(impl):  # its calls may run in this process (playback's after the first)
        _keep_main()
    module, source = _import(impl)
    namespace = getattr(module, op, None)
    if namespace is None or inspect.isroutine(namespace):
        namespace = module  # a top-level function named like the op is not a namespace
        declared = getattr(module, "OP", op)
        if declared != op:
            raise PeatError(f"{impl}: is a {declared} kernel (OP = {declared!r}), not {op}")
    funcs = {c: getattr(namespace, c) for c in COMPUTATIONS if callable(getattr(namespace, c, None))}
    if not funcs:
        raise PeatError(f"{impl}: defines none of {', '.join(COMPUTATIONS)} for op {op!r}")
    return Kernel(name=name, op=op, **(GOLDEN[op] | funcs), custom=tuple(funcs), source=source)


def shipped(impl: str) -> bool:
    """Golden or one of peat's own modules: code this project tests, loaded without a child."""
    return impl == "golden" or impl.startswith("peat.")


# Compiling a C++ source takes about a minute on 2 cores (longer on a busy machine) and happens in
# the loading child, so it gets at least this long: a job's timeout is meant for kernel calls.
CPP_BUILD_TIMEOUT = 1800.0


def check_loads(impl: str, op: str, *, timeout: float) -> None:
    """Load a user kernel once in a forked child: module-level code that segfaults, exits or hangs
    would take the job down (or hang it for ever) with no word; here it fails with one line naming
    the kernel, as a kernel that raises on import does. The caller then loads it as usual."""
    if shipped(impl):
        return
    if impl.endswith(CPP_SUFFIXES):
        timeout = max(timeout, CPP_BUILD_TIMEOUT)
    outcome = run_isolated(_load_error, impl, op, timeout=timeout)
    if outcome.ok and not outcome.value:
        return
    if outcome.ok:  # load raised: its own one-line message
        raise PeatError(outcome.value)
    what = (f"loading the kernel timed out after {timeout:g} s" if outcome.status == "timeout"
            else f"{outcome.message.removesuffix(' without a result')} while loading the kernel")
    raise PeatError(f"{_label(impl)}: {what}")


def _load_error(impl: str, op: str) -> str:
    """Child body of ``check_loads``: "" when ``impl`` loads, else the one line saying why not."""
    try:
        load(impl, op)
    except PeatError as err:
        return str(err)
    except BaseException as err:  # sys.exit() at module level, which load's handlers let through
        return _import_failed(impl, err)
    return ""


def _label(impl: str) -> str:
    """How load's messages name a kernel: a file by its path, a module by its import path."""
    return impl if impl.endswith(".py") or impl.endswith(CPP_SUFFIXES) else f"kernel impl {impl!r}"


def _import_failed(impl: str, err: BaseException) -> str:
    return f"{_label(impl)}: import failed: {_failure(err)[1]}"  # its first line: torch's errors run on


def source_of(impl: str) -> str | None:
    """The file a kernel spec refers to, without importing it (for workflow inputs)."""
    if impl == "golden":
        return None
    if impl.endswith(".py") or impl.endswith(CPP_SUFFIXES):
        return impl
    try:
        spec = importlib.util.find_spec(impl)
    except (ImportError, ValueError):
        spec = None
    except Exception as err:  # finding mypkg.kern imports mypkg: its own code failed (the config check's traceback)
        raise PeatError(_import_failed(impl, err)) from None
    if spec is None or spec.origin is None:
        raise PeatError(f"kernel impl {impl!r}: no such file or importable module")
    origin = Path(spec.origin)
    if not origin.is_file():  # "frozen" or "built-in" (os.path, sys): no file whose edit reruns its jobs
        raise PeatError(f"kernel impl {impl!r}: a {spec.origin} module without a source file; "
                        "a kernel is a Python or C++ file, or a module or package of them")
    return str(origin.relative_to(REPO)) if origin.is_relative_to(REPO) else str(origin)


def source_files(impl: str) -> list[str]:
    """Files whose change must rerun a kernel's jobs: its source, plus for a dotted import (a
    shipped ``peat.alt_kernels`` module or a user's package) the ``_*.py`` modules beside it that
    it imports, directly or through one another."""
    source = source_of(impl)
    if source is None:
        return []
    if impl.endswith(".py") or impl.endswith(CPP_SUFFIXES):
        path = _resolve(impl)
        return [str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)]
    origin = Path(source) if Path(source).is_absolute() else REPO / source
    helpers = sorted(p for p in origin.parent.glob("_*.py") if p.name != "__init__.py")
    package = impl if origin.name == "__init__.py" else impl.rpartition(".")[0]
    # Every helper of the folder reran every kernel in it: editing _norm.py reran im2col's jobs.
    imported, todo = [], [origin]
    while todo:
        names = _sibling_imports(todo.pop(), package)
        if names is None:  # does not parse (its load says so): any helper may be one it imports
            return [str(p) for p in [origin, *helpers]]
        found = [p for p in helpers if p.stem in names and p not in imported]
        imported += found
        todo += found
    return [str(p) for p in [origin, *sorted(imported)]]


def _sibling_imports(path: Path, package: str) -> set[str] | None:
    """Names of the modules of ``package`` (the folder of ``path``) that ``path`` imports
    (``from . import _a``, ``from ._a import f``, ``import pkg._a``); None where it does not parse."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return None
    prefix = f"{package}." if package else ""  # a top-level module's helpers are top-level too
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level <= 1:  # from pkg._a import f, from . import _a
            base = ".".join(filter(None, [package if node.level else "", node.module]))
            modules = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        names |= {m[len(prefix):].split(".")[0] for m in modules if m.startswith(prefix)}
    return names


def _resolve(path: str) -> Path:
    bases = list(dict.fromkeys((Path.cwd(), REPO)))  # one when run from the checkout
    for base in bases:
        # ~/ as in a dataset's path: the user's home, not a folder named "~" under the base.
        if (base / Path(path).expanduser()).is_file():
            return base / Path(path).expanduser()
    raise PeatError(f"kernel impl {path!r}: no such file (relative to {' or '.join(map(str, bases))})")


def _import(impl: str):
    if impl.endswith(CPP_SUFFIXES):
        path = _resolve(impl)
        return compile_cpp(path), impl
    if impl.endswith(".py"):
        path = _resolve(impl)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        # A plain name: pickle (a worker pool's calls) imports a dotted one's parent package, which
        # does not exist for a file named gemm.v2.py.
        spec = importlib.util.spec_from_file_location(f"peat_kernel_{_identifier(path.stem)}_{digest}", path)
        module = importlib.util.module_from_spec(spec)
        # Registered as an import would be: dataclasses, typing and pickle look the module up there.
        sys.modules[spec.name] = module
        _importable(spec.name, path)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # the user's file is at fault: say where
            del sys.modules[spec.name]
            raise PeatError(_import_failed(impl, err)) from None
        return module, impl
    try:
        module = importlib.import_module(impl)
    except ImportError as err:
        raise PeatError(f"kernel impl {impl!r}: cannot import ({err})") from None
    except Exception as err:  # the module's own code is at fault, as for a .py file
        raise PeatError(_import_failed(impl, err)) from None
    return module, source_of(impl)


def _cache_root() -> Path:
    return Path(os.environ.get("PEAT_KERNEL_CACHE", Path.home() / ".cache" / "peat" / "kernels"))


# Loads a kernel file under the module name peat gave it (see _importable).
_SHIM = """# Written by peat.kernels: a worker started by spawn or forkserver imports {path!r} by this name.
__file__ = {path!r}
with open(__file__, "rb") as _source:
    exec(compile(_source.read(), __file__, "exec"))
"""


def _importable(name: str, path: Path) -> None:
    """Make the kernel file at ``path``, registered here as module ``name``, importable by that name
    in a fresh interpreter: a pool the kernel starts by spawn or forkserver imports the functions it
    runs by their module's name, and every worker stopped with "No module named 'peat_kernel_...'"
    while the pool's call never returned. A module of that name in a folder on the import path,
    which the workers inherit; the kernel's own folder stays off it. Where the folder cannot be
    written, only spawn and forkserver pools go without (fork ones need no import)."""
    folder = _cache_root() / "py"
    shim = folder / f"{name}.py"
    text = _SHIM.format(path=str(path.resolve()))
    try:
        # The name holds the file's digest, not its place: one left by the same content elsewhere
        # (a checkout or a test's folder since deleted) would send the workers to a missing file.
        if not shim.is_file() or shim.read_text() != text:
            folder.mkdir(parents=True, exist_ok=True)
            partial = shim.with_name(f"{shim.name}.{os.getpid()}")
            partial.write_text(text)
            partial.replace(shim)  # whole, for a job loading the same kernel at the same time
    except OSError:
        return
    if str(folder) not in sys.path:
        sys.path.append(str(folder))  # last: it shadows nothing


def _identifier(stem: str) -> str:
    """A file's stem as part of a module name: letters, digits and underscores only."""
    return re.sub(r"[^A-Za-z0-9_]", "_", stem)


def compile_cpp(path: Path):
    """Build a C++ (or, with CUDA, .cu) kernel once; later calls reuse the build of the same source."""
    from torch.utils import cpp_extension

    source = path.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    name = f"peat_{_identifier(path.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    cache = _cache_root() / name
    cache.mkdir(parents=True, exist_ok=True)
    built = _spaceless(path, source, cache)
    try:
        module = cpp_extension.load(name=name, sources=[str(built)], build_directory=str(cache),
                                    extra_include_paths=[str(path.parent)] if built != path else None,
                                    extra_cflags=["-O2"], verbose=False)
    except (RuntimeError, OSError, ImportError) as err:
        error = first_compiler_error(str(err)).replace(str(built), str(path))
        raise PeatError(f"{path}: compile failed: {error}") from None
    sys.modules[name] = module  # torch's loader does not register it: the lookup above would never hit
    return module


def _spaceless(path: Path, source: bytes, cache: Path) -> Path:
    """``path``, or where its name has a space, a copy of ``source`` in ``cache`` under one without
    (its folder then on the include path, for the headers beside it): torch's build file names the
    object file after the source unescaped, and ninja failed with "'my', needed by ...", naming
    neither the file nor the space."""
    if " " not in path.name:
        return path
    copy = cache / f"{cache.name}{path.suffix}"
    if not copy.exists():  # the cache is by content: an existing copy is this source; rewriting it rebuilt
        partial = copy.with_name(f"{copy.name}.{os.getpid()}")
        partial.write_bytes(source)
        partial.replace(copy)  # whole, for a job building the same kernel at the same time
    return copy


def first_compiler_error(log: str) -> str:
    for line in log.splitlines():
        if re.search(r"\berror\b", line) and not line.lstrip().startswith(("FAILED", "ninja:", "subprocess")):
            return line.strip()
    return log.strip().splitlines()[-1] if log.strip() else "unknown error"


# -- replaying one recorded computation ----------------------------------------------------
def _conv_hp(attrs: dict) -> dict:
    return {"stride": tuple(attrs["stride"]), "padding": tuple(attrs["padding"]),
            "dilation": tuple(attrs["dilation"]), "groups": int(attrs["groups"])}


def _norm_hp(op: str, sample: dict, attrs: dict) -> dict:
    """Every hyper-parameter of a norm op; ``CALLS`` says which each computation takes."""
    if op in ("layer_norm", "rms_norm"):
        return {"normalized_shape": tuple(attrs["normalized_shape"]), "eps": float(attrs["eps"])}
    # momentum: a routed call's own, or a cumulative average's factor at the recorded step; -1
    # (cumulative, from a context without that factor) updates no statistic: no output reads it.
    return {"running_mean": sample.get("running_mean"), "running_var": sample.get("running_var"),
            "training": bool(sample.get("training", True)), "eps": float(attrs["eps"]),
            "momentum": max(float(sample.get("momentum", attrs.get("momentum", 0.1))), 0.0)}


# How peat calls each computation of each op, (positional, keyword): the tensors by position, named as
# in docs/kernels.md's table, then the hyper-parameters by name. ``arguments`` builds every call from it and
# the config check (``candidate``) reads a kernel file's signatures against it, so the two cannot drift.
_CONV, _BN, _NORM = ("stride", "padding", "dilation", "groups"), ("running_mean", "running_var", "training", "eps"), \
    ("normalized_shape", "eps")
CALLS = {
    "linear": {"forward": (("x", "weight", "bias"), ()), "input_grad": (("grad_out", "weight"), ()),
               "weight_grad": (("grad_out", "x"), ())},
    "conv2d": {"forward": (("x", "weight", "bias"), _CONV), "input_grad": (("grad_out", "weight"), (*_CONV, "input_shape")),
               "weight_grad": (("grad_out", "x"), (*_CONV, "weight_shape"))},
    "batch_norm": {"forward": (("x", "weight", "bias"), (*_BN, "momentum")),
                   "input_grad": (("grad_out", "x", "weight"), _BN), "weight_grad": (("grad_out", "x"), _BN)},
    **{op: {"forward": (("x", "weight", "bias"), _NORM), "input_grad": (("grad_out", "x", "weight"), _NORM),
            "weight_grad": (("grad_out", "x"), _NORM)} for op in ("layer_norm", "rms_norm")},
}


def arguments(op: str, computation: str, sample: dict, attrs: dict) -> tuple[list, dict]:
    """Positional and keyword arguments of ``computation`` for one recorded sample (``CALLS``)."""
    positional, keywords = CALLS[op][computation]
    tensors = {name: sample.get(key) for key, name in _INPUT_NAMES.items()}
    hp = _conv_hp(attrs) if op == "conv2d" else _norm_hp(op, sample, attrs) if op != "linear" else {}
    if "input_shape" in keywords:
        hp["input_shape"] = tuple(tensors["x"].shape)
    if "weight_shape" in keywords:
        hp["weight_shape"] = tuple(tensors["weight"].shape)
    return [tensors[name] for name in positional], {name: hp[name] for name in keywords}


def _cast(value, dtype, transposed: bool = False):
    """A fresh contiguous copy in ``dtype`` (kernels may write in place: running stats); ``transposed``
    lays it out as training hands a transposed layer's weight (GPT-2's ``Conv1D``): the transpose
    of a contiguous ``(in, out)`` matrix. One copy either way."""
    if not (torch.is_tensor(value) and value.is_floating_point()):
        return value
    value = value.detach().t() if transposed else value.detach()
    value = value.to(dtype, memory_format=torch.contiguous_format, copy=True)
    return value.t() if transposed else value


def call(kernel: Kernel, computation: str, sample: dict, attrs: dict, dtype=torch.float32,
         updated: dict | None = None) -> torch.Tensor:
    """Run one computation of ``kernel`` on one recorded sample (from ``profiler.read_layer``).

    Floating inputs are cast to ``dtype``: golden with float64 gives the rounding reference.
    ``updated``, when given, receives the running statistics the call updated in place (``updates``).
    """
    func = kernel.computation(computation)
    if not applies(computation, sample):
        raise PeatError(f"{kernel.name}: sample at step {sample.get('step')} has no input gradient (first layer)")
    args, kwargs = operands(kernel.op, computation, sample, attrs, dtype)
    out = func(*args, **kwargs)
    if updated is not None:
        updated.update({name: kwargs[name] for name in updates(kernel.op, computation, sample)})
    return out


def updates(op: str, computation: str, sample: dict) -> tuple[str, ...]:
    """The running statistics ``computation`` updates in place on this sample: a batch norm's in a
    training-mode forward (as ``F.batch_norm`` does, see the signatures above), none elsewhere."""
    if op != "batch_norm" or computation != "forward" or not sample.get("training", True):  # as _norm_hp reads it
        return ()
    return tuple(name for name in ("running_mean", "running_var") if sample.get(name) is not None)


def as_trained(sample: dict, attrs: dict) -> dict:
    """``sample`` with a transposed layer's recorded weight laid out as training hands it (see
    ``_cast``), once per sample: each call's copy is then a plain one, where a transposing copy
    per call cost 6 ms on GPT-2's 2304 x 768 weight (CPU)."""
    weight = sample.get("W")
    if not attrs.get("transposed") or weight is None or weight.t().is_contiguous():
        return sample
    return sample | {"W": weight.t().contiguous().t()}


def operands(op: str, computation: str, sample: dict, attrs: dict, dtype=torch.float32) -> tuple[list, dict]:
    """The arguments ``call`` passes: ``arguments``, floating ones as fresh copies in ``dtype``, laid
    out as a routed call in training hands them (``_kernel_forward``), so playback checks the
    kernel on the memory layout training runs it on."""
    args, kwargs = arguments(op, computation, sample, attrs)
    weight = sample.get("W") if attrs.get("transposed") else None
    return ([_cast(a, dtype, a is weight and weight is not None) for a in args],
            {k: _cast(v, dtype) for k, v in kwargs.items()})


def applies(computation: str, sample: dict) -> bool:
    """Whether a recorded sample has what ``computation`` needs: input_grad a layer whose input
    needed a gradient (not the first layer), weight_grad a weight; both an output gradient (none
    reaches a frozen layer, or one whose output did not feed the loss)."""
    if computation != "forward" and sample.get("dO") is None:
        return False
    if computation == "input_grad":
        return "dA" in sample or bool(sample.get("input_grad"))
    if computation == "weight_grad":
        return "dW" in sample or sample.get("W") is not None
    return True


def expected(computation: str, sample: dict, attrs: dict | None = None) -> torch.Tensor:
    """A tensor of the shape, dtype and device of golden's result of ``computation`` on this sample:
    the recorded result, else golden's shape on meta tensors (nothing computed; needs ``attrs``),
    as one element expanded, on the device of the operands."""
    target = TARGET[computation]
    if target in sample:
        return sample[target]
    shapes = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in sample.items()}
    shape = call(golden(attrs["op"], attrs), computation, shapes, attrs)
    return torch.empty((), dtype=shape.dtype, device=sample["A"].device).expand(shape.shape)


# -- running a kernel in a child process -------------------------------------------------------
OOM_MARKERS = ("can't allocate memory", "not enough memory", "out of memory", "MemoryError", "std::bad_alloc")


@dataclass
class Outcome:
    """What happened when a kernel ran: status (ok, crash, oom, timeout or shape_mismatch), message,
    result, seconds (the caller's wait: in a child, its start and the result's way back too) and
    ``called``, the seconds inside the call itself (0 where it never returned or raised: a hang, a death)."""

    status: str
    message: str = ""
    value: object = None
    seconds: float = 0.0
    called: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def record(self) -> dict:
        return {"status": self.status, "message": self.message, "seconds": self.seconds}


def _child(conn, calls, memory_mb, parent):
    import resource

    _die_with(parent)
    _own_group()
    _keep_main()
    torch.set_num_threads(1)
    if memory_mb:
        # CUDA cannot start under the address-space limit below (its start maps far more), and the
        # calls here hold CPU tensors (the parent runs them itself once CUDA is up): a library that
        # asks for devices (torch.compile's Inductor) is told there are none, not "out of memory"
        # from cudaGetDeviceCount, which made peat.alt_kernels.compiled fall back to the eager op on
        # a GPU machine (an H200).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for func, args, kwargs, expect in calls:
        if memory_mb:
            # The forked child already maps what the parent mapped: allow that much more, per call
            # (only the soft limit, so that the next call can move it).
            hard = resource.getrlimit(resource.RLIMIT_AS)[1]
            limit = _address_space() + memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        start, called = time.perf_counter(), None
        try:
            value = func(*args, **kwargs)
            called = time.perf_counter() - start  # the call alone, not the result's way back (Outcome.called)
            if expect is not None and (wrong := wrong_result(value, expect.shape, expect.dtype, expect.device)):
                # Judged here: a NumPy array would not travel back (torch.load with weights_only
                # refuses it), and became a crash with torch's message instead of this one; a CUDA
                # result of a CPU layer, loaded back, started CUDA in the job (no child after that).
                payload = ("shape_mismatch", wrong)
            else:
                buf = io.BytesIO()
                torch.save(value, buf)
                payload = ("ok", buf.getvalue())
        except BaseException as err:  # anything the kernel raises is its outcome
            payload, called = _failure(err), time.perf_counter() - start if called is None else called
        _flush_output()
        conn.send((*payload, called))
    conn.close()


def _keep_main() -> None:
    """Let no process a kernel starts by spawn or forkserver run a Snakemake job's script again: such a
    worker runs its parent's ``__main__`` file as ``__mp_main__``, and a job's script (Snakemake writes
    it to ``.snakemake/scripts/``) has no ``if __name__ == "__main__"`` guard: each worker ran the
    workflow's script, died on its first line (``NameError: name 'snakemake' is not defined``) and was
    replaced, while the kernel's call waited for its timeout. A main named by its module is not run
    again. Any other script is left as it is: a guarded one of the user's may run its own functions
    in such a pool."""
    main = sys.modules.get("__main__")
    # The file Python ran: Snakemake's preamble sets __file__ to the workflow's own script (the one
    # a worker would run), keeping its copy's path as __real_file__.
    ran = Path(getattr(main, "__real_file__", None) or sys.argv[0] or ".")
    if main is not None and getattr(main, "__spec__", None) is None and ran.parent.parts[-2:] == (".snakemake", "scripts"):
        main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)


def _die_with(parent: int) -> None:
    """Linux kills this child when its parent goes (a job killed while a kernel runs): it would
    run on otherwise, a hung kernel for ever, or blocked on a result that nobody reads."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, ctypes.c_ulong(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # it went before that
        os._exit(1)


def _own_group() -> None:
    """Lead a process group of its own, so that one signal kills the child with every process the
    kernel started (a worker pool for a CPU reference, a compiler): at a timeout, or once its last
    result is in. And tie each process forked below it to the one that forked it, as the child is
    tied to the job (``_die_with``): a job killed while a kernel's pool runs leaves none of it
    running. (A forked process dies when the *thread* that forked it ends, as Linux has it.)"""
    os.setpgid(0, 0)
    forker = os.getpid()

    def die_with_forker():
        nonlocal forker
        _die_with(forker)
        forker = os.getpid()  # the one that its own forks die with

    os.register_at_fork(after_in_child=die_with_forker)


def _flush_output() -> None:
    """Write out what the kernel printed so far: the child is killed, not left to exit, after its
    last result (a pool the kernel keeps would hold its exit)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):  # none, or closed by the kernel
            stream.flush()


# A full disk (candidate training writes its curve and final weights in the child) is no
# outcome of the kernel: recorded as its crash, the report failed a correct kernel, and a rerun
# after freeing space kept that crash. It fails the job instead, as golden training does.
NOT_THE_KERNEL = "no_space"


def _failure(err: BaseException) -> tuple[str, str]:
    """(status, one-line message) for an exception a kernel raised; one a routed call raised is
    prefixed with that call (``_raised_at``)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return NOT_THE_KERNEL, os_error_line(err)
    oom = isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError)) or any(m in str(err) for m in OOM_MARKERS)
    status = "shape_mismatch" if isinstance(err, ShapeMismatch) else "oom" if oom else "crash"
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    line = text[0] if text else type(err).__name__
    where = getattr(err, _RAISED_AT, None)
    return status, f"{where} raised {line}" if where else line


_RAISED_AT = "_peat_raised_at"


def _raised_at(err: BaseException, call: str) -> None:
    """Mark ``err`` as raised by the routed kernel call ``call`` (the innermost, where calls nest):
    a training run's crash said only "RuntimeError: mat1 and mat2 shapes cannot be multiplied",
    naming neither the computation nor which of the routed layers raised it, as its other outcomes do."""
    if not hasattr(err, _RAISED_AT):
        with contextlib.suppress(AttributeError, TypeError):  # an exception type without attributes
            setattr(err, _RAISED_AT, call)


def _failed(status: str, message: str, seconds: float) -> Outcome:
    """The outcome of a kernel that failed, in its process or in ours; a failure that is not the
    kernel's (``NOT_THE_KERNEL``) fails the job."""
    if status == NOT_THE_KERNEL:
        raise PeatError(message) from None
    return Outcome(status, message, seconds=seconds)


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class Call:
    """One call for ``run_isolated_many``: ``func(*args, **kwargs)``, its result checked against ``expect``."""

    func: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    expect: torch.Tensor | None = None


MAX_TIMEOUT = 31536000  # seconds: a year, the most an interval timer takes here (the config schema's bound)
# A child whose pipe ended is gone or going: its exit code is awaited this long at most. One wait takes
# int milliseconds (poll): with a timeout above 24.8 days, a call that killed its child was an OverflowError.
EXIT_WAIT = 86400.0


def check_timeout(what: str, seconds) -> None:
    """One line where ``seconds`` (``what``, a setting's name) is no time limit a kernel call can have:
    math.inf ("no limit") or a century overflowed the interval timer (``deadline``) in every call, each
    then a crash blamed on the kernel. The config schema's bound, for a library call's limits."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 < seconds <= MAX_TIMEOUT:
        raise PeatError(f"{what}={seconds!r}: seconds per kernel call need a number > 0 and <= {MAX_TIMEOUT} "
                        "(a year)")


def run_isolated(func: Callable, *args, timeout: float = 60.0, memory_mb: int | None = None,
                 expect: torch.Tensor | None = None, **kwargs) -> Outcome:
    """Call ``func(*args, **kwargs)`` in a forked child, so a crash, hang or leak cannot take us down.
    It may start processes of its own (a worker pool): they are killed with the child.

    ``expect`` (a tensor) makes a result of another shape, dtype or device a ``shape_mismatch``. The
    result travels back through ``torch.load(weights_only=True)``: tensors and plain containers.
    CUDA cannot be used in a child forked after CUDA started, so then the call runs in this
    process, with the timeout as an alarm (a hang inside native code or a segfault is not caught).
    """
    check_timeout("kernels.run_isolated: timeout", timeout)
    return run_isolated_many([Call(func, args, kwargs, expect)], timeout=timeout, memory_mb=memory_mb)[0]


def run_isolated_many(calls: list[Call], *, timeout: float = 60.0, memory_mb: int | None = None) -> list[Outcome]:
    """``run_isolated`` for several calls, in order, in as few children as they allow.

    Forking a process that holds a model and its context, and tearing the child down, costs
    tens of milliseconds: more than most kernel calls. So one child runs the calls one after
    the other; a call that kills or hangs it ends it, and the calls after it go to a fresh one.
    ``timeout`` and ``memory_mb`` hold for each call.
    """
    check_timeout("kernels.run_isolated_many: timeout", timeout)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [_run_inline(c.func, c.args, c.kwargs, timeout, c.expect) for c in calls]
    outcomes: list[Outcome] = []
    while len(outcomes) < len(calls):
        outcomes += _run_in_child(calls[len(outcomes):], timeout, memory_mb)
    return outcomes


def _run_in_child(calls: list[Call], timeout: float, memory_mb: int | None) -> list[Outcome]:
    """Outcomes of ``calls`` run by one child, up to the first that kills or hangs it."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    start = time.perf_counter()
    # Not daemonic: multiprocessing refuses a daemonic process children, and a kernel starting a
    # worker pool was a crash. _kill and _own_group stand in for what daemonic would give.
    proc = ctx.Process(target=_child, args=(child, [(c.func, c.args, c.kwargs, c.expect) for c in calls], memory_mb,
                                            os.getpid()))
    proc.start()
    child.close()
    outcomes = []
    try:
        for call in calls:
            payload, status = _receive(parent, proc, timeout)
            seconds, start = time.perf_counter() - start, time.perf_counter()
            if status == "timeout":
                outcomes.append(Outcome("timeout", f"no result after {timeout:g} s (killed)", seconds=seconds))
                break
            if payload is None:  # the child died inside this call: its exit code says how
                proc.join(min(timeout, EXIT_WAIT))
                outcomes.append(_died(proc.exitcode, seconds))
                break
            outcomes.append(_read_back(payload, call.expect, seconds))
    finally:
        _kill(proc)
        proc.join()
        parent.close()
    return outcomes


def _kill(proc) -> None:
    """Kill the child and what the kernel started: the child's process group (``_own_group``)."""
    with contextlib.suppress(ProcessLookupError):  # all gone already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()  # a kernel may have moved it out of its group


def _receive(conn, proc, timeout: float) -> tuple[object, str]:
    """The child's next payload (None: it died), and "timeout" when none came in time.

    The child's exit ends the wait too: a process the kernel forked inherits the pipe (and
    the child's sentinel), so no end of file comes when the child dies."""
    deadline = time.monotonic() + timeout
    try:
        while not conn.poll(max(0.0, min(0.1, deadline - time.monotonic()))):
            if not proc.is_alive():  # what it sent before it ended is in the pipe
                return (conn.recv(), "ok") if conn.poll(0) else (None, "died")
            if time.monotonic() >= deadline:
                return None, "timeout"
        return conn.recv(), "ok"
    except (EOFError, OSError):
        return None, "died"


def _read_back(payload: tuple, expect, seconds: float) -> Outcome:
    status, body, called = payload
    if status != "ok":
        return dataclasses.replace(_failed(status, body, seconds), called=called)
    try:
        value = torch.load(io.BytesIO(body), weights_only=True)
    except Exception as err:  # e.g. a kernel returning an arbitrary object
        return Outcome("crash", f"result could not be read back: {str(err).splitlines()[0]}", seconds=seconds,
                       called=called)
    return dataclasses.replace(_checked(value, expect, seconds), called=called)


class CallTimeout(TimeoutError):
    """A kernel call in this process ran past its ``deadline``."""


@contextlib.contextmanager
def deadline(seconds: float | None):
    """Raise ``CallTimeout`` inside once ``seconds`` have passed (None: no limit). An alarm, so in
    the main thread only, and a hang inside native code that never returns to Python is not cut short."""
    import threading

    if seconds is not None:
        check_timeout("kernels.deadline: seconds", seconds)
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(signum, frame):
        raise CallTimeout(f"no result after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _run_inline(func, args, kwargs, timeout, expect) -> Outcome:
    start = time.perf_counter()
    try:
        with deadline(timeout):
            value = func(*args, **kwargs)
    except TimeoutError as err:
        return Outcome("timeout", str(err), seconds=time.perf_counter() - start)
    except Exception as err:  # the kernel's failure is its outcome
        seconds = time.perf_counter() - start
        return dataclasses.replace(_failed(*_failure(err), seconds), called=seconds)
    seconds = time.perf_counter() - start
    return dataclasses.replace(_checked(value, expect, seconds), called=seconds)


def _died(exitcode: int | None, seconds: float) -> Outcome:
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode).name
        status = "oom" if sig == "SIGKILL" else "crash"
        return Outcome(status, f"killed by {sig}", seconds=seconds)
    return Outcome("crash", f"exited with code {exitcode} without a result", seconds=seconds)


def _checked(value, expect, seconds) -> Outcome:
    if expect is None:
        return Outcome("ok", value=value, seconds=seconds)
    if wrong := wrong_result(value, expect.shape, expect.dtype, expect.device):
        return Outcome("shape_mismatch", wrong, seconds=seconds)
    bad = int((~torch.isfinite(value)).sum())
    return Outcome("ok", f"{bad} non-finite values" if bad else "", value=value, seconds=seconds)


def wrong_result(value, shape, dtype, device) -> str:
    """What ``value`` returned where it is not a tensor of ``shape`` and ``dtype`` on ``device``, else "".

    The device is named where it differs: a result on another device than the operands' (a CPU
    one from a CUDA layer) passed playback, which moves results to the CPU to score them, and
    training then stopped at the next op with torch's error, naming neither kernel nor layer."""
    if not torch.is_tensor(value):
        return f"returned {type(value).__name__}, expected a tensor"
    if tuple(value.shape) == tuple(shape) and value.dtype == dtype and value.device == device:
        return ""
    got, want = f"{tuple(value.shape)} {value.dtype}", f"{tuple(shape)} {dtype}"
    if value.device != device:
        got, want = f"{got} on {value.device}", f"{want} on {device}"
    return f"returned {got}, expected {want}"


# -- routing layers through a kernel during training ------------------------------------------
@dataclass(frozen=True)
class _Plan:
    """How one routed layer runs, decided once at route time, so that a call does little besides the ops."""

    kernel: Kernel
    attrs: dict  # the layer's hyper-parameters as the Profiler records them (for the kernel's own functions)
    hp: dict  # the same, parsed once for the golden ops
    golden_forward: bool  # the kernel keeps PyTorch's forward
    own: frozenset  # the gradients the kernel computes itself; the rest come from one fused golden call
    layer: str = ""  # its name in the routed model
    outputs: _Outputs | None = None  # the model's kernel outputs in the current forward pass


def _plan(kernel: Kernel, attrs: dict, layer: str = "", outputs: _Outputs | None = None) -> _Plan:
    kernel = on_layer(kernel, attrs)
    return _Plan(kernel, attrs, _golden_hp(kernel.op, attrs), golden_forward="forward" not in kernel.custom,
                 own=frozenset(kernel.custom) & {"input_grad", "weight_grad"}, layer=layer, outputs=outputs)


class ReusedOutput(PeatError):
    """A kernel returned memory that an earlier routed call's result still holds (outcome ``crash``)."""


# Why an earlier result's memory may not be handed out again, by the computation that returned it.
_STILL_HELD = {
    "forward": ("output", "still held from earlier in this forward pass (a persistent output buffer overwrites what "
                "the backward reads)"),
    "input_grad": ("input_grad result", "still held by autograd in this backward pass (a persistent output buffer "
                   "overwrites a gradient not yet used)"),
    "weight_grad": ("weight_grad result", "now that layer's accumulated weight .grad (a persistent output buffer "
                    "overwrites it)"),
}


class _Result(NamedTuple):
    """One routed call's result, as ``_Outputs`` tracks it."""

    ref: StorageWeakRef
    layer: str
    computation: str
    weight: torch.Tensor | None  # the parameter a weight_grad is for


class _Outputs:
    """The storage of every kernel result in one forward pass of a routed model and the backward
    after it, by address, held weakly: an address seen again while its first holder lives means a
    kernel returned a buffer it returns on every call (a persistent output buffer). The later call
    then overwrites what autograd still reads (an output saved for the backward, a gradient not yet
    passed on): gradients go wrong with no error (autograd's version check misses writes from C++
    or through ``.data``). A weight gradient is copied by autograd unless it becomes the weight's
    ``.grad``, so its memory counts as held only while a ``.grad`` is on it. One address and a weak
    reference per call; healthy outputs are never copied."""

    def __init__(self):
        self.held: dict[int, _Result] = {}

    def forget(self, *_) -> None:  # a forward pre-hook of the routed model: a new pass begins
        self.held.clear()

    def __deepcopy__(self, memo) -> _Outputs:
        # A copied model's passes are its own; a copied weak reference would also be released twice.
        return _Outputs()

    def __reduce__(self):
        # Pickled (torch.save of a routed model) empty too: a weak reference is a pointer into this process.
        return _Outputs, ()

    def add(self, plan: _Plan, out: torch.Tensor, computation: str = "forward", weight=None) -> None:
        """Track ``out``, the result of ``computation`` (``weight``: the parameter a weight_grad is for)."""
        if not out.numel():
            return
        storage = out.untyped_storage()
        memory = storage.data_ptr()
        entry = _Result(StorageWeakRef(storage), plan.layer, computation, weight)
        # A weight gradient's own .grad first: from an earlier pass, or accumulated over micro-batches.
        own = (entry,) if computation == "weight_grad" else ()
        for earlier in (*own, self.held.get(memory)):
            if earlier is not None and _holds(earlier, memory):
                what, why = _STILL_HELD[earlier.computation]
                raise ReusedOutput(f"kernel {plan.kernel.name!r} {computation} at layer {plan.layer!r} returned the "
                                   f"memory of its {what} at layer {earlier.layer!r}, {why}: return a new tensor per call")
        self.held[memory] = entry


def _holds(entry: _Result, memory: int) -> bool:
    """Whether ``entry`` still needs ``memory``: a weight gradient while its parameter's ``.grad``
    is on it, any other result while it lives."""
    if entry.computation == "weight_grad":
        grad = entry.weight.grad if entry.weight is not None else None
        return grad is not None and grad.numel() > 0 and grad.untyped_storage().data_ptr() == memory
    return not entry.ref.expired()


def _outputs_of(model: torch.nn.Module) -> _Outputs:
    """The model's ``_Outputs``, made (and emptied at each forward pass) on first routing."""
    outputs = model.__dict__.get("_peat_kernel_outputs")
    if outputs is None:
        outputs = model.__dict__["_peat_kernel_outputs"] = _Outputs()
        model.register_forward_pre_hook(outputs.forget)
    return outputs


def _golden_hp(op: str, attrs: dict) -> dict:
    if op == "conv2d":
        return _conv_hp(attrs)
    if op == "batch_norm":
        return {"eps": float(attrs["eps"])}
    if op == "layer_norm":
        return {"normalized_shape": list(attrs["normalized_shape"]), "eps": float(attrs["eps"])}
    if op == "rms_norm":
        return {"normalized_shape": list(attrs["normalized_shape"]), "eps": float(attrs["eps"]),
                "forward": RMS_VARIANTS[_rms_variant(attrs)]}
    return {}


class _Routed(torch.autograd.Function):
    """One routed layer call: forward, input and weight gradients by the kernel, bias grad golden."""

    @staticmethod
    def forward(ctx, plan, state, x, weight, bias):
        ctx.plan, ctx.state = plan, state
        if plan.golden_forward:
            out, stats = _golden_forward(plan.kernel.op, plan.hp, state, x, weight, bias)
        else:
            out, stats = _kernel_forward(plan, state, x, weight, bias), ()
        ctx.save_for_backward(x, weight, *stats)
        out = _unaliased(out, x, weight, bias)
        if plan.outputs is not None and not plan.golden_forward:  # PyTorch's own outputs are fresh
            plan.outputs.add(plan, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        plan, (x, weight, *stats) = ctx.plan, ctx.saved_tensors
        need = dict(zip(("input_grad", "weight_grad", "bias_grad"), ctx.needs_input_grad[2:]))
        # What the kernel leaves to golden comes from one fused call, as in PyTorch's own backward.
        mask = [need[c] and c not in plan.own for c in need]
        grads = list(_golden_grads(plan, ctx.state, grad_out, x, weight, stats, mask)) if any(mask) else [None] * 3
        for slot, computation in enumerate(("input_grad", "weight_grad")):
            if need[computation] and computation in plan.own:
                grads[slot] = _kernel_grad(plan, ctx.state, computation, grad_out, x, weight)
                if plan.outputs is not None:
                    plan.outputs.add(plan, grads[slot], computation, _parameter(weight))
        return None, None, *grads


def _parameter(weight: torch.Tensor | None) -> torch.Tensor | None:
    """The parameter whose ``.grad`` a weight gradient accumulates into (a transposed layer's
    weight reaches the kernel as a view of it); None for a weight computed from one (a
    parametrization's), which has no ``.grad`` (reading it warns)."""
    weight = weight if weight is None or weight._base is None else weight._base
    return weight if weight is not None and weight.is_leaf else None


def _unaliased(out: torch.Tensor, *inputs) -> torch.Tensor:
    """``out`` as a custom Function's output that a later in-place op (ReLU(inplace=True)) may modify.

    Autograd refuses in-place ops on an output that is a view (F.linear's on a 3-D input with a
    bias, a kernel's reshaped GEMM result) or an input returned as is. A view of the call's own
    result is detached (no copy); one sharing an input's memory is copied, as writing into it
    would change that input."""
    memory = out.untyped_storage().data_ptr()
    if any(t is not None and t.untyped_storage().data_ptr() == memory for t in inputs):
        return out.clone()
    return out.detach() if out._base is not None else out


def _golden_forward(op: str, hp: dict, state: dict, x, weight, bias) -> tuple[torch.Tensor, tuple]:
    """(output, what autograd would save for the backward): the aten calls ``F.*`` makes on CPU, so the
    output is bit-identical and the norms' backward reuses the forward's mean and inverse std."""
    if op == "conv2d":
        return F.conv2d(x, weight, bias, hp["stride"], hp["padding"], hp["dilation"], hp["groups"]), ()
    if op == "linear":
        return F.linear(x, weight, bias), ()
    if op == "batch_norm":
        if state["training"]:
            F._verify_batch_size(x.size())  # F.batch_norm's error for one value per channel
        out, *stats = torch.ops.aten.native_batch_norm(x, weight, bias, state["running_mean"], state["running_var"],
                                                       state["training"], state["momentum"], hp["eps"])
        return out, stats
    if op == "rms_norm":  # the backward runs autograd through it again: nothing saved
        return hp["forward"](x, weight, bias, normalized_shape=hp["normalized_shape"], eps=hp["eps"]), ()
    out, *stats = torch.ops.aten.native_layer_norm(x, hp["normalized_shape"], weight, bias, hp["eps"])
    return out, stats


def _kernel_forward(plan: _Plan, state: dict, x, weight, bias) -> torch.Tensor:
    # x contiguous as playback's recorded one (a no-op in the shipped models); the weight is the
    # parameter itself: a transposed layer's is a non-contiguous view, and playback lays it out so too.
    sample = _plain({"A": x.contiguous(), "W": weight, "B": bias}) | state
    out = _checked_result(plan.kernel, "forward", _untouched(plan, "forward", sample),
                          output_shape(plan.kernel.op, x, weight, plan.attrs), x.dtype, x.device)
    # The model's code after the layer may view it (GPT-2's Conv1D does), as PyTorch's own ops give
    # contiguous outputs: a correct result in another layout (a column-major GEMM's) is laid out so.
    return row_major(out)


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides PyTorch's own ops give a new result. ``contiguous()`` keeps a channels-last
    (N, C, 1, 1) result as it is (strides of size-1 dimensions do not count), and a batch norm after it
    took its channels-last backward: training beside a kernel that computed golden's values differed
    from golden's in the last bits."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    return t if t.stride() == tuple(reversed(strides)) else t.clone(memory_format=torch.contiguous_format)


def _plain(operands: dict) -> dict:
    """``operands`` without autograd history, as playback's copies come: a kernel that sends them to a
    worker pool (multiprocessing's pickler refuses a tensor with history) crashed only in training.
    A detached tensor shares its memory and version counter: ``_untouched`` still sees a write."""
    return {k: v.detach() if torch.is_tensor(v) else v for k, v in operands.items()}


def _kernel_grad(plan: _Plan, state: dict, computation: str, grad_out, x, weight) -> torch.Tensor:
    sample = _plain({"A": x.contiguous(), "W": weight, "dO": grad_out.contiguous()}) | state
    like = x if computation == "input_grad" else weight
    return _checked_result(plan.kernel, computation, _untouched(plan, computation, sample), like.shape, like.dtype,
                           like.device)


class WroteInput(PeatError):
    """A kernel wrote into one of its inputs in place (outcome ``crash``)."""


_INPUT_NAMES = {"A": "x", "W": "weight", "B": "bias", "dO": "grad_out"}  # as the kernel functions name them


def _untouched(plan: _Plan, computation: str, sample: dict):
    """The kernel's ``computation`` on ``sample``, refused when it wrote into an input: in training
    that input is another layer's output or a parameter, which the rest of the forward, autograd's
    saved tensors and the optimizer then read changed, and the run trained on with no error
    (playback's fresh copies hide it). Only the version counter is read, so writes through ``.data``
    or from C++ pass unseen; the running statistics a training batch norm forward updates by contract
    are not inputs there."""
    args, kwargs = arguments(plan.kernel.op, computation, sample, plan.attrs)
    inputs = {name: sample[key] for key, name in _INPUT_NAMES.items() if torch.is_tensor(sample.get(key))}
    if not updates(plan.kernel.op, computation, sample):
        # Only a training forward may update them: elsewhere (an eval forward, any backward) a write
        # changed the layer's buffers for good, e.g. running_var.add_(eps).rsqrt_() at validation.
        inputs |= {name: sample[name] for name in ("running_mean", "running_var") if torch.is_tensor(sample.get(name))}
    versions = {name: t._version for name, t in inputs.items()}
    try:
        value = plan.kernel.computation(computation)(*args, **kwargs)
    except BaseException as err:
        _raised_at(err, f"kernel {plan.kernel.name!r} {computation} at layer {plan.layer!r}")
        raise
    for name, t in inputs.items():
        if t._version != versions[name]:
            raise WroteInput(f"kernel {plan.kernel.name!r} {computation} at layer {plan.layer!r} wrote into its input "
                             f"{name} in place, which training reads again: leave the inputs as they are and return "
                             "a new tensor")
    return value


class ShapeMismatch(PeatError):
    """A kernel returned a result of the wrong shape, dtype or device (outcome ``shape_mismatch``)."""


def output_shape(op: str, x: torch.Tensor, weight: torch.Tensor, attrs: dict) -> tuple[int, ...]:
    """The shape the forward computation of ``op`` must return."""
    if op == "linear":
        return (*x.shape[:-1], weight.shape[0])
    if op == "conv2d":
        hp = _conv_hp(attrs)
        size = [(x.shape[2 + i] + 2 * hp["padding"][i] - hp["dilation"][i] * (weight.shape[2 + i] - 1) - 1)
                // hp["stride"][i] + 1 for i in range(2)]
        return (x.shape[0], weight.shape[0], *size)
    return tuple(x.shape)


def _checked_result(kernel: Kernel, computation: str, value, shape, dtype, device) -> torch.Tensor:
    if mismatch := wrong_result(value, shape, dtype, device):
        raise ShapeMismatch(f"kernel {kernel.name!r} {computation} {mismatch}")
    return value


def _golden_grads(plan: _Plan, state: dict, dO, x, w, stats, mask: list[bool]) -> tuple:
    """Golden (input, weight, bias) gradients where ``mask`` says, computed as PyTorch's backward does
    (``stats``: what the golden forward saved, empty when the kernel's own forward ran)."""
    op, hp = plan.kernel.op, plan.hp
    if op == "linear":
        pytorch = golden(op, plan.attrs)
        return (pytorch.input_grad(dO, w) if mask[0] else None, pytorch.weight_grad(dO, x) if mask[1] else None,
                dO.reshape(-1, dO.shape[-1]).sum(0) if mask[2] else None)
    if op == "conv2d":
        return torch.ops.aten.convolution_backward(
            dO, x, w, [w.shape[0]] if mask[2] else None, hp["stride"], hp["padding"], hp["dilation"], False, [0, 0],
            hp["groups"], mask)
    if op == "batch_norm":
        return _bn_backward(dO, x, w, state["running_mean"], state["running_var"], state["training"], hp["eps"], mask,
                            stats)
    if op == "rms_norm":
        return _rms_backward(hp["forward"], dO, x, w, hp["normalized_shape"], hp["eps"], mask)
    return _ln_backward(dO, x, w, hp["normalized_shape"], hp["eps"], mask, stats)


class _RoutedForward:
    """A routed layer's ``forward``. An object, not a closure: ``copy.deepcopy`` of the model (which
    copies functions by reference) then gives the copy a forward on its own module, weights and
    output tracker; the kernel and ``active`` stay shared, as one kernel serves all routed layers."""

    def __init__(self, module, plan: _Plan, active: Callable[[], bool] | None, original: Callable):
        self.module, self.plan, self.active, self.original = module, plan, active, original
        self.transposed = bool(plan.attrs.get("transposed"))
        self.batch_norm = plan.kernel.op == "batch_norm"
        # An rms_norm is several ops whose input gradients autograd sums into the input's with the
        # residual's, one by one: golden's ops run under autograd, bit-identical to the module (one
        # Function's summed input gradient would round differently).
        self.autograd = plan.kernel.op == "rms_norm" and plan.golden_forward and not plan.own
        self.routed = plan.kernel

    def __call__(self, *args, **kw):
        if self.active is not None and not self.active():
            return self.original(*args, **kw)
        x = layer_input(f"layer {self.plan.layer!r}", self.routed.op, args, kw, "routed")
        module = self.module
        weight = module.weight.t() if self.transposed else module.weight
        if self.autograd:
            hp = self.plan.hp
            return hp["forward"](x, weight, None, normalized_shape=hp["normalized_shape"], eps=hp["eps"])
        # getattr: an RMSNorm has no bias attribute
        return _Routed.apply(self.plan, _bn_state(module) if self.batch_norm else {}, x, weight,
                             getattr(module, "bias", None))

    def __deepcopy__(self, memo) -> _RoutedForward:
        # The memo maps the module being copied (and its tracker) to their copies.
        outputs = copy.deepcopy(self.plan.outputs, memo)
        return _RoutedForward(copy.deepcopy(self.module, memo), dataclasses.replace(self.plan, outputs=outputs),
                              self.active, copy.deepcopy(self.original, memo))


def _routed_forward(module, kernel: Kernel, active: Callable[[], bool] | None, layer: str = "",
                    outputs: _Outputs | None = None) -> _RoutedForward:
    from .profiler import hyper_params

    return _RoutedForward(module, _plan(kernel, hyper_params(module), layer, outputs), active, module.forward)


def _bn_state(module) -> dict:
    """Running statistics, training flag and momentum exactly as ``nn.BatchNorm`` would use them this call."""
    training = module.training or module.running_mean is None
    momentum = 0.0 if module.momentum is None else module.momentum
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        if module.momentum is None:
            momentum = 1.0 / float(module.num_batches_tracked)
    use_running = not module.training or module.track_running_stats
    return {"running_mean": module.running_mean if use_running else None,
            "running_var": module.running_var if use_running else None, "training": training, "momentum": momentum}


def select(model: torch.nn.Module, op: str, layers: list[str] | None = None, key: str = "kernels.layers") -> list[str]:
    """Names of the ``op`` layers of ``model`` matching ``layers`` (globs; default all of them)."""
    from .profiler import match_layers, op_of

    candidates = match_layers(model, layers or ["*"], key)
    chosen = [name for name, m in candidates.items() if op_of(m) == op]
    if not chosen:
        raise PeatError(f"config key '{key}': {layers} matches no {op} layer; matched: {', '.join(candidates) or 'none'}")
    return chosen


def route(model: torch.nn.Module, kernel: Kernel, layers: list[str] | None = None,
          active: Callable[[], bool] | None = None, key: str = "kernels.layers") -> list[str]:
    """Route the chosen layers of ``model`` (globs; default all of the kernel's op) through ``kernel``.

    Other layers are untouched. ``active()``, when given, is asked at every call: False runs the
    layer's own (golden) forward, as frequency-based runtime FI needs. Returns the routed names.
    """
    chosen = select(model, kernel.op, layers, key)
    outputs = _outputs_of(model)
    for name in chosen:
        module = model.get_submodule(name)
        module.forward = _routed_forward(module, kernel, active, name, outputs)
    return chosen


def layer_ops(path, layers: list[str] | None, op: str) -> list[str]:
    """Recorded layers of ``op`` in a context file that match ``layers`` (globs; None: all)."""
    from .io import open_h5

    with open_h5(path) as f:
        recorded = {name: g.attrs["op"] for name, g in f.get("layers", {}).items()}
    return [n for n, o in recorded.items() if o == op and (not layers or any(fnmatch.fnmatchcase(n, p) for p in layers))]
