"""rms_norm, the fifth op: llama's RMSNorm layers and torch.nn.RMSNorm recorded, replayed, judged
and routed like layer_norm, on a tiny llama (the test config's gpt2 size) trained a few steps."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from conftest import REPO, TEST_CONFIG
from peat import candidate, detect, kernels, playback
from peat.config import validate
from peat.io import PeatError
from peat.models import build
from peat.profiler import Profiler, hyper_params, op_of, read_layer

torch.set_num_threads(1)
VOCAB, SEQ = 64, 16
SPEC = {"arch": "llama", "size": {"hidden": 32, "layers": 1, "heads": 2}}
NORMS = ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm"]
GLOBS = ["model.layers.*layernorm", "model.norm"]  # record.layers naming the RMSNorm layers alone
# Mean over the batch instead of the hidden dimension: a bug that still returns the right shape.
WRONG_DIM = ("import torch\nOP = 'rms_norm'\n\ndef forward(x, weight, bias, *, normalized_shape, eps):\n"
             "    return weight * (x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + eps))\n")
NO_EPS = ("import torch\nOP = 'rms_norm'\n\ndef forward(x, weight, bias, *, normalized_shape, eps):\n"
          "    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)))\n")


def llama() -> nn.Module:
    return build(SPEC, {"vocab_size": VOCAB, "seq_len": SEQ}, seed=0)


def train(model: nn.Module, steps: int = 2, profiler: Profiler | None = None) -> None:
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        opt.zero_grad()
        if profiler is not None:
            profiler.begin_step(step, 1)
        x = torch.randint(VOCAB, (4, SEQ), generator=gen)
        nn.functional.cross_entropy(model(input_ids=x).logits.reshape(-1, VOCAB), x.reshape(-1)).backward()
        if profiler is not None:
            profiler.end_step()
        opt.step()


def seen_by_the_layers(model: nn.Module) -> dict:
    """What each RMSNorm layer got at each call: its input, weight, output and output gradient."""
    seen = {name: [] for name in NORMS}

    def hook(name):
        def run(module, args, out):
            call = {"A": args[0].detach().clone(), "W": module.weight.detach().clone(), "O": out.detach().clone()}
            out.register_hook(lambda g: call.__setitem__("dO", g.detach().clone()))
            seen[name].append(call)
        return run

    for name in NORMS:
        model.get_submodule(name).register_forward_hook(hook(name))
    return seen


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(context recorded with derived outputs, the same training's state dict unrecorded, what the layers saw)."""
    plain, model = llama(), llama()
    train(plain)
    seen = seen_by_the_layers(model)
    path = tmp_path_factory.mktemp("rms") / "context.h5"
    prof = Profiler(path, GLOBS, every=1, derived=True, meta={"model": "tiny", "config_hash": "h1", "vendor": "cpu"})
    prof.attach(model)
    train(model, profiler=prof)
    prof.close()
    return path, plain.state_dict(), model.state_dict(), seen


def test_llamas_norms_are_rms_norm_layers_with_their_variant():
    model = llama()
    assert [n for n, m in model.named_modules() if op_of(m) == "rms_norm"] == NORMS
    assert hyper_params(model.model.norm) == {"eps": 1e-6, "normalized_shape": [32], "variant": "llama"}
    # torch's own: eps None is float32's epsilon, what F.rms_norm uses on float32 inputs.
    assert hyper_params(nn.RMSNorm(8)) == {"eps": torch.finfo(torch.float32).eps, "normalized_shape": [8],
                                           "variant": "torch"}


def test_recording_is_exact_and_leaves_training_bit_identical(recorded):
    path, plain, model, seen = recorded
    for name, a in plain.items():  # the input's alias of other layers would round llama's input grads differently
        assert torch.equal(a, model[name]), name
    for layer in NORMS:
        attrs, samples = read_layer(path, layer, derive=False)
        assert attrs["op"] == "rms_norm" and attrs["variant"] == "llama" and attrs["module_type"] == "LlamaRMSNorm"
        assert len(samples) == 2
        for sample, call in zip(samples, seen[layer]):
            for key in ("A", "W", "O", "dO"):
                assert torch.equal(sample[key], call[key]), (layer, key)
            assert "B" not in sample  # RMSNorm has no bias
            gold = kernels.golden("rms_norm", attrs)
            for computation in kernels.COMPUTATIONS:  # golden_vs_recorded 0: O, dA, dW as training made them
                if kernels.applies(computation, sample):
                    got = kernels.call(gold, computation, sample, attrs)
                    assert torch.equal(got, sample[kernels.TARGET[computation]]), (layer, computation)
            assert "dA" in sample and "dW" in sample


def test_torchs_rms_norm_equals_llamas_ops_bitwise_on_this_cpu():
    """Golden follows the module (recorded ``variant``); on the CPU in this torch both agree bit for bit,
    forward and gradients, so either golden replays the other's layers exactly."""
    gen = torch.Generator().manual_seed(0)
    for shape in ((4, 16, 32), (3, 5, 768)):
        x, w, g = (torch.randn(*s, generator=gen) for s in (shape, shape[-1:], shape))
        hp = {"normalized_shape": shape[-1:], "eps": 1e-6}
        torch_, llama_ = kernels.golden("rms_norm"), kernels.golden("rms_norm", {"variant": "llama"})
        assert torch.equal(torch_.forward(x, w, None, **hp), llama_.forward(x, w, None, **hp))
        assert torch.equal(torch_.input_grad(g, x, w, **hp), llama_.input_grad(g, x, w, **hp))
        assert torch.equal(torch_.weight_grad(g, x, **hp), llama_.weight_grad(g, x, **hp))
    norm = nn.RMSNorm(32)  # eps None
    eps = hyper_params(norm)["eps"]
    assert torch.equal(norm(x[..., :32]), kernels.golden("rms_norm").forward(x[..., :32], norm.weight, None,
                                                                             normalized_shape=[32], eps=eps))


def test_golden_routing_leaves_llamas_training_bit_identical():
    """LlamaRMSNorm is several ops whose input gradients autograd adds to the residual's one by one:
    golden routing runs them under autograd, as the module does."""
    plain, routed = llama(), llama()
    assert kernels.route(routed, kernels.golden("rms_norm")) == NORMS
    kernels.route(routed, kernels.golden("linear"))
    train(plain, steps=3)
    train(routed, steps=3)
    for (name, a), b in zip(plain.state_dict().items(), routed.state_dict().values()):
        assert torch.equal(a, b), name


def test_golden_rms_norm_gradients_are_autograds_of_the_module():
    """Called as a kernel's own (one Function, as a candidate kernel's gradients come): equal to the
    module's own gradients where the layer's input feeds nothing else."""
    torch.manual_seed(0)
    x, grad_out = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    for module in (nn.RMSNorm(32), llama().model.norm, nn.RMSNorm([6, 32], elementwise_affine=False)):
        grads = []
        for custom in ((), kernels.COMPUTATIONS):
            norm = copy.deepcopy(module)
            kernel = kernels.golden("rms_norm", hyper_params(norm))
            kernels.route(nn.Sequential(norm), kernel if not custom else dataclasses.replace(kernel, custom=custom))
            leaf = x.clone().requires_grad_()
            norm(leaf).backward(grad_out)
            grads.append((leaf.grad, None if norm.weight is None else norm.weight.grad))
        plain = copy.deepcopy(module)
        leaf = x.clone().requires_grad_()
        plain(leaf).backward(grad_out)
        for got in grads:
            assert torch.equal(got[0], leaf.grad)
            assert (got[1] is None and plain.weight is None) or torch.equal(got[1], plain.weight.grad)


def verdict(context, impl: str, rules: detect.Rules = detect.Rules()) -> dict:
    plan = playback.Plan(context=context, kernel=kernels.load(impl, "rms_norm"), errors=["rv:2"], rules=rules,
                         meta={"model": "tiny", "vendor": "cpu", "kernel": "k"})
    table, record = playback.replay(plan)
    assert record["layers"] == NORMS and record["outcome"]["status"] == "ok"
    own = table[table["case"] == "kernel"]
    assert set(own["computation"]) == set(kernels.COMPUTATIONS) and set(own["tensor"]) >= {"O", "dA", "dW"}
    assert (table.loc[table["case"] == "rv:2", "computation"].nunique()) == 3  # pseudo-errors act on it too
    return detect.verdict(table, rules)


def test_golden_and_the_shipped_rms_norm_pass_on_a_recorded_llama(recorded):
    path = recorded[0]
    assert verdict(path, "golden")["error_model"] == "none"
    shipped = verdict(path, "peat.alt_kernels.rms_norm")
    assert shipped["verdict"] == "pass" and shipped["error_model"] == "none"
    assert shipped["evidence"]["max_err_over_fp32_envelope"] > 0  # numerically different from golden
    assert shipped["evidence"]["pseudo_errors"]["rv:2"] == dict.fromkeys(kernels.COMPUTATIONS, "random_value")


def test_a_buggy_rms_norm_fails_on_a_recorded_llama(recorded, tmp_path):
    path = recorded[0]
    (tmp_path / "wrong_dim.py").write_text(WRONG_DIM)
    wrong = verdict(path, str(tmp_path / "wrong_dim.py"))
    assert wrong["verdict"] == "fail" and wrong["error_model"] == "block_structured"
    assert wrong["evidence"]["first_bug"]["computation"] == "forward"
    # eps forgotten: llama's activations (embeddings drawn with std 0.02) have a mean square of some
    # 1e-3, so the error is of fp16's rounding: reduced precision, a fail only where that is refused.
    (tmp_path / "no_eps.py").write_text(NO_EPS)
    no_eps = verdict(path, str(tmp_path / "no_eps.py"))
    assert no_eps["error_model"] == "reduced_precision" and no_eps["verdict"] == "pass"
    strict = detect.Rules(accept_reduced_precision=False)
    assert verdict(path, str(tmp_path / "no_eps.py"), strict)["verdict"] == "fail"


def config_with_llama() -> dict:
    config = yaml.safe_load(TEST_CONFIG.read_text())
    config["models"]["llama"] = config["models"]["gpt2"] | {"arch": "llama", "record": {"layers": GLOBS, "every": 2}}
    config["kernels"]["rms"] = {"op": "rms_norm", "impl": "peat.alt_kernels.rms_norm",
                                "layers": ["model.layers.*.input_layernorm"]}
    return validate(config, REPO / "workflow" / "schemas" / "config.schema.yaml")


def test_the_config_takes_an_rms_norm_kernel_for_llama():
    config = config_with_llama()
    candidate.check(config)
    assert candidate.models_for(config, "rms") == ["llama"]
    bad = copy.deepcopy(config)
    bad["kernels"]["rms"]["layers"] = ["model.layers.0.mlp.*"]
    with pytest.raises(PeatError, match=r"kernels\.rms\.layers.*matches no rms_norm layer of model 'llama', only linear"):
        candidate.check(bad)
    bad["kernels"]["rms"] = {"op": "rms_norm", "models": ["gpt2"]}
    with pytest.raises(PeatError, match=r"model 'gpt2' \(gpt2\) has no rms_norm layer"):
        candidate.check(bad)
    with pytest.raises(PeatError, match="rms"):
        validate(config | {"kernels": {"x": {"op": "rms"}}}, REPO / "workflow" / "schemas" / "config.schema.yaml")


def test_golden_rms_norm_is_torchs_op_on_its_module():
    norm = nn.RMSNorm([4, 8], eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 4, 8)
    hp = {k: v for k, v in hyper_params(norm).items() if k != "variant"}
    assert torch.equal(kernels.golden("rms_norm", hyper_params(norm)).forward(x, norm.weight, None, **hp), norm(x))
    assert torch.equal(F.rms_norm(x, [4, 8], norm.weight, 1e-5), norm(x))


def test_transformers_copies_of_llamas_norm_are_rms_norm_and_others_are_not():
    """Mistral's and Qwen2's RMSNorms are LlamaRMSNorm's forward under other names: recorded as
    ``variant: llama``, whose golden replays them bit for bit; Gemma's (1 + weight) and a forward of
    one's own are other computations."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    class Scaled(LlamaRMSNorm):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    def doubled(forward):
        @functools.wraps(forward)  # inspect.getsource would show LlamaRMSNorm's own text
        def run(self, hidden_states):
            return 2 * forward(self, hidden_states)
        return run

    class Wrapped(LlamaRMSNorm):
        forward = doubled(LlamaRMSNorm.forward)

    class Unannotated(nn.Module):  # a checkpoint's own modeling file: an older text, the same code
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    gen = torch.Generator().manual_seed(0)
    for cls in (MistralRMSNorm, Qwen2RMSNorm, Unannotated):
        norm = cls(16, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(16, generator=gen))
        assert op_of(norm) == "rms_norm"
        attrs = hyper_params(norm)
        assert attrs == {"eps": 1e-5, "normalized_shape": [16], "variant": "llama"}
        x, g = torch.randn(2, 5, 16, generator=gen, requires_grad=True), torch.randn(2, 5, 16, generator=gen)
        out = norm(x)
        out.backward(g)
        gold, hp = kernels.golden("rms_norm", attrs), {k: attrs[k] for k in ("normalized_shape", "eps")}
        assert torch.equal(gold.forward(x.detach(), norm.weight.detach(), None, **hp), out.detach())
        assert torch.equal(gold.input_grad(g, x.detach(), norm.weight.detach(), **hp), x.grad)
        assert torch.equal(gold.weight_grad(g, x.detach(), **hp), norm.weight.grad)
    assert op_of(GemmaRMSNorm(16)) is None and op_of(Scaled(16)) is None and op_of(Wrapped(16)) is None
