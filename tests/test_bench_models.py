"""The models of bench/tpu_dynamo_table.py at tiny sizes: bench/vision_models.py (ResNet-18/50 and
MobileNetV2 written out in torch) and bench/jax_resnet.py (the ResNets in plain ``jax.numpy``/``lax``).

The chip's table compares ``st.compile`` with the JAX ResNet-50, so the two must compute the same
function: here the JAX ResNet fed the torch model's weights (BatchNorm statistics random, so that a
misread of them shows) equals eager torch in float32, in both of its layouts. And the torch models'
inference under ``st.compile`` (the batch sharded over 8 devices, as the table's mesh) equals eager
torch, in the first call (traced) and the later ones (the frozen replay).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

import shardtensor as st

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name):
    """A bench module by its path (bench/ is not a package, nor on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vision_models = _load("vision_models")
jax_resnet = _load("jax_resnet")


def _model(name, width_mult, seed=0):
    torch.manual_seed(seed)
    model = getattr(vision_models, name)(num_classes=10, width_mult=width_mult)
    return vision_models.randomize_batchnorm(model, torch.Generator().manual_seed(seed + 1)).eval()


def _images(batch, side, seed):
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(seed))


def _relative(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


def test_full_size_models_have_torchvisions_parameter_counts_and_block_plan():
    counts = {"resnet18": 11_689_512, "resnet50": 25_557_032, "mobilenet_v2": 3_504_872}
    for name, count in counts.items():
        assert sum(p.numel() for p in getattr(vision_models, name)().parameters()) == count, name
    plan = jax_resnet.block_plan(vision_models.resnet50())
    assert [kind for _, kind, _, _ in plan] == ["bottleneck"] * 16
    assert [i for i, (_, _, stride, _) in enumerate(plan) if stride == 2] == [3, 7, 13]
    assert [i for i, (_, _, _, down) in enumerate(plan) if down] == [0, 3, 7, 13]


@pytest.mark.parametrize("layout", jax_resnet.LAYOUTS)
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_jax_resnet_equals_the_torch_resnet_on_its_weights(name, layout):
    model = _model(name, width_mult=1 / 16)
    x = _images(2, 32, seed=2)
    with torch.no_grad():
        want = model(x).numpy()
    params = jax_resnet.params_from_torch(model, layout)
    xj = (x.permute(0, 2, 3, 1) if layout == "NHWC" else x).contiguous().numpy()
    forward = jax.jit(jax_resnet.make_forward(model, layout, jax.lax.Precision.HIGHEST))
    got = np.asarray(forward(params, xj))
    assert got.shape == want.shape == (2, 10)
    assert _relative(got, want) < 1e-5


@pytest.mark.parametrize(("name", "width_mult"), [("resnet18", 1 / 16), ("mobilenet_v2", 0.25)])
def test_st_compile_of_the_torch_model_equals_eager_torch(name, width_mult):
    model = _model(name, width_mult)
    mesh = st.Mesh(range(8), (8,), ("d",))
    dev_model = _model(name, width_mult).to(st.device())  # the same weights (the same seeds)

    @st.compile
    def forward(x):
        with torch.no_grad():
            return dev_model(x)

    for seed in range(3):  # traced, then replayed
        x = _images(8, 32, seed)
        with torch.no_grad():
            want = model(x)
        got = forward(st.shard(x, mesh, ("d", None, None, None))).cpu()
        assert _relative(got, want) < 1e-5, f"call {seed}"
