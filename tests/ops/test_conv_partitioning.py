"""Sharded convolutions XLA's SPMD partitioner got wrong (jax 0.10.2), forward and backward, against
eager torch; see the layouts ``ops/conv.py`` gives it.

Before that layout, each config here either aborted the process (SIGABRT: a failed CHECK in
convolution_handler.cc, or ``free(): invalid pointer``), raised a JaxRuntimeError from the partitioner,
or returned wrong values; the neighbours marked "right" were already right and must stay so. They run
in ONE subprocess that reports each config as a JSON line, so an abort fails this test (naming the
config that was running) instead of killing the pytest run.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(nsp, transposed, groups, k, batch, channels, size, x=None, w=None, grad=None, bias=True, mode="lazy", **kw):
    """One convolution: ``channels`` = (in, out) channels per group; ``x``/``w``/``grad`` = {dim: mesh
    axes} on the (4, 2) mesh ('x', 'y') for the input, weight and output gradient; ``kw`` = stride,
    padding, dilation, output_padding."""
    return dict(
        nsp=nsp, transposed=transposed, groups=groups, k=k, batch=batch, channels=channels, size=size,
        specs=[x or {}, w or {}, grad or {}], bias=bias, mode=mode, kw=kw,
    )  # fmt: skip


_B = {0: "x"}  # batch over 'x' only: replicated over 'y'
CONFIGS = {
    # kernel gradient of a grouped conv (batch_group_count) with the batch on part of the mesh: wrong
    "issue: grouped dilated conv_transpose2d, batch on y": _config(
        2, True, 4, 3, 8, (2, 2), (8, 9), x={0: "y"}, grad={0: "y"}, padding=2, dilation=2, output_padding=1
    ),
    "grouped conv_transpose2d, k=1, batch on x": _config(2, True, 4, 1, 8, (4, 2), (3, 7), x=_B, grad=_B),
    "grouped conv2d, k=1, batch on y, grad batch on x": _config(2, False, 3, 1, 4, (3, 2), 5, x={0: "y"}, grad=_B),
    "grouped conv1d, eager": _config(1, False, 2, 3, 6, (2, 2), 9, x=_B, grad=_B, mode="eager", stride=2, padding=1),
    "grouped conv3d, grad channels on y": _config(3, False, 4, 3, 4, (3, 1), (8, 4, 7), x=_B, grad={1: "y"}, stride=3),
    # aborted: Check failed: new_input_batch_size % new_output_batch_size == 0
    "grouped conv_transpose3d, grad channels on y (abort)": _config(
        3, True, 3, 4, 16, (2, 1), (5, 5, 6), x=_B, grad={1: "y"}, stride=3, padding=3, dilation=3, output_padding=2
    ),
    # aborted: free(): invalid pointer
    "grouped conv_transpose2d, k=1, input channels on y (abort)": _config(2, True, 4, 1, 8, (1, 1), (6, 4), x={1: "y"}),
    "grouped conv_transpose2d, k=1, weight dim 0 on x (abort)": _config(2, True, 2, 1, 4, (1, 1), (7, 5), w={0: "x"}),
    # wrong forward values / JaxRuntimeError from the partitioner
    "grouped conv_transpose2d, k=1, input channels on y, batch 3": _config(2, True, 2, 1, 3, (2, 2), 8, x={1: "y"}),
    "conv1d, input length on y, weight dim 0 on x": _config(
        1, False, 1, 2, 8, (3, 1), 6, x={2: "y"}, w={0: "x"}, stride=3, padding=1
    ),
    "grouped conv_transpose2d, channels on x, weight dim 1 on y (raised)": _config(
        2, True, 2, 3, 8, (2, 2), (6, 8), x={1: "x"}, w={1: "y"}, stride=3, dilation=2, output_padding=2
    ),
    "grouped conv3d, k=1, input channels on y (raised)": _config(3, False, 2, 1, 3, (3, 1), 5, x={1: "y"}),
    # kernel gradient with the input sharded over a spatial dim and the output gradient on its batch: wrong
    "conv_transpose1d, input length on x, grad batch on x": _config(
        1, True, 1, 2, 4, (2, 1), 8, x={2: "x"}, grad=_B, bias=False, padding=1
    ),
    "conv2d, input width on y, grad batch on x": _config(
        2, False, 1, 2, 4, (2, 1), (7, 4), x={3: "y"}, grad=_B, bias=False, stride=3, padding=1
    ),
    # neighbours that were right
    "right: grouped dilated conv_transpose2d, batch on x": _config(
        2, True, 2, 3, 8, (2, 2), 6, x=_B, grad=_B, stride=2, padding=1, dilation=2, output_padding=1
    ),
    "right: the issue's conv_transpose2d, groups=1": _config(
        2, True, 1, 3, 8, (2, 2), (8, 9), x={0: "y"}, grad={0: "y"}, padding=2, dilation=2, output_padding=1
    ),
    "right: the issue's conv_transpose2d, batch on the whole mesh": _config(
        2,
        True,
        4,
        3,
        8,
        (2, 2),
        (8, 9),
        x={0: ("x", "y")},
        grad={0: ("x", "y")},
        padding=2,
        dilation=2,
        output_padding=1,
    ),
    "right: conv3d, input depth on x, eager": _config(
        3, False, 1, 3, 2, (2, 2), (8, 4, 4), x={2: "x"}, mode="eager", padding=1
    ),
    "right: conv2d, input width on y": _config(2, False, 1, 2, 4, (2, 1), (7, 4), x={3: "y"}, stride=3, padding=1),
}

_SWEEP = textwrap.dedent("""
    import json, sys
    import torch
    import shardtensor as st

    F = torch.nn.functional
    mesh = st.Mesh(range(8), (4, 2), ("x", "y"))

    def spec(ndim, dims):
        out = [None] * ndim
        for d, axes in dims.items():
            out[int(d)] = tuple(axes) if isinstance(axes, list) else axes
        return tuple(out)

    def run(c):
        nsp, groups, k, (cg, cog) = c["nsp"], c["groups"], c["k"], c["channels"]
        g = torch.Generator().manual_seed(0)
        size = [c["size"]] * nsp if isinstance(c["size"], int) else c["size"]
        x = torch.randn(c["batch"], cg * groups, *size, generator=g)
        w_shape = (cg * groups, cog) if c["transposed"] else (cog * groups, cg)
        w = torch.randn(*w_shape, *[k] * nsp, generator=g)
        b = torch.randn(cog * groups, generator=g)
        fn = getattr(F, f"conv_transpose{nsp}d" if c["transposed"] else f"conv{nsp}d")
        names = ("output", "x", "w", "b")[: 4 if c["bias"] else 3]
        leaves = [t.clone().requires_grad_() for t in (x, w, b)[: len(names) - 1]]
        want = fn(*leaves, groups=groups, **c["kw"])
        grad = torch.randn(want.shape, generator=g)
        want.backward(grad)
        xs, ws, gs = c["specs"]
        st.eager_mode(c["mode"] == "eager")
        try:
            dev = [st.shard(t.detach(), mesh, spec(t.dim(), s)).requires_grad_() for t, s in zip(leaves, (xs, ws, {}))]
            got = fn(*dev, groups=groups, **c["kw"])
            got.backward(st.shard(grad, mesh, spec(grad.dim(), gs)))
            pairs = [(names[0], got, want)] + [(n, d.grad, l.grad) for n, d, l in zip(names[1:], dev, leaves)]
            for name, a, e in pairs:
                torch.testing.assert_close(a.cpu(), e.detach(), rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        finally:
            st.eager_mode(False)

    for name, config in json.load(sys.stdin).items():
        print(json.dumps({"started": name}), flush=True)
        try:
            run(config)
            result = "ok"
        except Exception as e:  # reported back: a raise is a failure of its config, not of the sweep
            result = f"{type(e).__name__}: {str(e)[:600]}"
        print(json.dumps({"config": name, "result": result}), flush=True)
""")


def _text(output):
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def test_sharded_convolutions_partition_right_and_never_abort():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _SWEEP],
            input=json.dumps(CONFIGS),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        stdout, stderr, returncode = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # a hang is reported like an abort: with the config running
        stdout, stderr, returncode = _text(e.stdout), _text(e.stderr), "timeout"
    started, results = None, {}
    for line in stdout.splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "started" in msg:
            started = msg["started"]
        else:
            results[msg["config"]] = msg["result"]
    if returncode != 0:
        pytest.fail(
            f"the sweep died (exit {returncode}) while running {started!r}; "
            f"done before it: {sorted(results)}\n{stderr[-3000:]}"
        )
    assert set(results) == set(CONFIGS), stderr[-3000:]
    wrong = {name: result for name, result in results.items() if result != "ok"}
    assert not wrong, json.dumps(wrong, indent=1)
