"""Training checkpoints in HDF5, readable by any HDF5 tool.

Layout: ``/model/<state_dict name>`` (attrs ``module_type``, ``kind`` = parameter|buffer),
``/optimizer/state/<parameter name>/<key>`` with the param groups as JSON in
``/optimizer`` attribute ``param_groups``, ``/history`` (JSON metric rows so far), and
root attributes ``step``, ``epoch`` and the run's metadata (model, vendor, config_hash, ...).
A tensor under several names (tied weights such as GPT-2's ``lm_head.weight`` = ``transformer.wte.weight``)
is stored once, under its first name; the other names are soft links to it, so that altering the
file alters the model's one tensor.
"""

from __future__ import annotations

import json

import h5py
import numpy as np
import torch
from torch import nn

from .alter import is_bfloat16
from .io import PeatError, atomic_path, open_h5


def _module_types(model: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules()}


def save(path, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, step: int, epoch: int,
         meta: dict, history: list[dict] | None = None) -> None:
    types = _module_types(model)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    with atomic_path(path) as tmp, open_h5(tmp, "w") as f:
        f.attrs.update(step=step, epoch=epoch, **meta)
        first: dict[int, str] = {}  # id of a parameter or buffer -> the first name it was saved under
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in first:
                f[f"model/{name}"] = h5py.SoftLink(f"/model/{first[id(tensor)]}")
                continue
            first[id(tensor)] = name
            ds = _create(f, f"model/{name}", tensor)
            ds.attrs["module_type"] = types.get(name.rpartition(".")[0], "")
            ds.attrs["kind"] = "parameter" if name in params else "buffer"
        if optimizer is not None:
            _save_optimizer(f, model, optimizer)
        f.create_dataset("history", data=json.dumps(history or []))


def _create(group: h5py.Group, name: str, value) -> h5py.Dataset:
    # numpy has no bfloat16: its bits go in uint16, tagged as peat alter reads bfloat16 (docs/alter.md).
    if torch.is_tensor(value) and value.dtype == torch.bfloat16:
        ds = group.create_dataset(name, data=value.detach().cpu().view(torch.int16).numpy().view(np.uint16))
        ds.attrs["dtype"] = "bfloat16"
        return ds
    return group.create_dataset(name, data=value.detach().cpu().numpy() if torch.is_tensor(value) else value)


def _tensor(ds: h5py.Dataset) -> torch.Tensor:
    # In this machine's byte order: torch takes no other (ValueError), and a bfloat16 view of
    # big-endian bits swapped their bytes.
    data = np.asarray(ds[()])
    data = data.astype(data.dtype.newbyteorder("="), copy=False)
    # bfloat16 as peat alter reads it (docs/alter.md): a tag "bf16", or one stored as a fixed-length
    # string (h5repack, other writers), loaded the bits as integers, 16256.0 for 1.0, without a word.
    if is_bfloat16(ds):
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(data)


def _param_names(model: nn.Module) -> list[str]:
    # Same order and de-duplication of tied weights as model.parameters(), which built the optimizer.
    return [name for name, _ in model.named_parameters()]


def _save_optimizer(f, model, optimizer) -> None:
    names = _param_names(model)
    state = optimizer.state_dict()
    group = f.create_group("optimizer")
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    group.attrs["param_groups"] = json.dumps(groups)
    group.attrs["class"] = type(optimizer).__name__
    for index, entries in state["state"].items():
        for key, value in entries.items():
            _create(group, f"state/{names[index]}/{key}", value if torch.is_tensor(value) else np.asarray(value))


def load(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         new_head: bool = False) -> dict:
    """Load weights (and optimizer state) into ``model``; return root attributes and history.

    ``new_head`` keeps the model's own init for its head (its last linear layer) where the shapes
    differ: fine-tuning on a task with other classes. Any other difference is an error, as a
    skipped embedding or block would make the fine-tuning silently start from scratch.
    """
    with open_h5(path) as f:
        if "model" not in f:
            raise PeatError(f"{path}: not a peat checkpoint (no /model group)")
        if optimizer is not None:  # checked before anything is loaded: a refused load changes nothing
            if "optimizer" not in f:
                raise PeatError(f"{path}: no optimizer state to resume from")
            # torch would take the other class's param_groups and fail at the first step (KeyError).
            saved = f["optimizer"].attrs.get("class", type(optimizer).__name__)
            if saved != type(optimizer).__name__:
                raise PeatError(f"{path}: optimizer state is {saved}'s, the optimizer is {type(optimizer).__name__}")
        own = model.state_dict()
        stored = f["model"]
        missing = [n for n in own if n not in stored]
        if missing:
            raise PeatError(f"{path}: missing parameters: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        head = _head(model) if new_head else None
        new_state = {}
        for name, tensor in own.items():
            data = _tensor(stored[name])
            if data.shape != tensor.shape:
                if head is not None and name.rpartition(".")[0] == head:
                    continue
                raise PeatError(f"{path}: '{name}' has shape {tuple(data.shape)}, model expects {tuple(tensor.shape)}"
                                + (f" (only the head, {head}, may differ)" if head is not None else ""))
            new_state[name] = data.to(tensor.dtype)
        model.load_state_dict(new_state, strict=False)
        if optimizer is not None:
            optimizer.load_state_dict(_load_optimizer(f["optimizer"], model))
        attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
        attrs["history"] = json.loads(f["history"][()]) if "history" in f else []
    return attrs


def _head(model: nn.Module) -> str:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)][-1]


def _load_optimizer(group, model) -> dict:
    names = _param_names(model)
    index = {n: i for i, n in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in json.loads(group.attrs["param_groups"])]
    state = {}
    for name, entries in group.get("state", {}).items():
        state[index[name]] = {k: _tensor(v) for k, v in entries.items()}
    return {"state": state, "param_groups": groups}
