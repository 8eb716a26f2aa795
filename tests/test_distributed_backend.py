"""torch.distributed on shardtensor: the "shardtensor" backend (``dist.init_process_group("shardtensor")``),
torch.distributed's collectives and the functional collectives on device tensors, CPU tensors through
gloo in the same group, and DistributedDataParallel — in one real 2-process job (`st.launch`, 2 devices
each) checked against each collective's definition, plus single-process checks (world size 1)."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.nn.parallel import DistributedDataParallel

import shardtensor as st
from _distributed_backend_worker import WORLD, int_value, model_and_batch, value, work


def _reduced(reduce):
    return reduce(torch.stack([value(r) for r in range(WORLD)]))


def _check_the_group_is_the_jobs_processes(job):
    assert [(r["rank"], r["world"], r["backend"]) for r in job] == [(0, 2, "shardtensor"), (1, 2, "shardtensor")]
    # st.launch sets torchrun's variables (env:// needs them)
    for index, r in enumerate(job):
        assert r["env"] == {"RANK": str(index), "WORLD_SIZE": "2", "LOCAL_RANK": str(index), "LOCAL_WORLD_SIZE": "2"}


def _check_all_reduce_with_every_reduce_op(job):
    ints = torch.stack([int_value(r) for r in range(WORLD)])
    expected = {
        "SUM": _reduced(lambda s: s.sum(0)),
        "AVG": _reduced(lambda s: s.mean(0)),
        "MAX": _reduced(lambda s: s.amax(0)),
        "MIN": _reduced(lambda s: s.amin(0)),
        "PRODUCT": _reduced(lambda s: s.prod(0)),
        "BAND": ints[0] & ints[1],
        "BOR": ints[0] | ints[1],
        "BXOR": ints[0] ^ ints[1],
    }
    for r in job:
        for op, want in expected.items():
            torch.testing.assert_close(r[f"all_reduce_{op}"], want, msg=op)
        torch.testing.assert_close(r["async"], expected["SUM"])  # async_op=True: wait() works


def _check_the_other_collectives_follow_their_definitions(job):
    values = [value(r) for r in range(WORLD)]
    total = sum(values)
    for rank, r in enumerate(job):
        torch.testing.assert_close(r["broadcast"], values[1])
        torch.testing.assert_close(r["broadcast_everyone"], values[1])  # a new group of every process
        for got, want in zip(r["all_gather"], values, strict=True):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(r["all_gather_single"], torch.cat(values))
        torch.testing.assert_close(r["reduce_scatter_single"], total.chunk(WORLD)[rank])
        # reduce_scatter (list): input i of every process, reduced, goes to process i
        torch.testing.assert_close(r["reduce_scatter_max"], torch.stack([v[:, rank] * 2 for v in values]).amax(0))
        # all_to_all: input i of process j becomes output j of process i
        for j, got in enumerate(r["all_to_all"]):
            torch.testing.assert_close(got, values[j] + 100 * rank)
        torch.testing.assert_close(r["coalesced"][0], torch.cat(values))
        torch.testing.assert_close(r["coalesced"][1], torch.cat(values) * 3)
        torch.testing.assert_close(r["coalesced"][2], total.chunk(WORLD)[rank])
        torch.testing.assert_close(r["coalesced"][3], total)
        torch.testing.assert_close(r["coalesced"][4], total * 2)
        # all_to_all_single: part j of process i's input becomes part i of process j's output
        torch.testing.assert_close(r["all_to_all_single"], torch.cat([v.chunk(WORLD)[rank] for v in values]))

    torch.testing.assert_close(job[0]["reduce_min"], torch.stack(values).amin(0))  # reduce: at dst


def _check_cpu_tensors_go_through_gloo_in_the_same_group(job):
    for r in job:
        torch.testing.assert_close(r["cpu_all_reduce"], sum(value(i) for i in range(WORLD)))
        for got, want in zip(r["cpu_all_gather"], [value(i) for i in range(WORLD)], strict=True):
            torch.testing.assert_close(got, want)


def _check_what_the_program_cannot_express_raises_clearly(job):
    for r in job:
        for key in ("send_error", "recv_error"):
            assert r[key].startswith("NotImplementedError") and "collective_permute" in r[key], r[key]
        assert "only equal splits" in r["unequal_error"], r["unequal_error"]
        assert "dist.gather on shardtensor tensors: only the root" in r["gather_error"], r["gather_error"]
    for r in job:  # arguments that differ between the processes: each process names what each one passed
        shape, dtype, op = r["shape_mismatch_error"], r["dtype_mismatch_error"], r["op_mismatch_error"]
        assert shape.startswith("ValueError: dist.all_reduce: the processes passed different tensors"), shape
        assert "process 0: dist.all_reduce((2,) torch.float32" in shape and "process 1: dist.all_reduce((3,)" in shape
        assert dtype.startswith("ValueError") and "torch.float32" in dtype and "torch.float64" in dtype, dtype
        assert op.startswith("ValueError") and "'sum'" in op and "'max'" in op, op
    error = job[0]["subgroup_error"]
    assert "ranks [0], which is not every one of the 2 processes" in error and "same program" in error, error


def _check_functional_collectives_stay_in_the_steps_one_program(job):
    a = 2 * sum(value(i) for i in range(WORLD))
    for r in job:
        # all_reduce -> all_gather -> reduce_scatter(avg) -> all_to_all -> broadcast(1): see the worker
        torch.testing.assert_close(r["functional"], torch.cat([a[2:4], a[2:4]]))
        assert r["functional_programs"] == 1
    values = [value(i) for i in range(WORLD)]
    stacked, total = torch.stack(values), sum(values)
    for rank, r in enumerate(job):
        want = [stacked.amax(0), values[1] * 3, stacked.amin(0), stacked.amin(0) * 2, total + 2]
        want += [torch.cat(values), torch.cat(values) * 2, total.chunk(WORLD)[rank], (total * 2).chunk(WORLD)[rank]]
        for i, (got, expected) in enumerate(zip(r["functional_raw"], want, strict=True)):
            torch.testing.assert_close(got, expected, msg=str(i))


def _check_ddp_trains_like_eager_torch_on_the_whole_batch(job):
    model, batches = model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    rows = 8 // WORLD
    losses = []
    for x, y in batches:
        out = model(x)
        losses.append(
            [
                torch.nn.functional.mse_loss(out[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows])
                for i in range(WORLD)
            ]
        )
        torch.nn.functional.mse_loss(out, y).backward()
        opt.step()
        opt.zero_grad()
    for rank, r in enumerate(job):
        torch.testing.assert_close(r["ddp_losses"], torch.stack([step[rank] for step in losses]).detach())
        for name, want in model.state_dict().items():
            torch.testing.assert_close(r["ddp_params"][name], want, msg=name)


def test_one_job_of_two_processes():
    """One job (several tests would each start one under xdist): every check on its reports."""
    job = st.launch(work, nprocs=WORLD, devices_per_process=2)
    _check_the_group_is_the_jobs_processes(job)
    _check_all_reduce_with_every_reduce_op(job)
    _check_the_other_collectives_follow_their_definitions(job)
    _check_cpu_tensors_go_through_gloo_in_the_same_group(job)
    _check_what_the_program_cannot_express_raises_clearly(job)
    _check_functional_collectives_stay_in_the_steps_one_program(job)
    _check_ddp_trains_like_eager_torch_on_the_whole_batch(job)


# --------------------------------------------------------------------------- one process


@pytest.fixture
def world_of_one():
    dist.init_process_group("shardtensor", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_rank_that_is_not_the_process_is_refused():
    with pytest.raises(RuntimeError, match=r"rank 1 of world size 2, but this process is process 0 of 1"):
        dist.init_process_group("shardtensor", store=dist.HashStore(), rank=1, world_size=2)
    assert not dist.is_initialized()


def test_collectives_in_a_world_of_one_in_compiled_functions(world_of_one):
    x = torch.arange(6.0).reshape(3, 2)

    def step(t):
        a = funcol.all_reduce(t * 2, "sum", world_of_one)
        return funcol.all_gather_single(a + 1, 0, world_of_one) - funcol.broadcast(t, 0, world_of_one)

    torch.testing.assert_close(st.compile(step)(x.to(st.device())).cpu(), x + 1)
    torch.testing.assert_close(torch.compile(step, backend="shardtensor")(x.to(st.device())).cpu(), x + 1)
    # the autograd forms (tensor parallelism's) record their backward
    w = x.to(st.device()).requires_grad_()
    (funcol.all_gather_single_autograd(w * 2, 0, world_of_one) * w.detach()).sum().backward()
    torch.testing.assert_close(w.grad.cpu(), x * 2)
    t = x.to(st.device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    torch.testing.assert_close(t.cpu(), x)
    with pytest.raises(NotImplementedError, match="premul_sum"):
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))


def test_a_gloo_group_takes_device_tensors_too():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.arange(4.0).to(st.device())
        dist.all_gather_single(out := torch.zeros(4).to(st.device()), t * 3)
        torch.testing.assert_close(out.cpu(), torch.arange(4.0) * 3)
    finally:
        dist.destroy_process_group()


def test_ddp_in_a_world_of_one_matches_eager(world_of_one):
    model, batches = model_and_batch()
    ddp = DistributedDataParallel(model.to(st.device()))
    reference, _ = model_and_batch()
    for m in (ddp, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.2)
        for x, y in batches[:2]:
            device = st.device() if m is ddp else "cpu"
            torch.nn.functional.mse_loss(m(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
    for (name, got), want in zip(ddp.module.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got.cpu(), want, msg=name)
