"""The declared special handlers: ops that need host values (``.item()``, ``equal``, torch's error
checks), have data-dependent shapes (``nonzero``, boolean masks), move data between devices, keep a
sharding annotation (``clone``, ``*_like``), or update state their schema does not declare
(``native_batch_norm``'s running statistics).
"""

from __future__ import annotations

import torch

from shardtensor.dispatch import param_moves
from shardtensor.dispatch.mutation import mutating_op
from shardtensor.dispatch.record import record_and_wrap
from shardtensor.dispatch.table import special
from shardtensor.dtypes import torch_to_numpy
from shardtensor.graph import views
from shardtensor.graph.execute import run_cells
from shardtensor.graph.ir import Failed
from shardtensor.graph.state import STATE, check_execution_allowed, set_concrete
from shardtensor.ops.schema import facts
from shardtensor.tensor import ShardedTensor
from shardtensor.tensor import device as torch_device
from shardtensor.tensor.readback import to_cpu
from shardtensor.tensor.upload import Upload, upload_as, upload_like, upload_replicated
from shardtensor.trees import map_leaves

aten = torch.ops.aten
_SPARSE_CONVERSIONS = ("_to_sparse", "_to_sparse_csr", "_to_sparse_csc", "_to_sparse_bsr", "_to_sparse_bsc")


@special(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    t = args[0]
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        out = to_cpu(t)
        dtype = kwargs.get("dtype")
        return out.to(dtype) if dtype is not None else out
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory", "non_blocking")}
    if kwargs.get("dtype") in (None, t.dtype) and kwargs.get("memory_format") is None:
        return _keep_sharding(t, record_and_wrap(aten.clone.default, (t,), {}))
    kwargs.pop("memory_format", None)
    # .to(dtype) keeps the sharding (model.to(torch.bfloat16) must not un-shard the parameters)
    return _keep_sharding(t, record_and_wrap(aten._to_copy.default, (t,), kwargs))


@special(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, ShardedTensor) and dst.device.type == "cpu":
        # cpu_tensor.copy_(device_tensor): read the value back and let torch's CPU kernel write it
        # (through dst's view, converting the dtype, broadcasting), as a copy from CUDA does
        return func(dst, to_cpu(src), **kwargs)
    if isinstance(src, torch.Tensor) and not isinstance(src, ShardedTensor):
        param_moves.note_move(dst, src)
        host_src = src.to(dst.dtype).expand(dst.shape)
        if _whole_overwrite_in_eager_mode(dst):
            # (``cpu_tensor.to(st.device())`` is an empty tensor, then this copy): the upload, in the
            # layout dst's value has, becomes that value; no program to compile and run for the copy
            return _take_upload(dst, host_src)
        how = Upload.like(dst, dst.dtype, tuple(dst.shape))
        uploaded = how.tensor(src)
        if STATE.trace_uploads is not None:  # (an st.compile trace: a replay uploads an argument again)
            STATE.trace_uploads.append((src, how, uploaded._cell))
        src = uploaded
    if isinstance(src, ShardedTensor) and not dst._chain and isinstance(dst._cell.value, Failed):
        return _replace_lost_value(dst, src)
    return mutating_op(func, facts(func), (dst, src), {})


def _whole_overwrite_in_eager_mode(dst) -> bool:
    """Eager mode, not traced, and ``dst`` is a whole tensor (no view chain) with a computed value or
    a sharding spec: a copy into it can simply replace its value."""
    if not STATE.eager or STATE.tracing or dst._chain:
        return False
    cell = dst._cell
    return cell.sharding is not None or hasattr(cell.value, "sharding")


def _take_upload(dst, host_src):
    """``dst``'s value becomes the upload of ``host_src``, in the layout its value has (its spec's,
    padded alike, or the sharding of its current array)."""
    cell = dst._cell
    if cell.sharding is not None:
        array = upload_like(host_src, dst)._cell.value
    else:
        array = upload_as(torch_to_numpy(host_src.contiguous()), cell.value.sharding)
    set_concrete(cell, array, owned=True)
    return dst


def _replace_lost_value(dst, src):
    """``dst.copy_(src)`` where ``dst``'s value was lost (its program failed, e.g. after consuming
    it): the copy replaces all of it without reading it, so restoring from a checkpoint
    (``load_state_dict``) works."""
    if src.dtype != dst.dtype:
        src = src.to(dst.dtype)
    if tuple(src.shape) != tuple(dst.shape):
        src = src.expand(dst.shape)
    views.write(dst, views.read(src))
    if STATE.eager:
        run_cells([dst._cell])
    return dst


@special(aten._local_scalar_dense.default)
def _local_scalar_dense(func, args, kwargs):
    return to_cpu(args[0]).item()


@special(aten.equal.default)
def _equal(func, args, kwargs):
    a, b = args
    if a.shape != b.shape:
        return False
    return bool(to_cpu(aten.eq.Tensor(a, b).all()).item())


@special(aten.is_nonzero.default)
def _is_nonzero(func, args, kwargs):
    return bool(to_cpu(args[0]).item())


@special(aten.allclose.default)
def _allclose(func, args, kwargs):
    """A Python bool: the values are needed on the host (as for ``equal``)."""
    return bool(to_cpu(aten.isclose.default(*args, **kwargs).all()).item())


@special(
    *(
        getattr(getattr(aten, name), o)
        for name in _SPARSE_CONVERSIONS
        if hasattr(aten, name)
        for o in getattr(aten, name).overloads()
    )
)
def _sparse(func, args, kwargs):
    layout = kwargs.get("layout") or {
        "_to_sparse_csr": "torch.sparse_csr",
        "_to_sparse_csc": "torch.sparse_csc",
        "_to_sparse_bsr": "torch.sparse_bsr",
        "_to_sparse_bsc": "torch.sparse_bsc",
    }.get(func._schema.name.split("::")[1], "torch.sparse_coo")
    raise NotImplementedError(
        f"{func}: shardtensor holds dense (torch.strided) tensors only; a tensor of layout {layout} cannot live "
        "on st.device(). Convert on the host instead, e.g. t.cpu().to_sparse()"
    )


@special(aten._linalg_check_errors.default)
def _linalg_check_errors(func, args, kwargs):
    """``_linalg_check_errors(info, api_name, is_matrix)`` raises torch's error when a factorization
    failed (a singular matrix for inv/solve, not positive-definite for cholesky). It needs the values
    of ``info``: like torch on CUDA, read them (a sync) and run torch's own check on the host, so the
    messages are torch's. The ``*_ex`` variants skip the check and do not sync."""
    check_execution_allowed(
        f"{args[1]} checks its result for errors; use the *_ex variant "
        "(e.g. torch.linalg.inv_ex) to keep the program whole"
    )
    return func(to_cpu(args[0]), *args[1:], **kwargs)


@special(aten._linalg_det.default, aten._linalg_slogdet.default)
def _det_factors(func, args, kwargs):
    """``_linalg_det`` / ``_linalg_slogdet`` also return LU factors, which backward reads as factors of
    A^T when A is contiguous and real (torch's CPU kernel factors the column-major view) and of A
    otherwise. The lowering always factors its input's transpose, so a non-contiguous A goes in as
    the contiguous values of A^T: the same determinant, and the factors of A that backward expects."""
    a = args[0]
    if isinstance(a, ShardedTensor) and not a.is_contiguous() and not a.is_complex():
        args = (a.mT.contiguous(), *args[1:])
    return record_and_wrap(func, args, kwargs)


@special(aten._ctc_loss.Tensor)
def _ctc_loss_tensor(func, args, kwargs):
    """``_ctc_loss.Tensor`` takes the lengths as tensors, and its output shape depends on their values
    (torch has no meta kernel for it): read them on the host and record ``_ctc_loss.default``."""
    bound = facts(func).bind(args, kwargs)
    check_execution_allowed("ctc_loss with tensor lengths needs their values")
    for name in ("input_lengths", "target_lengths"):
        v = bound[name]
        bound[name] = (to_cpu(v) if isinstance(v, ShardedTensor) else v).tolist()
    return record_and_wrap(aten._ctc_loss.default, (), bound)


@special(aten._fused_sdp_choice.default)
def _sdp_choice(func, args, kwargs):
    return 0  # SDPBackend.math: attention decomposes into ops we lower


@special(
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
    aten.bincount.default,
)
def _data_dependent(func, args, kwargs):
    """Ops whose output shape depends on values (nonzero, masked_select, unique...): they need the
    values anyway, so run torch's own kernel on the host and upload the (replicated) result."""
    check_execution_allowed(f"{func} has a data-dependent output shape")

    def host(v):
        if isinstance(v, ShardedTensor):
            return to_cpu(v)
        if isinstance(v, torch.device) and v.type != "cpu":
            return torch.device("cpu")
        return v

    host_args, host_kwargs = map_leaves(host, (args, kwargs))
    out = func(*host_args, **host_kwargs)
    upload = upload_replicated

    if isinstance(out, torch.Tensor):
        return upload(out)
    return type(out)(upload(o) if isinstance(o, torch.Tensor) else o for o in out)


def _on_device(i):
    """CPU index tensors are allowed with device tensors (as with CUDA): upload them."""
    if isinstance(i, torch.Tensor) and not isinstance(i, ShardedTensor):
        return i.to(torch_device.device())
    return i


@special(aten.index.Tensor)
def _index(func, args, kwargs):
    x, indices = args[0], [_on_device(i) for i in args[1]]
    if any(isinstance(i, ShardedTensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        check_execution_allowed("boolean-mask indexing has a data-dependent shape")
        expanded = []
        for i in indices:
            if isinstance(i, ShardedTensor) and i.dtype in (torch.bool, torch.uint8):
                expanded.extend(aten.nonzero.default(i).unbind(1))
            else:
                expanded.append(i)
        indices = expanded
    return record_and_wrap(func, (x, indices), kwargs)


@special(aten.one_hot.default)
def _one_hot(func, args, kwargs):
    """``F.one_hot(x)`` without ``num_classes`` reads the largest class from the data, as torch does."""
    x, num_classes = args[0], (args[1] if len(args) > 1 else kwargs.get("num_classes", -1))
    if num_classes == -1:
        if x.numel() == 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        num_classes = int(x.max().item()) + 1
    return record_and_wrap(func, (x, num_classes), {})


@special(
    aten.clone.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
)
def _same_sharding(func, args, kwargs):
    """``clone`` and ``*_like`` keep the sharding annotation of their source (as in PyTorch/XLA and
    DTensor), so e.g. optimizer state is laid out like its parameter."""
    return _keep_sharding(args[0], record_and_wrap(func, args, kwargs))


def _keep_sharding(src, out):
    """``out`` annotated with ``src``'s sharding, when ``src`` has one of its own (not a view)."""
    if src._cell.spec is not None and not src._chain and isinstance(out, ShardedTensor):
        out._cell.sharding = src._cell.sharding
    return out


@special(aten.index_put.default, aten.index_put_.default)
def _index_put(func, args, kwargs):
    """``x[mask] = v``: a scalar value becomes ``where`` (no data-dependent shape); otherwise the
    masks become index tensors (which needs their values)."""
    bound = facts(func).bind(args, kwargs)
    x, indices, values = bound["self"], [_on_device(i) for i in bound["indices"]], bound["values"]
    bound["indices"] = indices
    accumulate = bound.get("accumulate", False)
    masks = [i for i in indices if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    if not masks:
        args, kwargs = tuple(bound[n] for n in facts(func).arg_names if n in bound), {}
        return (
            record_and_wrap(func, args, kwargs)
            if not facts(func).mutated
            else mutating_op(func, facts(func), args, kwargs)
        )
    inplace = bool(facts(func).mutated)
    if (
        len(indices) == 1
        and values.numel() == 1
        and not accumulate
        and tuple(masks[0].shape) == tuple(x.shape[: masks[0].dim()])
    ):
        mask = masks[0].bool().reshape(tuple(masks[0].shape) + (1,) * (x.dim() - masks[0].dim()))
        result = aten.where.self(mask, values.reshape(()).to(x.dtype), x)
    else:
        check_execution_allowed("indexing with a boolean mask has a data-dependent shape")
        expanded = []
        for i in indices:
            if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                expanded.extend(aten.nonzero.default(i).unbind(1))
            else:
                expanded.append(i)
        result = aten.index_put.default(x, expanded, values, accumulate)
    if inplace:
        return x.copy_(result)
    return result


@special(aten.native_batch_norm.default)
def _native_batch_norm(func, args, kwargs):
    """``native_batch_norm`` updates the running statistics in training although its schema does not
    say so: run the functional form and write the new statistics back."""
    bound = facts(func).bind(args, kwargs)
    rm, rv = bound["running_mean"], bound["running_var"]
    if not bound["training"] or rm is None or rv is None:
        return record_and_wrap(func, args, kwargs)
    out, mean, rstd, new_rm, new_rv = record_and_wrap(aten._native_batch_norm_legit_functional.default, args, kwargs)
    for target, value in ((rm, new_rm), (rv, new_rv)):
        views.write(target, views.read(value))
    if STATE.eager:
        run_cells([rm._cell, rv._cell])
    return out, mean, rstd


def _split_points_on_host(x, points, dim):
    """``tensor_split(x, points, dim)`` with the split points read back to the host: torch's kernel
    requires them on the CPU (it reads them), so a device tensor is read back as CUDA's would be."""
    if isinstance(points, ShardedTensor):
        check_execution_allowed("tensor_split with a device tensor of split points needs their values")
        points = to_cpu(points)
    # torch's own checks and messages (dtype, dims), on a stand-in without data
    aten.tensor_split.tensor_indices_or_sections(torch.empty(x.shape, device="meta"), points, dim)
    if points.dim() == 0:
        return aten.tensor_split.sections(x, int(points), dim)
    return aten.tensor_split.indices(x, points.tolist(), dim)


@special(aten.tensor_split.tensor_indices_or_sections)
def _tensor_split_by_tensor(func, args, kwargs):
    """Reached without autograd (inference mode); with autograd, the kernel below runs first."""
    bound = facts(func).bind(args, kwargs)
    return _split_points_on_host(bound["self"], bound["tensor_indices_or_sections"], bound.get("dim", 0))


def _tensor_split_autograd_kernel(x, points, dim=0):
    # tensor_split is a composite op, decomposed (with its device check) above __torch_dispatch__: a
    # kernel for the autograd key of st.device() reads the points first; the ops it decomposes into
    # (slices) record their own backward
    return _split_points_on_host(x, points, dim)


@special(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    """Only CPU tensors can be pinned (DCP, DataLoader and others ask)."""
    return False


@special(aten._pin_memory.default)
def _pin_memory(func, args, kwargs):
    """torch's error for pinning a tensor that is not on the CPU (``t.pin_memory()`` on CUDA raises it)."""
    raise RuntimeError(f"cannot pin '{args[0].type()}' only dense CPU tensors can be pinned")


_AUTOGRAD_LIB = torch.library.Library("aten", "IMPL")  # kept: the registration lasts as long as it
_AUTOGRAD_LIB.impl("tensor_split.tensor_indices_or_sections", _tensor_split_autograd_kernel, "AutogradPrivateUse1")
