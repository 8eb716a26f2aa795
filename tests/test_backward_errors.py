"""Issue 2 §6: an error raised inside ``backward()`` reaches the user as that error (a Python
PrivateUse1 backend otherwise turns it into a bare SystemError), in lazy, eager and compile mode;
an op with no lowering hit only in backward names the op."""

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _training_helpers import mesh_4x2, mesh_8, reset_state
from shardtensor.ops import registry

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("custom backward failed on purpose")


def _run(mode, fn):
    if mode == "eager":
        with st.eager_mode(True):
            return fn()
    if mode == "compile":
        return st.compile(fn)()
    return fn()


def _x(requires_grad=True):
    x = st.shard(torch.randn(8, 4), mesh_4x2(), ("data", None))
    return x.requires_grad_(requires_grad)


@pytest.mark.parametrize("mode", ["lazy", "eager", "compile"])
def test_custom_function_error_in_backward_reaches_user(mode):
    x = _x()

    def step():
        y = FailingBackward.apply(x * 3).sum()
        y.backward()

    with pytest.raises(ValueError, match="custom backward failed on purpose"):
        _run(mode, step)


def test_custom_function_error_through_autograd_grad():
    x = _x()
    y = FailingBackward.apply(x).sum()
    with pytest.raises(ValueError, match="custom backward failed on purpose"):
        torch.autograd.grad(y, x)


@pytest.mark.parametrize("where", ["leaf_tensor_hook", "tensor_hook", "node_post_hook", "node_pre_hook"])
def test_error_in_a_backward_hook_reaches_user(where):
    """A Python hook that raises while autograd runs (a tensor hook, or a hook on a grad_fn node)."""
    x = _x()
    h = x * 2

    def fail(*args):
        raise KeyError("hook failed on purpose")

    if where == "leaf_tensor_hook":
        x.register_hook(fail)
    elif where == "tensor_hook":
        h.register_hook(fail)
    elif where == "node_post_hook":
        h.grad_fn.register_hook(fail)
    else:
        h.grad_fn.register_prehook(fail)
    with pytest.raises(KeyError, match="hook failed on purpose"):
        h.sum().backward()


def test_error_in_backward_is_not_a_system_error():
    x = _x()
    y = FailingBackward.apply(x).sum()
    with pytest.raises(Exception) as info:
        y.backward()
    assert not isinstance(info.value, SystemError), repr(info.value)
    assert "returned NULL" not in str(info.value)


def test_usable_after_an_error_in_backward():
    """After a failed backward, a normal forward/backward works and gives torch's gradients."""
    x = _x()
    with pytest.raises(ValueError):
        FailingBackward.apply(x).sum().backward()
    a = torch.randn(8, 4)
    ref = a.clone().requires_grad_()
    x = st.shard(a, mesh_4x2(), ("data", None)).requires_grad_()
    (x.sin() * 3).sum().backward()
    (ref.sin() * 3).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), ref.grad)


def test_backward_error_inside_a_custom_function_with_a_good_sibling():
    """The failing node is one branch; the error (not a later crash) is what the user sees."""
    x = _x()
    y = (FailingBackward.apply(x) + x.exp()).sum()
    with pytest.raises(ValueError, match="on purpose"):
        y.backward()


@pytest.mark.parametrize("mode", ["lazy", "eager", "compile"])
def test_missing_lowering_hit_only_in_backward_names_the_op(mode, monkeypatch):
    """avg_pool2d has a lowering; take its backward op's away: forward works, backward raises
    NotImplementedError naming aten.avg_pool2d_backward."""
    op = aten.avg_pool2d_backward.default
    assert op in registry._TABLE, "this test needs a lowering to remove"
    monkeypatch.delitem(registry._TABLE, op)
    x = st.shard(torch.randn(2, 3, 8, 8), mesh_8(), (None, None, "d", None)).requires_grad_()

    def step():
        y = F.avg_pool2d(x, 2).sum()
        y.backward()

    with pytest.raises(NotImplementedError, match="avg_pool2d_backward"):
        _run(mode, step)


def test_missing_lowering_in_forward_names_the_op(monkeypatch):
    op = aten.avg_pool2d.default
    monkeypatch.delitem(registry._TABLE, op)
    x = st.shard(torch.randn(2, 3, 8, 8), mesh_8(), (None, None, "d", None))
    with pytest.raises(NotImplementedError, match="avg_pool2d"):
        F.avg_pool2d(x, 2)


@pytest.mark.parametrize("kind", ["full_backward_hook", "full_backward_pre_hook"])
def test_error_in_module_backward_hook_reaches_user(kind):
    model = torch.nn.Linear(4, 3).to(st.device())

    def hook(*args):
        raise ValueError(f"module {kind} failed on purpose")

    getattr(model, f"register_{kind}")(hook)
    with pytest.raises(ValueError, match="failed on purpose"):
        model(torch.randn(2, 4).to(st.device())).sum().backward()


def test_without_the_cpp_guard_op_and_tensor_hook_errors_still_reach_user():
    """The fallback when the C++ device guard cannot be built (no compiler): torch's Python guard."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch, shardtensor as st
        from shardtensor import dispatch
        from shardtensor.tensor import device as torch_device
        assert not torch_device.CPP_GUARD
        x = torch.randn(8, 4).to(st.device()).requires_grad_()
        h = x * 2
        h.register_hook(lambda g: (_ for _ in ()).throw(KeyError("hook failed")))
        try:
            h.sum().backward()
        except KeyError as e:
            print("hook:", e)
        y = x.exp().sum()
        dispatch.SPECIAL[torch.ops.aten.mul.Tensor] = lambda f, a, k: (_ for _ in ()).throw(ValueError("op failed"))
        try:
            y.backward()
        except ValueError as e:
            print("op:", e)
    """)
    env = dict(os.environ, SHARDTENSOR_PYTHON_DEVICE_GUARD="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "hook: 'hook failed'" in result.stdout and "op: op failed" in result.stdout, result.stderr
    assert result.returncode == 0, result.stderr


def test_exit_right_after_backward_does_not_abort():
    """A script that ends just after ``backward()`` exits cleanly. (Autograd's device thread drops
    the backward pass after ``backward()`` returns, and that takes the GIL: during interpreter
    shutdown it aborted the process — "terminate called without an active exception" — in 5 runs
    out of 5 before backward() waited for it.)"""
    import os
    import subprocess
    import sys

    code = (
        "import torch, shardtensor as st\n"
        "w = torch.randn(16, 16).to(st.device()).requires_grad_()\n"
        "(torch.randn(16, 16).to(st.device()) @ w).sum().backward()\n"
        "print('done')\n"
    )
    for guard in ("cpp", "python"):
        env = dict(os.environ)
        if guard == "python":
            env["SHARDTENSOR_PYTHON_DEVICE_GUARD"] = "1"
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert (result.returncode, result.stdout) == (0, "done\n"), (guard, result.returncode, result.stderr)
