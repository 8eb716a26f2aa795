"""What tests/test_distributed_backend.py runs in each process of an `st.launch` job: torch.distributed
with the "shardtensor" backend — every collective on device tensors whose value differs per process,
CPU tensors through gloo in the same group, the errors, functional collectives in one lazy program,
and DDP training. Returns CPU tensors and error texts; the test checks them against the definitions."""

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.nn.parallel import DistributedDataParallel

import shardtensor as st

WORLD = 2


def value(rank: int) -> torch.Tensor:
    """This rank's value of the tensor the collectives combine: (4, 2), different on every rank."""
    return torch.arange(8.0).reshape(4, 2) * (rank + 1) + 0.5 * rank - 3


def int_value(rank: int) -> torch.Tensor:
    return torch.tensor([0b0110, 0b1011, 7, -2]) + rank * torch.tensor([1, 4, 3, 5])


def model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 — the text goes back to the test
        return f"{type(e).__name__}: {e}"
    return None


def _dev(t):
    return t.to(st.device())


def _collectives(rank: int, world: int, out: dict) -> None:
    """Every collective of torch.distributed, on device tensors (recorded, then run as one program)
    and on CPU tensors (gloo); ``out`` gets the tensors they wrote."""
    x = value(rank)
    for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        t = _dev(x)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce_{op}"] = t
    for op in ("BAND", "BOR", "BXOR"):
        t = _dev(int_value(rank))
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce_{op}"] = t
    t = _dev(x)
    work = dist.all_reduce(t, async_op=True)
    assert work.wait() is True
    out["async"] = t
    t = _dev(x)
    dist.broadcast(t, src=1)
    out["broadcast"] = t
    gathered = [_dev(torch.zeros(4, 2)) for _ in range(world)]
    dist.all_gather(gathered, _dev(x))
    out["all_gather"] = gathered
    t = _dev(torch.zeros(4 * world, 2))
    dist.all_gather_single(t, _dev(x))
    out["all_gather_single"] = t
    t = _dev(torch.zeros(4 // world, 2))
    dist.reduce_scatter_single(t, _dev(x))
    out["reduce_scatter_single"] = t
    t = _dev(torch.zeros(4))
    dist.reduce_scatter(t, [_dev(x[:, 0] * 2), _dev(x[:, 1] * 2)][:world], op=dist.ReduceOp.MAX)
    out["reduce_scatter_max"] = t
    t = _dev(torch.zeros(4, 2))
    dist.all_to_all_single(t, _dev(x))
    out["all_to_all_single"] = t
    received = [_dev(torch.zeros(4, 2)) for _ in range(world)]
    dist.all_to_all(received, [_dev(x + 100 * i) for i in range(world)])
    out["all_to_all"] = received
    a, b = _dev(torch.zeros(4 * world, 2)), _dev(torch.zeros(4 * world, 2))
    c, d, e = _dev(torch.zeros(4 // world, 2)), _dev(x), _dev(x * 2)
    with dist._coalescing_manager():
        dist.all_gather_single(a, _dev(x))
        dist.all_gather_single(b, _dev(x * 3))
    with dist._coalescing_manager():
        dist.reduce_scatter_single(c, _dev(x))
    with dist._coalescing_manager():
        dist.all_reduce(d)
        dist.all_reduce(e)
    out["coalesced"] = [a, b, c, d, e]
    t = _dev(x)
    dist.reduce(t, dst=0, op=dist.ReduceOp.MIN)
    out["reduce_min"] = t  # kept (and read) on every process: each must run the same program
    st.sync()  # every collective above in one program
    dist.barrier()  # gloo, on a CPU tensor
    dist.barrier(device_ids=[0])  # on a device tensor: a program of its own
    # another group of every process (torch sorts its ranks: group rank i is process i)
    everyone = dist.new_group([1, 0])
    t = _dev(x)
    dist.broadcast(t, group=everyone, group_src=1)
    out["broadcast_everyone"] = t
    # CPU tensors in the same group: gloo
    c = x.clone()
    dist.all_reduce(c)
    out["cpu_all_reduce"] = c
    cpu_gathered = [torch.zeros(4, 2) for _ in range(world)]
    dist.all_gather(cpu_gathered, x)
    out["cpu_all_gather"] = cpu_gathered


def _errors(rank: int, out: dict) -> None:
    t = _dev(value(rank))
    out["send_error"] = _error(lambda: dist.send(t, dst=1 - rank))
    out["recv_error"] = _error(lambda: dist.recv(t, src=1 - rank))
    out["unequal_error"] = _error(
        lambda: dist.all_to_all_single(t, t, output_split_sizes=[1, 3], input_split_sizes=[3, 1])
    )
    gathered = [_dev(torch.zeros(4, 2)) for _ in range(2)] if rank == 0 else None
    out["gather_error"] = _error(lambda: dist.gather(t, gathered, dst=0))
    # arguments that differ between the processes: refused in every process before anything is recorded
    out["shape_mismatch_error"] = _error(lambda: dist.all_reduce(_dev(torch.ones(2 + rank))))
    wide = torch.float32 if rank == 0 else torch.float64
    out["dtype_mismatch_error"] = _error(
        lambda: funcol.all_reduce(_dev(torch.ones(2, dtype=wide)), "sum", dist.group.WORLD)
    )
    op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
    out["op_mismatch_error"] = _error(lambda: dist.all_reduce(_dev(torch.ones(2)), op=op))
    alone = dist.new_group([0])  # every process calls new_group; only process 0 is in it
    if rank == 0:
        out["subgroup_error"] = _error(lambda: dist.all_reduce(t, group=alone))


def _functional_in_one_program(rank: int, out: dict) -> None:
    x = _dev(value(rank))
    st.sync()
    st.clear_counters()
    group = dist.group.WORLD
    a = funcol.all_reduce(x * 2, "sum", group)
    b = funcol.all_gather_single(a + 1, 0, group)
    c = funcol.reduce_scatter_single(b, "avg", 0, group)
    d = funcol.all_to_all_single(c, None, None, group)
    e = funcol.broadcast(d, 1, group)
    # the raw ops (in place, coalesced), by group name
    fc, name = torch.ops._c10d_functional, group.group_name
    f = x + 0
    fc.wait_tensor(fc.all_reduce_(f, "max", name))
    g = x * 3
    fc.wait_tensor(fc.broadcast_(g, 1, name))
    coalesced = fc.all_reduce_coalesced([x, x * 2], "min", name)
    coalesced += fc.all_reduce_coalesced_([x + 1], "sum", name)
    coalesced += fc.all_gather_into_tensor_coalesced([x, x * 2], WORLD, name)
    coalesced += fc.reduce_scatter_tensor_coalesced([x, x * 2], "sum", WORLD, name)
    out["functional"] = (e - 1).cpu()
    out["functional_raw"] = [t.cpu() for t in (f, g, *map(fc.wait_tensor, coalesced))]
    out["functional_programs"] = st.counter_value("ExecuteReplicated")


def _ddp(rank: int, world: int, out: dict) -> None:
    model, batches = model_and_batch()
    ddp = DistributedDataParallel(model.to(st.device()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.5)
    rows = 8 // world
    losses = []
    for x, y in batches:
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        loss = torch.nn.functional.mse_loss(ddp(_dev(x)), _dev(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    out["ddp_losses"] = torch.stack(losses).cpu()
    out["ddp_params"] = {k: v.cpu() for k, v in ddp.module.state_dict().items()}


def work(index: int) -> dict:
    dist.init_process_group("shardtensor")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "world": world, "backend": dist.get_backend()}
    out["env"] = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    results: dict = {}
    _collectives(rank, world, results)
    out |= {k: [t.cpu() for t in v] if isinstance(v, list) else v.cpu() for k, v in results.items()}
    _errors(rank, out)
    _functional_in_one_program(rank, out)
    _ddp(rank, world, out)
    dist.destroy_process_group()
    return out
