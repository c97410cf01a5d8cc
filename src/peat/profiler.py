"""PEAT's Profiler: record the training context of chosen layers during golden training.

At sampled steps it stores, per target layer, the input activation ``A``, weight ``W``,
bias ``B``, output gradient ``dO`` and the golden outputs ``O``, ``dA``, ``dW``, ``dB``
(batch norm also its running statistics before the step). Every step it also stores cheap
summaries (mean, std, min, max, absmax, non-finite count) of every layer's output
activation, weight and weight gradient. Everything goes to one self-describing HDF5 file:

    /layers/<module name>/            attrs: op, module_type, hyper-parameters
    /layers/<module name>/<step>/     A, W, B, O, dO, dA, dW, dB [, running_mean, running_var]
    /summaries                        table: step, epoch, layer, tensor, mean, std, ...
    root attrs                        model, vendor, torch_version, config_hash, dtype, ...

Linear-like layers that compute ``x @ W + b`` with a transposed weight (transformers'
GPT-2 ``Conv1D``) are stored in ``nn.Linear`` convention with attribute ``transposed``.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import nn

from .io import PeatError, atomic_path, open_h5, write_json

SUMMARY_STATS = ("mean", "std", "min", "max", "absmax", "nonfinite")
SUMMARY_DTYPE = np.dtype([("step", "i8"), ("epoch", "i4"), ("layer", "S128"), ("tensor", "S8")]
                         + [(s, "f8") for s in SUMMARY_STATS])
COMPRESSION = dict(compression="gzip", compression_opts=1, shuffle=True)


def op_of(module: nn.Module) -> str | None:
    """The PEAT op a module computes, or None if it is not a recordable layer."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Conv2d):
        return "conv2d"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batch_norm"
    if isinstance(module, nn.LayerNorm):
        return "layer_norm"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers GPT-2
        return "linear"
    return None


def hyper_params(module: nn.Module) -> dict:
    """Hyper-parameters a kernel needs to replay the layer, as HDF5-friendly values."""
    op = op_of(module)
    if op == "conv2d":
        return {k: list(getattr(module, k)) for k in ("stride", "padding", "dilation")} | {"groups": module.groups}
    if op == "batch_norm":
        return {"eps": module.eps, "momentum": module.momentum if module.momentum is not None else -1.0}
    if op == "layer_norm":
        return {"eps": module.eps, "normalized_shape": list(module.normalized_shape)}
    return {"transposed": op == "linear" and not isinstance(module, nn.Linear)}


def match_layers(model: nn.Module, patterns: list[str], key: str = "record.layers") -> dict[str, nn.Module]:
    """Recordable modules whose names match any glob in ``patterns`` (in model order)."""
    layers = {name: m for name, m in model.named_modules() if name and op_of(m)}
    chosen = {}
    for pattern in patterns:
        hits = [n for n in layers if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            examples = ", ".join(list(layers)[:6])
            raise PeatError(f"config key '{key}': {pattern!r} matches no conv/linear/norm layer; layers are e.g. {examples}")
        chosen.update({n: layers[n] for n in hits})
    return {n: layers[n] for n in layers if n in chosen}


def _as_linear(module: nn.Module, tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is not None and hyper_params(module).get("transposed"):
        return tensor.t()
    return tensor


def _stats(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().float()
    # sum and a norm are an order of magnitude faster than torch.std_mean on CPU.
    mean = t.sum() / t.numel()
    std = torch.linalg.vector_norm(t - mean) / max(t.numel() - 1, 1) ** 0.5
    lo, hi = torch.aminmax(t)
    absmax = torch.maximum(lo.abs(), hi.abs())
    # One cheap reduction in the common case: the sum of finite tensors is finite.
    bad = (~torch.isfinite(t)).sum().float() if not torch.isfinite(mean) else torch.zeros(())
    return torch.stack([mean, std, lo, hi, absmax, bad])


class Profiler:
    """Attach to a model, then call ``begin_step``/``end_step`` around each training step."""

    def __init__(self, path: str | Path, layers: list[str], *, every: int = 1, epochs: list[int] | None = None,
                 meta: dict | None = None, key: str = "record.layers"):
        self.path = Path(path)
        # Kept beside the training state so that a killed run resumes the same file.
        self.partial = self.path.parent / ".partial" / self.path.name
        self.patterns, self.every, self.epochs = layers, every, epochs
        self.meta, self.key = meta or {}, key

    # -- lifecycle ----------------------------------------------------------------------
    def attach(self, model: nn.Module, first_step: int = 0) -> None:
        self.model = model
        self.targets = match_layers(model, self.patterns, self.key)
        self.all_layers = {n: m for n, m in model.named_modules() if n and op_of(m)}
        self.first_step, self.last_step = first_step, first_step - 1
        self.naive_bytes_per_step = 0
        self._rows: list[tuple] = []
        self._pending: dict[str, torch.Tensor] = {}
        self._captured: dict[str, dict] = {}
        self.recording = False
        self._hooks = [m.register_forward_hook(self._forward_hook(n)) for n, m in self.all_layers.items()]
        self._open(resuming=first_step > 0)

    def _open(self, resuming: bool) -> None:
        # A file open for writing when its process was killed may be corrupt: resume from the
        # last consistent snapshot instead.
        if resuming and self._snapshot.exists():
            shutil.copyfile(self._snapshot, self.partial)
            self.file = open_h5(self.partial, "a")
            self._truncate(self.first_step)
            return
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        self.file = open_h5(self.partial, "w")
        self.file.attrs.update(self.meta)
        self.file.attrs.update(torch_version=str(torch.__version__), dtype="float32", every=self.every,
                               record_epochs=list(self.epochs or []),
                               layers=np.array(list(self.targets), dtype=h5py.string_dtype()))
        for name, module in self.targets.items():
            group = self.file.create_group(f"layers/{name}")
            group.attrs.update(op=op_of(module), module_type=type(module).__name__, **hyper_params(module))
        self.file.create_dataset("summaries", shape=(0,), maxshape=(None,), dtype=SUMMARY_DTYPE, chunks=(4096,),
                                 **COMPRESSION)

    def _truncate(self, step: int) -> None:
        """Drop what a killed run wrote at or after ``step``, so a resumed run rewrites it identically."""
        for name in self.targets:
            for key in [k for k in self.file[f"layers/{name}"] if int(k) >= step]:
                del self.file[f"layers/{name}/{key}"]
        summaries = self.file["summaries"]
        summaries.resize((int(np.sum(summaries["step"][()] < step)),))
        self.naive_bytes_per_step = int(self.file.attrs.get("naive_bytes_per_step", 0))

    def want(self, step: int, epoch: int) -> bool:
        return step % self.every == 0 and (not self.epochs or epoch in self.epochs)

    def begin_step(self, step: int, epoch: int) -> None:
        self.step, self.epoch = step, epoch
        self.recording = self.want(step, epoch)
        self._input_hooks = []
        if self.recording:
            for name, module in self.targets.items():
                self._captured[name] = self._before(module)
                self._input_hooks.append(module.register_forward_pre_hook(self._input_hook(name)))

    def end_step(self) -> None:
        for name, module in self.all_layers.items():
            weight = getattr(module, "weight", None)
            if weight is not None:
                self._pending[f"{name}\0W"] = _stats(weight)
                if weight.grad is not None:
                    self._pending[f"{name}\0dW"] = _stats(weight.grad)
        stats = torch.stack(list(self._pending.values())).cpu().numpy() if self._pending else np.zeros((0, 6))
        for key, row in zip(self._pending, stats):
            layer, tensor = key.split("\0")
            self._rows.append((self.step, self.epoch, layer.encode(), tensor.encode(), *row))
        self._pending.clear()
        if self.recording:
            for handle in self._input_hooks:
                handle.remove()
            for name, module in self.targets.items():
                self._write(name, module, self._captured.pop(name))
        if self.naive_bytes_per_step == 0:
            self.naive_bytes_per_step = self._naive_bytes
        self.last_step = self.step

    def flush(self) -> None:
        if self._rows:
            rows = np.array(self._rows, dtype=SUMMARY_DTYPE)
            summaries = self.file["summaries"]
            summaries.resize((summaries.shape[0] + len(rows),))
            summaries[-len(rows):] = rows
            self._rows.clear()
        self.file.attrs["naive_bytes_per_step"] = self.naive_bytes_per_step
        self.file.flush()

    @property
    def _snapshot(self) -> Path:
        return self.partial.with_name("context.snapshot.h5")

    def snapshot(self) -> None:
        """Write a consistent copy of the context so far, for a resumed run to start from."""
        self.flush()
        self.file.close()
        with atomic_path(self._snapshot) as tmp:
            shutil.copyfile(self.partial, tmp)
        self.file = open_h5(self.partial, "a")

    def close(self) -> None:
        """Finish the file, rename it into place and write the storage accounting beside it."""
        for handle in self._hooks:
            handle.remove()
        self.flush()
        steps = self.last_step + 1
        self.file.attrs["steps"] = steps
        self.file.close()
        os.replace(self.partial, self.path)
        context = self.path.stat().st_size
        naive = self.naive_bytes_per_step * steps
        write_json(self.path.with_name("storage.json"), {
            "context_bytes": context, "naive_bytes_per_step": self.naive_bytes_per_step, "steps": steps,
            "naive_bytes": naive, "ratio": context / naive if naive else None,
            "recorded_layers": list(self.targets), "every": self.every,
        })

    # -- hooks --------------------------------------------------------------------------
    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            if not self.model.training:
                return
            out = output if torch.is_tensor(output) else output[0]
            self._pending[f"{name}\0act"] = _stats(out)
            if self.naive_bytes_per_step == 0:
                w = getattr(module, "weight", None)
                self._sizes = getattr(self, "_sizes", {})
                self._sizes[name] = 4 * (inputs[0].numel() + out.numel() + (w.numel() if w is not None else 0))
            if self.recording and name in self.targets:
                cap = self._captured[name]
                cap["A"], cap["O"] = inputs[0].detach().clone(), out.detach().clone()
                # A hook registered before an in-place change of `out` still sees the
                # gradient of the value this layer produced.
                out.register_hook(self._store(name, "dO"))
        return hook

    @property
    def _naive_bytes(self) -> int:
        return int(sum(getattr(self, "_sizes", {}).values()))

    # Gradients come from tensor hooks, not module backward hooks: those wrap the output in a
    # view that in-place code after the layer (ResNet's `out += identity`) may not modify.
    def _input_hook(self, name: str):
        """Feed the layer an alias of its input, so the alias's gradient is this layer's dA alone
        (the input itself may also feed a skip connection)."""
        def hook(module, inputs):
            x = inputs[0]
            if not (torch.is_tensor(x) and x.requires_grad):
                return None
            alias = x.view_as(x)
            alias.register_hook(self._store(name, "dA"))
            return (alias, *inputs[1:])
        return hook

    def _store(self, name: str, key: str):
        def hook(grad):
            self._captured[name][key] = grad.detach().clone()
        return hook

    @staticmethod
    def _before(module: nn.Module) -> dict:
        cap = {"W": _as_linear(module, module.weight.detach().clone()) if module.weight is not None else None}
        cap["B"] = module.bias.detach().clone() if getattr(module, "bias", None) is not None else None
        if op_of(module) == "batch_norm" and module.running_mean is not None:
            cap["running_mean"] = module.running_mean.detach().clone()
            cap["running_var"] = module.running_var.detach().clone()
        return cap

    def _write(self, name: str, module: nn.Module, cap: dict) -> None:
        if module.weight is not None and module.weight.grad is not None:
            cap["dW"] = _as_linear(module, module.weight.grad)
        if getattr(module, "bias", None) is not None and module.bias.grad is not None:
            cap["dB"] = module.bias.grad
        group = self.file.create_group(f"layers/{name}/{self.step:07d}")
        group.attrs.update(step=self.step, epoch=self.epoch, training=module.training)
        for key, tensor in cap.items():
            if tensor is not None:
                group.create_dataset(key, data=tensor.detach().float().cpu().numpy(), **COMPRESSION)


def read_layer(path: str | Path, layer: str) -> tuple[dict, list[dict]]:
    """Layer attributes and its recorded samples (dicts of tensors plus step/epoch), in step order."""
    with open_h5(path) as f:
        if f"layers/{layer}" not in f:
            have = ", ".join(f.get("layers", {}))
            raise PeatError(f"{path}: no recorded layer {layer!r}; recorded: {have or 'none'}")
        group = f[f"layers/{layer}"]
        attrs = {k: _plain(v) for k, v in group.attrs.items()}
        samples = []
        for key in sorted(group):
            sample = {k: torch.from_numpy(v[()]) for k, v in group[key].items()}
            sample.update({k: _plain(v) for k, v in group[key].attrs.items()})
            samples.append(sample)
    return attrs, samples


def _plain(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value.item() if hasattr(value, "item") else value


