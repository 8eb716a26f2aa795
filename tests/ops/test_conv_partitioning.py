"""Sharded convolutions XLA's SPMD partitioner got wrong (jax 0.10.2), forward and backward, against
eager torch; see the layouts ``ops/conv.py`` gives it.

Before that layout, each config here either aborted the process (SIGABRT: a failed CHECK in
convolution_handler.cc, or ``free(): invalid pointer``), raised a JaxRuntimeError from the partitioner,
or returned wrong values; the neighbours marked "right" were already right and must stay so. They run
in ONE subprocess that reports each config as a JSON line, so an abort fails this test (naming the
config that was running) instead of killing the pytest run.
"""

import itertools
import json
import os
import subprocess
import sys
import textwrap

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

    def record(c):
        # eager torch's output and gradients, and the sharded ones: recorded, not run yet (lazy
        # mode), or run now (eager mode)
        nsp, groups, k, (cg, cog) = c["nsp"], c["groups"], c["k"], c["channels"]
        g = torch.Generator().manual_seed(0)
        size = [c["size"]] * nsp if isinstance(c["size"], int) else c["size"]
        x = torch.randn(c["batch"], cg * groups, *size, generator=g)
        w_shape = (cg * groups, cog) if c["transposed"] else (cog * groups, cg)
        w = torch.randn(*w_shape, *([k] * nsp if isinstance(k, int) else k), generator=g)
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
        finally:
            st.eager_mode(False)
        return [(names[0], got, want)] + [(n, d.grad, l.grad) for n, d, l in zip(names[1:], dev, leaves)]

    def compare(pairs):
        for name, a, e in pairs:
            torch.testing.assert_close(a.cpu(), e.detach(), rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    def error(e):
        return f"{type(e).__name__}: {str(e)[:600]}"

    # a batch of lazy configs is one program (one compile): the first readback runs them all
    work = json.load(sys.stdin)
    for batch in work["batches"]:
        print(json.dumps({"started": batch}), flush=True)
        results = {}
        recorded = {}
        for name in batch:
            try:
                recorded[name] = record(work["configs"][name])
            except Exception as e:  # reported back: a raise is a failure of its config, not of the sweep
                results[name] = error(e)
        for name, pairs in recorded.items():
            try:
                compare(pairs)
                results[name] = "ok"
            except Exception as e:
                results[name] = error(e)
        if len(batch) > 1 and any(r != "ok" for r in results.values()):
            # whose failure it is: the parent runs the batch's configs one by one, in a fresh process
            print(json.dumps({"split": batch}), flush=True)
            break
        for name in batch:
            print(json.dumps({"config": name, "result": results[name]}), flush=True)
""")


def _text(output):
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _sweep(configs: dict, batch: int = 1, timeout: float = 600) -> tuple[dict, dict]:
    """Run ``configs`` in a subprocess, up to ``batch`` lazy ones in one program; a batch in which
    something fails is run again config by config. A process that dies (an abort) or hangs is
    restarted with the configs after the one it was running. Returns ({name: "ok" or the error
    raised}, {name: how the process running it died, with the end of its stderr})."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    lazy = [name for name, c in configs.items() if c["mode"] == "lazy"]
    queue = [lazy[i : i + batch] for i in range(0, len(lazy), batch)]
    queue += [[name] for name, c in configs.items() if c["mode"] != "lazy"]
    results: dict = {}
    died: dict = {}
    while queue:
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _SWEEP],
                input=json.dumps({"configs": configs, "batches": queue}),
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            stdout, stderr, returncode = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:  # a hang is reported like an abort: with the config running
            stdout, stderr, returncode = _text(e.stdout), _text(e.stderr), "timeout"
        started, split = None, None
        for line in stdout.splitlines():
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "started" in msg:
                started = msg["started"]
            elif "split" in msg:
                split = msg["split"]
            else:
                results[msg["config"]] = msg["result"]
        if returncode == 0 and split is None:
            assert all(name in results for b in queue for name in b), f"the sweep skipped configs\n{stderr[-3000:]}"
            break
        if returncode != 0 and split is None:
            if started is None or all(name in results for name in started):  # nothing to blame
                raise AssertionError(f"the sweep died (exit {returncode}) outside any config\n{stderr[-3000:]}")
            if len(started) == 1:
                died[started[0]] = f"the process died (exit {returncode}): {stderr[-1500:]}"
            else:
                split = started
        rest = [b for b in queue if not all(name in results or name in died for name in b)]
        queue = [[name] for name in split] + [b for b in rest if b != split] if split else rest
    return results, died


def _assert_all_right(configs: dict, batch: int = 1) -> None:
    results, died = _sweep(configs, batch)
    assert not died, "aborted (each in its own process, the rest run after it):\n" + "\n".join(
        f"{name}: {how}" for name, how in died.items()
    )
    assert set(results) == set(configs)
    wrong = {name: result for name, result in results.items() if result != "ok"}
    assert not wrong, json.dumps(wrong, indent=1)


def test_sharded_convolutions_partition_right_and_never_abort():
    _assert_all_right(CONFIGS)


def _grid() -> dict:
    """Convolutions, transposed or not, with a (4, 5) kernel and padding (1, 2), over an input
    sharded on one spatial dim (H over 'x', W over 'y'; a transposed one's 4 x 4 input leaves one row
    or two columns per device, less than the kernel's halo) for every stride x dilation x
    output_padding (transposed: 0, or 2, less than the stride or the dilation) x groups, forward and
    backward."""
    grid = {}
    for transposed, stride, dilation, groups in itertools.product((True, False), (1, 3), (1, 4), (1, 2)):
        paddings = (0, 2) if transposed and max(stride, dilation) > 1 else (0,)
        for output_padding, (dim, axis) in itertools.product(paddings, ((2, "x"), (3, "y"))):
            kw = dict(stride=stride, dilation=dilation, padding=(1, 2))
            if transposed:
                kw["output_padding"] = output_padding
            # not transposed: the smallest input the dilated kernel fits, plus 3 (uneven shards)
            size = (4, 4) if transposed else (dilation * 3 + 2, dilation * 4)
            name = f"{'conv_transpose2d' if transposed else 'conv2d'} {kw} groups={groups}, input dim {dim} on {axis}"
            grid[name] = _config(2, transposed, groups, [4, 5], 2, (1, 2), size, x={dim: axis}, **kw)
    # issue 34: aborted the process (convolution_handler.cc: Check failed: ShapeUtil::Compatible)
    for mode in ("lazy", "eager"):
        grid[f"issue 34: conv_transpose2d, stride, dilation and output_padding, input H on x, {mode}"] = _config(
            2, True, 2, [4, 5], 2, (1, 2), (4, 4), x={2: "x"}, mode=mode,
            stride=(3, 2), padding=(1, 2), output_padding=(2, 3), dilation=(4, 4),
        )  # fmt: skip
    return grid


def test_spatially_sharded_convolutions_over_strides_dilations_output_paddings_and_groups():
    # before conv.py gathered a transposed convolution's spatial dims, several of these computed wrong
    # values (stride 1 too), raised from the partitioner or aborted (stride, dilation and output_padding)
    _assert_all_right(_grid(), batch=16)
