"""An ``st.compile`` call that raises its own failed checks waits only for its check rows' own program.

With ``raise_on_call=True`` (the default) a call reads its run's check rows before it returns; read
from the step's program, that waits for the whole step, and the host cannot prepare the next call
while the devices run this one. When the rows need only cheap work, a frozen replay computes them by a
program of their own dispatched just before the step (``graph.early_rows``) and waits for that; the
step's own rows are read later (once ready, or at the next read or sync). On a CPU it is off by
default (nothing to overlap); these tests turn it on (``early_rows.ENABLED``).

What must hold: results equal eager torch's; a bad index raises torch's error on the call that ran it,
with the state as before the call; the step's own rows are read too (a failure only they show still
raises, at the next read); a check that needs a product keeps the plain wait.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from shardtensor.graph import checks, early_rows

VOCAB, WIDTH = 16, 8


@pytest.fixture
def early(monkeypatch):
    monkeypatch.setattr(early_rows, "ENABLED", True)
    st.sync()
    checks.verify()


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        return self.head(self.emb(ids))


def _trainer(device):
    model = _Model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, capturable=device != "cpu")

    def step(ids, targets):
        loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return model, step


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, VOCAB, (4, 6), generator=g) for _ in range(2)) for _ in range(n)]


def _frozen(compiled):
    (frozen,) = compiled._frozen.values()
    return frozen


def _has_rows_program(fn) -> bool:
    return getattr(fn, "early_rows", None) not in (None, early_rows._SEEN, early_rows._NONE)


def test_training_matches_eager_and_uses_the_rows_program(early, monkeypatch):
    seen = []
    real = checks.host_rows
    monkeypatch.setattr(checks, "host_rows", lambda rows: seen.append(rows) or real(rows))
    model, step = _trainer(st.device())
    compiled = st.compile(step)
    eager_model, eager_step = _trainer("cpu")
    batches = _batches(6)
    for ids, targets in batches:
        loss = compiled(ids.to(st.device()), targets.to(st.device()))
        expected = eager_step(ids, targets)
        torch.testing.assert_close(loss.cpu(), expected, rtol=1e-5, atol=1e-5)
    frozen = _frozen(compiled)
    assert _has_rows_program(frozen.executable)  # index checks only: cheap
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-5)
    st.sync()
    checks.verify()
    assert not checks._UNREAD  # every run's rows were read, its own and the early ones
    assert len(seen) >= 2 * 3  # (the replays: early rows and the step's own each)


def test_a_bad_target_raises_on_its_call_with_the_state_kept(early):
    model, step = _trainer(st.device())
    compiled = st.compile(step)
    for ids, targets in _batches(4):
        compiled(ids.to(st.device()), targets.to(st.device()))
    assert _has_rows_program(_frozen(compiled).executable)
    before = [p.detach().cpu().clone() for p in model.parameters()]
    ids, targets = _batches(1)[0]
    targets = targets.clone()
    targets[1, 2] = VOCAB + 3
    with pytest.raises(IndexError, match="out of bounds"):
        compiled(ids.to(st.device()), targets.to(st.device()))
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.cpu(), b)
    assert not checks._UNREAD  # (the failed run's own rows are not read again)
    # and the next good call trains on
    loss = compiled(ids.to(st.device()), _batches(1)[0][1].to(st.device()))
    assert torch.isfinite(loss.cpu())


def test_the_steps_own_rows_are_read_later(early, monkeypatch):
    """Its own rows not ready when the call ends: left unread by the call, read by the next read."""
    monkeypatch.setattr(checks, "_ready", lambda rows: False)
    model, step = _trainer(st.device())
    compiled = st.compile(step)
    for ids, targets in _batches(4):
        loss = compiled(ids.to(st.device()), targets.to(st.device()))
    # only the runs' own rows are left: each call read its early rows
    assert checks._UNREAD and all(entry.late for entry in checks._UNREAD)
    loss.cpu()  # a read: every run's rows are read first
    assert not checks._UNREAD


def test_a_failure_only_the_steps_own_rows_show_still_raises(early, monkeypatch):
    """The early rows are the same checks; were they ever to pass where the step's failed, the
    step's rows still raise (at the next read), and its results that depend on them fail."""
    model, step = _trainer(st.device())
    compiled = st.compile(step)
    for ids, targets in _batches(4):
        compiled(ids.to(st.device()), targets.to(st.device()))
    frozen = _frozen(compiled)
    real = frozen.executable.early_rows
    frozen.executable.early_rows = lambda *arguments: real(*arguments) * 0  # always "passed"
    monkeypatch.setattr(checks, "_ready", lambda rows: False)
    ids, targets = _batches(1)[0]
    targets = targets.clone()
    targets[0, 0] = -5
    loss = compiled(ids.to(st.device()), targets.to(st.device()))  # early rows say fine
    with pytest.raises(IndexError, match="out of bounds"):
        loss.cpu()


def test_a_check_after_a_product_keeps_the_plain_wait(early):
    """Rows that need a matmul would cost most of the step: no program of their own."""
    table = torch.arange(32.0).reshape(16, 2).to(st.device())

    def pick(x, w):
        index = (x @ w).argmax(-1)  # checked by the gather below: depends on the product
        return table[index].sum()

    compiled = st.compile(pick)
    x, w = torch.randn(4, 5).to(st.device()), torch.randn(5, 16).to(st.device())
    for _ in range(3):
        out = compiled(x, w)
    expected = torch.arange(32.0).reshape(16, 2)[(x.cpu() @ w.cpu()).argmax(-1)].sum()
    torch.testing.assert_close(out.cpu(), expected)
    assert _frozen(compiled).executable.early_rows is early_rows._NONE


def test_lazy_steps_read_the_earlier_run_early(early, monkeypatch):
    """A repeated lazy step's program gets its rows' own program too: the next step's program is
    called without waiting for this one. A bad target still raises at the next step (before its
    program runs: the failed step is rolled back, the next one stays pending and runs at the read)."""
    monkeypatch.setattr(checks, "_ready", lambda rows: False)
    model, step = _trainer(st.device())
    eager_model, eager_step = _trainer("cpu")
    losses, expected = [], []
    for ids, targets in _batches(5):
        with st.step():
            losses.append(step(ids.to(st.device()), targets.to(st.device())))
        expected.append(eager_step(ids, targets))
    assert any(entry.late for entry in checks._UNREAD)  # the last runs' own rows: not waited for
    torch.testing.assert_close(torch.stack([x.cpu() for x in losses]), torch.stack(expected), rtol=1e-5, atol=1e-5)
    assert not checks._UNREAD
    ids, targets = _batches(1)[0]
    bad = targets.clone()
    bad[0, 1] = VOCAB
    with st.step():
        step(ids.to(st.device()), bad.to(st.device()))
    with pytest.raises(IndexError, match="out of bounds"), st.step():
        step(ids.to(st.device()), targets.to(st.device()))
    eager_step(ids, targets)  # (eager torch raised at the bad step: only the good one trained)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-5)


def test_a_program_whose_ops_check_nothing_gets_no_rows_program(early, monkeypatch):
    """Checks on, but no op checks anything: the program has no rows, so no rows' program (its empty
    result crashed the copy to the host on a TPU)."""
    from shardtensor.graph import execute

    seen = []
    real = early_rows.dispatch
    monkeypatch.setattr(execute.early_rows, "dispatch", lambda fn, *a: seen.append((fn, real(fn, *a))) or seen[-1][1])
    x = torch.arange(12.0).reshape(3, 4).to(st.device())
    for _ in range(4):
        y = x * 2 + 1
        st.sync()
    torch.testing.assert_close(y.cpu(), torch.arange(12.0).reshape(3, 4) * 2 + 1)
    assert len(seen) == 4 and all(rows is None for _, rows in seen)
    assert early_rows.used(seen[-1][0]) is False


def test_what_counts_as_heavy():
    """The compiler's own cheap calls of a TPU (as its optimized HLO writes them) do not make the rows'
    program heavy; products, loops and kernels do."""
    concat = (
        "%custom-call.1 = s64[2,3]{1,0} custom-call(s64[1,3]{1,0} %a, s64[1,3]{1,0} %b), "
        'custom_call_target="ConcatBitcast"'
    )
    gather = '%custom-call.2 = s32[4]{0} custom-call(s32[4]{0} %i), custom_call_target="AssumeGatherIndicesInBound"'
    kernel = '%custom-call.3 = f32[8,128]{1,0} custom-call(f32[8,128]{1,0} %x), custom_call_target="tpu_custom_call"'
    split = '%custom-call.4 = u32[2]{0} custom-call(s64[2]{0} %r), custom_call_target="X64SplitHigh"'
    product = "%dot.1 = f32[4,4]{1,0} dot(f32[4,8]{1,0} %a, f32[8,4]{1,0} %b)"
    assert not early_rows.heavy(concat + "\n" + gather + "\n" + split)
    assert early_rows.heavy(concat + "\n" + kernel)
    assert early_rows.heavy(product)


def test_off_on_a_cpu_by_default_and_the_environment_decides(monkeypatch):
    monkeypatch.delenv("SHARDTENSOR_EARLY_ROWS", raising=False)
    assert early_rows.ENABLED is None and early_rows.enabled() is False
    monkeypatch.setenv("SHARDTENSOR_EARLY_ROWS", "1")
    assert early_rows.enabled() is True
    monkeypatch.setenv("SHARDTENSOR_EARLY_ROWS", "off")
    assert early_rows.enabled() is False
