"""The config check reads a Python kernel's signatures against the call peat makes
(``kernels.arguments``): a forward without ``bias``, an extra required parameter or a misspelt
hyper-parameter was each of its calls' TypeError, a ``crash`` row found only after golden training."""

from __future__ import annotations

import copy
import glob

import pytest
import torch
import yaml

from conftest import REPO, TEST_CONFIG, snakemake
from peat import candidate, kernels
from peat.config import validate
from peat.io import PeatError

MODEL_OF = {"linear": "gpt2", "conv2d": "resnet18", "batch_norm": "resnet18", "layer_norm": "gpt2"}  # in test.yaml
CONV = "stride, padding, dilation, groups"

# name: (op, source, where and why it is refused, after "<file>:")
REFUSED = {
    "missing_bias": ("linear", "def forward(A, W):\n    return A @ W.t()\n",
                     "1: def forward(A, W) cannot take the bias argument peat passes; peat calls forward(x, weight, bias)"),
    "annotated": ("linear", "import torch\n\n\ndef forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:\n"
                  "    return x @ weight.t()\n",
                  "4: def forward(x, weight) cannot take the bias argument peat passes; peat calls forward(x, weight, bias)"),
    "extra_positional": ("linear", "def input_grad(grad_out, weight, scale):\n    return grad_out @ weight * scale\n",
                         "1: def input_grad(grad_out, weight, scale) requires scale, which peat does not pass; "
                         "peat calls input_grad(grad_out, weight)"),
    "keyword_only": ("conv2d", f'OP = "conv2d"\n\n\ndef forward(x, weight, bias, *, {CONV}, tile):\n    return x\n',
                     f"4: def forward(x, weight, bias, *, {CONV}, tile) requires tile, which peat does not pass; "
                     f"peat calls forward(x, weight, bias, *, {CONV})"),
    "misspelt_keyword": ("conv2d", "def forward(x, weight, bias, *, stride, pad, dilation, groups):\n    return x\n",
                         "1: def forward(x, weight, bias, *, stride, pad, dilation, groups) cannot take the padding "
                         f"argument peat passes (by name); peat calls forward(x, weight, bias, *, {CONV})"),
    "two_values": ("layer_norm", "def forward(x, weight, eps, *, normalized_shape):\n    return x\n",
                   "1: def forward(x, weight, eps, *, normalized_shape) gets two values for eps: peat passes bias in "
                   "its place and eps by name; peat calls forward(x, weight, bias, *, normalized_shape, eps)"),
    "positional_only": ("batch_norm", "def weight_grad(grad_out, x, eps, /, **stats):\n    return x.sum(0)\n",
                        "1: def weight_grad(grad_out, x, eps, /, **stats) requires eps, which peat does not pass; "
                        "peat calls weight_grad(grad_out, x, *, running_mean, running_var, training, eps)"),
    "namespace": ("linear", "class linear:\n    @staticmethod\n    def weight_grad(grad_out):\n        return grad_out\n",
                  "3: def weight_grad(grad_out) cannot take the x argument peat passes; peat calls weight_grad(grad_out, x)"),
    "method_with_self": ("linear", "class linear:\n    def forward(self, x, weight, bias):\n        return x\n",
                         "2: def forward(self, x, weight, bias) requires bias, which peat does not pass; peat calls "
                         "forward(x, weight, bias) (on the class, not an instance: a @staticmethod without self)"),
}

# name: (op, source), each of whose computations takes peat's call
ACCEPTED = {
    "varargs": ("conv2d", "def forward(*args, **kwargs):\n    return args[0]\n"),
    "hyper_parameters_as_kwargs": ("conv2d", "def input_grad(grad_out, weight, **hp):\n    return grad_out\n"),
    "defaults": ("linear", "def forward(x, weight, bias=None, scale=1.0):\n    return x\n"),
    "keyword_only_defaults": ("layer_norm", "def forward(x, weight, bias, *, normalized_shape, eps, tile=32):\n"
                              "    return x\n"),
    "hyper_parameters_by_position_or_name": ("batch_norm", "def input_grad(grad_out, x, weight, running_mean, "
                                             "running_var, training, eps):\n    return x\n"),
    # A decorator may change the signature: this one adapts a forward written without hyper-parameters.
    "decorated": ("conv2d", "def adapt(func):\n    return lambda x, weight, bias, **hp: func(x, weight, bias)\n\n\n"
                  "@adapt\ndef forward(x, weight, bias):\n    return x\n"),
    "assigned": ("linear", "def _forward(x, weight):\n    return x\n\n\n"
                 "forward = lambda x, weight, bias: _forward(x, weight)\n"),
    "rebound": ("linear", "def forward(x, weight):\n    return x\n\n\ndef _with_bias(x, weight, bias):\n    return x\n\n\n"
                "forward = _with_bias\n"),
    "defaults_set_later": ("linear", "def forward(x, weight, bias, scale):\n    return x\n\n\n"
                           "forward.__defaults__ = (1.0,)\n"),
    "set_on_the_module": ("linear", "import sys\n\n\ndef forward(x, weight):\n    return x\n\n\n"
                          "def _install():\n    sys.modules[__name__].forward = lambda x, weight, bias: x\n\n\n"
                          "_install()\n"),
    # The module's forward rebound from inside a function, however it is spelt (helper-v's review).
    **{f"set_on_the_module_{how}": ("linear", f"{imports}\n\n\ndef forward(x, weight):\n    return x\n\n\n"
                                    f"def _install():\n    {module}.forward = lambda x, weight, bias: x\n\n\n_install()\n")
       for how, imports, module in (("sys_alias", "import sys as _sys", "_sys.modules[__name__]"),
                                    ("from_sys", "from sys import modules", "modules[__name__]"),
                                    ("import_module", "import importlib", "importlib.import_module(__name__)"))},
    "namespace_patched_by_a_function": ("linear", "class linear:\n    def forward(x, weight):\n        return x\n\n\n"
                                        "def _finish(ns):\n    ns.forward = staticmethod(lambda x, weight, bias: x)\n\n\n"
                                        "_finish(linear)\n"),
    "namespace_replaced_through_global": ("linear", "import types\n\n\nclass linear:\n    @staticmethod\n"
                                          "    def forward(x, weight):\n        return x\n\n\ndef _setup():\n"
                                          "    global linear\n    linear = types.SimpleNamespace(forward=lambda x, weight, "
                                          "bias: x)\n\n\n_setup()\n"),
    "conditional": ("linear", "import os\n\nif os.environ.get('PEAT_NO_SUCH_VARIABLE'):\n    def forward(x, weight):\n"
                    "        return x\nelse:\n    def forward(x, weight, bias):\n        return x\n"),
    "plain_method": ("linear", "class linear:\n    def forward(x, weight, bias):\n        return x\n"),
    "another_ops_namespace": ("linear", "class conv2d:\n    def forward(x):\n        return x\n\n\n"
                              "def forward(x, weight, bias):\n    return x\n"),
}


@pytest.fixture(scope="module")
def config():
    return validate(yaml.safe_load(TEST_CONFIG.read_text()), REPO / "workflow/schemas/config.schema.yaml")


def naming(config: dict, op: str, path) -> dict:
    """``config`` with a kernel ``k`` of ``op`` from ``path``, on a test model with that op."""
    config = copy.deepcopy(config)
    config["kernels"]["k"] = {"op": op, "impl": str(path), "models": [MODEL_OF[op]]}
    return config


def binding_error(path, op: str) -> str | None:
    """What Python says calling each computation the kernel defines as the job calls it
    (``kernels.arguments``; the kernels here return an input); None where every call runs.
    (``inspect.signature().bind`` is not Python's own binding: positional-only defaults with ``**kw``.)"""
    kernel = kernels.load(str(path), op)
    x, w = torch.zeros(2, 3, 4, 4), torch.zeros(3, 3, 1, 1)
    sample = {"A": x, "W": w, "B": torch.zeros(3), "dO": torch.zeros(2, 3, 4, 4), "running_mean": torch.zeros(3),
              "running_var": torch.ones(3), "training": True}
    attrs = {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1, "eps": 1e-5, "momentum": 0.1,
             "normalized_shape": [4]}
    for computation in kernel.custom:
        args, kwargs = kernels.arguments(op, computation, sample, attrs)
        try:
            kernel.computation(computation)(*args, **kwargs)
        except TypeError as err:
            return str(err)
    return None


@pytest.mark.parametrize("name", REFUSED)
def test_a_kernel_whose_signature_cannot_take_peats_call_is_refused_naming_the_line(name, config, tmp_path):
    op, source, why = REFUSED[name]
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    assert binding_error(path, op) is not None  # each of its jobs failed so, after golden training
    with pytest.raises(PeatError) as err:
        candidate.check(naming(config, op, path))
    assert str(err.value) == f"config key 'kernels.k.impl': {path}:{why}"


@pytest.mark.parametrize("name", ACCEPTED)
def test_a_kernel_whose_signature_may_take_peats_call_is_accepted(name, config, tmp_path):
    op, source = ACCEPTED[name]
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    assert binding_error(path, op) is None
    candidate.check(naming(config, op, path))


def test_the_shipped_kernels_signatures_are_read_and_accepted():
    """Every shipped Python kernel passes, for each op it may serve; and those defining plain
    functions are read (a check that read nothing would pass them too)."""
    read = set()
    for path in sorted(glob.glob(str(REPO / "src/peat/alt_kernels/*.py")) + glob.glob(str(REPO / "kernels/*.py"))):
        tree = candidate._parsed(path, "kernels.k.impl")
        for op in (op for op in kernels.OPS if candidate._declared_op(path, op, tree) in (None, op)):
            candidate._check_signatures(tree, op, path, "kernels.k.impl")
            read |= {(path.rpartition("/")[2], op, c) for c in candidate._computations(tree, op)}
    every = set(kernels.COMPUTATIONS)
    assert read >= {("my_gemm.py", "linear", c) for c in every} | {("im2col.py", "conv2d", c) for c in every} \
        | {("rms_norm.py", "rms_norm", c) for c in every} | {("winograd.py", "conv2d", "forward")}


def test_snakemake_stops_on_a_kernel_without_bias_with_one_line_before_any_job(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "nobias.py").write_text('OP = "linear"\n\n\ndef forward(x, weight):\n    return x @ weight.t()\n')
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("kernels:\n  my_gemm: {op: linear, impl: kernels/nobias.py, models: [gpt2]}\n")
    proc = snakemake(tmp_path, "-n", "--configfile", str(TEST_CONFIG), str(overlay), configfile=None, check=False)
    lines = [text for text in proc.stderr.splitlines() if text.startswith("peat:")]
    assert proc.returncode == 1 and lines == [
        "peat: config key 'kernels.my_gemm.impl': kernels/nobias.py:4: def forward(x, weight) cannot take the bias "
        "argument peat passes; peat calls forward(x, weight, bias)"], proc.stderr
    assert not (tmp_path / "results").exists()


def test_a_package_whose_submodule_is_named_like_the_op_is_not_read_for_its_own_functions(config, tmp_path,
                                                                                           monkeypatch):
    """Importing ``mykernels.linear`` binds it as the package's ``linear``: load reads that submodule,
    so the package's own (here unusable) forward is never called."""
    package = tmp_path / "mykernels_sig"
    package.mkdir()
    (package / "__init__.py").write_text("from .linear import forward as _unused\n\n\ndef forward(x):\n    return x\n")
    (package / "linear.py").write_text("def forward(x, weight, bias):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert binding_error("mykernels_sig", "linear") is None
    candidate.check(naming(config, "linear", "mykernels_sig"))
