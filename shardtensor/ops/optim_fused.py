"""Fused optimizer steps, what ``torch.optim.Adam / AdamW / SGD / Adagrad(fused=True)`` call:
``_fused_adam``, ``_fused_adamw``, ``_fused_sgd`` and ``_fused_adagrad``. These are the functional
twins of the in-place ops torch.optim calls; the dispatcher writes their results back into the
parameters, gradients and state, so the whole update is one op of the step's program and every
tensor keeps its sharding.

Each is torch's CPU kernel, elementwise per tensor: computed in float32 for float32 / bfloat16 /
float16 tensors (float64 for float64), with the step-dependent factors (bias corrections, step
size) in float64 from the step counters on the device, as torch's kernel reads them in double, then
rounded once to the compute dtype. The counters stay on the device (torch's ``capturable``
behaviour): no value is read back to the host.

``grad_scale``: the gradients are divided by it, and the unscaled gradients are written back.
``found_inf`` equal to 1 skips the whole update (parameters, gradients and state keep their values),
as in torch's kernels; the step counters are torch.optim's business (it adds 1 before the call and
subtracts ``found_inf`` after).

Also here: the kernels of ``torch.amp.GradScaler`` (``_amp_foreach_non_finite_check_and_unscale``,
``_amp_update_scale``), which hand ``grad_scale`` and ``found_inf`` to the fused steps.

The learning rate (and Adam's betas, SGD's momentum) enter the program as runtime values, so a
learning-rate schedule does not recompile the step.

Example::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)   # parameters on st.device()
    loss.backward(); opt.step()      # records aten._fused_adamw_ (one program with the step in lazy mode)
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from shardtensor.ops._promote import FLOAT64, cast, fresh, opmath
from shardtensor.ops.registry import register

aten = torch.ops.aten


def _check_lengths(op: str, n: int, **lists) -> None:
    for name, values in lists.items():
        if len(values) != n:  # torch's kernels raise a RuntimeError
            raise RuntimeError(
                f"{op}: {name} has {len(values)} tensors but there are {n} parameters; pass one per "
                "parameter (or an empty list where the option is off: max_exp_avg_sqs without amsgrad, "
                "momentum_buffer_list with momentum 0)"
            )


def _unscale(g, grad_scale, ct):
    """(the gradient in compute dtype, the value to store back into it)."""
    gc = cast(g, ct)
    if grad_scale is None:
        return gc, fresh(g)
    gc = gc / cast(grad_scale, ct)
    return gc, cast(gc, g.dtype)


def _skip_if_found_inf(found_inf, old: list, new: list) -> list:
    """``new``, or ``old`` where ``found_inf`` is 1: torch's kernels return before writing anything."""
    if found_inf is None:
        return new
    skip = cast(found_inf, jnp.float32) == 1.0
    return [jnp.where(skip, o, n) for o, n in zip(old, new)]


# ----------------------------------------------------------------------------------------------
# Adam / AdamW
# ----------------------------------------------------------------------------------------------
def _adam_one(p, g, m, v, vmax, step, *, lr, beta1, beta2, weight_decay, eps, maximize, grad_scale, decoupled):
    """One tensor's Adam update: (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq or None)."""
    ct = opmath(p.dtype)
    step = cast(step, FLOAT64)
    lr, beta1, beta2 = cast(lr, FLOAT64), cast(beta1, FLOAT64), cast(beta2, FLOAT64)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = jnp.sqrt(1 - beta2**step)
    step_size = lr / bias_correction1

    gc, g_out = _unscale(g, grad_scale, ct)
    if maximize:
        gc = -gc
    pc = cast(p, ct)
    if weight_decay != 0:
        if decoupled:  # AdamW: shrink the parameter
            pc = pc * cast(1 - lr * weight_decay, ct)
        else:  # Adam: L2 penalty in the gradient
            gc = gc + pc * cast(weight_decay, ct)
    # exp_avg.lerp_(grad, 1 - beta1), with torch's two lerp formulas
    w = cast(1 - beta1, ct)
    mc = cast(m, ct)
    mc = jnp.where(jnp.abs(w) < 0.5, mc + w * (gc - mc), gc - (gc - mc) * (1 - w))
    vc = cast(v, ct) * cast(beta2, ct) + cast(1 - beta2, ct) * gc * gc
    vmax_out = None
    if vmax is not None:  # amsgrad: the denominator uses the running maximum
        vmax_out = jnp.maximum(cast(vmax, ct), vc)
        vc_denom = vmax_out
    else:
        vc_denom = vc
    denom = jnp.sqrt(vc_denom) / cast(bias_correction2_sqrt, ct) + cast(eps, ct)
    pc = pc - cast(step_size, ct) * mc / denom
    return (
        cast(pc, p.dtype),
        g_out,
        cast(mc, m.dtype),
        cast(vc, v.dtype),
        None if vmax is None else cast(vmax_out, vmax.dtype),
    )


def _adam(
    name,
    decoupled,
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    state_steps,
    *,
    lr,
    beta1,
    beta2,
    weight_decay,
    eps,
    amsgrad,
    maximize,
    grad_scale=None,
    found_inf=None,
):
    n = len(params)
    _check_lengths(name, n, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, state_steps=state_steps)
    if amsgrad:
        _check_lengths(name, n, max_exp_avg_sqs=max_exp_avg_sqs)
    elif max_exp_avg_sqs:
        raise RuntimeError(f"{name}: max_exp_avg_sqs must be empty when amsgrad=False (got {len(max_exp_avg_sqs)})")
    out: list[list] = [[], [], [], [], []]
    for i in range(n):
        results = _adam_one(
            params[i],
            grads[i],
            exp_avgs[i],
            exp_avg_sqs[i],
            max_exp_avg_sqs[i] if amsgrad else None,
            state_steps[i],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            maximize=maximize,
            grad_scale=grad_scale,
            decoupled=decoupled,
        )
        old = (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i] if amsgrad else None)
        kept = [k for k in range(5) if results[k] is not None]
        new = _skip_if_found_inf(found_inf, [old[k] for k in kept], [results[k] for k in kept])
        for k, value in zip(kept, new):
            out[k].append(value)
    return tuple(out)


_ADAM_RUNTIME = ("lr", "beta1", "beta2")


@register(aten._fused_adam.default, aten._fused_adam.tensor_lr, runtime_floats=_ADAM_RUNTIME)
def fused_adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **kwargs):
    """``torch.optim.Adam(fused=True)``'s update (weight decay as an L2 term in the gradient)."""
    return _adam("_fused_adam", False, self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **kwargs)


@register(aten._fused_adamw.default, aten._fused_adamw.tensor_lr, runtime_floats=_ADAM_RUNTIME)
def fused_adamw(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **kwargs):
    """``torch.optim.AdamW(fused=True)``'s update (decoupled weight decay)."""
    return _adam("_fused_adamw", True, self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **kwargs)


# ----------------------------------------------------------------------------------------------
# SGD
# ----------------------------------------------------------------------------------------------
def _sgd_one(p, g, buf, *, weight_decay, momentum, lr, dampening, nesterov, maximize, is_first_step, grad_scale):
    """One tensor's SGD update: (param, grad, momentum buffer or None).

    (torch 2.13's CPU kernel leaves bfloat16 / float16 parameters unchanged on its vectorized path, a
    torch bug; this follows its float32 path, the CUDA kernel and the unfused optimizer.)"""
    ct = opmath(p.dtype)
    gc, g_out = _unscale(g, grad_scale, ct)
    if maximize:
        gc = -gc
    pc = cast(p, ct)
    if weight_decay != 0:
        gc = pc * cast(weight_decay, ct) + gc
    buf_out = None
    if buf is not None:
        mom = cast(momentum, ct)
        # the first step's buffer is the gradient (torch.optim made it with empty_like)
        buf_out = gc if is_first_step else cast(buf, ct) * mom + cast(1 - dampening, ct) * gc
        gc = buf_out * mom + gc if nesterov else buf_out
    pc = pc - gc * cast(lr, ct)
    return cast(pc, p.dtype), g_out, None if buf is None else cast(buf_out, buf.dtype)


@register(aten._fused_sgd.default, aten._fused_sgd.tensor_lr, runtime_floats=("lr", "momentum"))
def fused_sgd(
    self,
    grads,
    momentum_buffer_list,
    *,
    weight_decay,
    momentum,
    lr,
    dampening,
    nesterov,
    maximize,
    is_first_step,
    grad_scale=None,
    found_inf=None,
):
    """``torch.optim.SGD(fused=True)``'s update; momentum buffers only when ``momentum_buffer_list`` is
    not empty (torch.optim passes none for momentum 0)."""
    n = len(self)
    _check_lengths("_fused_sgd", n, grads=grads)
    if momentum_buffer_list:
        _check_lengths("_fused_sgd", n, momentum_buffer_list=momentum_buffer_list)
    out: list[list] = [[], [], []]
    for i in range(n):
        buf = momentum_buffer_list[i] if momentum_buffer_list else None
        results = _sgd_one(
            self[i],
            grads[i],
            buf,
            weight_decay=weight_decay,
            momentum=momentum,
            lr=lr,
            dampening=dampening,
            nesterov=nesterov,
            maximize=maximize,
            is_first_step=is_first_step,
            grad_scale=grad_scale,
        )
        old = (self[i], grads[i], buf)
        kept = [k for k in range(3) if results[k] is not None]
        new = _skip_if_found_inf(found_inf, [old[k] for k in kept], [results[k] for k in kept])
        for k, value in zip(kept, new):
            out[k].append(value)
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Adagrad
# ----------------------------------------------------------------------------------------------
def _adagrad_one(p, g, state_sum, step, *, lr, lr_decay, weight_decay, eps, maximize, grad_scale):
    """One tensor's Adagrad update: (param, grad, state_sum), as torch's CPU kernel (the learning
    rate decayed in float64 from the step count)."""
    ct = opmath(p.dtype)
    clr = cast(lr, FLOAT64) / (1 + (cast(step, FLOAT64) - 1) * lr_decay)
    gc, g_out = _unscale(g, grad_scale, ct)
    if maximize:
        gc = -gc
    pc = cast(p, ct)
    if weight_decay != 0:
        gc = gc + pc * cast(weight_decay, ct)
    sc = cast(state_sum, ct) + gc * gc
    pc = pc - cast(clr, ct) * gc / (jnp.sqrt(sc) + cast(eps, ct))
    return cast(pc, p.dtype), g_out, cast(sc, state_sum.dtype)


@register(aten._fused_adagrad.default, aten._fused_adagrad.tensor_lr, runtime_floats=("lr",))
def fused_adagrad(
    self, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize, grad_scale=None, found_inf=None
):
    """``torch.optim.Adagrad(fused=True)``'s update (the step counters, which torch.optim advances
    before the call, are read on the devices: nothing goes back to the host)."""
    n = len(self)
    _check_lengths("_fused_adagrad", n, grads=grads, state_sums=state_sums, state_steps=state_steps)
    out: list[list] = [[], [], [], []]
    for i in range(n):
        results = _adagrad_one(
            self[i],
            grads[i],
            state_sums[i],
            state_steps[i],
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            eps=eps,
            maximize=maximize,
            grad_scale=grad_scale,
        )
        new = _skip_if_found_inf(found_inf, [self[i], grads[i], state_sums[i]], list(results))
        for k, value in enumerate(new):
            out[k].append(value)
        out[3].append(fresh(state_steps[i]))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# the grad scaler's kernels (torch.amp.GradScaler): with a fused optimizer it never reads a value back
# ----------------------------------------------------------------------------------------------
@register(aten._amp_foreach_non_finite_check_and_unscale.default)
def amp_non_finite_check_and_unscale(self, found_inf, inv_scale):
    """Each gradient times ``inv_scale`` (left as is where ``inv_scale`` is 1), and ``found_inf`` set
    to 1 if any gradient holds an inf or a NaN (it is never cleared)."""
    found = found_inf
    out = []
    for g in self:
        ct = opmath(g.dtype)
        gc, inv = cast(g, ct), cast(inv_scale, ct)
        found = jnp.where(jnp.all(jnp.isfinite(gc)), found, jnp.ones_like(found))
        out.append(cast(jnp.where(inv == 1, gc, gc * inv), g.dtype))
    return out, found


@register(aten._amp_update_scale.default)
def amp_update_scale(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    """GradScaler.update(): back off after an inf (and restart counting), grow after
    ``growth_interval`` clean steps in a row (unless the grown scale would be inf)."""
    found = found_inf != 0
    scale64 = cast(self, FLOAT64)  # torch multiplies the float scale by the double factors in double
    backed_off = cast(scale64 * scale_backoff_factor, self.dtype)
    grown = cast(scale64 * scale_growth_factor, self.dtype)
    successful = growth_tracker + 1
    grow = successful == growth_interval
    new_scale = jnp.where(found, backed_off, jnp.where(grow & jnp.isfinite(grown), grown, self))
    new_tracker = jnp.where(found | grow, jnp.zeros_like(successful), successful)
    return new_scale, cast(new_tracker, growth_tracker.dtype)


# torch 2.13 has meta kernels for _fused_adam(w)_.default only (the dispatcher takes output shapes from
# meta kernels, and the functional twins run the in-place meta kernel on copies): the others update
# in place and return nothing.
def _meta_in_place(*args, **kwargs):
    return None


_META_LIB = torch.library.Library("aten", "IMPL")
for _name in (
    "_fused_adam_.tensor_lr",
    "_fused_adamw_.tensor_lr",
    "_fused_sgd_",
    "_fused_sgd_.tensor_lr",
    "_fused_adagrad_",
    "_fused_adagrad_.tensor_lr",
):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta"):  # a later torch may have one
        _META_LIB.impl(_name, _meta_in_place, "Meta")
