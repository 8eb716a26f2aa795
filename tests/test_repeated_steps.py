"""Issue 37 §2: a repeated lazy step costs little host time. A step whose graph equals the last one
reuses the last program key (counter ``RepeatedGraph``: no hashing, an identity match in the
executable cache); in-place ops reuse their memoised call shape. Every result equals eager torch, and
a step that changes (shape, op, static scalar, dtype, in-place or not, matmul precision) compiles
anew and is right; an error inside a repeated step names the op and leaves the state usable."""

import copy

import pytest
import torch

import shardtensor as st
from _training_helpers import cross_entropy_step as _step
from _training_helpers import reset_state


def _count(name):
    return st.counter_value(name) or 0


def _model_and_opt(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # torch's default: step counts on the host
    return model, opt


def test_a_repeated_lazy_step_reuses_the_last_program_and_equals_torch():
    reset_state()
    ref, ref_opt = _model_and_opt("cpu")
    dev, dev_opt = _model_and_opt(st.device())
    torch.manual_seed(1)
    batches = [(torch.randn(5, 6), torch.randint(0, 4, (5,))) for _ in range(6)]
    before = _count("RepeatedGraph")
    losses = []
    for x, y in batches:
        want = _step(ref, ref_opt, x, y)
        with st.step():
            got = _step(dev, dev_opt, x.to(st.device()), y.to(st.device()))
        losses.append((got, want))
    for got, want in losses:
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    for p, q in zip(dev.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    # steps 1-2 differ (Adam's state is created, then read); from the third on each repeats the last
    assert _count("RepeatedGraph") - before >= len(batches) - 3


def _run_variant(variant, w, x):
    """One small step on (w, x) as ``variant`` says; the same in torch and on the device."""
    if variant == "base":
        return (x @ w).sum(dim=0) * 2.0
    if variant == "op":
        return torch.tanh(x @ w).sum(dim=0) * 2.0
    if variant == "static scalar":
        return (x @ w).sum(dim=1) * 2.0
    if variant == "in place":
        y = x @ w
        y.mul_(2.0)
        return y.sum(dim=0)
    raise AssertionError(variant)


@pytest.mark.parametrize("change", ["shape", "op", "static scalar", "dtype", "in place", "precision"])
def test_a_changed_step_compiles_again_and_is_right(change):
    reset_state()
    torch.manual_seed(0)
    w, x = torch.randn(4, 3), torch.randn(5, 4)
    dw = w.to(st.device())
    for _ in range(3):  # the same step repeats: the last ones reuse the last program
        got = _run_variant("base", dw, x.to(st.device()))
        st.sync()
    torch.testing.assert_close(got.cpu(), _run_variant("base", w, x))
    repeated, compiles = _count("RepeatedGraph"), _count("UncachedCompile")
    variant, xx, ww = "base", x, w
    previous_precision = torch.get_float32_matmul_precision()
    try:
        if change == "shape":
            xx = torch.randn(7, 4)
        elif change == "dtype":
            xx, ww = x.double(), w.double()
        elif change == "precision":
            torch.set_float32_matmul_precision("high" if previous_precision == "highest" else "highest")
        else:
            variant = change
        got = _run_variant(variant, ww.to(st.device()) if change == "dtype" else dw, xx.to(st.device()))
        st.sync()
        assert _count("RepeatedGraph") == repeated, "a changed step was taken for the last one"
        assert _count("UncachedCompile") == compiles + 1, "a changed step did not compile"
        want = _run_variant(variant, ww, xx)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.cpu(), want)
    finally:
        torch.set_float32_matmul_precision(previous_precision)
    # and the first step again: its program is cached, the result right
    got = _run_variant("base", dw, x.to(st.device()))
    st.sync()
    assert _count("UncachedCompile") == compiles + 1
    torch.testing.assert_close(got.cpu(), _run_variant("base", w, x))


def test_repeated_in_place_ops_equal_torch_through_views_casts_and_defaults():
    reset_state()
    torch.manual_seed(0)
    p, a, b = torch.randn(4, 5), torch.randn(4, 5), torch.rand(4, 5) + 0.5
    half = torch.randn(4, 5).half()
    dp, da, db, dhalf = (t.clone().to(st.device()) for t in (p, a, b, half))
    for step in range(4):
        for q, u, v, h in ((p, a, b, half), (dp, da, db, dhalf)):
            q.mul_(0.9)
            q.addcdiv_(u, v, value=-0.1 * (step + 1))  # a scalar that changes each step
            q.lerp_(u, 0.25)
            q.add_(u)  # alpha left out: its default
            q.t()[1].add_(1.5)  # through a view chain
            q[:, 0].sub_(v[:, 0], alpha=2)
            h.add_(u)  # float32 result cast back to float16
            r = q.addcmul_(u, v)  # returns the target
            assert r is q
        st.sync()
        torch.testing.assert_close(dp.cpu(), p)
        torch.testing.assert_close(dhalf.cpu(), half)


def test_an_error_inside_a_repeated_step_names_the_op_and_keeps_the_state():
    reset_state()
    torch.manual_seed(0)
    p, a = torch.randn(4, 5), torch.randn(4, 5)
    dp, da = p.clone().to(st.device()), a.to(st.device())
    for _ in range(3):
        dp.mul_(0.5)
        dp.add_(da)
        st.sync()
        p.mul_(0.5)
        p.add_(a)
    dp.mul_(0.5)  # the repeated step, up to the op that fails
    with pytest.raises(RuntimeError, match="add_|broadcast|shape"):
        dp.add_(torch.randn(3, 4, 5).to(st.device()))  # cannot be written into a (4, 5) tensor
    with pytest.raises(RuntimeError, match="add_|broadcast|shape"):  # again: the check is not memoised away
        dp.add_(torch.randn(3, 4, 5).to(st.device()))
    p.mul_(0.5)
    st.sync()  # what was recorded before the error still runs
    torch.testing.assert_close(dp.cpu(), p)
    dp.add_(da)  # and the next steps are right
    p.add_(a)
    torch.testing.assert_close(dp.cpu(), p)


def test_an_in_place_op_on_a_cpu_tensor_still_says_which_device():
    reset_state()
    dp = torch.ones(3).to(st.device())
    for _ in range(2):
        dp.mul_(2.0)
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3).mul_(dp)
    torch.testing.assert_close(dp.cpu(), torch.full((3,), 4.0))


def test_structural_keys_equal_and_pickle_as_their_tuples():
    import pickle

    from shardtensor.graph.program import StructuralKey

    k = StructuralKey((("mul", (1, 2)), ("add", 3)))
    assert k == (("mul", (1, 2)), ("add", 3)) and hash(k) == hash((("mul", (1, 2)), ("add", 3)))
    assert {k: 1}[(("mul", (1, 2)), ("add", 3))] == 1
    assert pickle.loads(pickle.dumps(k)) == k and copy.deepcopy(k) == k


def test_a_new_python_scalar_value_repeats_the_graph_with_the_new_value():
    reset_state()
    torch.manual_seed(0)
    w, x = torch.randn(4, 3), torch.randn(5, 4)
    dw, dx = w.to(st.device()), x.to(st.device())
    for lr in (0.1, 0.2, 0.3, 0.4):
        repeated, compiles = _count("RepeatedGraph"), _count("UncachedCompile")
        got = (dx @ dw).mul(lr).sum(dim=0)
        st.sync()
        torch.testing.assert_close(got.cpu(), (x @ w).mul(lr).sum(dim=0))
        if lr >= 0.3:  # the first two may compile (a scalar's input sharing settles); then repeats
            assert _count("RepeatedGraph") == repeated + 1 and _count("UncachedCompile") == compiles


def _foreach_step(xs, ys, change, scalars):
    """An optimizer-like step of foreach in-place ops (their short path in dispatch.mutation)."""
    torch._foreach_mul_(xs, 0.9)
    if change == "op":
        torch._foreach_sub_(xs, ys)
    else:
        torch._foreach_add_(xs, ys)
    torch._foreach_addcmul_(xs, ys, ys, scalars)


@pytest.mark.parametrize("change", ["none", "scalar", "shape", "dtype", "view", "op"])
def test_a_repeated_foreach_step_changed_at_one_element_is_right(change):
    """A step of foreach ops repeats its program; one whose lists differ at one element (its shape,
    dtype, a view for a contiguous tensor, a Python scalar) or that runs another op compiles again
    when its graph differs, and every result equals eager torch."""
    reset_state()
    torch.manual_seed(0)
    xs = [torch.randn(3, 4), torch.randn(4, 3), torch.randn(5)]
    ys = [torch.randn_like(x) for x in xs]
    dxs, dys = [x.to(st.device()) for x in xs], [y.to(st.device()) for y in ys]
    scalars = [0.5, 0.25, 2.0]
    for _ in range(3):
        _foreach_step(xs, ys, "none", scalars)
        _foreach_step(dxs, dys, "none", scalars)
        st.sync()
    repeated, compiles = _count("RepeatedGraph"), _count("UncachedCompile")
    if change == "scalar":
        scalars = [0.5, -1.5, 2.0]
    elif change == "shape":
        xs[1], ys[1] = torch.randn(2, 3), torch.randn(2, 3)
    elif change == "dtype":
        xs[1], ys[1] = xs[1].double(), ys[1].double()
    elif change == "view":  # the same values and shape, seen through a transpose
        xs[1] = xs[1].t().contiguous().t()
    if change in ("shape", "dtype"):
        dxs[1], dys[1] = xs[1].to(st.device()), ys[1].to(st.device())
    elif change == "view":
        dxs[1] = xs[1].t().to(st.device()).t()
    _foreach_step(xs, ys, change, scalars)
    _foreach_step(dxs, dys, change, scalars)
    st.sync()
    same_graph = change in ("none", "scalar")
    assert (_count("RepeatedGraph") == repeated + 1) == same_graph
    assert _count("UncachedCompile") == compiles + (0 if same_graph else 1)
    for got, want in zip(dxs, xs):
        assert got.dtype == want.dtype and got.stride() == want.stride()
        torch.testing.assert_close(got.cpu(), want)
