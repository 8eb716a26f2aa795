"""On-device value checks: where eager torch raises on a value (an index out of range, a class
target past the last class, bad multinomial probabilities, integer division by zero), shardtensor
raises the same exception type with torch's message and the user's line — in lazy mode when a value
is read or at the next sync, in eager mode at the op, with ``st.compile`` on the call.

Inputs are sharded over a (4, 2) mesh, unevenly (6 rows over 4 shards: padded storage), with the bad
value in the last shard, so the flags are reduced across shards and padding never trips a check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from shardtensor.graph import checks as graph_checks
from shardtensor.graph import program, state
from shardtensor.graph.capture import capture, lower
from shardtensor.ops import checks as op_checks

MESH = st.Mesh(range(8), (4, 2), ("x", "y"))
X = torch.arange(18, dtype=torch.float32).reshape(6, 3) / 7
I64 = torch.int64


def _t(*values):
    return torch.tensor(values, dtype=I64)


def _setitem(x, i):
    y = x.clone()
    y[i] = 1.0
    return y


def _index_put_acc(x, i):
    return x.clone().index_put_((i,), torch.tensor(1.0), accumulate=True)


# name: (function, bad arguments, good arguments); the first argument of every function is sharded
# on its first dimension, the others too where they have one
CASES = {
    "index_select": (lambda x, i: x.index_select(0, i), (X, _t(0, 1, 2, 3, 4, 6)), (X, _t(5, 0, 1, 2, 3, 4))),
    "index_select_negative": (lambda x, i: x.index_select(0, i), (X, _t(0, 1, 2, 3, 4, -1)), None),
    "gather": (lambda x, i: x.gather(1, i), (X, _t(0, 1, 2, 0, 1, 3)[:, None]), (X, _t(0, 1, 2, 0, 1, 2)[:, None])),
    "getitem": (lambda x, i: x[i], (X, _t(0, 1, 2, 3, 4, -7)), (X, _t(0, 1, 2, 3, 4, -6))),
    "setitem": (_setitem, (X, _t(0, 1, 2, 3, 4, 6)), (X, _t(0, 1, 2, 3, 4, -1))),
    "index_put_accumulate": (_index_put_acc, (X, _t(0, 1, 2, 3, 4, 9)), (X, _t(0, 1, 1, 3, 4, 5))),
    "scatter_": (
        lambda x, i: x.clone().scatter_(0, i, 1.0),
        (X, _t(0, 1, 2, 3, 4, 6)[:, None].expand(6, 3)),
        (X, _t(5, 1, 2, 3, 4, 0)[:, None].expand(6, 3)),
    ),
    "scatter_add_": (
        lambda x, i: x.clone().scatter_add_(0, i, torch.ones_like(x)),
        (X, _t(0, 1, 2, 3, 4, 6)[:, None].expand(6, 3)),
        (X, _t(0, 0, 2, 3, 4, 4)[:, None].expand(6, 3)),
    ),
    "scatter_reduce": (
        lambda x, i: x.scatter_reduce(0, i, x * 2, "amax"),
        (X, _t(0, 1, 2, 3, 4, 7)[:, None].expand(6, 3)),
        (X, _t(0, 0, 2, 3, 1, 4)[:, None].expand(6, 3)),
    ),
    "index_add_": (lambda x, i: x.clone().index_add_(0, i, x[:2]), (X, _t(0, 6)), (X, _t(5, 5))),
    "index_copy_": (lambda x, i: x.clone().index_copy_(0, i, x[:2]), (X, _t(-1, 2)), (X, _t(5, 2))),
    # one position: a slice update (a KV cache's decode step), checked all the same
    "index_copy_one": (lambda x, i: x.clone().index_copy_(0, i, x[1:2]), (X, _t(6)), (X, _t(4))),
    "index_fill_": (lambda x, i: x.clone().index_fill_(0, i, 1.0), (X, _t(0, -7)), (X, _t(0, -6))),
    "take": (lambda x, i: x.take(i), (X, _t(0, 1, 2, 3, 4, 18)), (X, _t(0, 1, 2, 3, 4, -18))),
    "embedding": (lambda w, i: F.embedding(i, w), (X, _t(0, 1, 2, 3, 4, 6)), (X, _t(5, 1, 2, 3, 4, 0))),
    "embedding_negative": (lambda w, i: F.embedding(i, w), (X, _t(0, 1, 2, 3, 4, -1)), None),
    "embedding_bag": (
        lambda w, i: F.embedding_bag(i, w),
        (X, _t(0, 1, 2, 3, 4, 6).reshape(3, 2)),
        (X, _t(0, 1, 2, 3, 4, 5).reshape(3, 2)),
    ),
    "one_hot": (lambda i: F.one_hot(i, 3), (_t(0, 1, 2, 0, 1, 3),), (_t(0, 1, 2, 0, 1, 2),)),
    "one_hot_negative": (lambda i: F.one_hot(i, 3), (_t(0, 1, 2, 0, 1, -1),), None),
    "one_hot_inferred_classes": (lambda i: F.one_hot(i), None, (_t(0, 1, 4, 0, 1, 2),)),
    "cross_entropy": (lambda x, t: F.cross_entropy(x, t), (X, _t(0, 1, 2, 0, 1, 3)), (X, _t(0, 1, 2, -100, 1, 2))),
    "cross_entropy_negative": (lambda x, t: F.cross_entropy(x, t), (X, _t(0, 1, 2, 0, 1, -1)), None),
    "cross_entropy_ignore_index": (
        lambda x, t: F.cross_entropy(x, t, ignore_index=5),
        (X, _t(0, 1, 2, 0, 1, 7)),
        (X, _t(0, 1, 2, 0, 5, 5)),
    ),
    "nll_loss": (lambda x, t: F.nll_loss(x, t), (X, _t(0, 1, 2, 0, 1, 3)), (X, _t(0, 1, 2, 0, 1, 2))),
    "multi_margin_loss": (lambda x, t: F.multi_margin_loss(x, t), (X, _t(0, 1, 2, 0, 1, 3)), (X, _t(0, 1, 2, 0, 1, 2))),
    "multilabel_margin_loss": (
        lambda x, t: F.multilabel_margin_loss(x, t),
        (X, _t(*[0, 1, -1] * 5, 0, 3, -1).reshape(6, 3)),
        (X, _t(*[0, 1, -1] * 5, 2, 0, 1).reshape(6, 3)),
    ),
    "multinomial_negative": (lambda p: torch.multinomial(p, 1), (X - 0.1,), (X + 0.1,)),
    "multinomial_nan": (lambda p: torch.multinomial(p, 1), (X.where(X[5, 2] != X, float("nan")),), None),
    "multinomial_zero_row": (lambda p: torch.multinomial(p, 1), (X * (torch.arange(6) < 5)[:, None],), None),
    "floor_divide": (
        lambda a, b: a // b,
        (_t(7, 8, 9, 1, 2, 3), _t(1, 2, 3, 1, 2, 0)),
        (_t(7, -8, 9, 1, 2, 3), _t(1, 2, -3, 1, 2, 5)),
    ),
    "floor_divide_scalar": (lambda a: a // 0, (_t(7, 8, 9, 1, 2, 3),), None),
    "remainder": (
        lambda a, b: a % b,
        (_t(7, 8, 9, 1, 2, 3), _t(1, 2, 3, 1, 2, 0)),
        (_t(7, -8, 9, 1, 2, 3), _t(1, 2, -3, 1, 2, 5)),
    ),
    "fmod": (
        lambda a, b: torch.fmod(a, b),
        (_t(7, 8, 9, 1, 2, 3), _t(1, 2, 3, 1, 2, 0)),
        (_t(7, -8, 9, 1, 2, 3), _t(1, 2, -3, 1, 2, 5)),
    ),
    "div_trunc": (
        lambda a, b: torch.div(a, b, rounding_mode="trunc"),
        (_t(7, 8, 9, 1, 2, 3), _t(1, 2, 3, 1, 2, 0)),
        (_t(7, -8, 9, 1, 2, 3), _t(1, 2, -3, 1, 2, 5)),
    ),
    "div_floor": (
        lambda a, b: torch.div(a, b, rounding_mode="floor"),
        (_t(7, 8, 9, 1, 2, 3), _t(1, 2, 3, 1, 2, 0)),
        (_t(7, -8, 9, 1, 2, 3), _t(1, 2, -3, 1, 2, 5)),
    ),
    # an integer tensor to a negative integer power: an exponent that is a runtime input, one that is
    # baked into the program (torch special-cases -1), and an unsigned tensor
    "pow": (lambda a: a**-3, (_t(7, 8, 9, 1, 2, 3),), None),
    "pow_negative": (lambda a: a**-1, (_t(7, 8, 9, 1, 2, 3),), None),
    "pow_negative_unsigned": (lambda a: a**-2, (torch.arange(6, dtype=torch.uint8),), None),
}


# torch's kernel reports these in words of its own for the 2-d input used here: compare the type only
OTHER_MESSAGE = {"embedding_bag"}


def _put(t):
    return st.shard(t, MESH, ("x",) + (None,) * (t.dim() - 1)) if t.dim() else st.shard(t, MESH, ())


def _torch_error(fn, args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


@pytest.fixture(autouse=True)
def _clean():
    yield
    try:
        graph_checks.verify()
        st.sync()
    except Exception:  # noqa: BLE001  (a test left a failed check or graph: start the next one clean)
        state.forget_pending()
    op_checks.set_checks(True)


# every op in every mode; the variants of an op (negative ids, NaN, a scalar divisor ...) lazily only
_VARIANTS = ("_negative", "_nan", "_zero_row", "_scalar", "_ignore_index")
_BAD = [
    pytest.param(n, m, id=f"{n}-{m}")
    for n, case in CASES.items()
    if case[1] is not None
    for m in ("lazy", "eager", "compile")
    if m == "lazy" or not n.endswith(_VARIANTS)
]


@pytest.mark.parametrize(("name", "mode"), _BAD)
def test_bad_value_raises_like_torch(name, mode):
    fn, bad, _ = CASES[name]
    expected = _torch_error(fn, bad)
    first_line = str(expected).splitlines()[0]
    args = [_put(a) for a in bad]
    if mode == "lazy":
        out = fn(*args)  # recorded, not run: nothing known yet
        with pytest.raises(type(expected)) as info:
            out.cpu()
        with pytest.raises(type(expected)):  # the result depends on the failed check: it stays failed
            out.cpu()
    elif mode == "eager":
        with st.eager_mode(True), pytest.raises(type(expected)) as info:
            fn(*args)
    else:
        with pytest.raises(type(expected)) as info:
            st.compile(fn)(*args)
    assert type(info.value) is type(expected)
    message = str(info.value)
    if name not in OTHER_MESSAGE:
        assert message.splitlines()[0] == first_line
    assert "test_checks.py" in message  # the user's line (here: the lambda's) is named


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[2] is not None])
def test_good_values_equal_torch(name):
    fn, _, good = CASES[name]
    out = fn(*[_put(a) for a in good]).cpu()
    expected = fn(*good)
    if name.startswith("multinomial"):  # other random numbers: a valid draw of the same shape
        assert out.shape == expected.shape and bool(((out >= 0) & (out < 3)).all())
    else:
        torch.testing.assert_close(out, expected)


def test_lazy_failure_raises_at_next_sync_and_keeps_other_results():
    x = _put(X)
    fine = (x * 2).sum()
    bad = x.index_select(0, _put(_t(9)))
    st.sync()
    with pytest.raises(IndexError, match="index out of range in self"):
        st.sync()
    torch.testing.assert_close(fine.cpu(), (X * 2).sum())  # does not depend on the failed check
    with pytest.raises(IndexError):
        bad.cpu()
    with pytest.raises(IndexError):  # recording from a failed value raises at once
        bad + 1


def test_sync_wait_raises_for_this_step():
    bad = _put(X).index_select(0, _put(_t(9)))
    with pytest.raises(IndexError, match="index out of range in self"):
        st.sync(wait=True)
    with pytest.raises(IndexError):
        bad.cpu()


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_failed_inplace_op_keeps_its_target(mode):
    y = _put(X.clone())
    with st.eager_mode(mode == "eager"), pytest.raises(IndexError):
        y.index_fill_(0, _put(_t(0, 9)), 1.0)
        y.cpu()
    torch.testing.assert_close(y.cpu(), X)  # the value before the failed op


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, ids):
        return self.out(self.emb(ids))


def _train_step(model, opt, ids, targets):
    loss = F.cross_entropy(model(ids), targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.parametrize("rollback", ["platform", "selects"])
@pytest.mark.parametrize("mode", ["lazy", "compile"])
def test_failed_step_keeps_parameters_and_training_resumes(mode, rollback, monkeypatch, request):
    """``rollback``: as this platform does it (one conditional on the suite's XLA:CPU), or by a
    select per overwritten value (every other platform's way, see ``program.rollback_by_selects``)."""
    if rollback == "selects":
        monkeypatch.setattr(program, "rollback_by_selects", lambda mesh: True)
        st.clear_executables()  # programs built the selects' way (and again after the test)
        request.addfinalizer(st.clear_executables)
    torch.manual_seed(0)
    ref = _Net()
    model = _Net()
    model.load_state_dict(ref.state_dict())
    model = model.to(st.device())
    for p in model.parameters():
        st.mark_sharding(p, MESH, ("x",) + (None,) * (p.dim() - 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, capturable=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    good = (_t(0, 1, 2, 3, 4, 5, 0, 1), _t(0, 1, 2, 0, 1, 2, 0, 1))
    bad_ids = (_t(0, 1, 2, 3, 4, 5, 0, 6), good[1])
    bad_target = (good[0], _t(0, 1, 2, 0, 1, 2, 0, 3))
    step = (
        st.compile(lambda i, t: _train_step(model, opt, i, t))
        if mode == "compile"
        else (lambda i, t: _train_step(model, opt, i, t))
    )

    def run(batch):
        loss = step(_put(batch[0]), _put(batch[1]))
        return loss.cpu()

    for _ in range(3):  # with st.compile: traced twice, then a frozen replay
        torch.testing.assert_close(run(good), _train_step(ref, ref_opt, *good))
    for batch, error in ((bad_ids, IndexError), (bad_target, IndexError)):
        with pytest.raises(error):
            run(batch)
        for p, q in zip(model.parameters(), ref.parameters()):  # as before the failed step
            torch.testing.assert_close(p.cpu(), q.detach())
    torch.testing.assert_close(run(good), _train_step(ref, ref_opt, *good))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach())


def test_set_checks_false_traces_no_checks():
    x, i = _put(X), _put(_t(0, 1, 2, 3, 4, 5))
    with capture() as seen:
        y = x.index_select(0, i)
    lowered = lower(seen.pending())
    assert lowered.program.checks
    assert isinstance(lowered.compile().output_shardings, tuple)  # (values, check rows)
    del y
    state.forget_pending()
    st.set_checks(False)
    assert not st.checks_enabled()
    with capture() as seen:
        y = x.index_select(0, i)  # noqa: F841  (kept alive: pending values are weakly held)
    lowered = lower(seen.pending())
    assert not lowered.program.checks
    assert len(lowered.compile().output_shardings) == 1  # the program of today: its one result
    state.forget_pending()
    x.index_select(0, _put(_t(9))).cpu()  # unchecked: no error (the value is unspecified)


def test_environment_switch():
    assert op_checks.enabled_by_environment({})
    assert op_checks.enabled_by_environment({"SHARDTENSOR_CHECKS": "1"})
    assert not op_checks.enabled_by_environment({"SHARDTENSOR_CHECKS": "0"})
    assert not op_checks.enabled_by_environment({"SHARDTENSOR_CHECKS": "off"})


def test_export_has_no_check_output():
    w = _put(X)
    exported = st.export(lambda i: F.embedding(i, w), _put(_t(0, 1, 2, 3, 4, 5)))
    out = exported(_put(_t(5, 4, 3, 2, 1, 0)))
    torch.testing.assert_close(out.cpu(), X.flip(0))


def test_torch_compile_backend_raises_on_the_call():
    x = _put(X)
    f = torch.compile(lambda x, i: x.index_select(0, i) * 2, backend="shardtensor")
    torch.testing.assert_close(f(x, _put(_t(0, 5))).cpu(), X[[0, 5]] * 2)
    with pytest.raises(IndexError, match="index out of range in self") as info:
        f(x, _put(_t(0, 6)))
    assert "test_checks.py" in str(info.value)


def test_failed_step_keeps_values_overwritten_after_the_last_check(monkeypatch, request):
    """Float32 values computed after the last check (so selected where they are computed, see
    ``program.Program.make_executable``) overwriting two tensors stored padded: a failed check gives
    each its own value back."""
    monkeypatch.setattr(program, "rollback_by_selects", lambda mesh: True)
    st.clear_executables()
    request.addfinalizer(st.clear_executables)
    a0, b0 = torch.arange(6.0).reshape(2, 3), -torch.arange(6.0).reshape(2, 3)
    a, b = _put(a0.clone()), _put(b0.clone())

    @st.compile
    def step(ids):
        picked = X.to(st.device()).index_select(0, ids).sum()  # checked: ids in range
        new = a * 2 + picked
        a.copy_(new)
        b.copy_(new)
        return picked

    good, bad = _put(_t(0, 1)), _put(_t(0, 9))
    for _ in range(2):
        step(good)
    a1, b1 = a.cpu(), b.cpu()
    with pytest.raises(IndexError):
        step(bad)
        a.cpu()
    torch.testing.assert_close(a.cpu(), a1)
    torch.testing.assert_close(b.cpu(), b1)
    torch.testing.assert_close(b1, a1)  # (both got the same value before)


def test_a_ctrl_c_while_the_checks_are_read_loses_no_failed_check(monkeypatch):
    """A Ctrl-C while a run's check rows are read (waiting for the run) leaves them unread: the next
    read raises the failed check, and the tensors it computed raise it (before, they were dropped)."""
    x = st.shard(X, MESH, ("x", "y"))
    bad = x.index_select(0, st.shard(_t(0, 1, 2, 3, 4, 6), MESH, ("x",)))
    st.sync()
    read = graph_checks.host_rows

    def interrupted(rows):
        monkeypatch.setattr(graph_checks, "host_rows", read)
        raise KeyboardInterrupt

    monkeypatch.setattr(graph_checks, "host_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        graph_checks.verify()
    with pytest.raises(IndexError, match="out of range"):
        st.sync()
    with pytest.raises(IndexError, match="out of range"):
        bad.cpu()
