"""The functions tests/test_launch.py runs in other processes, and its torchrun script.

Through `st.launch` (imported by module name in each spawned process): `sharded_rows` (with
`st.rendezvous` / `st.mesh_reduce`), `raise_in_1`,
`kill_0`. As a script under torchrun (``SHARDTENSOR_AUTO_DISTRIBUTED=1``, so importing shardtensor
joins the job; ``dist.init_process_group("shardtensor")`` too): writes what process RANK saw to
``$REPORT_DIR/RANK.json``; with ``KILL_RANK_0=1``, rank 0 is SIGKILLed after a first collective and
rank 1 writes what its next collectives raised, and ``$REPORT_DIR/RANK.left`` once it got through its
exit (its last exit hook: no abort on the way out).
"""

import atexit
import json
import os
import pathlib
import signal
import time


def _mark_left():
    (pathlib.Path(os.environ["REPORT_DIR"]) / f"{os.environ['RANK']}.left").write_text(str(time.time()))


if __name__ == "__main__" and os.environ.get("KILL_RANK_0"):
    atexit.register(_mark_left)  # before shardtensor joins the job: it runs after its and JAX's exit hooks

import torch  # noqa: E402

import shardtensor as st  # noqa: E402


def _global_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 6, generator=g), torch.randn(6, 3, generator=g)


def _matmul_over_every_process():
    """(X @ W) with X's rows over every device of every process; the result read back whole."""
    X, W = _global_inputs()
    n = st.global_runtime_device_count()
    mesh = st.Mesh(range(n), (n,), ("rows",))
    return (st.shard(X, mesh, ("rows", None)) @ W.to(st.device())).cpu()


def _host_collectives(index, out):
    """rendezvous twice under one tag, mesh_reduce of a CPU tensor and of an int, and process 0 alone
    at a tag process 1 never reaches (its TimeoutError's message)."""
    timed_out = None
    if index == 0:
        try:
            st.rendezvous("only_0", timeout=0.5)
        except TimeoutError as e:
            timed_out = str(e)
    return {
        "rendezvous": [st.rendezvous("rows", f"p{index}".encode()), st.rendezvous("rows", b"again%d" % index)],
        "mesh_reduce": st.mesh_reduce("rows", out * (index + 1), lambda ts: torch.stack(ts).sum(0)),
        "mesh_reduce_int": st.mesh_reduce("index", index + 10, lambda xs: xs),
        "timed_out": timed_out,
    }


def sharded_rows(index, scale):
    out = _matmul_over_every_process() * scale
    return {
        **_host_collectives(index, out),
        "index": index,
        "process_index": st.process_index(),
        "process_count": st.process_count(),
        "devices": st.global_runtime_device_count(),
        "local_devices": st.addressable_runtime_device_count(),
        "result": out,
    }


def raise_in_1(index):
    if index == 1:
        raise ValueError("process 1 refuses")
    return _matmul_over_every_process()  # process 0 waits in a collective for process 1


def kill_0(index):
    _matmul_over_every_process()  # both processes joined and computed once
    if index == 0:  # process 0, which would host the coordination service without launch
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(1000):  # the survivor's next collectives have a dead peer
        _matmul_over_every_process()
    return "not reached"


def _all_reduce_through_torch_distributed() -> list:
    """torch.distributed's group of the job (env://, torchrun's variables): the sum of rank + 1."""
    import torch.distributed as dist

    dist.init_process_group("shardtensor")
    x = torch.full((2,), dist.get_rank() + 1.0).to(st.device())
    dist.all_reduce(x)
    dist.destroy_process_group()
    return x.tolist()


def _kill_rank_0_under_torchrun():
    """Rank 0 dies after a first collective; rank 1 reports the exception its next collective raises
    (and the times, for the record)."""
    _matmul_over_every_process()
    rank = int(os.environ["RANK"])
    report = pathlib.Path(os.environ["REPORT_DIR"]) / f"{rank}.json"
    if rank == 0:
        report.write_text(json.dumps({"killed_at": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(1000):
            _matmul_over_every_process()
        raised = None
    except Exception as e:  # noqa: BLE001 — what the survivor saw is the report
        raised = f"{type(e).__name__}: {e}"
    report.write_text(json.dumps({"raised": raised, "raised_at": time.time()}))


if __name__ == "__main__" and os.environ.get("KILL_RANK_0"):
    _kill_rank_0_under_torchrun()
elif __name__ == "__main__":  # under torchrun
    out = _matmul_over_every_process()
    report = {
        "rank": int(os.environ["RANK"]),
        "process_index": st.process_index(),
        "process_count": st.process_count(),
        "devices": st.global_runtime_device_count(),
        "result": out.tolist(),
        "all_reduce": _all_reduce_through_torch_distributed(),
    }
    with open(os.path.join(os.environ["REPORT_DIR"], f"{os.environ['RANK']}.json"), "w") as f:
        json.dump(report, f)
