"""PyTorch/XLA's collectives across processes (`st.all_reduce`, ...) and data parallelism
(`st.optimizer_step`): a 4-process x 1-device job and a 2-process x 4-device job through `st.launch`,
compared with the collectives' definitions on each process's value and with eager torch training on
the whole batch; then the API in a job of one process, and its argument errors."""

import functools

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from _data_parallel_worker import (
    CASES,
    COMPILED_STEPS,
    PAIRS,
    STEPS,
    STRIDED,
    data_parallel_job,
    global_batch,
    make_model,
    make_optimizer,
    two_hosts_job,
    value,
)

N = 4
REDUCE = {
    st.REDUCE_SUM: lambda xs: functools.reduce(torch.add, xs),
    st.REDUCE_MUL: lambda xs: functools.reduce(torch.mul, xs),
    st.REDUCE_MIN: lambda xs: functools.reduce(torch.minimum, xs),
    st.REDUCE_MAX: lambda xs: functools.reduce(torch.maximum, xs),
    st.REDUCE_AND: lambda xs: functools.reduce(torch.bitwise_and, xs),
    st.REDUCE_OR: lambda xs: functools.reduce(torch.bitwise_or, xs),
    torch.distributed.ReduceOp.AVG: lambda xs: sum(xs) / len(xs),
    torch.distributed.ReduceOp.BXOR: lambda xs: functools.reduce(torch.bitwise_xor, xs),
}


def _group(index, groups, n=N):
    return next(row for row in (groups or [list(range(n))]) if index in row)


def _scaled(t, scale):
    return t if scale == 1.0 else t * scale


def expected(fn, kind, args, index, n=N):
    """What process ``index`` should get, from the collective's definition."""
    row = _group(index, args.get("groups"), n)
    values = [value(kind, p) for p in row]
    me = row.index(index)
    if fn == "all_reduce":
        return _scaled(REDUCE[args["reduce_type"]](values), args.get("scale", 1.0))
    if fn == "all_gather":
        return torch.cat(values, args["dim"])
    if fn == "reduce_scatter":
        reduced = _scaled(REDUCE[args["reduce_type"]](values), args["scale"])
        return reduced.chunk(len(row), args["scatter_dim"])[me]
    if fn == "all_to_all":
        parts = [v.chunk(len(row), args["split_dimension"])[me] for v in values]
        return torch.cat(parts, args["concat_dimension"])
    sources = [s for s, t in args["pairs"] if t == index]
    return value(kind, sources[0]) if sources else torch.zeros_like(value(kind, index))


def eager_training(steps):
    """The parameters after eager torch training on the whole batch (mean loss)."""
    model = make_model()
    opt = make_optimizer(model)
    for x, y in global_batch(steps):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]


def assert_params(got, want):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def four_processes():
    return st.launch(data_parallel_job, nprocs=N, devices_per_process=1)


def test_optimizer_step_trains_like_eager_torch_on_the_whole_batch(four_processes):
    trained, compiled = eager_training(STEPS), eager_training(COMPILED_STEPS)
    for r in four_processes:
        assert_params(r["trained"], trained)
        assert_params(r["compiled"], compiled)
        # st.compile of a step with optimizer_step freezes: its last call replays without Python
        assert r["frozen"] >= 1 and r["replayed"] >= 1, (r["frozen"], r["replayed"])


def test_every_collective_matches_its_definition_on_each_process_value(four_processes):
    for index, r in enumerate(four_processes):
        got = r["collectives"]
        for name, fn, kind, args in CASES:
            torch.testing.assert_close(got[name], expected(fn, kind, args, index), rtol=1e-6, atol=0, msg=name)
        # a list is reduced in place (and returned); output= is written (and returned)
        assert got["list is returned"] and got["output is returned"]
        sums = [
            expected("all_reduce", k, {"reduce_type": st.REDUCE_SUM, "groups": STRIDED}, index)
            for k in ("float", "int")
        ]
        torch.testing.assert_close(got["list 0"], sums[0])
        torch.testing.assert_close(got["list 1"], sums[1])
        torch.testing.assert_close(got["list 2"], 2 * sums[0])
        torch.testing.assert_close(got["list 3"], torch.full((1 << 18,), float(sum(_group(index, STRIDED)))))
        torch.testing.assert_close(
            got["all_gather output"], expected("all_gather", "float", {"dim": 0, "groups": PAIRS}, index)
        )
        scattered = expected("reduce_scatter", "float", {"reduce_type": "sum", "scale": 1.0, "scatter_dim": 0}, index)
        torch.testing.assert_close(got["reduce_scatter outputs"], torch.stack([scattered, 2 * scattered]))


def test_bad_arguments_in_a_job_of_four_processes(four_processes):
    errors = four_processes[0]["errors"]
    assert errors["missing"].startswith("ValueError: all_reduce: every group must have the same size, got sizes [2, 1]")
    assert "has repeated [1], missing [3] (this job has 4 processes)" in errors["uncovered"]
    assert "out of range [4], missing [3]" in errors["range"]
    assert "shard_count=4 must equal the number of processes in each group (2)" in errors["shard_count"]
    assert "split_count=2 must equal the number of processes in each group (4)" in errors["split_count"]
    assert errors["cpu"].startswith("RuntimeError: shardtensor.all_reduce on a CPU tensor in a job of several")
    assert "each process is the target of at most one pair" in errors["pairs"]


def test_two_processes_of_four_devices():
    results = st.launch(two_hosts_job, nprocs=2, devices_per_process=4)
    trained = eager_training(1)
    for index, r in enumerate(results):
        assert_params(r["trained"], trained)
        torch.testing.assert_close(r["own step"], torch.full((2,), -float(index)))  # groups of one: its own grad
        torch.testing.assert_close(r["sum"], value("float", 0) + value("float", 1))
        torch.testing.assert_close(r["gather"], torch.cat([value("float", 0), value("float", 1)], 1))
        # a tensor sharded over both processes has the same value in each: the sum is twice it
        torch.testing.assert_close(r["sharded sum"], 2 * torch.arange(16.0).reshape(8, 2))


# --------------------------------------------------------------------------- a job of one process


def test_one_process_collectives_are_the_identity_and_optimizer_step_is_a_plain_step():
    x = value("float", 0).to(st.device())
    torch.testing.assert_close(st.all_reduce(st.REDUCE_SUM, x, scale=2.0).cpu(), 2 * value("float", 0))
    torch.testing.assert_close(st.all_gather(x, -1, groups=[[0]]).cpu(), value("float", 0))
    torch.testing.assert_close(st.reduce_scatter(st.REDUCE_MAX, x, 1.0, 1, 1).cpu(), value("float", 0))
    torch.testing.assert_close(st.all_to_all(x, 0, 1, 1).cpu(), value("float", 0))
    torch.testing.assert_close(st.collective_permute(x, [[0, 0]]).cpu(), value("float", 0))
    torch.testing.assert_close(st.collective_permute(x, []).cpu(), torch.zeros(4, 2))
    cpu = [value("float", 0), value("int", 0)]
    assert st.all_reduce(torch.distributed.ReduceOp.SUM, cpu) is cpu  # CPU tensors too, alone
    torch.testing.assert_close(cpu[1], value("int", 0))

    model = make_model().to(st.device())
    opt = make_optimizer(model)
    for x, y in global_batch(STEPS):
        F.mse_loss(model(x.to(st.device())), y.to(st.device())).backward()
        marks = st.counter_value("MarkStep") or 0
        st.optimizer_step(opt, barrier=True)  # runs the step: st.sync()
        assert st.counter_value("MarkStep") == marks + 1
        opt.zero_grad(set_to_none=True)
    assert_params([p.detach().cpu() for p in model.parameters()], eager_training(STEPS))
    # alone, optimizer_step records no reduction: its step is the program of a plain opt.step()
    x, y = global_batch(1)[0]
    for step in (lambda: opt.step(), lambda: st.optimizer_step(opt)):
        F.mse_loss(model(x.to(st.device())), y.to(st.device())).backward()
        step()
        opt.zero_grad(set_to_none=True)
        compiles = st.counter_value("UncachedCompile") or 0
        st.sync()
    assert st.counter_value("UncachedCompile") == compiles


def test_bad_arguments_say_what_is_wrong():
    x = torch.ones(4, 2)
    with pytest.raises(ValueError, match="unknown reduce type 'add': use REDUCE_SUM"):
        st.all_reduce("add", x)
    with pytest.raises(TypeError, match="groups must be a list of lists of process indices .a partition of 0..0."):
        st.all_reduce(st.REDUCE_SUM, x, groups=[0])
    with pytest.raises(ValueError, match=r"has out of range \[1\]"):
        st.all_gather(x, groups=[[0, 1]])
    with pytest.raises(TypeError, match="scale=0.5 needs a floating-point tensor, got torch.int64"):
        st.all_reduce(st.REDUCE_SUM, torch.ones(2, dtype=torch.int64), scale=0.5)
    mixed = [torch.ones(2), torch.ones(2, dtype=torch.int64)]
    with pytest.raises(TypeError, match="scale=0.5 needs a floating-point tensor"):
        st.all_reduce(st.REDUCE_SUM, mixed, scale=0.5)
    assert mixed[0].tolist() == [1.0, 1.0]  # nothing changed
    with pytest.raises(IndexError, match=r"all_gather: dim=2 is out of range for a tensor of shape \(4, 2\)"):
        st.all_gather(x, 2)
    with pytest.raises(IndexError, match="0-dimensional tensor has no scatter_dim: reshape it to"):
        st.reduce_scatter(st.REDUCE_SUM, torch.tensor(1.0), 1.0, 0, 1)
    with pytest.raises(
        ValueError, match="output has shape .2, 2. and dtype torch.float32; the result has shape .4, 2."
    ):
        st.all_gather(x, output=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="shard_count=2 must equal the number of processes in each group .1."):
        st.reduce_scatter(st.REDUCE_SUM, x, 1.0, 0, 2)
    with pytest.raises(ValueError, match=r"pairs must be a list of \[source, target\] process indices in 0..0"):
        st.collective_permute(x, [[0, 1]])
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer, got list"):
        st.optimizer_step([x])
