"""Lowerings of loss ops: nll_loss (1-d and 2-d/K-d, weight, ignore_index, reduction) and its
backward, mse, binary cross entropy (plain and with logits), smooth L1, Huber, soft margin.

nll_loss picks the target class with a one-hot comparison against an iota (``where(t == c, x, 0)``
summed over classes), never with a gather, so batch-sharded targets stay local (see DESIGN pitfalls)
and a class-sharded input needs only a reduction. ``reduction`` is 0 none, 1 mean, 2 sum.

Example::

    loss, total_weight = lookup(aten.nll_loss_forward.default).fn(logp, target, None, 1, -100)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from shardtensor import runtime as rt
from shardtensor.dtypes import to_jax as to_jax_dtype
from shardtensor.ops._promote import acc_dtype
from shardtensor.ops._traced import recall, remember
from shardtensor.ops.checks import fail_where, out_of_range
from shardtensor.ops.precision import precision
from shardtensor.ops.registry import register

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2


def reduce_loss(loss, reduction, dtype=None):
    """torch's apply_loss_reduction; sums in float32 for half types."""
    dtype = loss.dtype if dtype is None else dtype
    if reduction == NONE:
        return loss.astype(dtype)
    acc = acc_dtype(loss.dtype)
    if reduction == MEAN:
        return jnp.mean(loss, dtype=acc).astype(dtype)
    if reduction == SUM:
        return jnp.sum(loss, dtype=acc).astype(dtype)
    raise ValueError(f"{reduction} is not a valid value for reduction")


def _grad_norm(reduction, numel):
    return 1.0 / numel if reduction == MEAN else 1.0


# --------------------------------------------------------------------------------------- nll loss


def _target_mask(target, nclass, cdim, ndim):
    """The one-hot mask of the targets. nll_loss_forward and nll_loss_backward compare the same
    targets with the same iota, and XLA partitions the two comparisons apart: with the classes
    sharded (vocab-sharded logits) each all-gathers the batch-sharded targets. The backward reusing
    the forward's mask (a fact about the traced targets, ``_traced``) — as JAX's autodiff keeps it as
    a residual — makes that one all-gather."""
    kind = ("onehot", nclass, cdim, ndim)
    onehot = recall(target, kind)
    if onehot is not None:
        return onehot
    t = target
    if jnp.dtype(t.dtype).itemsize > 4 and nclass < 2**31:
        # int32 over the (..., nclass) comparison: a TPU emulates every 64-bit integer op, and an
        # out-of-range target (-1 here) still matches no class
        t = jnp.where((t >= 0) & (t < nclass), t, -1).astype(jnp.int32)
    classes = jax.lax.broadcasted_iota(t.dtype, tuple(nclass if i == cdim else 1 for i in range(ndim)), cdim)
    onehot = jnp.expand_dims(t, cdim) == classes
    remember(target, kind, onehot)  # (a tracer's only: valid while its trace is)
    return onehot


def _nll_parts(x, target, weight, ignore_index):
    """(one-hot over the class axis, class axis, per-element weight with ignored -> 0, valid mask)."""
    cdim = 0 if x.ndim == 1 else 1
    if target.ndim != x.ndim - 1:
        raise RuntimeError(
            f"nll_loss: expected target of {x.ndim - 1} dims for input of {x.ndim} dims, got {target.ndim}"
        )
    nclass = x.shape[cdim]
    onehot = _target_mask(target, nclass, cdim, x.ndim)
    valid = target != ignore_index
    acc = acc_dtype(x.dtype)
    if weight is None:
        w = jnp.ones(target.shape, acc)
    else:
        wb = weight.astype(acc).reshape(tuple(nclass if i == cdim else 1 for i in range(x.ndim)))
        w = jnp.sum(jnp.where(onehot, wb, jnp.zeros((), acc)), axis=cdim)
    w = jnp.where(valid, w, jnp.zeros((), acc))
    return onehot, cdim, w, valid


def _logits_kept() -> bool:
    """Whether XLA keeps a log_softmax's input in memory anyway, so that reading it again is free: on
    a TPU (the logits' product writes them); XLA:CPU fuses the whole log_softmax into the product and
    keeps only its output, so a pick from the logits would keep them too: one more pass."""
    return rt.platform() != "cpu"


def _picked(x, target, onehot, cdim, acc):
    """Each row's element at its target (0 where the target is out of range), in ``acc``. When ``x`` is
    log_softmax's output ``x0 - lse``, the pick reads ``x0`` and subtracts ``lse`` once per row (the
    same rounding: one subtraction of the same two numbers): a reduction that does not wait for
    ``lse``, so XLA can fuse it into a pass over ``x0`` that it makes anyway (the product, the max),
    instead of a pass of its own over the logits (on a TPU, 0.7 ms a step for 4096 tokens of a
    32768-word vocabulary)."""
    facts = recall(x, "log_softmax_of")
    if facts is None or facts[2] != cdim or not _logits_kept():
        return jnp.sum(jnp.where(onehot, x.astype(acc), jnp.zeros((), acc)), axis=cdim)
    x0, lse, _ = facts
    raw = jnp.sum(jnp.where(onehot, x0, jnp.zeros((), x0.dtype)), axis=cdim)  # one nonzero: exact
    hit = (target >= 0) & (target < x.shape[cdim])
    picked = (raw - jnp.squeeze(lse, cdim)).astype(x.dtype).astype(acc)
    return jnp.where(hit, picked, jnp.zeros((), acc))


def nll_forward(x, target, weight, reduction, ignore_index):
    onehot, cdim, w, valid = _nll_parts(x, target, weight, ignore_index)
    acc = acc_dtype(x.dtype)
    picked = _picked(x, target, onehot, cdim, acc)
    loss = jnp.where(valid, -picked * w, jnp.zeros((), acc))
    total = jnp.sum(w)
    if reduction == NONE:  # torch reports a total weight only for 1-d input
        return loss.astype(x.dtype), (total if x.ndim == 1 else jnp.zeros((), acc)).astype(x.dtype)
    out = jnp.sum(loss)
    if reduction == MEAN:
        out = out / total
    return out.astype(x.dtype), total.astype(x.dtype)


def nll_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    onehot, cdim, w, valid = _nll_parts(x, target, weight, ignore_index)
    acc = acc_dtype(x.dtype)
    g = grad.astype(acc)
    if reduction == MEAN:
        g = g / total_weight.astype(acc)
    coef = jnp.where(valid, -w * g, jnp.zeros((), acc))
    out = jnp.where(onehot, jnp.expand_dims(coef, cdim), jnp.zeros((), acc)).astype(x.dtype)
    # each row's sum, known without a pass over the classes (log_softmax's backward needs it)
    hit = (target >= 0) & (target < x.shape[cdim])
    remember(out, "onehot_rows", (jnp.where(hit, coef, jnp.zeros((), acc)).astype(x.dtype), cdim))
    return out


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default, checked=True)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    if target.ndim == x.ndim - 1:
        n_classes = x.shape[0 if x.ndim == 1 else 1]
        fail_where(
            (target != ignore_index) & out_of_range(target, n_classes, negative_ok=False),
            IndexError,
            "Target {value} is out of bounds.",
            value=target,
        )
    return nll_forward(x, target, weight, reduction, ignore_index)


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    return nll_backward(grad, x, target, weight, reduction, ignore_index, total_weight)


# ------------------------------------------------------------------------------ regression losses


@register(aten.mse_loss.default)
def mse_loss(x, target, reduction=MEAN):
    return reduce_loss(jnp.square(x - target), reduction)


@register(aten.mse_loss_backward.default)
def mse_loss_backward(grad, x, target, reduction):
    diff = x - target
    norm = 2.0 / diff.size if reduction == MEAN else 2.0
    return ((diff * norm) * grad).astype(x.dtype)


@register(aten.smooth_l1_loss.default)
def smooth_l1_loss(x, target, reduction=MEAN, beta=1.0):
    z = jnp.abs(x - target)
    if beta == 0:
        return reduce_loss(z, reduction)
    return reduce_loss(jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta).astype(x.dtype), reduction)


@register(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(grad, x, target, reduction, beta):
    d = x - target
    norm = _grad_norm(reduction, d.size)
    g = jnp.where(d <= -beta, -norm * grad, jnp.where(d >= beta, norm * grad, (norm * d * grad / beta) if beta else 0))
    return g.astype(x.dtype)


@register(aten.huber_loss.default)
def huber_loss(x, target, reduction=MEAN, delta=1.0):
    z = jnp.abs(x - target)
    return reduce_loss(jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta)).astype(x.dtype), reduction)


@register(aten.huber_loss_backward.default)
def huber_loss_backward(grad, x, target, reduction, delta):
    d = x - target
    norm = _grad_norm(reduction, d.size)
    g = jnp.where(d < -delta, -norm * grad * delta, jnp.where(d > delta, norm * grad * delta, norm * d * grad))
    return g.astype(x.dtype)


# ------------------------------------------------------------------------------- classification


@register(aten.binary_cross_entropy.default)
def binary_cross_entropy(x, target, weight=None, reduction=MEAN):
    acc = acc_dtype(x.dtype)
    xf, t = x.astype(acc), target.astype(acc)
    loss = (t - 1) * jnp.maximum(jnp.log1p(-xf), -100) - t * jnp.maximum(jnp.log(xf), -100)
    if weight is not None:
        loss = loss * weight.astype(acc)
    return reduce_loss(loss.astype(x.dtype), reduction)


@register(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad, x, target, weight=None, reduction=MEAN):
    acc = acc_dtype(x.dtype)
    xf, t = x.astype(acc), target.astype(acc)
    g = grad.astype(acc) * (xf - t) / jnp.maximum((1 - xf) * xf, 1e-12)
    if weight is not None:
        g = g * weight.astype(acc)
    if reduction == MEAN:
        g = g / xf.size
    return jnp.broadcast_to(g, x.shape).astype(x.dtype)


@register(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(x, target, weight=None, pos_weight=None, reduction=MEAN):
    log_sig = jax.nn.log_sigmoid(x)
    if pos_weight is not None:
        log_sig = log_sig * ((pos_weight - 1) * target + 1)
    loss = (1 - target) * x - log_sig
    if weight is not None:
        loss = loss * weight
    return reduce_loss(loss.astype(x.dtype), reduction)


@register(aten.soft_margin_loss.default)
def soft_margin_loss(x, target, reduction=MEAN):
    return reduce_loss(jnp.log1p(jnp.exp(-target * x)).astype(x.dtype), reduction)


@register(aten.soft_margin_loss_backward.default)
def soft_margin_loss_backward(grad, x, target, reduction):
    norm = _grad_norm(reduction, x.size)
    z = jnp.exp(-target * x)
    return (-norm * target * z / (1 + z) * grad).astype(x.dtype)


# ---------------------------------------------------------------------------------- margin losses


def _onehot(target, nclass):
    """(..., nclass) bool: the target class of every sample, by comparison with an iota (no gather)."""
    return target[..., None] == jax.lax.broadcasted_iota(target.dtype, (1,) * target.ndim + (nclass,), target.ndim)


def _multi_margin(x, target, p, margin, weight):
    """Per-sample multi-margin loss of (N, C) input: sum over i != y of max(0, margin - x_y + x_i)^p
    (times weight[y]) / C. ``where(z > 0)`` keeps torch's zero derivative at z == 0."""
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    hot = _onehot(target, x.shape[-1])
    zero = jnp.zeros((), acc)
    x_y = jnp.sum(jnp.where(hot, xf, zero), axis=-1, keepdims=True)
    z = margin - x_y + xf
    h = jnp.where((z > 0) & ~hot, z if p == 1 else z * z, zero)
    if weight is not None:
        h = h * jnp.sum(jnp.where(hot, weight.astype(acc), zero), axis=-1, keepdims=True)
    return jnp.sum(h, axis=-1) / x.shape[-1]


def _margin_args(x, target, p):
    """(input as (N, C), target as (N,), result shape for reduction 'none'), with torch's checks."""
    if p not in (1, 2):
        raise ValueError("only p == 1 and p == 2 supported")
    nframe = x.shape[0] if x.ndim == 2 else 1
    if x.ndim > 2 or target.ndim > 1 or target.size != nframe:
        raise RuntimeError(
            "multi_margin_loss: target tensor should be 1-D with size equal to the number of input "
            f"samples (batch size). Expected target size [{nframe}], but got {list(target.shape)}. "
            f"Input has shape {list(x.shape)}."
        )
    xs = x.reshape(nframe, -1) if x.ndim else x.reshape(1, 1)
    return xs, target.reshape(nframe), (nframe,) if target.ndim else ()


@register(aten.multi_margin_loss.default, static_scalars=True, checked=True)
def multi_margin_loss(x, target, p=1, margin=1, weight=None, reduction=MEAN):
    xs, t, shape = _margin_args(x, target, p)
    fail_where(out_of_range(t, xs.shape[-1], negative_ok=False), RuntimeError, "target out of range")
    return reduce_loss(_multi_margin(xs, t, p, margin, weight).reshape(shape), reduction, x.dtype)


@register(aten.multi_margin_loss_backward.default, static_scalars=True)
def multi_margin_loss_backward(grad, x, target, p, margin, weight=None, reduction=MEAN):
    xs, t, shape = _margin_args(x, target, p)
    acc = acc_dtype(x.dtype)
    fwd = lambda v: reduce_loss(_multi_margin(v, t, p, margin, weight).reshape(shape), reduction, acc)  # noqa: E731
    _, vjp = jax.vjp(fwd, xs.astype(acc))
    g = vjp(jnp.broadcast_to(grad.astype(acc), jax.eval_shape(fwd, xs.astype(acc)).shape))[0]
    return g.reshape(x.shape).astype(x.dtype)


def _multilabel(x, target):
    """(per-sample loss, is_target) of torch's multilabel margin loss: the targets of a sample are the
    entries of its row before the first -1 (a repeated one counts twice)."""
    if x.ndim == 0:  # a single class
        loss, is_target = _multilabel(x[None], target[None])
        return loss, is_target[0]
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    c = x.shape[-1]
    valid = jnp.cumprod(target >= 0, axis=-1).astype(bool)  # (..., C): before the first negative
    hot = _onehot(target, c) & valid[..., None]  # (..., C entries, C classes)
    is_target = jnp.any(hot, axis=-2)
    zero = jnp.zeros((), acc)
    x_t = jnp.sum(jnp.where(hot, xf[..., None, :], zero), axis=-1)  # input at each target entry
    z = 1 - x_t[..., :, None] + xf[..., None, :]
    keep = valid[..., :, None] & ~is_target[..., None, :] & (z > 0)
    return jnp.sum(jnp.where(keep, z, zero), axis=(-2, -1)) / c, is_target


def _check_multilabel(x, target):
    if x.ndim > 2 or target.shape != x.shape:
        raise RuntimeError(
            f"multilabel_margin_loss: inconsistent target size {list(target.shape)} for input of size {list(x.shape)}"
        )


@register(aten.multilabel_margin_loss_forward.default, checked=True)
def multilabel_margin_loss_forward(x, target, reduction):
    _check_multilabel(x, target)
    n_classes = x.shape[-1] if x.ndim else 1  # -1 ends a row's targets; any entry past that is checked too
    fail_where((target < -1) | (target >= n_classes), RuntimeError, "argument #2 'target' is out of range")
    loss, is_target = _multilabel(x, target)
    return reduce_loss(loss, reduction, x.dtype), is_target.astype(x.dtype)


@register(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    _check_multilabel(x, target)
    acc = acc_dtype(x.dtype)
    fwd = lambda v: reduce_loss(_multilabel(v, target)[0], reduction, acc)  # noqa: E731
    _, vjp = jax.vjp(fwd, x.astype(acc))
    return vjp(jnp.broadcast_to(grad.astype(acc), jax.eval_shape(fwd, x.astype(acc)).shape))[0].astype(x.dtype)


# --------------------------------------------------------------------------------------- CTC loss


def _lse3(a, b, c):
    """log(e^a + e^b + e^c) as torch's CTC kernel computes it (max shift, 0 when all are -inf)."""
    m = jnp.maximum(jnp.maximum(a, b), c)
    m = jnp.where(m == -jnp.inf, jnp.zeros((), m.dtype), m)
    return jnp.log(jnp.exp(a - m) + jnp.exp(b - m) + jnp.exp(c - m)) + m


def _shift(v, k):
    """v[..., s - k] along the last axis, -inf where s < k."""
    pad = jnp.full(v.shape[:-1] + (k,), -jnp.inf, v.dtype)
    return jnp.concatenate([pad, v[..., : v.shape[-1] - k]], axis=-1)


def _ctc_setup(log_probs, targets, input_lengths, target_lengths, blank, max_len):
    """Batch-major (N, T, C) log-probs and the extended label sequences l' = (blank, l1, blank, ...,
    blank): (lp, labels (N, S), state mask (N, S), skip allowed (N, S), input and target lengths)."""
    if log_probs.ndim != 3:
        raise RuntimeError(f"ctc_loss: expected 3-D log_probs (T, N, C), got {log_probs.ndim}-D")
    lp = jnp.swapaxes(log_probs, 0, 1)
    n = lp.shape[0]
    il = jnp.asarray(input_lengths, jnp.int64).reshape(n)
    tl = jnp.asarray(target_lengths, jnp.int64).reshape(n)
    j = jnp.arange(max_len)
    if targets.ndim == 2:  # (N, padded length)
        tg = jnp.pad(targets[:, :max_len], [(0, 0), (0, max(max_len - targets.shape[1], 0))])
    elif targets.size:  # concatenated 1-d targets
        start = jnp.cumsum(tl) - tl
        tg = jnp.take(targets, jnp.clip(start[:, None] + j, 0, targets.shape[0] - 1), axis=0)
    else:
        tg = jnp.zeros((n, max_len), jnp.int64)
    tg = jnp.where(j < tl[:, None], tg, blank).astype(jnp.int64)
    s = 2 * max_len + 1
    labels = jnp.full((n, s), blank, jnp.int64).at[:, 1::2].set(tg)
    states = jnp.arange(s) <= 2 * tl[:, None]
    skip = (jnp.arange(s) >= 2) & (labels != jnp.concatenate([jnp.full((n, 2), -1, jnp.int64), labels[:, :-2]], 1))
    return lp, labels, states, skip, il, tl


def _ctc_alpha(lp, labels, states, skip, il):
    """log_alpha (N, T, S): the forward variables, -inf outside each sample's input and states."""
    acc = lp.dtype
    emit = jnp.take_along_axis(lp, labels[:, None, :], axis=2)  # (N, T, S): lp[t, l'_s], per sample
    neg = jnp.asarray(-jnp.inf, acc)
    first = jnp.where(jnp.arange(labels.shape[1]) < 2, emit[:, 0], neg)
    first = jnp.where(states & (il[:, None] > 0), first, neg)

    def step(prev, t):
        a = _lse3(prev, _shift(prev, 1), jnp.where(skip, _shift(prev, 2), neg)) + emit[:, t]
        a = jnp.where(states & (t < il[:, None]), a, neg)
        return a, a

    _, rest = jax.lax.scan(step, first, jnp.arange(1, lp.shape[1]))
    return jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)


def _ctc_nll(alpha, il, tl):
    last = jnp.take_along_axis(alpha, jnp.clip(il - 1, 0, None)[:, None, None], axis=1)[:, 0]  # (N, S)
    l1 = jnp.take_along_axis(last, (2 * tl)[:, None], axis=1)[:, 0]
    l2 = jnp.take_along_axis(last, jnp.clip(2 * tl - 1, 0, None)[:, None], axis=1)[:, 0]
    l2 = jnp.where(tl > 0, l2, -jnp.inf)
    m = jnp.maximum(l1, l2)
    m = jnp.where(m == -jnp.inf, jnp.zeros((), m.dtype), m)
    ll = jnp.log(jnp.exp(l1 - m) + jnp.exp(l2 - m)) + m
    # an empty input explains only an empty target
    return -jnp.where(il > 0, ll, jnp.where(tl == 0, 0.0, -jnp.inf).astype(ll.dtype))


@register(aten._ctc_loss.default)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """torch's CTC forward: (negative log likelihood (N,), log_alpha (N, T, 2 * max target length + 1)).
    (``_ctc_loss.Tensor``, with tensor lengths, has a data-dependent output shape: not lowered.)"""
    max_len = max([int(v) for v in target_lengths], default=0)
    lp, labels, states, skip, il, tl = _ctc_setup(log_probs, targets, input_lengths, target_lengths, blank, max_len)
    acc = acc_dtype(lp.dtype)
    alpha = _ctc_alpha(lp.astype(acc), labels, states, skip, il)
    nll = _ctc_nll(alpha, il, tl)
    return nll.astype(log_probs.dtype), alpha.astype(log_probs.dtype)


@register(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def ctc_loss_backward(
    grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank, zero_infinity=False
):
    """torch's CTC gradient with respect to log_probs: (exp(lp) - posterior of each class) * grad, which
    is the gradient through a log_softmax folded in (torch's convention), 0 past each input's length."""
    max_len = (log_alpha.shape[-1] - 1) // 2
    lp, labels, states, skip, il, tl = _ctc_setup(log_probs, targets, input_lengths, target_lengths, blank, max_len)
    acc = acc_dtype(lp.dtype)
    lp = lp.astype(acc)
    n, t_max, s = lp.shape[0], lp.shape[1], labels.shape[1]
    emit = jnp.take_along_axis(lp, labels[:, None, :], axis=2)
    neg = jnp.asarray(-jnp.inf, acc)
    at_end = (jnp.arange(s) == 2 * tl[:, None]) | ((jnp.arange(s) == 2 * tl[:, None] - 1) & (tl[:, None] > 0))
    skip_up = jnp.concatenate([skip[:, 2:], jnp.zeros((n, 2), bool)], axis=1)  # s -> s + 2 allowed

    def up(v, k):  # v[..., s + k], -inf past the end
        return jnp.concatenate([v[..., k:], jnp.full(v.shape[:-1] + (k,), -jnp.inf, v.dtype)], axis=-1)

    def step(nxt, t):
        b = _lse3(nxt, up(nxt, 1), jnp.where(skip_up, up(nxt, 2), neg)) + emit[:, t]
        b = jnp.where(t == il[:, None] - 1, jnp.where(at_end, emit[:, t], neg), b)
        b = jnp.where(states & (t < il[:, None]), b, neg)
        return b, b

    _, beta = jax.lax.scan(step, jnp.full((n, s), -jnp.inf, acc), jnp.arange(t_max), reverse=True)
    beta = jnp.swapaxes(beta, 0, 1)  # (N, T, S)
    # (torch leaves log_alpha unset outside each sample's states and input: read only the valid part)
    ab = jnp.where(beta == -jnp.inf, neg, log_alpha.astype(acc) + beta)
    # log of the sum of alpha * beta over the states of each class, folded over the states in
    # descending order as torch does (the loss is a difference of large logs: rounding must agree)
    classes = jnp.arange(lp.shape[2])

    def fold(acc_log, s_idx):
        v = ab[:, :, s_idx][..., None]
        mx = jnp.maximum(acc_log, v)
        summed = jnp.log(jnp.exp(acc_log - mx) + jnp.exp(v - mx)) + mx
        new = jnp.where(acc_log == -jnp.inf, v, summed)
        hot = (labels[:, s_idx][:, None] == classes)[:, None, :]
        return jnp.where(hot, new, acc_log), None

    res, _ = jax.lax.scan(fold, jnp.full(lp.shape, -jnp.inf, acc), jnp.arange(s), reverse=True)
    nll_b = nll.astype(acc).reshape(n)
    g = (jnp.exp(lp) - jnp.exp(res + nll_b[:, None, None] - lp)) * grad.astype(acc).reshape(n)[:, None, None]
    live = jnp.arange(t_max)[None, :, None] < il[:, None, None]
    if zero_infinity:
        live = live & (nll_b != jnp.inf)[:, None, None]
    g = jnp.where(live, g, jnp.zeros((), acc))
    return jnp.swapaxes(g, 0, 1).astype(log_probs.dtype)


# ----------------------------------------------------------------- linear cross entropy (chunked)


def _linear_ce(x, lw, target, lb, weight, ignore_index, acc):
    """(logits, per-row nll, per-row class weight w (0 for ignored rows), one-hot of the targets) of
    cross entropy on logits = x @ lw.T + lb, computed in ``acc``; targets picked by one-hot, no gather."""
    logits = jnp.matmul(x.astype(acc), lw.astype(acc).T, precision=precision())
    if lb is not None:
        logits = logits + lb.astype(acc)
    hot = _onehot(target, lw.shape[0])
    zero = jnp.zeros((), acc)
    nll = jax.nn.logsumexp(logits, axis=1) - jnp.sum(jnp.where(hot, logits, zero), axis=1)
    w = (target != ignore_index).astype(acc)
    if weight is not None:
        w = w * jnp.sum(jnp.where(hot, weight.astype(acc), zero), axis=1)
    return logits, nll, w, hot


def _acc_of(x, dtype):
    """The accumulation dtype: the op's ``acc_dtype`` argument (a torch dtype), else float32 for halves."""
    return acc_dtype(x.dtype) if dtype is None else to_jax_dtype(dtype)


def linear_cross_entropy_chunked(
    x,
    lw,
    target,
    lb,
    weight,
    reduction,
    ignore_index,
    label_smoothing,
    batch_chunk_size,
    acc_policy,
    acc_dtype,
    allow_retain_graph,
    compute_input_grad,
    compute_linear_weight_grad,
    compute_linear_bias_grad,
):
    """torch_nn._linear_cross_entropy_batch_chunked (reduction mean / sum): the loss and, precomputed,
    the gradients of input, linear weight and bias (empty when not asked for). One XLA program
    replaces torch's loop over batch chunks: XLA schedules the memory itself."""
    if label_smoothing > 0:
        raise NotImplementedError("linear_cross_entropy does not support label smoothing")
    if reduction not in ("mean", "sum"):
        raise NotImplementedError(f"linear_cross_entropy does not support reduction={reduction!r}")
    acc = _acc_of(x, acc_dtype)
    logits, nll, w, hot = _linear_ce(x, lw, target, lb, weight, ignore_index, acc)
    if reduction == "mean":  # no weight at all: NaN everywhere, as torch (explicitly: XLA folds
        d = jnp.sum(w)  # convert(mask) / d into select(mask, 1 / d, 0), losing 0 / 0)
        coef = jnp.where(d == 0, jnp.asarray(jnp.nan, acc), w / d)
    else:
        coef = w
    loss = jnp.sum(coef * nll)
    if reduction == "mean" and x.shape[0] == 0:
        loss = jnp.asarray(jnp.nan, acc)
    dlogits = coef[:, None] * (jax.nn.softmax(logits, axis=1) - hot.astype(acc))
    mm = lambda a, b: jnp.matmul(a, b, precision=precision())  # noqa: E731
    dt = x.dtype
    gi = mm(dlogits, lw.astype(acc)).astype(dt) if compute_input_grad else jnp.zeros((0, 0), dt)
    gw = mm(dlogits.T, x.astype(acc)).astype(dt) if compute_linear_weight_grad else jnp.zeros((0, 0), dt)
    gb = jnp.sum(dlogits, axis=0).astype(dt) if compute_linear_bias_grad else jnp.zeros((0,), dt)
    return loss.astype(dt), gi, gw, gb


def linear_cross_entropy_chunked_none(x, lw, target, lb, weight, ignore_index, batch_chunk_size, acc_policy, acc_dtype):
    """torch_nn._linear_cross_entropy_batch_chunked_no_reduction: the per-row loss (N,)."""
    acc = _acc_of(x, acc_dtype)
    _, nll, w, _ = _linear_ce(x, lw, target, lb, weight, ignore_index, acc)
    return (w * nll).astype(x.dtype)


try:  # torch's chunked linear cross entropy custom ops (torch >= 2.13) exist once their module is imported
    import torch.nn.modules.linear_cross_entropy  # noqa: F401

    register(torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default, products=True)(
        linear_cross_entropy_chunked
    )
    register(torch.ops.torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default, products=True)(
        linear_cross_entropy_chunked_none
    )
except (ImportError, AttributeError):
    pass


# torch 2.13 has no meta kernels for these backward ops (the dispatcher takes output shapes from meta
# kernels): each gradient is shaped like the op's input.
def _like_second_arg(grad, x, *args, **kwargs):
    return torch.empty_like(x)


_META_LIB = torch.library.Library("aten", "IMPL")
for _name in (
    "multi_margin_loss_backward",
    "multilabel_margin_loss_backward",
    "_ctc_loss_backward",
    "_ctc_loss_backward.Tensor",
):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta"):
        _META_LIB.impl(_name, _like_second_arg, "Meta")
