"""Runs every Python block of one of the two design documents shardtensor was built from
(tests/xla_seeds/*.md, copied verbatim), statement by statement in one namespace as a notebook would,
under ``python -m shardtensor.xla``; then checks the results against eager torch. Used by
tests/test_xla_seeds.py in a fresh process per document:

    python -m shardtensor.xla tests/_xla_seed_runner.py seed_spmd_guide.md WORKDIR

The blocks assume a few names they do not define (``MyModel``, ``loader``, ``torch``, ``np``,
``PartitionSpec``, ``input`` ...): FILL_INS gives them, per block, before it runs. A statement that
PyTorch/XLA also rejects must raise what EXPECTED says; any other exception fails the run. Each check
prints ``CHECK <name> ok``.
"""

import ast
import collections
import copy
import functools
import os
import re
import sys

import numpy as np
import torch
import torch.nn.functional as F

SEEDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xla_seeds")

# (document, block, statement) -> (exception type, message pattern); PyTorch/XLA raises there too
EXPECTED = {
    # a 1-entry spec for a 2-d tensor: "Partition spec length (1) should be equal to the input rank (2)"
    # (PyTorch/XLA already rejects the statement before, re-marking device data with another spec; under
    # shardtensor the tensor is still pending there, so its second spec is a sharding constraint)
    ("seed_spmd_guide.md", 3, 4): (
        AssertionError,
        r"Partition spec length \(1\) should be equal to the input rank \(2\)",
    ),
}


class MyModel(torch.nn.Module):
    """The documents' model: a batch in, a scalar loss out."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(x).pow(2).mean()


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def _mp_fn(index):
    """The function the torchtpu document launches (``torch_xla.launch(_mp_fn, args=())``)."""
    import torch_xla

    return (index, str(torch_xla.device()), float((torch.ones(3, device="xla") * 2).sum().item()))


def step_fn(x):
    return (x * 2).sum()


def train_step(model, x):
    return model(x)


def check(name, ok):
    if not ok:
        raise AssertionError(f"check {name} failed")
    print(f"CHECK {name} ok", flush=True)


def blocks(document):
    with open(os.path.join(SEEDS, document)) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def run_block(document, index, source, namespace):
    """Each top-level statement in turn; an expression statement's value is kept (``values``)."""
    values = []
    for number, statement in enumerate(ast.parse(source).body):
        expected = EXPECTED.get((document, index, number))
        try:
            if isinstance(statement, ast.Expr):
                values.append(eval(compile(ast.Expression(statement.value), f"{document}[{index}]", "eval"), namespace))
            else:
                exec(compile(ast.Module([statement], []), f"{document}[{index}]", "exec"), namespace)
        except Exception as e:
            if expected is None or not isinstance(e, expected[0]) or not re.search(expected[1], str(e)):
                raise
            print(f"CHECK {document}[{index}] statement {number} raises {type(e).__name__} ok", flush=True)
            continue
        if expected is not None:
            raise AssertionError(f"{document}[{index}] statement {number} should raise {expected[0].__name__}")
    return values


def spmd_guide():
    import torch_xla
    import torch_xla.distributed.spmd as xs
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    doc = "seed_spmd_guide.md"
    code = blocks(doc)
    ns = {"torch": torch}
    run_block(doc, 0, code[0], ns)
    check("use_spmd sets XLA_USE_SPMD", os.environ.get("XLA_USE_SPMD") == "1")
    run_block(doc, 1, code[1], ns)
    shape, logical, attributes = run_block(doc, 2, code[2], ns)
    check("mesh.shape()", shape == collections.OrderedDict([("data", 8), ("model", 1)]))
    check("mesh.get_logical_mesh()", np.array_equal(logical, np.arange(8).reshape(8, 1)))
    check("device attributes", [a["name"] for a in attributes] == [f"CPU:{i}" for i in range(8)])

    torch.manual_seed(0)
    want = torch.randn(8, 4)
    torch.manual_seed(0)
    run_block(doc, 3, code[3], ns)
    t = ns["t"]
    torch.testing.assert_close(t.cpu(), want)
    check("t's last valid spec", t.sharding_spec == "{devices=[1,8]0,1,2,3,4,5,6,7}")

    images = [torch.randn(16, 3, 4, 4) for _ in range(2)]
    labels = [torch.arange(16) for _ in range(2)]
    ns.update(batch_size=2, train_loader=list(zip(images, labels)), device=torch_xla.device())
    run_block(doc, 4, code[4], ns)
    check("batch_size scaled", ns["batch_size"] == 16)
    for (x, y), (want_x, want_y) in zip(ns["train_loader"], zip(images, labels)):
        check("input batch sharded on data", x.sharding_spec == "{devices=[8,1,1,1]0,1,2,3,4,5,6,7}")
        torch.testing.assert_close(x.cpu(), want_x)
        torch.testing.assert_close(y.cpu(), want_y)

    torch.manual_seed(0)
    model = torch.nn.Sequential(Layer(), Layer())
    reference = copy.deepcopy(model)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer})
    ns.update(FSDPv2=SpmdFullyShardedDataParallel, model=model, auto_wrap_policy=policy)
    run_block(doc, 5, code[5], ns)
    wrapped = ns["model"]
    check("global mesh", xs.get_global_mesh() is ns["mesh"])
    check(
        "FSDPv2 shards the largest dimension",
        wrapped[0].module.up.weight.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}",
    )
    x = torch.randn(16, 16)
    torch.testing.assert_close(
        wrapped(xs.mark_sharding(x.to("xla"), ns["mesh"], ("fsdp", None))).cpu(), reference(x).detach()
    )
    check("FSDPv2 forward equals eager torch", True)

    (attributes,) = run_block(doc, 6, code[6], ns)
    check("one slice: no slice_index", all("slice_index" not in a for a in attributes))


def torchtpu(workdir):
    import torch_xla
    import torch_xla.distributed.spmd as xs

    doc = "seed_torchtpu.md"
    code = blocks(doc)
    os.chdir(workdir)

    def trained(make, batches, zero_grad):
        torch.manual_seed(1)
        ref = make()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
        for x in batches:
            if zero_grad:
                opt.zero_grad()
            ref(x).backward()
            opt.step()
        return ref

    batches = [torch.randn(4, 16) for _ in range(3)]
    torch.manual_seed(1)
    ns = {"MyModel": MyModel, "loader": [b.to("xla") for b in batches], "PartitionSpec": xs.PartitionSpec}
    run_block(doc, 0, code[0], ns)
    check("sharded rows", ns["model"].fc.weight.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}")
    ref = trained(MyModel, batches, zero_grad=False)  # (the block never zeroes the gradients)
    for p, q in zip(ns["model"].parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q)
    check("xm.optimizer_step loop equals eager torch", True)

    ns["input"] = torch.randn(4, 16)
    run_block(doc, 1, code[1], ns)
    torch.testing.assert_close(ns["output"].cpu(), ns["model"](ns["input"]).detach())
    check("torch.compile(backend='openxla') equals eager torch", True)

    run_block(doc, 2, code[2], ns)
    saved = torch.load("ckpt.pt")
    for k, v in ns["model"].state_dict().items():
        torch.testing.assert_close(saved[k], v.cpu())
    check("xr.save writes plain CPU tensors", all(v.device.type == "cpu" for v in saved.values()))

    torch.manual_seed(1)
    ns.update(np=np, loader=[{"input_ids": b, "labels": torch.zeros(4)} for b in batches])
    run_block(doc, 3, code[3], ns)
    ref = trained(MyModel, batches, zero_grad=True)
    for p, q in zip(ns["model"].parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q)
    check("torch_xla.step() loop equals eager torch", True)

    ns.update(input=torch.randn(4, 16).to("xla"), train_step=train_step)
    run_block(doc, 4, code[4], ns)
    reference = MyModel()
    reference.load_state_dict({k: v.cpu() for k, v in ns["model"].state_dict().items()})
    torch.testing.assert_close(ns["output"].cpu(), reference(ns["input"].cpu()).detach())
    check("compiled inference equals eager torch", True)

    path = os.path.join(workdir, "xser.pt")
    ns.update(_mp_fn=_mp_fn, step_fn=step_fn, path=path)
    values = run_block(doc, 5, code[5], ns)
    check("torch_xla.launch ran _mp_fn in a process of its own", [(0, str(torch_xla.device()), 6.0)] in values)
    check("eager mode on", torch_xla.experimental.is_eager_mode())
    for k, v in ns["model"].state_dict().items():
        torch.testing.assert_close(ns["state_dict"][k], v.cpu())
    check("xser round trip", True)
    x = torch.arange(4.0).to("xla")
    torch.testing.assert_close(ns["compiled"](x).cpu(), torch.tensor(12.0))
    check("torch_xla.compile(step_fn)", True)


if __name__ == "__main__":
    document, workdir = sys.argv[1], sys.argv[2]
    if document == "seed_spmd_guide.md":
        spmd_guide()
    else:
        torchtpu(workdir)
    print("DONE", flush=True)
