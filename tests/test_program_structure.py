"""The programs shardtensor builds have the structure of the ones ``jax.jit`` builds for the same math
(issue 36, item 2; bench/hlo_compare.py prints the whole comparison for a GPT): here the counts of
the expensive elementwise ops in the HLO that XLA's CPU compiler optimized, which are what a TPU pays
for too. Values are compared with eager torch; the structure is compared by counts, never by time.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

import shardtensor as st
from shardtensor.graph import program
from shardtensor.graph.capture import capture, lower  # white box: the program a run would compile
from shardtensor.ops.registry import lookup
from shardtensor.runtime import x64_scope

aten = torch.ops.aten


def _optimized_hlo(tensors) -> str:
    return lower([t._cell for t in tensors]).compile().as_text()


def _count(op: str, hlo: str) -> int:
    return len(re.findall(rf"\s{op}\(", hlo))


def _leaves(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _on_device(leaves):
    return [t.detach().to(st.device()).requires_grad_() for t in leaves]


def test_causal_sdpa_backward_reuses_the_forward_probabilities():
    """bf16 causal attention, forward and backward: one exponential (the forward's softmax), as JAX's
    autodiff has; the backward used to compute exp(scores - logsumexp) a second time."""
    ref = _leaves([(2, 2, 16, 8)] * 3, torch.bfloat16)
    out = F.scaled_dot_product_attention(*ref, is_causal=True)
    out.float().square().sum().backward()
    mine = _on_device(ref)
    got = F.scaled_dot_product_attention(*mine, is_causal=True)
    got.float().square().sum().backward()
    hlo = _optimized_hlo([got] + [t.grad for t in mine])
    assert _count("exponential", hlo) == 1, hlo
    torch.testing.assert_close(got.cpu(), out, atol=2e-2, rtol=2e-2)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=5e-2, rtol=5e-2)


def test_tanh_gelu_backward_reuses_the_forward_tanh():
    """bf16 tanh GELU, forward and backward: one tanh, the forward's."""
    (ref,) = _leaves([(4, 32)], torch.bfloat16, seed=1)
    out = F.gelu(ref, approximate="tanh")
    out.float().square().sum().backward()
    (mine,) = _on_device([ref])
    got = F.gelu(mine, approximate="tanh")
    got.float().square().sum().backward()
    hlo = _optimized_hlo([got, mine.grad])
    assert _count("tanh", hlo) == 1, hlo
    torch.testing.assert_close(got.cpu(), out)
    torch.testing.assert_close(mine.grad.cpu(), ref.grad)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.out = torch.nn.Linear(6, 5)

    def forward(self, ids):
        return self.out(self.emb(ids))


def _step(model, opt, ids, targets):
    loss = F.cross_entropy(model(ids), targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _checked_step_hlo(monkeypatch, selects: bool, checks: bool = True) -> str:
    """The optimized HLO of a steady AdamW step of a net with an embedding (so a checked op),
    its failed-check rollback by selects or by one conditional (``checks=False``: the program
    without checks)."""
    monkeypatch.setattr(program, "rollback_by_selects", lambda mesh: selects)
    torch.manual_seed(0)
    model = _Net().to(st.device())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, capturable=True)
    ids, targets = torch.tensor([1, 2, 3, 9]).to(st.device()), torch.tensor([0, 1, 4, 2]).to(st.device())
    _step(model, opt, ids, targets)
    st.sync()
    with capture() as seen:
        loss = _step(model, opt, ids, targets)
    lowered = lower(seen.pending(), donate=True, checks=checks)
    del loss
    with x64_scope():
        return lowered.jitted().lower(*lowered.abstract_arguments()).compile().as_text()


def test_failed_check_rollback_by_selects_copies_no_state(monkeypatch):
    """A checked step keeps the state before a failed check by selects fused into the updates: no
    copy of each overwritten parameter and optimizer state (one conditional over all of them copies
    each: what a TPU paid on every step). The selects' rollback itself: tests/test_checks.py."""
    by_selects = _count("copy", _checked_step_hlo(monkeypatch, True))
    by_conditional = _count("copy", _checked_step_hlo(monkeypatch, False))
    state = 3 * 4  # parameters, exp_avg, exp_avg_sq of the 4 parameters
    assert by_selects + state <= by_conditional, (by_selects, by_conditional)
    # and the updates computed after the last check are selected where computed, so the parameter
    # update reads the moments' outputs: no copy of the moments either (13 copies before, 4 after)
    unchecked = _count("copy", _checked_step_hlo(monkeypatch, True, checks=False))
    assert by_selects <= unchecked, (by_selects, unchecked)


def test_cpu_flash_attention_backward_reuses_the_forward_probabilities():
    """The CPU attention ops (an exported or traced CPU graph's) too: forward and backward in one
    program have the forward's exponential only; the gradients equal torch's CPU kernels'."""
    fwd = lookup(aten._scaled_dot_product_flash_attention_for_cpu.default).fn
    bwd = lookup(aten._scaled_dot_product_flash_attention_for_cpu_backward.default).fn
    q, k, v, g = (t.detach() for t in _leaves([(2, 2, 16, 8)] * 4, torch.float32, seed=2))

    def both(q, k, v, g):
        out, lse = fwd(q, k, v, 0.0, True)
        return out, bwd(g, q, k, v, out, lse, 0.0, True)

    args = [jnp.asarray(t.numpy()) for t in (q, k, v, g)]
    with x64_scope():
        hlo = jax.jit(both).lower(*args).compile().as_text()
        out, grads = jax.jit(both)(*args)
    assert _count("exponential", hlo) == 1, hlo
    ref_out, ref_lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    ref = aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, ref_out, ref_lse, 0.0, True)
    torch.testing.assert_close(torch.tensor(np.asarray(out)), ref_out)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(torch.tensor(np.asarray(a)), b)


def _stablehlo(tensors) -> str:
    lowered = lower([t._cell for t in tensors])
    with x64_scope():
        return lowered.jitted().lower(*lowered.abstract_arguments()).as_text()


def _class_passes(text: str, rows: int, classes: int) -> tuple[int, int]:
    """(reductions over a (rows, classes) value, 64-bit integer ops of that shape) in StableHLO."""
    shape = f"tensor<{rows}x{classes}x"
    reductions = len(re.findall(rf"stablehlo\.reduce\(.*\({re.escape(shape)}f32>", text))
    wide = len(re.findall(rf"{re.escape(shape)}i64>", text))
    return reductions, wide


def test_cross_entropy_passes_over_the_logits_as_jax():
    """F.cross_entropy forward and backward reduces over the (rows, classes) logits three times, as
    JAX's log_softmax + take_along_axis and its gradient: the max, the sum of exponentials, the
    target's pick, and none in the backward (the one-hot gradient's row sums are known: it summed
    them over the classes once more); and compares classes in int32 (a TPU emulates 64-bit
    integers). Values equal eager torch's, ignored targets and weights included."""
    rows, classes = 6, 40
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, classes, generator=g).requires_grad_()
    t = torch.randint(0, classes, (rows,), generator=g)
    t[2] = -100
    weight = torch.rand(classes, generator=g)
    for kw in ({}, {"weight": weight}):
        ref = F.cross_entropy(x, t, **kw)
        ref.backward()
        mine = x.detach().to(st.device()).requires_grad_()
        kwd = {k: v.to(st.device()) for k, v in kw.items()}
        got = F.cross_entropy(mine, t.to(st.device()), **kwd)
        got.backward()
        passes, wide = _class_passes(_stablehlo([got, mine.grad]), rows, classes)
        assert wide == 0
        assert passes == 3 or kw  # (a class weight is picked by more, of the weights alone)
        torch.testing.assert_close(got.cpu(), ref)
        torch.testing.assert_close(mine.grad.cpu(), x.grad)
        x.grad = None

    def jax_loss(x, t):
        logp = jax.nn.log_softmax(x, axis=-1)
        return -jnp.take_along_axis(logp, t[:, None], axis=-1).mean()

    jax_text = jax.jit(jax.value_and_grad(jax_loss)).lower(jnp.zeros((rows, classes)), jnp.zeros(rows, int)).as_text()
    assert _class_passes(jax_text, rows, classes)[0] == 3


def _after_log(text: str, rows: int, classes: int) -> int:
    """How many reductions over a (rows, classes) value in the StableHLO's main function depend on a
    ``log`` (log_softmax's logsumexp): passes over the logits that cannot start before it is known."""
    main = text[text.index("func.func public @main") :]
    main = main[: main.index("\n  }")]
    shape = f"tensor<{rows}x{classes}xf32>"
    tainted: set = set()
    late = 0
    for line in main.splitlines():
        m = re.match(r"\s*(%[\w#:]+?)(?::\d+)? = (.*)", line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        reads = {o.split("#")[0] for o in re.findall(r"%[\w#]+", rest)}
        if "stablehlo.log " in rest or reads & tainted:
            tainted.add(name)
            late += bool(re.search(rf"stablehlo\.reduce\(.*\({re.escape(shape)}", rest))
    return late


def test_cross_entropy_picks_the_target_without_waiting_for_the_logsumexp(monkeypatch):
    """F.cross_entropy's pick of each row's target reads the logits, not log_softmax's output (the
    logits minus the logsumexp), and subtracts the logsumexp per row: no pass over the logits waits
    for it, so XLA fuses the pick into a pass it makes anyway (on a TPU the f32 GPT's loss head had a
    pass of its own for it, 0.7 ms of a 23 ms step). Not on a CPU (see ops/loss.py), so the lowering
    is told it runs as on a TPU. The loss and its gradient equal eager torch's, to the bit for the loss
    (the same subtraction of the same two numbers)."""
    from shardtensor.ops import loss

    monkeypatch.setattr(loss, "_logits_kept", lambda: True)
    rows, classes = 6, 40
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, classes, generator=g).requires_grad_()
    t = torch.randint(0, classes, (rows,), generator=g)
    t[1] = -100
    for reduction in ("mean", "none"):
        ref = F.cross_entropy(x, t, reduction=reduction)
        ref.sum().backward()
        mine = x.detach().to(st.device()).requires_grad_()
        got = F.cross_entropy(mine, t.to(st.device()), reduction=reduction)
        got.sum().backward()
        assert _after_log(_stablehlo([got, mine.grad]), rows, classes) == 0
        torch.testing.assert_close(got.cpu(), ref, rtol=0, atol=0)
        torch.testing.assert_close(mine.grad.cpu(), x.grad)
        x.grad = None
    # log_softmax's output read by something else first: the pick reads it (and stays exact)
    logp = F.log_softmax(x.detach(), -1)
    ref = F.nll_loss(logp * 1.0, t)
    got = F.nll_loss(F.log_softmax(x.detach().to(st.device()), -1) * 1.0, t.to(st.device()))
    torch.testing.assert_close(got.cpu(), ref, rtol=0, atol=0)


def test_linear_on_tokens_contracts_the_tokens_unflattened(monkeypatch):
    """A Linear layer on (batch, tokens, features), forward and backward: its three products and its
    bias gradient read the 3-D values, as JAX's dots of ``x @ w.T + b`` do, though torch flattens
    (batch, tokens) into rows for them (the rows merged in memory: on a TPU, two layout copies of each
    attention gradient piece feeding the qkv layer, and a concatenation for its bias gradient). Not
    on a CPU (see ops/shape.py's view), so the lowering is told it runs on a TPU. The values equal
    eager torch's."""
    from shardtensor.ops import shape

    monkeypatch.setattr(shape, "_unflattened_products", lambda: True)
    g = torch.Generator().manual_seed(6)
    layer = torch.nn.Linear(8, 12)
    x = torch.randn(3, 5, 8, generator=g).requires_grad_()
    w = torch.randn(3, 5, 12, generator=g)
    (layer(x) * w).sum().backward()
    mine = torch.nn.Linear(8, 12).to(st.device())
    mine.load_state_dict(layer.state_dict())
    mx = x.detach().to(st.device()).requires_grad_()
    out = mine(mx)
    (out * w.to(st.device())).sum().backward()
    text = _stablehlo([out, mx.grad, mine.weight.grad, mine.bias.grad])
    dots = re.findall(r"stablehlo\.dot_general .*", text)
    assert len(dots) == 3 and all("tensor<3x5x" in d for d in dots), dots
    assert "contracting_dims = [0, 1] x [0, 1]" in text  # the weight's gradient
    assert re.search(r"stablehlo\.reduce\(.*across dimensions = \[0, 1\] : \(tensor<3x5x12xf32>", text)
    torch.testing.assert_close(out.detach().cpu(), layer(x).detach())
    torch.testing.assert_close(mx.grad.cpu(), x.grad)
    torch.testing.assert_close(mine.weight.grad.cpu(), layer.weight.grad)
    torch.testing.assert_close(mine.bias.grad.cpu(), layer.bias.grad)


def test_a_vocabulary_head_keeps_its_rows_flattened(monkeypatch):
    """A Linear layer whose widths differ more than 8 times (a vocabulary head) keeps torch's 2-D
    products on a TPU too: there a TPU's XLA computes the logits' gradient inside them instead of
    writing it (ops/matmul.py _HEAD_RATIO). The values equal eager torch's."""
    from shardtensor.ops import shape

    monkeypatch.setattr(shape, "_unflattened_products", lambda: True)
    g = torch.Generator().manual_seed(7)
    head = torch.nn.Linear(4, 40, bias=False)
    x = torch.randn(3, 5, 4, generator=g).requires_grad_()
    F.cross_entropy(head(x).flatten(0, 1), torch.arange(15) % 40).backward()
    mine = torch.nn.Linear(4, 40, bias=False).to(st.device())
    mine.load_state_dict(head.state_dict())
    mx = x.detach().to(st.device()).requires_grad_()
    out = mine(mx)
    F.cross_entropy(out.flatten(0, 1), (torch.arange(15) % 40).to(st.device())).backward()
    text = _stablehlo([out, mx.grad, mine.weight.grad])
    dots = re.findall(r"stablehlo\.dot_general .*", text)
    assert len(dots) == 3 and not any("tensor<3x5x" in d.split("->")[0] for d in dots), dots
    torch.testing.assert_close(out.detach().cpu(), head(x).detach())
    torch.testing.assert_close(mx.grad.cpu(), x.grad)
    torch.testing.assert_close(mine.weight.grad.cpu(), head.weight.grad)


def test_causal_sdpa_masks_with_32_bit_integers():
    """The causal mask of shardtensor's attention (JAX's, traced inside shardtensor's 64-bit scope)
    compares int32 positions, as under jax.jit: a TPU emulates int64 in the fused softmax."""
    ref = _leaves([(1, 2, 24, 8)] * 3, torch.float32, seed=4)
    out = F.scaled_dot_product_attention(*ref, is_causal=True)
    out.square().sum().backward()
    mine = _on_device(ref)
    got = F.scaled_dot_product_attention(*mine, is_causal=True)
    got.square().sum().backward()
    text = _stablehlo([got] + [t.grad for t in mine])
    assert "24x24xi32>" in text and "24x24xi64>" not in text
    torch.testing.assert_close(got.cpu(), out)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.grad.cpu(), b.grad)


def test_embedding_gathers_without_a_nan_fill():
    """An embedding's gather is not followed by a select filling out-of-range rows with NaN (its index
    check raises for those): the select ran through every residual sum of a transformer, which a TPU's
    XLA then recomputed in the backward. As JAX's ``w[ids]``."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(12, 6)
    ids = torch.tensor([[0, 3, 11], [5, 5, 2]])
    out = (emb(ids) + 1.0).sum(-1)
    mine = torch.nn.Embedding(12, 6).to(st.device())
    mine.load_state_dict(emb.state_dict())
    got = (mine(ids.to(st.device())) + 1.0).sum(-1)
    text = _stablehlo([got])
    assert "stablehlo.gather" in text and "0x7FC00000" not in text, text
    assert not re.search(r"stablehlo\.select .*f32>", text), text  # (the check's own selects are on integers)
    torch.testing.assert_close(got.cpu(), out)
