"""Models built from config with seeded random weights: nothing is downloaded."""

from __future__ import annotations

import torch
from torch import nn

IMAGE_ARCHS = ("resnet18", "resnet34", "resnet50", "mobilenet_v2", "efficientnet_b0")
TEXT_ARCHS = ("llama", "gpt2", "bert")


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


def _language_model(arch: str, size: dict, vocab: int, seq_len: int) -> nn.Module:
    import transformers

    hidden, layers = size.get("hidden", 64), size.get("layers", 2)
    heads, inner = size.get("heads", 4), size.get("intermediate", 4 * size.get("hidden", 64))
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
    else:
        logits = model(input_ids=x).logits
        logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
    loss = nn.functional.cross_entropy(logits, y)
    correct = (logits.argmax(-1) == y).sum().item()
    return loss, {"correct": correct, "count": y.numel()}
