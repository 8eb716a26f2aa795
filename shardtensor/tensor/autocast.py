"""``torch.autocast`` on the device: the casts torch's autocast makes, for shardtensor's tensors.

torch runs autocast as a dispatch key above autograd, one per device type; shardtensor's device is
PrivateUse1 renamed, so its key is ``AutocastPrivateUse1``, for which torch registers nothing. This
module registers there, with ``torch.library``: a fallthrough for every op (an op off the lists runs
in the dtypes it is given) and, for each op on the lists below, a kernel that casts the op's
floating-point device tensors as the op's policy says and calls the op again with autocast off —
what torch's own C++ wrappers do for CUDA and CPU. So ``with torch.autocast(st.device().type,
dtype=torch.bfloat16):`` behaves on the device as on any torch device: autograd records the casts,
backward runs in the forward's dtypes, nesting, ``enabled=False`` inside, ``cache_enabled`` and
``torch.get_autocast_dtype`` / ``torch.is_autocast_enabled`` are torch's own.

**The lists are PyTorch/XLA's** (``torch.autocast('xla')`` on a TPU), the device shardtensor's users
come from and the chip it runs on. They are torch's CPU lists with PyTorch/XLA's changes: ``relu``,
``max_pool2d`` and ``einsum`` run in the lower precision too, and ``softmax``, ``log_softmax``,
``batch_norm`` and ``pow(Tensor, Scalar)`` in float32 (on CPU they run in their input's dtype). The
entries PyTorch/XLA leaves commented out only for want of a lowering (scaled_dot_product_attention;
fft, quantile, most of linalg) are here, as on CPU. Left out, as on PyTorch/XLA: the CPU-only entries
for CPU kernels' limits (3-d pooling, ``_addmm_activation``, ``linalg_vecdot``, mkldnn's RNN layer).

Policies (torch's words): ``lower`` casts float32 to the autocast dtype; ``fp32`` casts to float32;
``promote`` casts every floating argument to the widest floating type among them. Only floating
tensors on the device are cast, never float64 ones; in-place and ``out=`` forms are not cast.

Example::

    with torch.autocast(st.device().type, dtype=torch.bfloat16):
        y = model(x)        # Linear/conv/matmul in bfloat16, softmax and losses in float32
    y.float().sum().backward()
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

from shardtensor.tensor import device as torch_device

KEY = "AutocastPrivateUse1"

# op overloads (aten) -> policy
# fmt: off
LOWER = (
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "einsum", "scaled_dot_product_attention",
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "prelu", "relu", "max_pool2d",
)
FP32 = (
    "softmax.int", "softmax.Dimname", "_softmax", "log_softmax.int", "log_softmax.Dimname", "batch_norm",
    "pow.Tensor_Scalar", "prod", "prod.dim_int", "prod.dim_Dimname", "cdist", "trace",
    "quantile", "quantile.scalar", "nanquantile", "nanquantile.scalar", "polar", "view_as_complex",
    "grid_sampler", "grid_sampler_2d", "grid_sampler_3d", "stft", "stft.center",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    # losses
    "cross_entropy_loss", "nll_loss", "nll_loss2d", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "poisson_nll_loss", "ctc_loss.IntList",
    "ctc_loss.Tensor", "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "multilabel_margin_loss", "multilabel_margin_loss_forward",
    # fft
    "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft",
    "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft",
    # linear algebra
    "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse",
    "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve", "fake_quantize_per_tensor_affine",
    "linalg_cond", "linalg_cond.p_str", "linalg_matrix_rank", "linalg_matrix_rank.tol_tensor",
    "linalg_matrix_rank.atol_rtol_tensor", "linalg_matrix_rank.atol_rtol_float", "linalg_solve",
    "linalg_cholesky", "linalg_cholesky_ex", "linalg_svdvals", "linalg_svd", "linalg_eigvals", "linalg_eigvalsh",
    "linalg_eig", "linalg_eigh", "linalg_inv", "linalg_inv_ex", "linalg_householder_product",
    "linalg_tensorinv", "linalg_tensorsolve", "linalg_qr", "linalg_lstsq",
)
PROMOTE = ("cat", "stack", "index_copy", "index_copy.dimname")
# fmt: on
POLICIES: dict[str, str] = {
    **dict.fromkeys(LOWER, "lower"),
    **dict.fromkeys(FP32, "fp32"),
    **dict.fromkeys(PROMOTE, "promote"),
}

_AUTOCAST_OFF = DispatchKeySet(DispatchKey.AutocastPrivateUse1)  # type: ignore[attr-defined]  # (not in the stubs)


def _eligible(t: Any) -> bool:
    """torch's test: a defined floating tensor on this device that is not float64."""
    return (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dtype is not torch.float64
        and t.device.type == torch_device.BACKEND
    )


# --- the cast cache -------------------------------------------------------------------------------
# torch caches the lower-precision cast of a float32 leaf that requires grad (a weight) while autocast
# is on, so a weight used twice in one region is cast once and its gradient flows through one cast;
# the cache is emptied when the outermost region exits. torch's cache is C++ and holds only its own
# devices' casts: the device's are kept here the same way, and emptied by the same call
# (``torch.clear_autocast_cache``, which ``torch.autocast.__exit__`` makes; wrapped below). An entry
# is for one dtype: a float16 region nested in a bfloat16 one casts the weight again (torch's cache
# would hand it the bfloat16 cast).
_cache: dict[int, tuple[weakref.ref, torch.dtype, torch.Tensor]] = {}


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if (
        dtype is torch.float32
        or t.dtype is not torch.float32
        or not (t.requires_grad and t.is_leaf)
        or t._is_view()
        or not torch.is_autocast_cache_enabled()
        or torch._C._is_cached_tensor(t)  # type: ignore[attr-defined]
    ):
        return t.to(dtype)
    entry = _cache.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] is dtype:
        return entry[2]
    out = t.to(dtype)
    _cache[id(t)] = (weakref.ref(t), dtype, out)
    return out


def clear_cache() -> None:
    """Forget the device's cached casts (what ``torch.clear_autocast_cache()`` now also does).

    Example: ``shardtensor.tensor.autocast.clear_cache()``.
    """
    _cache.clear()


def _also_clear_device_casts(clear_torch_cache):
    def clear_autocast_cache() -> None:
        clear_torch_cache()
        _cache.clear()

    clear_autocast_cache.__doc__ = clear_torch_cache.__doc__
    clear_autocast_cache._shardtensor_wraps = clear_torch_cache  # type: ignore[attr-defined]
    return clear_autocast_cache


# --- the kernels ----------------------------------------------------------------------------------
def _map(value: Any, fn) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return value


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _promoted(args: tuple, kwargs: dict, lower: torch.dtype) -> torch.dtype:
    """The widest floating type among the eligible arguments (torch's ``promote_type``)."""
    widest = lower
    for t in _tensors((args, tuple(kwargs.values()))):
        if not _eligible(t):
            continue
        if widest is torch.float32 or t.dtype is torch.float32:
            widest = torch.float32
        elif t.dtype is not lower:
            raise RuntimeError(
                f"autocast to {lower} met a {t.dtype} tensor in a promoting op (torch allows only {lower} "
                "and float32 there): cast it to one of them first"
            )
    return widest


def _kernel(op, policy: str):
    def autocast_kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype(torch_device.BACKEND)
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_OFF):
            if policy == "lower":
                to = lower
            elif policy == "fp32":
                to = torch.float32
            else:
                to = _promoted(args, kwargs, lower)

            def cast(t):
                return _cast(t, to) if _eligible(t) and t.dtype is not to else t

            return op(*_map(args, cast), **{k: _map(v, cast) for k, v in kwargs.items()})

    autocast_kernel.__qualname__ = f"autocast_{policy}[{op}]"
    return autocast_kernel


def _overload(name: str):
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return None if packet is None else getattr(packet, overload or "default", None)


_LIBRARIES: list = []  # (kept: a torch.library.Library unregisters when collected)
KERNELS: dict[str, Any] = {}  # overload name -> its kernel (for Dynamo's list of untraced frames)


def _install() -> None:
    if _LIBRARIES:
        return
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(torch.library.fallthrough_kernel, KEY)
    listed = torch.library.Library("aten", "IMPL")
    for name, policy in POLICIES.items():
        op = _overload(name)
        if op is None:  # (an overload this torch does not have)
            continue
        KERNELS[name] = _kernel(op, policy)
        listed.impl(name, KERNELS[name], KEY)
    _LIBRARIES.extend([everything, listed])
    if not hasattr(torch.clear_autocast_cache, "_shardtensor_wraps"):
        torch.clear_autocast_cache = _also_clear_device_casts(torch.clear_autocast_cache)


def autocast(
    dtype: torch.dtype | None = torch.bfloat16, *, enabled: bool = True, cache_enabled: bool | None = None
) -> torch.autocast:
    """``torch.autocast`` for the device, bfloat16 unless told (PyTorch/XLA's ``autocast('xla')``;
    ``torch.autocast(st.device().type, ...)`` is the same, with torch's default dtype, float16).

    Example::

        with st.autocast():                       # torch.autocast("shardtensor", dtype=torch.bfloat16)
            loss = loss_fn(model(x), y)
    """
    return torch.autocast(torch_device.BACKEND, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


_install()
