"""Models built from config with seeded random weights: nothing is downloaded."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch
from torch import nn

from .io import atomic_path

IMAGE_ARCHS = ("resnet18", "resnet34", "resnet50", "mobilenet_v2", "efficientnet_b0")


def build(spec: dict, data_attrs: dict, seed: int) -> nn.Module:
    """Model ``spec['arch']`` sized for the dataset, initialised from ``seed``."""
    torch.manual_seed(seed)
    arch = spec["arch"]
    if arch in IMAGE_ARCHS:
        import torchvision

        model = getattr(torchvision.models, arch)(weights=None, num_classes=int(data_attrs["num_classes"]))
    else:
        model = _language_model(arch, spec.get("size", {}), int(data_attrs["vocab_size"]), int(data_attrs["seq_len"]))
    # In-place activations break backward hooks on the layer before them; values are identical.
    for module in model.modules():
        if hasattr(module, "inplace"):
            module.inplace = False
    return model


def layer_ops(spec: dict) -> dict[str, str]:
    """Name -> PEAT op of every recordable layer of the model ``spec`` describes, in model order,
    for config checks before any job. The model is built without weights (meta device); the map is
    kept on disk, by what it depends on, because building imports torchvision or transformers:
    seconds that every ``snakemake -n`` would pay again."""
    key, cache = _layout_key(spec), _layout_cache()
    path = cache / f"{key}.json" if cache is not None else None
    memo = path if path is not None else key  # by file: a process may switch cache folders
    if memo not in _LAYOUTS:
        _LAYOUTS[memo] = _cached(path) if path is not None else None
        if _LAYOUTS[memo] is None:
            _LAYOUTS[memo] = _built_layout(spec)
            if path is not None:
                _remember(path, _LAYOUTS[memo])
    return _LAYOUTS[memo]


def _cached(path: Path) -> dict[str, str] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or a damaged file: built again
        return None


_LAYOUTS: dict[Path | str, dict[str, str]] = {}
# The sizes build() takes from the dataset set weight shapes only, never a layer's name or op.
_LAYOUT_DATA = {"num_classes": 10, "vocab_size": 256, "seq_len": 64}


def _layout_cache() -> Path | None:
    """The cache folder; None where there is no home (no HOME, a uid without a passwd entry) and
    no override: the checks then build the model at every parse."""
    override = os.environ.get("PEAT_LAYOUT_CACHE")
    if override is not None:
        return Path(override)
    try:
        return Path.home() / ".cache" / "peat" / "layouts"
    except RuntimeError:
        return None


def _layout_key(spec: dict) -> str:
    """What the names depend on: arch, a language model's size, this file and op_of's, and the
    installed model library (its file's identity: asking its version costs a tenth of a second)."""
    library = importlib.util.find_spec("torchvision" if spec["arch"] in IMAGE_ARCHS else "transformers").origin
    here = Path(__file__).parent
    key = {"arch": spec["arch"], "size": None if spec["arch"] in IMAGE_ARCHS else spec.get("size", {}),
           "torch": torch.__version__, "library": [library, os.stat(library).st_mtime_ns],
           "code": hashlib.sha256((here / "models.py").read_bytes() + (here / "profiler.py").read_bytes()).hexdigest()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _built_layout(spec: dict) -> dict[str, str]:
    from .profiler import op_of

    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # build() seeds the global generator
        model = build(spec, _LAYOUT_DATA, seed=0)
    return {name: op for name, module in model.named_modules() if name and (op := op_of(module))}


def _remember(path: Path, layout: dict) -> None:
    try:
        # Concurrent parses each rename a whole file; a failed write (a home over its quota) leaves none.
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(layout))
    except OSError:
        pass  # a read-only or full home: the checks still run, each parse builds the model again


def language_size(size: dict | None) -> dict[str, int]:
    """A language model's ``size`` with its defaults filled in (image models take no size)."""
    size = size or {}
    hidden = size.get("hidden", 64)
    return {"hidden": hidden, "layers": size.get("layers", 2), "heads": size.get("heads", 4),
            "intermediate": size.get("intermediate", 4 * hidden)}


def _language_model(arch: str, size: dict, vocab: int, seq_len: int) -> nn.Module:
    import transformers

    size = language_size(size)
    hidden, layers, heads, inner = size["hidden"], size["layers"], size["heads"], size["intermediate"]
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq_len,
            attention_dropout=0.0,
        )
        cls = transformers.LlamaForCausalLM
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=inner, n_positions=seq_len,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        )
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.BertConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=inner, max_position_embeddings=seq_len, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, is_decoder=True,
        )
        cls = transformers.BertLMHeadModel
    cfg._attn_implementation = "eager"
    return cls(cfg)


def loss_and_metrics(model: nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor):
    """Mean loss and a dict of summed metrics (correct predictions, counted items)."""
    if kind == "image":
        logits = model(x)
    else:  # tokens are stored one byte each (peat.data): widened here, a batch at a time
        x, y = x.long(), y.long()
        logits = model(input_ids=x).logits
        logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
    loss = nn.functional.cross_entropy(logits, y)
    # A row whose largest logit is not finite (NaN, +inf, all -inf) predicts nothing: argmax reads NaN as
    # the largest, and a candidate whose loss went NaN reported class 0's share as its accuracy. max gives
    # that logit with argmax's index in one pass (isfinite over all logits cost another read per step).
    best, predicted = logits.max(-1)
    correct = ((predicted == y) & best.isfinite()).sum().item()
    return loss, {"correct": correct, "count": y.numel()}
