"""What tests/test_data_parallel.py runs in each process of its `st.launch` jobs.

`data_parallel_job` (4 processes x 1 device): data-parallel training with `st.optimizer_step`
(lazy and `st.compile`), every `st.*` collective on per-process values (`CASES`, `value`), the
in-place and ``output=`` forms, and what bad arguments raise. `two_hosts_job` (2 processes x 4
devices): collectives and a training step on processes that each drive several devices. The test computes what each
should give from the definitions.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardtensor as st

PAIRS, STRIDED = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
STEPS, COMPILED_STEPS = 3, 4  # compiled: trace, trace, trace equal to the last (frozen), replay


def value(kind: str, index: int) -> torch.Tensor:
    """Process ``index``'s value of a tensor of kind 'float', 'int' or 'bool' (all (4, 2))."""
    if kind == "float":
        return ((torch.arange(8.0) - 3).reshape(4, 2) * (index + 1) + 0.25 * index) / 4
    if kind == "int":
        return (torch.arange(8).reshape(4, 2) * 3 + 5 * index + 1) % 16
    return (torch.arange(8).reshape(4, 2) + index) % 3 == 0


# (name, st function, kind of value, arguments after the value or before it for the reductions)
CASES = [
    *[
        (f"all_reduce {t} {kind} {g}", "all_reduce", kind, {"reduce_type": t, "groups": g})
        for t, kind in [
            (st.REDUCE_SUM, "float"),
            (st.REDUCE_MUL, "float"),
            (st.REDUCE_MIN, "float"),
            (st.REDUCE_MAX, "int"),
            (st.REDUCE_AND, "int"),
            (st.REDUCE_OR, "bool"),
            (st.REDUCE_AND, "bool"),
        ]
        for g in (None, PAIRS, STRIDED)
    ],
    ("all_reduce sum scale", "all_reduce", "float", {"reduce_type": st.REDUCE_SUM, "scale": 0.25, "groups": STRIDED}),
    ("all_reduce ReduceOp.AVG", "all_reduce", "float", {"reduce_type": torch.distributed.ReduceOp.AVG}),
    (
        "all_reduce ReduceOp.BXOR",
        "all_reduce",
        "int",
        {"reduce_type": torch.distributed.ReduceOp.BXOR, "groups": PAIRS},
    ),
    ("all_gather 0", "all_gather", "float", {"dim": 0}),
    ("all_gather -1 strided", "all_gather", "int", {"dim": -1, "groups": STRIDED}),
    (
        "reduce_scatter",
        "reduce_scatter",
        "float",
        {"reduce_type": st.REDUCE_SUM, "scale": 0.5, "scatter_dim": 0, "shard_count": 4},
    ),
    (
        "reduce_scatter max pairs",
        "reduce_scatter",
        "int",
        {"reduce_type": st.REDUCE_MAX, "scale": 1.0, "scatter_dim": 0, "shard_count": 2, "groups": PAIRS},
    ),
    ("all_to_all", "all_to_all", "float", {"split_dimension": 0, "concat_dimension": 1, "split_count": 4}),
    (
        "all_to_all strided",
        "all_to_all",
        "int",
        {"split_dimension": 1, "concat_dimension": 0, "split_count": 2, "groups": STRIDED},
    ),
    ("collective_permute ring", "collective_permute", "float", {"pairs": [[0, 1], [1, 2], [2, 3], [3, 0]]}),
    ("collective_permute partial", "collective_permute", "int", {"pairs": [[3, 0], [1, 2]]}),
]


def _call(fn: str, x, args: dict):
    args = dict(args)
    if "reduce_type" in args:
        return getattr(st, fn)(args.pop("reduce_type"), x, **args)
    return getattr(st, fn)(x, **args)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def global_batch(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches (16 rows each) of a training run; process i of n takes its n-th of the rows."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)) for _ in range(steps)]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(index: int, nprocs: int, compiled: bool, steps: int = STEPS) -> list[torch.Tensor]:
    """The parameters after data-parallel training: this process's part of each global batch."""
    model = make_model().to(st.device())
    opt = make_optimizer(model)

    def train_step(x, y):
        F.mse_loss(model(x), y).backward()
        st.optimizer_step(opt, barrier=not compiled)  # lazy: runs the step and waits for every process
        opt.zero_grad(set_to_none=True)

    step = st.compile(train_step) if compiled else train_step
    for x, y in global_batch(steps):
        rows = slice(index * 16 // nprocs, (index + 1) * 16 // nprocs)
        step(x[rows].to(st.device()), y[rows].to(st.device()))
    return [p.detach().cpu() for p in model.parameters()]


def _error(call) -> str:
    try:
        call()
    except (TypeError, ValueError, IndexError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "nothing raised"


def _bad_arguments(x: torch.Tensor) -> dict:
    return {
        "missing": _error(lambda: st.all_reduce(st.REDUCE_SUM, x, groups=[[0, 1], [2]])),
        "uncovered": _error(lambda: st.all_reduce(st.REDUCE_SUM, x, groups=[[0, 1], [1, 2]])),
        "range": _error(lambda: st.all_gather(x, groups=[[0, 1], [2, 4]])),
        "shard_count": _error(lambda: st.reduce_scatter(st.REDUCE_SUM, x, 1.0, 0, 4, groups=PAIRS)),
        "split_count": _error(lambda: st.all_to_all(x, 0, 1, 2)),
        "cpu": _error(lambda: st.all_reduce(st.REDUCE_SUM, torch.ones(2))),
        "pairs": _error(lambda: st.collective_permute(x, [[0, 1], [2, 1]])),
    }


def _collectives(index: int) -> dict:
    """Every case, recorded lazily and run as one program, then read."""
    out = {name: _call(fn, value(kind, index).to(st.device()), args) for name, fn, kind, args in CASES}
    # a list in place (mixed dtypes), output=, a list of outputs
    in_place = [value("float", index).to(st.device()), value("int", index).to(st.device()), 2 * value("float", index)]
    in_place[2] = in_place[2].to(st.device())
    in_place.append(torch.full((1 << 18,), float(index)).to(st.device()))  # a large one: reduced alone
    returned = st.all_reduce(st.REDUCE_SUM, in_place, scale=1.0, groups=STRIDED)
    out["list is returned"] = torch.tensor(returned is in_place)
    out.update({f"list {i}": t for i, t in enumerate(in_place)})
    x = value("float", index).to(st.device())
    gathered = torch.zeros(8, 2).to(st.device())
    out["output is returned"] = torch.tensor(st.all_gather(x, 0, PAIRS, output=gathered) is gathered)
    out["all_gather output"] = gathered
    scattered = [torch.zeros(1, 2).to(st.device()), torch.zeros(1, 2).to(st.device())]
    st.reduce_scatter(st.REDUCE_SUM, [x, 2 * x], 1.0, 0, 4, output=scattered)
    out["reduce_scatter outputs"] = torch.stack(scattered)
    st.sync()
    return {name: t.cpu() for name, t in out.items()}


def data_parallel_job(index: int) -> dict:
    return {
        "trained": _train(index, st.process_count(), compiled=False),
        "compiled": _train(index, st.process_count(), compiled=True, steps=COMPILED_STEPS),
        "frozen": st.counter_value("CompileFrozen") or 0,
        "replayed": st.counter_value("CompileReplay") or 0,
        "collectives": _collectives(index),
        "errors": _bad_arguments(value("float", index).to(st.device())),
    }


def two_hosts_job(index: int) -> dict:
    """2 processes x 4 devices: training, an all_reduce and an all_gather of per-process values, and
    an all_reduce of a tensor sharded over all 8 devices (the same value in both processes)."""
    mesh = st.Mesh(range(8), (8,), ("data",))
    sharded = st.shard(torch.arange(16.0).reshape(8, 2), mesh, ("data", None))
    x = value("float", index).to(st.device())
    out = {
        "sum": st.all_reduce(st.REDUCE_SUM, x),
        "gather": st.all_gather(x, 1),
        "sharded sum": st.all_reduce(st.REDUCE_SUM, sharded),
    }
    st.sync()
    # barrier=True with nothing reduced across processes: a host rendezvous completes the wait
    p = torch.ones(2, device=st.device(), requires_grad=True)
    (p * (index + 1)).sum().backward()
    st.optimizer_step(torch.optim.SGD([p], lr=1.0), barrier=True, groups=[[0], [1]])
    out["own step"] = p.detach()
    return {"trained": _train(index, 2, compiled=False, steps=1), **{k: v.cpu() for k, v in out.items()}}
