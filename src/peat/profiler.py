"""PEAT's Profiler: record the training context of chosen layers during golden training.

At sampled steps it stores, per target layer, the input activation ``A``, weight ``W``,
bias ``B`` and output gradient ``dO`` (batch norm also its running statistics before the
step). The golden outputs ``O``, ``dA``, ``dW``, ``dB`` follow from those with the golden op:
they are stored only with ``derived=True`` (``record.derived``), otherwise ``read_layer``
recomputes them (see "Context file" in docs/design.md for when that differs). Every step it
also stores cheap summaries (mean, std, min, max, absmax, non-finite count, see
``peat.tensor_stats``) of every layer's output activation, weight and weight gradient.
Everything goes to one self-describing HDF5 file:

    /layers/<module name>/            attrs: op, module_type, hyper-parameters
    /layers/<module name>/<step>/     (step zero-padded to 7 digits, e.g. 0000040)
                                      A, W, B, dO [, O, dA, dW, dB] [, running_mean, running_var];
                                      attrs step, epoch, training, input_grad [, momentum]
    /summaries                        table: step, epoch, layer, tensor, mean, std, ...
    root attrs                        model, vendor, torch_version, config_hash, dtype, derived, ...

Linear-like layers that compute ``x @ W + b`` with a transposed weight (transformers'
GPT-2 ``Conv1D``) are stored in ``nn.Linear`` convention with attribute ``transposed``.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import fnmatch
import functools
import json
import operator
import os
import warnings
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from .io import PeatError, atomic_path, check_int, open_h5, write_json
from .tensor_stats import BATCH_ELEMENTS, stats, stats_many

SUMMARY_STATS = ("mean", "std", "min", "max", "absmax", "nonfinite")
SUMMARY_NAME_BYTES = 128  # the layer column's width, wider where a layer's UTF-8 name needs it
COMPRESSION = dict(compression="gzip", compression_opts=1, shuffle=True)  # the summaries table
DERIVED = ("O", "dA", "dW", "dB")  # what the golden op computes from A, W, B and dO
# Recorded tensors: float32 with random low mantissa bits does not compress (gzip level 1 with
# shuffle saves about 12% at ~30 ms per MB, longer than a training step takes for the whole
# layer). Where many elements repeat one value (ReLU zeros and their gradients, image
# background) lzf shrinks them 2-5x at ~7 ms per MB, so only those are compressed.
REPEATED_SHARE = 1 / 8
MIN_COMPRESSED_ELEMENTS = 4096
MAX_CHUNK_BYTES = 1 << 30  # one chunk per tensor (read whole anyway) up to this size
# Summary rows held before they are written: some 300 bytes each, and every layer adds three per
# step, so an epoch's worth (5000 steps of 160 layers: 2.4M rows) held 750 MB until the epoch's end.
SUMMARY_ROWS_HELD = 1 << 16


def op_of(module: nn.Module) -> str | None:
    """The PEAT op a module computes, or None if it is not a recordable layer."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Conv2d):
        # The op pads with zeros, evenly: a reflect-padded conv or an uneven 'same' is another computation.
        return "conv2d" if module.padding_mode == "zeros" and _conv_padding(module) is not None else None
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batch_norm"
    if isinstance(module, nn.LayerNorm):
        return "layer_norm"
    if isinstance(module, nn.RMSNorm) or _llama_rms_norm(module):
        return "rms_norm"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers GPT-2
        return "linear"
    return None


def _llama_rms_norm(module: nn.Module) -> bool:
    return hasattr(module, "variance_epsilon") and isinstance(getattr(module, "weight", None), torch.Tensor) \
        and _llama_forward(type(module))


@functools.cache
def _llama_forward(cls: type) -> bool:
    """Whether ``cls.forward`` runs LlamaRMSNorm.forward's bytecode. transformers copies it into most
    of its models (Mistral's, Qwen2's, ...: "Copied from" in its sources) under their own names, and a
    checkpoint's own modeling file may hold an older text of it (no annotations: the same code);
    Gemma's scales by 1 + weight, T5's rounds elsewhere, and a wrapper runs code of its own: other
    computations, left unrecordable."""
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return False
    code, llama = getattr(cls.forward, "__code__", None), LlamaRMSNorm.forward.__code__
    return code is not None and \
        (code.co_code, code.co_names, code.co_consts) == (llama.co_code, llama.co_names, llama.co_consts)


def hyper_params(module: nn.Module) -> dict:
    """Hyper-parameters a kernel needs to replay the layer, as HDF5-friendly values."""
    op = op_of(module)
    if op == "conv2d":
        return {"stride": list(module.stride), "padding": _conv_padding(module), "dilation": list(module.dilation),
                "groups": module.groups}
    if op == "batch_norm":
        return {"eps": module.eps, "momentum": module.momentum if module.momentum is not None else -1.0}
    if op == "layer_norm":
        return {"eps": module.eps, "normalized_shape": list(module.normalized_shape)}
    if op == "rms_norm" and isinstance(module, nn.RMSNorm):
        # eps None: F.rms_norm uses the epsilon of float32 (its compute type for the float32 layers recorded)
        eps = torch.finfo(torch.float32).eps if module.eps is None else module.eps
        return {"eps": eps, "normalized_shape": list(module.normalized_shape), "variant": "torch"}
    if op == "rms_norm":
        return {"eps": module.variance_epsilon, "normalized_shape": [module.weight.shape[-1]], "variant": "llama"}
    return {"transposed": op == "linear" and not isinstance(module, nn.Linear)}


def _cumulative_momentum(module: nn.Module) -> dict:
    """``{"momentum": 1/n}`` for a batch norm that averages cumulatively (``momentum=None``), read
    after its forward has counted this batch as the n-th; else nothing (``hyper_params`` holds it)."""
    if op_of(module) == "batch_norm" and module.momentum is None and module.training \
            and module.num_batches_tracked is not None:
        return {"momentum": 1.0 / float(module.num_batches_tracked)}
    return {}


def _conv_padding(module: nn.Conv2d) -> list[int] | None:
    """Zeros added on each side of (height, width); a string ('same', 'valid') as those numbers,
    None where 'same' pads one side more (an even kernel)."""
    if not isinstance(module.padding, str):
        return list(module.padding)
    left, right, top, bottom = module._reversed_padding_repeated_twice
    return [top, left] if (left, top) == (right, bottom) else None


def match_layers(model: nn.Module, patterns: list[str], key: str = "record.layers") -> dict[str, nn.Module]:
    """Recordable modules whose names match any glob in ``patterns`` (in model order)."""
    layers = {name: m for name, m in model.named_modules() if name and op_of(m)}
    try:
        chosen = {n: layers[n] for n in match_names(list(layers), patterns, key)}
    except PeatError as err:
        # A conv that op_of leaves out would look absent: say why it is not a layer here.
        odd = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d) and not op_of(m)]
        if not odd:
            raise
        raise PeatError(f"{err} (not recordable: {', '.join(odd[:6])}: Conv2d padded unevenly or not with zeros)") from None
    for name, module in chosen.items():
        weight = _weight(module)
        if isinstance(weight, nn.parameter.UninitializedParameter):  # torch's ValueError named no layer
            raise PeatError(f"config key '{key}': layer {name!r} has an uninitialized (lazy) weight; "
                            "run the model on a batch first, which shapes it")
        if weight is not None and not weight.numel():
            raise PeatError(f"config key '{key}': layer {name!r} has a weight of shape {tuple(weight.shape)}, "
                            "no element to replay")
    return chosen


def match_names(names: list[str], patterns: list[str], key: str, where: str = "") -> list[str]:
    """``names`` (recordable layers, in model order) that match any glob in ``patterns``; a glob
    that matches none fails naming ``key`` (``where``: which model, when the key does not say): a
    config key, or a command-line option as it is typed (benchmarks' ``--record-layers``)."""
    named = key if key.startswith("--") else f"config key '{key}'"
    if isinstance(patterns, str):  # iterated, it would be one glob per character
        raise PeatError(f"{named}: expected a list of globs, got the string {patterns!r} "
                        f"(write [{patterns!r}])")
    # A library caller's None or numbers ended in fnmatch's TypeError (the schema checks the config's).
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise PeatError(f"{named}: expected a list of globs (strings), got {patterns!r}")
    chosen = set()
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            have = f"layers are e.g. {', '.join(names[:6])}" if names else "there are none"
            raise PeatError(f"{named}: {pattern!r} matches no conv/linear/norm layer{where}; {have}")
        chosen.update(hits)
    return [n for n in names if n in chosen]


def check_records_a_step(key: str, every: int, epochs, per_epoch: int) -> None:
    """``record.epochs`` (None: every epoch) must hold a step that is a multiple of ``every``
    (epoch e runs steps (e-1)*per_epoch to e*per_epoch-1): a context without a sample leaves
    playback nothing to replay. ``key``: the config key named when it does not."""
    if epochs and not any(step % every == 0 for e in epochs for step in range((e - 1) * per_epoch, e * per_epoch)):
        raise PeatError(f"config key '{key}': no step of record.epochs {list(epochs)} is a multiple of {every} "
                        f"({per_epoch} training steps per epoch, from step 0); nothing would be recorded")


def summary_dtype(names) -> np.dtype:
    """The summaries table's row for layers ``names`` (encoded): numpy cuts a longer name to the
    column's width, and a cut name matches no layer, or fails to decode (a split character)."""
    width = max([SUMMARY_NAME_BYTES, *map(len, names)])
    return np.dtype([("step", "i8"), ("epoch", "i4"), ("layer", f"S{width}"), ("tensor", "S8")]
                    + [(s, "f8") for s in SUMMARY_STATS])


def _check_group_names(layers, key: str) -> None:
    """Each recorded layer is an HDF5 group named after it: a '/' (a ModuleDict key) nested it in
    another's group, and 'x' beside 'x/y' mixed their steps, failing reads and resumes naming no layer."""
    for name in layers:
        if "/" in name:
            raise PeatError(f"config key '{key}': layer {name!r} has '/' in its name, which the context (HDF5) "
                            "reads as a path; rename the module or leave it out of the globs")


# The file attributes the Profiler writes itself: a meta key among them was overwritten without a word.
# (torch_version too, with what a caller's meta means by it: the torch that ran.)
OWN_ATTRS = ("dtype", "every", "record_epochs", "derived", "layers", "steps", "naive_bytes_per_step")


def _meta(meta) -> dict:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise PeatError(f"Profiler: meta={meta!r}: expected a dict of attribute names and values")
    for key in meta:
        if key in OWN_ATTRS:
            raise PeatError(f"Profiler: meta[{key!r}] is an attribute the Profiler writes itself "
                            f"({', '.join(OWN_ATTRS)}); name it otherwise")
    return meta


def _count(label: str, value, least: int, means: str) -> int:
    """``value`` as an int (any integer type: numpy's, a 0-d integer tensor), >= ``least``: a step of
    0.5 or text failed at end_step in a format or comparison error, an epoch '1' matched no epoch."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < least:
        raise PeatError(f"Profiler: {label}={value!r}: {means}")
    return number


def _write_meta(attrs: h5py.AttributeManager, meta: dict) -> None:
    for key, value in meta.items():
        try:
            attrs[key] = value
        except (TypeError, ValueError) as err:
            raise PeatError(f"Profiler: meta[{key!r}] = {value!r} cannot be an HDF5 attribute ({err}); "
                            "give a string, a number or a list of them") from None


def _epoch_list(epochs) -> list[int] | None:
    """``epochs`` as a list, each an integer >= 1; a bare number (``epochs=2``) or a string failed at
    ``attach`` or at the first step in a TypeError."""
    if epochs is None:
        return None
    if isinstance(epochs, (str, bytes)) or not isinstance(epochs, collections.abc.Iterable):
        raise PeatError(f"Profiler: epochs={epochs!r}: expected a list of epoch numbers, or None for every epoch")
    epochs = list(epochs)
    for epoch in epochs:
        check_int(f"Profiler: epochs={epochs!r}: epoch", epoch, 1, "epochs are integers from 1, as training counts them")
    return epochs


def _weight(module: nn.Module) -> torch.Tensor | None:
    """``module.weight``, read without side effects. A parametrized weight (weight_norm,
    spectral_norm) is computed at each access, spectral_norm's after a power iteration in training
    mode that would change training: it is read as the last forward computed it, without one."""
    if not parametrize.is_parametrized(module, "weight"):
        return getattr(module, "weight", None)
    chain = list(module.parametrizations.weight.modules())
    modes = [m.training for m in chain]
    try:
        for m in chain:
            m.training = False
        with torch.no_grad():  # a computed weight has no .grad
            return module.weight
    finally:
        for m, mode in zip(chain, modes):
            m.training = mode


def _parameters(module: nn.Module) -> dict:
    """The weight (in nn.Linear's layout) and bias of ``module`` as its forward uses them, read in its
    forward hook: one that a forward pre-hook computes (torch.nn.utils.prune, the older weight_norm and
    spectral_norm) or that torch.func.functional_call swaps in (MAML's adapted weights) is not the
    module's own between forwards."""
    weight, bias = _weight(module), getattr(module, "bias", None)
    return {"W": None if weight is None else _as_linear(module, weight.detach().clone()),
            "B": None if bias is None else bias.detach().clone()}


def _grad(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's gradient; None for a computed weight (no leaf: reading its .grad warns)."""
    return tensor.grad if tensor is not None and tensor.is_leaf else None


def _holds_grad(module: nn.Module) -> bool:
    """Whether the weight or bias of ``module`` has a gradient (read before the step's backward:
    one that earlier steps left, which this step's adds to)."""
    return any(_grad(p) is not None for p in (_weight(module), getattr(module, "bias", None)))


def layer_input(label: str, op: str, args: tuple, kwargs: dict, how: str) -> torch.Tensor | None:
    """A recorded or routed layer's one input, given by position or keyword (``fc(input=x)``); a
    conv2d's must be batched: golden's gradients need the batch dimension. ``label`` names the
    layer in the error, ``how`` says what needs the batch ("recorded", "routed")."""
    x = args[0] if args else next(iter(kwargs.values()), None)
    if op == "conv2d" and torch.is_tensor(x) and x.dim() != 4:
        raise PeatError(f"{label} got an input of shape {tuple(x.shape)}; "
                        f"a conv2d layer is {how} on batched (N, C, H, W) inputs")
    return x


def _as_linear(module: nn.Module, tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is not None and hyper_params(module).get("transposed"):
        return tensor.t()
    return tensor


def _filters(t: torch.Tensor) -> dict:
    """HDF5 storage options of one recorded tensor (see REPEATED_SHARE)."""
    if t.numel() < MIN_COMPRESSED_ELEMENTS:
        return {}
    # Judged on every 7th element (prime, so not in step with channels or rows): a seventh of the work.
    sample = t.reshape(-1)[::7]
    repeated = max(int(torch.count_nonzero(sample == 0)), int(torch.count_nonzero(sample == sample.min())))
    if repeated < sample.numel() * REPEATED_SHARE:
        return {}
    return dict(compression="lzf", chunks=tuple(t.shape) if 4 * t.numel() <= MAX_CHUNK_BYTES else True)


class Profiler:
    """Attach to a model, then call ``begin_step``/``end_step`` around each training step."""

    def __init__(self, path: str | Path, layers: list[str], *, every: int = 1, epochs: list[int] | None = None,
                 meta: dict | None = None, key: str = "record.layers", derived: bool = False):
        check_int("Profiler: every", every, 1, "record every N-th step needs an integer N >= 1")
        epochs = _epoch_list(epochs)
        self.path = Path(path)
        # Kept beside the training state so that a killed run resumes the same file.
        self.partial = self.path.parent / ".partial" / self.path.name
        self.patterns, self.every, self.epochs = layers, every, epochs
        self.meta, self.key, self.derived = _meta(meta), key, derived
        # new -> attached <-> in_step -> closed (close or abandon)
        self._phase = "new"

    def _require(self, call: str, *phases: str) -> None:
        """One line for a call out of order: it ended in an AttributeError about the Profiler's
        internals (begin_step before attach), or in h5py's errors on a closed file."""
        if self._phase in phases:
            return
        if self._phase == "new":
            raise PeatError(f"Profiler: {call} before attach(model); attach the model first")
        if self._phase == "closed":
            raise PeatError(f"Profiler: {call} after close; a closed Profiler records no more (make a new one)")
        if call == "attach":
            raise PeatError("Profiler: attach, but it is attached already; one Profiler records one model")
        if self._phase == "in_step":
            raise PeatError(f"Profiler: {call} while step {self.step} is begun; call end_step first "
                            "(or abandon, to stop as after an interruption)")
        raise PeatError(f"Profiler: {call} without its begin_step; call begin_step(step, epoch) first")

    # -- lifecycle ----------------------------------------------------------------------
    def attach(self, model: nn.Module, first_step: int = 0, resuming: bool = False) -> None:
        """Record ``model`` from ``first_step`` on; ``resuming`` a killed run of the same settings,
        whose snapshots (``snapshot``) hold the steps before it."""
        self._require("attach", "new")
        if self.path.is_dir():  # else found by close's rename, after the whole training
            raise PeatError(f"Profiler: {self.path} is a directory; give the path of the context file to write")
        self.model = model
        self.targets = match_layers(model, self.patterns, self.key)
        _check_group_names(self.targets, self.key)
        for name, module in self.targets.items():
            weight = _weight(module)
            if weight is not None and weight.dtype != torch.float32:  # golden replays float32
                raise PeatError(f"Profiler: layer {name!r} has {weight.dtype} weights; "
                                "the context records float32 layers only")
        self.all_layers = {n: m for n, m in model.named_modules() if n and op_of(m)}
        # A weight tied to another module's (GPT-2's lm_head and wte): its .grad sums both uses.
        uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        self._tied = {n for n, m in self.targets.items() if uses[id(_weight(m))] > 1}
        self.first_step, self.last_step = first_step, first_step - 1
        # The context's first step: a run started from a checkpoint (fit's ``start``) records from its
        # step, not 0. Kept in every snapshot: a resumed run reads it back (``_restore``).
        self.origin = first_step
        self.naive_bytes_per_step = 0
        self._rows: list[tuple] = []
        # (layer, tensor) -> six statistics: a numpy row, or a tensor still on the device
        self._pending: dict[tuple[str, str], np.ndarray | torch.Tensor] = {}
        self._held: dict[tuple[str, str], torch.Tensor] = {}  # tensors to summarise in one batch
        self._held_elements = 0
        self._names = {name: name.encode() for name in self.all_layers}
        self._summary_dtype = summary_dtype(self._names.values())
        self._captured: dict[str, dict] = {}
        # Per recorded layer, attributes of this step's sample: whether its input needed a gradient,
        # and a cumulative batch norm's averaging factor (it changes every step).
        self._step_attrs: dict[str, dict] = {}
        # Layers fed the same tensor (llama's gate_proj and up_proj) share one copy and one dataset
        # (an HDF5 hard link). This step's: input identity -> (input, copy); id(copy) -> (copy, dataset),
        # holding the tensors so that no id or address is reused before the step is written.
        self._inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._written: dict[int, tuple[torch.Tensor, h5py.Dataset]] = {}
        self._ran: set[str] = set()  # targets whose input a recorded step holds: the others are named at close
        self.recording = False
        self._input_hooks = []
        self._open(resuming)  # first: a refused file leaves no hook behind
        # First of the forward hooks: one registered before that returns another output (out * 2) would
        # have it recorded as the layer's, with its gradient as dO, which no op on A and W gives.
        self._hooks = [m.register_forward_hook(self._forward_hook(n), with_kwargs=True, prepend=True)
                       for n, m in self.all_layers.items()]
        self._phase = "attached"

    def _open(self, resuming: bool) -> None:
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        self.file = open_h5(self.partial, "w")
        try:
            _write_meta(self.file.attrs, self.meta)
            settings = self._settings()
            self.file.attrs.update(settings | {"dtype": "float32",
                                               "layers": np.array(settings["layers"], dtype=h5py.string_dtype())})
            for name, module in self.targets.items():
                group = self.file.create_group(f"layers/{name}")
                group.attrs.update(op=op_of(module), module_type=type(module).__name__, **hyper_params(module))
            self.file.create_dataset("summaries", shape=(0,), maxshape=(None,), dtype=self._summary_dtype,
                                     chunks=(4096,), **COMPRESSION)
            if resuming:
                self._restore()
        except PeatError:  # closed and removed, or the next Profiler could not create the file
            self.file.close()
            self.partial.unlink()
            self._drop_empty_partial_folder()
            raise
        # The last step and the summary rows inside a snapshot: every one before first_step.
        self._snapped, self._snapped_rows = self.first_step - 1, len(self.file["summaries"])

    def _settings(self) -> dict:
        """What a resumed run must share with the killed one whose snapshots it continues."""
        # Plain ints: a numpy integer (which every and epochs take) is no JSON, and the snapshot failed.
        return {"torch_version": str(torch.__version__), "every": int(self.every),
                "record_epochs": [int(e) for e in self.epochs or []], "derived": bool(self.derived),
                "layers": list(self.targets)}

    def _check_same_settings(self, shards: list[Path]) -> None:
        """A snapshot of other settings (another ``every``, other layers) was restored as it was, and
        the context mixed two recordings under the new settings' attributes."""
        mine = self._settings()
        for shard in shards:
            with open_h5(shard) as f:
                theirs = json.loads(f.attrs.get("settings", "{}"))  # none in snapshots of older versions
            for key, value in theirs.items():
                if mine.get(key) != value:
                    raise PeatError(f"{shard}: a snapshot recorded with {key}={value!r}, not {mine.get(key)!r}; "
                                    f"resume with the killed run's settings, or delete {self.partial.parent} "
                                    "to train again from the start")

    def _restore(self) -> None:
        """Rebuild what was recorded before ``first_step`` from the snapshots: the file a killed
        run had open for writing may be corrupt, they were closed whole."""
        shards = sorted(self._shards.glob("*.h5"), key=_step_of) if self._shards.is_dir() else []
        self._check_same_settings(shards)  # first: nothing deleted or copied for a refused resume
        if shards and int(shards[0].stem) < self.first_step:
            with open_h5(shards[0]) as f:
                self.origin = int(f.attrs.get("origin", 0))
        restored = self.origin  # every step from the context's first before it
        for shard in shards:
            if int(shard.stem) >= self.first_step:  # taken after the resume point (killed before its checkpoint)
                shard.unlink()
            elif int(shard.stem) == restored:
                with open_h5(shard) as f:
                    rows = f["summaries"][()]
                    rows = rows[rows["step"] < self.first_step]
                    written = done = 0  # rows appended; rows of the steps replayed so far

                    def through(step: int) -> None:
                        # The rows end_step appended (SUMMARY_ROWS_HELD) up to this step, before its
                        # recorded tensors: HDF5 places what follows by what came before.
                        nonlocal written, done
                        while done < len(rows) and rows["step"][done] <= step:
                            done += int(np.searchsorted(rows["step"][done:], rows["step"][done], side="right"))
                            if done - written >= SUMMARY_ROWS_HELD:
                                self._append_summaries(rows[written:done])
                                written = done

                    _copy_steps(f, self.file, self.targets, self.first_step, on_step=through)
                    through(self.first_step)
                    self._append_summaries(rows[written:])
                    self.naive_bytes_per_step = int(f.attrs["naive_bytes_per_step"])
                    self._flush()  # as the snapshot did
                    restored = int(f.attrs["last_step"]) + 1
        self._ran = {name for name in self.targets
                     if any("A" in step for step in self.file.get(f"layers/{name}", {}).values())}
        if restored < self.first_step:
            raise PeatError(f"{self._shards}: the Profiler's snapshots hold the steps before {restored}, not every "
                            f"step before the resume point {self.first_step}; delete {self.partial.parent} "
                            "to train again from the start")

    def want(self, step: int, epoch: int) -> bool:
        return step % self.every == 0 and (not self.epochs or epoch in self.epochs)

    def begin_step(self, step: int, epoch: int) -> None:
        self._require("begin_step", "attached", "in_step")  # a step that failed half-way is begun again
        step = _count("step", step, 0, "steps are integers from 0, one counter for the whole training")
        epoch = _count("epoch", epoch, 1, "epochs are integers from 1, as training counts them")
        if step <= self.last_step:  # a step counted per epoch: h5py's 'name already exists' an epoch later
            raise PeatError(f"Profiler: step {step} (epoch {epoch}) is not after the last step, {self.last_step}; "
                            "number the steps across epochs (one counter for the whole training)")
        self.step, self.epoch = step, epoch
        self._phase = "in_step"
        self.recording = self.want(step, epoch)
        # A training-mode forward since the last step (say, a user's accuracy check) is no part of this one.
        self._pending.clear()
        self._held.clear()
        self._held_elements = 0
        for handle in self._input_hooks:  # a step begun again before its end: its hooks stayed for good
            handle.remove()
        self._input_hooks = []
        self._repeated = set()  # targets called more than once this step: their first call is recorded
        self._graded = set()  # targets whose recorded call this step produced an output needing a gradient
        self._carried = set()  # targets whose weight or bias has a .grad before their first call this step
        if self.recording:
            for name, module in self.targets.items():
                self._captured[name] = self._before(module)
                # dA is only stored then. An rms_norm's input feeds two of its ops: an alias would sum
                # their gradients before the residual's is added, which changes training's last bits;
                # its dA is derived in _write instead (autograd's sum of those two, see kernels).
                if self.derived and op_of(module) != "rms_norm":
                    self._input_hooks.append(module.register_forward_pre_hook(self._input_hook(name), with_kwargs=True))

    def end_step(self) -> None:
        self._require("end_step", "in_step")  # else it wrote the last step again: h5py's 'name already exists'
        # Not copied: nothing changes them before these statistics run (queued first on a GPU).
        for name, module in self.all_layers.items():
            weight = _weight(module)
            if weight is not None:
                self._held[name, "W"] = weight
                if _grad(weight) is not None:
                    self._held[name, "dW"] = weight.grad
        self._summarise_held()
        self._collect_summaries()
        if len(self._rows) >= SUMMARY_ROWS_HELD:
            self._write_rows()
        if self.recording:
            for handle in self._input_hooks:
                handle.remove()
            for name, module in self.targets.items():
                self._write(name, module, self._captured.pop(name))
            self._inputs.clear()
            self._written.clear()
            self.recording = False  # a forward before the next begin_step (say, accuracy) records nothing
        if self.naive_bytes_per_step == 0:
            self.naive_bytes_per_step = self._naive_bytes
        self.last_step = self.step
        self._phase = "attached"

    def _summarise(self, name: str, out: torch.Tensor) -> None:
        """The summary of a layer's output; on a GPU from a copy summarised later with others
        (``stats_many``), a copy since later in-place code (ResNet's ReLU) may change the output."""
        if not out.is_cuda:
            self._pending[name, "act"] = stats(out)
            return
        self._pending[name, "act"] = None  # its place in the rows, filled by _summarise_held
        self._held[name, "act"] = out.detach().clone()
        self._held_elements += out.numel()
        if self._held_elements > BATCH_ELEMENTS:  # bounds the copies' memory
            self._summarise_held()

    def _summarise_held(self) -> None:
        self._pending.update(zip(self._held, stats_many(list(self._held.values()))))
        self._held.clear()
        self._held_elements = 0

    def _collect_summaries(self) -> None:
        """Turn this step's statistics into summary rows (device tensors moved in one transfer)."""
        on_device = [key for key, row in self._pending.items() if torch.is_tensor(row)]
        if on_device:
            moved = torch.stack([self._pending[key] for key in on_device]).cpu().numpy()
            self._pending.update(zip(on_device, moved))
        self._rows += [(self.step, self.epoch, self._names[layer], tensor.encode(), *row)
                       for (layer, tensor), row in self._pending.items()]
        self._pending.clear()

    def _write_rows(self) -> None:
        if self._rows:
            self._append_summaries(np.array(self._rows, dtype=self._summary_dtype))
            self._rows.clear()

    def _append_summaries(self, rows: np.ndarray) -> None:
        summaries = self.file["summaries"]
        summaries.resize((summaries.shape[0] + len(rows),))
        summaries[summaries.shape[0] - len(rows):] = rows

    def flush(self) -> None:
        self._require("flush", "attached", "in_step")
        self._flush()

    def _flush(self) -> None:
        self._write_rows()
        self.file.attrs["naive_bytes_per_step"] = self.naive_bytes_per_step
        self.file.flush()

    @property
    def _shards(self) -> Path:
        return self.partial.with_name("context.snapshots")

    def snapshot(self) -> None:
        """Keep what was recorded since the last snapshot safe for a resumed run, in a file of its
        own named by its first step: each snapshot costs what its epochs recorded, not the whole
        context so far (copied whole, it took 0.65 s per GB every epoch). They outlive ``close``,
        in the training's ``.partial/``: a job killed after it may still have to resume."""
        self._require("snapshot", "attached")
        self._flush()
        first = self._snapped + 1
        with atomic_path(self._shards / f"{first:07d}.h5") as tmp, open_h5(tmp, "w") as shard:
            _copy_steps(self.file, shard, self.targets, self.last_step + 1, since=first)
            shard.create_dataset("summaries", data=self.file["summaries"][self._snapped_rows:])
            shard.attrs.update(naive_bytes_per_step=self.naive_bytes_per_step, last_step=self.last_step,
                               origin=self.origin, settings=json.dumps(self._settings()))
        self._snapped, self._snapped_rows = self.last_step, len(self.file["summaries"])

    def abandon(self) -> None:
        """Stop recording and close the file as it is: training was interrupted, and a rerun resumes
        from the snapshots (in this process too, as after Ctrl-C in a notebook: HDF5 refuses to
        create a file that is still open). Called on any interruption, it does nothing where there is
        nothing open: before attach (one refused), or after close."""
        if self._phase in ("new", "closed"):
            return
        self._phase = "closed"
        for handle in self._hooks + self._input_hooks:
            handle.remove()
        self.file.close()

    def close(self) -> None:
        """Finish the file, rename it into place and write the storage accounting beside it."""
        self._require("close", "attached")
        for handle in self._hooks:
            handle.remove()
        self._flush()
        steps = self.last_step + 1
        self.file.attrs["steps"] = steps
        self.file.close()
        self._phase = "closed"
        os.replace(self.partial, self.path)
        self._drop_empty_partial_folder()
        context = self.path.stat().st_size
        # The steps this context covers: a run started from a checkpoint (fit's start) ran none before it.
        steps -= self.origin
        naive = self.naive_bytes_per_step * steps
        not_run = [name for name in self.targets if name not in self._ran]
        write_json(self.path.with_name("storage.json"), {
            "context_bytes": context, "naive_bytes_per_step": self.naive_bytes_per_step, "steps": steps,
            "naive_bytes": naive, "ratio": context / naive if naive else None,
            "recorded_layers": list(self.targets), "every": self.every, "derived": self.derived,
            "layers_not_run": not_run,
        })
        # Else a kernel's verdict on the context passed without a word about them (a run of no step has none to name).
        if not_run and self.last_step >= self.origin:
            warnings.warn(f"Profiler: layer(s) {', '.join(not_run)} never ran at a recorded step (a module whose "
                          "weights its parent uses without calling it, as nn.MultiheadAttention's out_proj, or a "
                          "branch not taken): the context holds their weights only, and playback replays none of "
                          "them", stacklevel=2)

    def _drop_empty_partial_folder(self) -> None:
        with contextlib.suppress(OSError):  # left empty unless training keeps its own state there
            self.partial.parent.rmdir()

    # -- hooks --------------------------------------------------------------------------
    def _forward_hook(self, name: str):
        def hook(module, args, kwargs, output):
            if not self.model.training:
                return
            target = name in self.targets
            x = layer_input(f"Profiler: layer {name!r}", op_of(module) if target else None, args, kwargs, "recorded")
            out = output if torch.is_tensor(output) else output[0]
            if target and out.dtype != torch.float32:  # golden replays it in float32
                raise PeatError(f"Profiler: layer {name!r} computed in {out.dtype} (under torch.autocast?); "
                                "the context records float32 layers only")
            cap = self._captured.get(name) if self.recording and target else None
            recorded = cap is not None and self._records(name, module) and not ("A" in cap and not out.requires_grad)
            # One call per step is summarised: the recorded one, so the Analyzer's statistics describe
            # the tensors playback replays; for other layers the first.
            if recorded or (name, "act") not in self._pending:
                self._summarise(name, out)
            if self.naive_bytes_per_step == 0:
                w = _weight(module)
                self._sizes = getattr(self, "_sizes", {})
                self._sizes[name] = 4 * (x.numel() + out.numel() + (w.numel() if w is not None else 0))
            if cap is not None:
                if not recorded:
                    self._repeated.add(name)  # a later call (weights reused in one step): A, O, dO stay
                    return                    # the recorded call's
                if self.derived and "A" not in cap and _holds_grad(module):  # accumulating over steps
                    self._carried.add(name)
                # Clones: later in-place code (ResNet's `out += identity`) may change these. An input made
                # under torch.inference_mode has no version counter to tell such a change by: never shared.
                same = object() if x.is_inference() else (x.data_ptr(), x._version, tuple(x.shape), x.stride(), x.dtype)
                if same not in self._inputs:  # x is kept too, so no other tensor gets its memory this step
                    self._inputs[same] = (x, x.detach().clone())
                cap["A"] = self._inputs[same][1]
                self._step_attrs[name] = {"input_grad": bool(x.requires_grad)} | _cumulative_momentum(module)
                if self.derived:
                    cap["O"] = out.detach().clone()
                cap.update(_parameters(module))
                # A hook registered before an in-place change of `out` still sees the
                # gradient of the value this layer produced. A frozen layer behind a frozen
                # prefix has no gradient: only its forward is recorded.
                if out.requires_grad:
                    self._graded.add(name)
                    out.register_hook(self._store(name, "dO"))
        return hook

    def _records(self, name: str, module: nn.Module) -> bool:
        """Whether this call of a target is the one recorded this step: its first, or a later one where
        the first carried no gradient (under no_grad, or a reentrant checkpoint's first pass, which
        runs again with one in the backward); not a training batch norm's, whose running statistics
        the first call already updated."""
        if "A" not in self._captured[name]:
            return True
        updates = op_of(module) == "batch_norm" and module.training and module.running_mean is not None
        return name not in self._graded and not updates

    @property
    def _naive_bytes(self) -> int:
        return int(sum(getattr(self, "_sizes", {}).values()))

    # Gradients come from tensor hooks, not module backward hooks: those wrap the output in a
    # view that in-place code after the layer (ResNet's `out += identity`) may not modify.
    def _input_hook(self, name: str):
        """Feed the layer an alias of its input, so the alias's gradient is this layer's dA alone
        (the input itself may also feed a skip connection)."""
        def hook(module, args, kwargs):
            x = layer_input(name, None, args, kwargs, "recorded")
            if not (torch.is_tensor(x) and x.requires_grad) or not self._records(name, module):
                return None
            alias = x.view_as(x)
            alias.register_hook(self._store(name, "dA"))
            return ((alias, *args[1:]), kwargs) if args else (args, kwargs | {next(iter(kwargs)): alias})
        return hook

    def _store(self, name: str, key: str):
        def hook(grad):
            cap, grad = self._captured[name], grad.detach()
            # Each backward of the step (several losses, retain_graph=True) brings its share, as .grad sums them.
            cap[key] = cap[key] + grad if key in cap else grad.clone()
        return hook

    @staticmethod
    def _before(module: nn.Module) -> dict:
        cap = {}  # the weights are read as the recorded call used them (_parameters)
        if op_of(module) == "batch_norm" and module.running_mean is not None:
            cap["running_mean"] = module.running_mean.detach().clone()
            cap["running_var"] = module.running_var.detach().clone()
        return cap

    def _write(self, name: str, module: nn.Module, cap: dict) -> None:
        # A tied weight's .grad, or that of a module called twice or accumulated over steps, sums several
        # uses, and a frozen or computed (parametrized) weight has none: the recorded call's own follows
        # from its A and dO.
        attrs = hyper_params(module) | {"op": op_of(module)}
        weight, bias = _weight(module), getattr(module, "bias", None)
        if self.derived and weight is not None and "dO" in cap:
            own = _grad(weight) is not None and name not in self._tied | self._repeated | self._carried
            cap["dW"] = _as_linear(module, weight.grad) if own else _golden("weight_grad", cap, attrs)
        if self.derived and attrs["op"] == "rms_norm" and "dO" in cap and self._step_attrs.get(name, {}).get("input_grad"):
            cap["dA"] = _golden("input_grad", cap, attrs)
        if self.derived and bias is not None and "dO" in cap:
            own = _grad(bias) is not None and name not in self._repeated | self._carried
            cap["dB"] = bias.grad if own else _bias_grad(cap, attrs)
        if cap.get("A") is not None:
            self._ran.add(name)
        else:  # not run at this step: its weights alone, as they are (no optimizer step since begin_step)
            cap |= _parameters(module)
        group = self.file.create_group(f"layers/{name}/{self.step:07d}")
        # A batch norm without running statistics normalises with the batch's even in eval mode.
        training = module.training or (attrs["op"] == "batch_norm" and module.running_mean is None)
        group.attrs.update(step=self.step, epoch=self.epoch, training=training,
                           **{"input_grad": False} | self._step_attrs.pop(name, {}))
        for key, tensor in sorted(cap.items(), key=lambda item: _order(_ORDER)(item[0])):
            if tensor is None:
                continue
            if id(tensor) in self._written:
                group[key] = self._written[id(tensor)][1]  # hard link: stored once, read as usual
                continue
            data = tensor.detach().float().cpu()
            # .numpy() of a contiguous float32 CPU tensor is a view, no copy
            self._written[id(tensor)] = (tensor, group.create_dataset(key, data=data.numpy(), **_filters(data)))


def _step_of(snapshot: Path) -> int:
    """A snapshot's first step, its name: names are 7 digits up to step 9,999,999, 8 after, so that
    sorted as text, 10000000.h5 came before 9999998.h5 and a resumed run found a gap."""
    return int(snapshot.stem)


# The order in which _write creates a step's tensors and attributes, which _copy_steps repeats.
_ORDER = ("W", "B", "running_mean", "running_var", "A", "O", "dO", "dA", "dW", "dB")
_ATTRS = ("step", "epoch", "training", "input_grad", "momentum")


def _order(names: tuple[str, ...]):
    return lambda name: (names.index(name), "") if name in names else (len(names), name)


def _copy_steps(src: h5py.File, dst: h5py.File, layers, before: int, since: int = 0, on_step=None) -> None:
    """Copy the recorded steps ``since`` <= step < ``before`` of ``layers`` from ``src`` to ``dst``
    (datasets shared by hard links stay shared: one copy, linked again). Written as ``_write`` wrote
    them (step by step, layers, attributes and tensors in its order, the same storage options), not
    by HDF5's object copy: a resumed run's file is then byte for byte the uninterrupted run's.
    ``on_step(step)`` is called before each step's tensors are written."""
    groups = {name: src.get(f"layers/{name}", {}) for name in layers}
    # names only: opening every group costs
    keys = sorted({k for steps in groups.values() for k in steps if since <= int(k) < before}, key=int)
    for key in keys:
        if on_step is not None:
            on_step(int(key))
        copied = {}  # source dataset id -> its copy; held for a step only, as _write holds its datasets
        for name, steps in groups.items():
            if key not in steps:
                continue
            group, out = steps[key], dst.create_group(f"layers/{name}/{key}")
            out.attrs.update({k: group.attrs[k] for k in sorted(group.attrs, key=_order(_ATTRS))})
            for tensor in sorted(group, key=_order(_ORDER)):
                dataset = group[tensor]
                if dataset.id in copied:
                    out[tensor] = copied[dataset.id]
                else:
                    copied[dataset.id] = out.create_dataset(tensor, data=dataset[()], compression=dataset.compression,
                                                            chunks=dataset.chunks)


def read_layer(path: str | Path, layer: str, steps=None, derive: bool = True,
               tensors: tuple[str, ...] | None = None) -> tuple[dict, list[dict]]:
    """Layer attributes and its recorded samples (dicts of tensors plus step/epoch), in step order;
    only those of ``steps`` when given, and only the tensors named in ``tensors`` when given (those a
    sample holds). With ``derive``, golden outputs the file does not hold
    (recorded with ``derived=False``) are computed from the recorded inputs (``derive_outputs``)."""
    with open_h5(path) as f:
        group = _layer_group(f, path, layer)
        attrs = {k: _plain(v) for k, v in group.attrs.items()}
        samples = []
        keys = sorted(group, key=int) if steps is None else [f"{s:07d}" for s in sorted(int(s) for s in steps)]
        missing = [int(k) for k in keys if k not in group]
        if missing:
            raise PeatError(f"{path}: layer {layer!r} has no recorded step {missing[0]} "
                            f"(recorded: {', '.join(str(k) for k in sorted(map(int, group))) or 'none'})")
        if derive:
            _check_derivable(path, layer, attrs, group, keys)
        for key in keys:
            sample = {k: torch.from_numpy(v[()]) for k, v in group[key].items() if tensors is None or k in tensors}
            sample.update({k: _plain(v) for k, v in group[key].attrs.items()})
            if derive and "O" not in sample and "A" in sample:  # no A: the layer did not run at that step
                sample.update(derive_outputs(sample, attrs))
            samples.append(sample)
    return attrs, samples


# What golden needs to derive a layer's outputs: the layer's attributes (hyper_params) and, in a step at
# which it ran, the recorded tensors (a norm's weight is optional: no affine).
_DERIVE_ATTRS = {"linear": ("transposed",), "conv2d": ("stride", "padding", "dilation", "groups"),
                 "batch_norm": ("eps", "momentum"), "layer_norm": ("eps", "normalized_shape"),
                 "rms_norm": ("eps", "normalized_shape")}
_DERIVE_TENSORS = {"linear": ("A", "W"), "conv2d": ("A", "W")}


def _check_derivable(path, layer: str, attrs: dict, group, keys) -> None:
    """One line naming what a damaged or foreign context lacks: it ended in golden's KeyError or TypeError."""
    op = attrs.get("op")
    if op not in _DERIVE_ATTRS:
        raise PeatError(f"{path}: layer {layer!r} has op {op!r}, not one of {', '.join(_DERIVE_ATTRS)} "
                        "(a damaged context, or not the Profiler's)")
    for name in _DERIVE_ATTRS[op]:
        if name not in attrs:
            raise PeatError(f"{path}: layer {layer!r} ({op}) lacks its attribute {name!r} (a damaged context)")
    for key in keys:
        if "O" in group[key] or "A" not in group[key]:  # stored outputs, or not run: nothing derived
            continue
        for name in _DERIVE_TENSORS.get(op, ()):
            if name not in group[key]:
                raise PeatError(f"{path}: layers/{layer}/{key} lacks {name} (a damaged context)")


def derive_outputs(sample: dict, attrs: dict) -> dict:
    """The golden O, dA, dW, dB of one sample, from its A, W, B and dO (and running statistics).

    They are what the golden kernels (``peat.kernels.golden``) compute in float32 on the CPU:
    bit-identical to what training produced for most layers, but PyTorch's autograd may round
    some gradients differently (docs/design.md, "Context file"). dA only where the layer's
    input needed a gradient; dW and dB where the layer has that parameter.
    """
    def run(computation):
        return _golden(computation, sample, attrs)

    out = {"O": run("forward")}
    if sample.get("dO") is None:  # frozen, or its output did not reach the loss: no backward to derive
        return out
    if sample.get("input_grad"):
        out["dA"] = run("input_grad")
    if sample.get("W") is not None:
        out["dW"] = run("weight_grad")
    if sample.get("B") is not None:
        out["dB"] = _bias_grad(sample, attrs)
    return out


def _golden(computation: str, sample: dict, attrs: dict) -> torch.Tensor:
    """What the golden kernel computes for ``computation`` of a recorded sample."""
    from . import kernels

    # As training laid them out (a transposed layer's weight): some BLAS round another layout's product differently.
    args, kwargs = kernels.arguments(attrs["op"], computation, kernels.as_trained(sample, attrs), attrs)
    # clones: the batch-norm forward updates the running statistics in place
    kwargs = {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    return kernels.golden(attrs["op"], attrs).computation(computation)(*args, **kwargs)


def _bias_grad(sample: dict, attrs: dict) -> torch.Tensor:
    """The bias gradient: the sample's ``dO`` summed over every dimension but the bias's own."""
    op, grad_out = attrs["op"], sample["dO"]
    if op == "conv2d":  # autograd's own sum: a plain one rounded 1e-9 away from training's
        return torch.ops.aten.convolution_backward(
            grad_out, sample["A"], sample["W"], [grad_out.shape[1]], attrs["stride"], attrs["padding"],
            attrs["dilation"], False, [0, 0], attrs["groups"], [False, False, True])[2]
    if op == "batch_norm":  # channels are dimension 1
        return grad_out.sum([d for d in range(grad_out.dim()) if d != 1])
    kept = len(attrs["normalized_shape"]) if op in ("layer_norm", "rms_norm") else 1
    return grad_out.reshape(-1, *grad_out.shape[grad_out.dim() - kept:]).sum(0)


def recorded_steps(path: str | Path, layer: str, ran: bool = False) -> list[int]:
    """The steps at which ``layer`` was recorded, in order (no tensor is read); with ``ran``, only
    those at which it ran (its input recorded: a conditional branch or an idle expert holds its weights only)."""
    with open_h5(path) as f:
        group = _layer_group(f, path, layer)
        return sorted(int(key) for key in group if not ran or "A" in group[key])


def _layer_group(f, path, layer: str):
    if f"layers/{layer}" not in f:
        have = ", ".join(f.get("layers", {}))
        raise PeatError(f"{path}: no recorded layer {layer!r}; recorded: {have or 'none'}")
    return f[f"layers/{layer}"]


def _plain(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value.item() if hasattr(value, "item") else value


