"""Checkpoints of a sharded GPT and its AdamW state: save and load throughput and peak host memory of
the four ways to save, on 8 simulated devices in one process and on 2 processes x 4 devices.

The model is a GPT (token embedding, learned positions, pre-norm attention + MLP blocks) wrapped in
``FSDPv2`` on a mesh (8, 1) ``('fsdp', 'model')``: every parameter sharded over 'fsdp' on its largest
dimension. One AdamW step creates the optimizer's state (sharded like the parameters). The state dict
is ``get_state_dict(model, optimizer)``, float32, ~280 MB by default. Measured in one run:

* ``dcp``         ``torch.distributed.checkpoint.save`` / ``load`` of the sharded state dict (each
                  process writes its own distinct shards; a load reads into the sharded tensors);
* ``st.save``     ``st.save`` (``xr.save``); loaded with ``torch.load`` and copied into the sharded tensors;
* ``xser``        ``st.serialization.save`` / ``load`` (a file per tensor), copied into the sharded tensors;
* ``torch.save``  plain ``torch.save`` of ``.cpu()`` copies: the time is the write alone (the same
                  bytes from CPU tensors; the copying is timed as ``.cpu()``), the memory includes the
                  copies; loaded with ``torch.load`` into CPU tensors;
* ``save_async``  ``CheckpointManager.save_async`` between optimizer steps: how long the call blocks
                  the loop, against the time to copy this process's distinct shards to the host
                  (``shards d2h``) — skipped, with a note, where shardtensor has no CheckpointManager.

Throughput: the state dict's logical bytes over the wall time (several processes: from a barrier
before to a barrier after). Peak: the growth of the process's resident memory during the operation,
read from the kernel's high-water mark (VmHWM), which writing 5 to /proc/self/clear_refs resets to the
current RSS before each operation, after ``malloc_trim(0)`` and with glibc's mmap threshold fixed at
1 MiB, so memory freed earlier is not resident and cannot hide growth; with several processes, the
largest of them. Each operation runs ``--repeats`` times, round robin, and the best time and the
smallest peak count (the first run pays one-time costs: imports, compiling the uploads). Every load is
checked against the saved values once. Files go to a temporary directory in ``--dir`` (default
/dev/shm, a tmpfs, so no disk sets the pace), removed at the end.

Targets (issue 14): DCP save >= 0.8x the throughput of ``torch.save`` of the same bytes from CPU
tensors; DCP save's peak extra host memory <= 2 shards' worth per process (a shard: the largest
single-device piece of any tensor); ``save_async`` blocks <= the device-to-host copy time.

Example::

    .venv/bin/python bench/checkpoint.py               # ~280 MB: one process, then two
    .venv/bin/python bench/checkpoint.py --quick       # ~50 MB
    .venv/bin/python bench/checkpoint.py --only single --d 768 --layers 8
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

from gpt_model import GPT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1e6
MiB = 2**20
METHODS = ("dcp", "st.save", "xser", "torch.save")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model (~50 MB of state)")
    p.add_argument("--d", type=int, default=None, help="model width (default 512, --quick 256)")
    p.add_argument("--layers", type=int, default=None, help="blocks (default 6, --quick 4)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 8192, --quick 4096)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each operation; the best counts")
    p.add_argument("--only", choices=["single", "multi"], help="only one process, or only two processes")
    p.add_argument("--dir", default=None, help="where the temporary checkpoint directory goes (default /dev/shm)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # one measuring process: "single" or "multi:PORT:PID:TORCH_PORT"
    args = p.parse_args(argv)
    for name, (full, quick) in {"d": (512, 256), "layers": (6, 4), "vocab": (8192, 4096)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


# ---- the model: gpt_model.GPT (the one bench/train_vs_jax.py trains) ----------------------------


def build(args):
    """The FSDPv2 GPT after one AdamW step, its optimizer, and a training step (the optimizer's)."""
    import shardtensor as st
    from shardtensor.fsdp import FSDPv2

    torch.manual_seed(0)
    mesh = st.Mesh(range(8), (8, 1), ("fsdp", "model"))
    model = FSDPv2(GPT(args.vocab, 512, args.d, 8, args.layers), mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # fixed gradients stand in for a backward pass: the optimizer step is what makes AdamW's state
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)

    def train_step():
        optimizer.step()
        st.step()

    train_step()
    return model, optimizer, train_step


# ---- memory -------------------------------------------------------------------------------------

_LIBC = ctypes.CDLL("libc.so.6")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: this bench measures memory on Linux only")


def fix_mmap_threshold() -> None:
    """glibc raises its mmap threshold as large blocks are freed, then keeps later ones in its heap,
    where freed memory stays resident: fixed at 1 MiB, large buffers go back to the kernel when freed."""
    M_MMAP_THRESHOLD = -3
    if not _LIBC.mallopt(M_MMAP_THRESHOLD, MiB):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


class Measured:
    """Wall time (``seconds``) and peak resident-memory growth (``peak_bytes``) of the block;
    ``barrier`` (several processes) is passed by everyone before and after."""

    def __init__(self, barrier=None):
        self.barrier = barrier or (lambda: None)

    def __enter__(self):
        gc.collect()
        _LIBC.malloc_trim(0)  # freed heap pages back to the kernel: RSS is what is in use
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.base = _status_kib("VmRSS")
        self.barrier()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.barrier()
        self.seconds = time.perf_counter() - self.start
        self.peak_bytes = (_status_kib("VmHWM") - self.base) * 1024
        return False


# ---- one measuring process ----------------------------------------------------------------------


def leaves(obj, prefix=""):
    """(dotted key, tensor) of every tensor in nested dicts."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, torch.Tensor):
        yield prefix, obj


class Worker:
    """One measuring process: the state dict, and each save and load of it."""

    def __init__(self, args, barrier):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        import shardtensor as st

        self.st, self.dcp, self.barrier, self.root = st, dcp, barrier, args.dir
        self.main_process = st.runtime.process_index() == 0
        model, optimizer, self.train_step = build(args)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        self.state = {"model": model_sd, "optim": optim_sd}
        self.targets = dict(leaves(self.state))
        st.sync()
        self.reference = {key: t.detach().cpu() for key, t in self.targets.items()}  # what each load gives back
        self.out: dict = {
            "bytes": sum(t.numel() * t.element_size() for t in self.targets.values()),
            "tensors": len(self.targets),
            "shard": max(p.nbytes for p in self.host_shards()),
            "save": {},
            "load": {},
        }

    def path(self, name):
        return os.path.join(self.root, name)

    def host_shards(self) -> list:
        """A host copy of this process's distinct shards (what save_async has to copy), each alone."""
        from shardtensor.checkpoint.protocol import _pieces  # (white box: the shards DCP writes)
        from shardtensor.tensor.sharded import ShardedTensor

        copies = []
        for t in self.targets.values():
            if isinstance(t, ShardedTensor):
                # (numpy copies on this thread; torch's clone would start OpenMP threads, slow on a busy machine)
                copies += [np.array(p.shard.data) for p in _pieces(t)]
            else:
                copies.append(t.detach().cpu().clone())
        return copies

    def record(self, kind, method, seconds, peak_bytes):
        best = self.out[kind].setdefault(method, {"seconds": float("inf"), "peak": float("inf")})
        best["seconds"] = min(best["seconds"], seconds)
        best["peak"] = min(best["peak"], peak_bytes)

    # -- saves

    def save(self, method):
        if method == "torch.save":
            return self.save_cpu_copies()
        if method == "dcp" and self.main_process:  # (DCP would overwrite it, and warn)
            shutil.rmtree(self.path("dcp"), ignore_errors=True)
        with Measured(self.barrier) as m:
            if method == "dcp":
                self.dcp.save(self.state, checkpoint_id=self.path("dcp"))
            elif method == "st.save":
                self.st.save(self.state, self.path("st_save.pt"))
            else:
                self.st.serialization.save(self.state, self.path("xser.pt"))
        self.record("save", method, m.seconds, m.peak_bytes)

    def save_cpu_copies(self):
        with Measured(self.barrier) as m:
            copying = time.perf_counter()
            host = {key: t.detach().cpu() for key, t in self.targets.items()}
            writing = time.perf_counter()
            if self.main_process:
                torch.save(host, self.path("torch_save.pt"))
            done = time.perf_counter()
        self.record("save", "torch.save", done - writing, m.peak_bytes)
        self.record("save", ".cpu()", writing - copying, m.peak_bytes)

    # -- loads

    def load(self, method, check):
        if method == "torch.save":  # into CPU tensors
            with Measured(self.barrier) as m:
                loaded = torch.load(self.path("torch_save.pt"), weights_only=True)
            if check and (
                loaded.keys() != self.reference.keys()
                or not all(map(torch.equal, loaded.values(), self.reference.values()))
            ):
                raise AssertionError("torch.load: the tensors read back differ from the saved ones")
        else:
            self.scramble()  # a load into zeroed targets
            with Measured(self.barrier) as m:
                if method == "dcp":
                    self.dcp.load(self.state, checkpoint_id=self.path("dcp"))
                    self.st.sync()
                elif method == "st.save":
                    self.copy_into_targets(torch.load(self.path("st_save.pt"), weights_only=True))
                else:
                    self.copy_into_targets(self.st.serialization.load(self.path("xser.pt")))
            if check:
                self.check(method)
        self.record("load", method, m.seconds, m.peak_bytes)

    def scramble(self):
        with torch.no_grad():
            for t in self.targets.values():
                t.zero_()
        self.st.sync()

    def copy_into_targets(self, loaded):
        with torch.no_grad():
            for key, value in leaves(loaded):
                self.targets[key].copy_(value)
        self.st.sync()

    def check(self, method):
        for key, t in self.targets.items():
            if not torch.equal(t.detach().cpu(), self.reference[key]):
                raise AssertionError(f"{method}: {key} differs from the saved value after loading")

    # -- save_async

    def save_async(self):
        """How long ``CheckpointManager.save_async`` blocks a loop of training steps, against the
        host copy of this process's distinct shards; None without a CheckpointManager."""
        try:
            from shardtensor.checkpoint import CheckpointManager  # type: ignore[attr-defined]
        except ImportError:
            return None
        copies = []
        for _ in range(2):
            with Measured(self.barrier) as copy:
                self.host_shards()
            copies.append(copy)
        copy = min(copies, key=lambda m: m.seconds)
        manager = CheckpointManager(self.path("manager"), save_interval=1000)
        steps = [self.timed_step() for _ in range(5)]  # (the first ones compile: after the loads, again)
        with Measured(self.barrier) as blocked:
            manager.save_async(len(steps), self.state, force=True)
        step_during_write = self.timed_step()
        start = time.perf_counter()
        manager.join()
        return {
            "blocked": blocked.seconds,
            "blocked_peak": blocked.peak_bytes,
            "copy": copy.seconds,
            "copy_peak": copy.peak_bytes,
            "join": time.perf_counter() - start,
            "step": min(steps[2:]),
            "step_during_write": step_during_write,
        }

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.train_step()
        self.st.sync()
        return time.perf_counter() - start

    def run(self, repeats) -> dict:
        for _ in range(repeats):  # round robin, so the machine's changing load touches every method
            for method in METHODS:
                self.save(method)
        for repeat in range(repeats):
            for method in METHODS:
                self.load(method, check=repeat == 0)  # (reading everything back is slow with 2 processes)
        self.reference.clear()
        self.out["save_async"] = self.save_async()
        return self.out


def run_worker(args) -> dict:
    """Join the job (several processes), build the model and measure; the measurements of this process."""
    role = args.worker.split(":")
    barrier = None
    if role[0] == "multi":
        import shardtensor.runtime as rt

        port, pid, torch_port = role[1], int(role[2]), role[3]
        rt.initialize_distributed(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=pid, world_size=2)
        barrier = dist.barrier
    else:
        # DCP warns that it assumes one process without torch.distributed: that is the case here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    fix_mmap_threshold()
    return Worker(args, barrier).run(args.repeats)


# ---- the launcher -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, processes: int) -> list[dict]:
    """Run the measuring processes (this script with --worker) and return their reports."""
    command = [sys.executable, os.path.abspath(__file__), "--d", str(args.d), "--layers", str(args.layers)]
    command += ["--vocab", str(args.vocab), "--repeats", str(args.repeats)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(SHARDTENSOR_CPU_DEVICES=str(8 // processes), SHARDTENSOR_PLATFORM="cpu")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])  # this checkout's shardtensor
    if processes == 1:
        roles = ["single"]
    else:
        port, torch_port = _free_port(), _free_port()
        roles = [f"multi:{port}:{pid}:{torch_port}" for pid in range(processes)]
    directory = tempfile.mkdtemp(prefix="shardtensor_checkpoint_bench_", dir=args.dir)
    procs: list[subprocess.Popen] = []
    try:
        for role in roles:
            worker = command + ["--dir", directory, "--worker", role]
            procs.append(subprocess.Popen(worker, env=env, stdout=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(directory, ignore_errors=True)
    reports = []
    for role, p, stdout in zip(roles, procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"the measuring process {role} failed (exit {p.returncode}); its errors are above")
        reports.append(json.loads(next(line for line in stdout.splitlines() if line.startswith("REPORT "))[7:]))
    return reports


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def summarize(title: str, reports: list[dict]) -> list[str]:
    """The table of one configuration, and the targets."""
    total = reports[0]["bytes"]
    shard = max(r["shard"] for r in reports)

    def worst(kind, method, what):  # (the slowest process, the largest peak)
        return max(r[kind][method][what] for r in reports)

    lines = [
        f"== {title}: {total / MB:.0f} MB in {reports[0]['tensors']} tensors, largest shard {shard / MB:.1f} MB ==",
        f"{'':<12} {'save s':>7} {'MB/s':>6} {'peak MB':>8}   {'load s':>7} {'MB/s':>6} {'peak MB':>8}",
    ]
    for method in METHODS:
        save, load = worst("save", method, "seconds"), worst("load", method, "seconds")
        lines.append(
            f"{method:<12} {save:>7.2f} {total / MB / save:>6.0f} {worst('save', method, 'peak') / MB:>8.0f}   "
            f"{load:>7.2f} {total / MB / load:>6.0f} {worst('load', method, 'peak') / MB:>8.0f}"
        )
    cpu_copies = worst("save", ".cpu()", "seconds")
    lines.append(f"{'.cpu()':<12} {cpu_copies:>7.2f} {total / MB / cpu_copies:>6.0f}   (the copies torch.save writes)")
    ratio = worst("save", "torch.save", "seconds") / worst("save", "dcp", "seconds")
    shards = max(r["save"]["dcp"]["peak"] / r["shard"] for r in reports)
    lines.append(f"target: DCP save >= 0.8x torch.save's MB/s        {ratio:5.2f}x       {verdict(ratio >= 0.8)}")
    lines.append(f"target: DCP save peak <= 2 shards per process     {shards:5.2f} shards  {verdict(shards <= 2)}")
    if reports[0]["save_async"] is None:
        lines.append("target: save_async: this shardtensor has no checkpoint.CheckpointManager: not measured")
        return lines
    a = {k: max(r["save_async"][k] for r in reports) for k in reports[0]["save_async"]}
    lines.append(
        f"target: save_async blocks <= shards d2h           {a['blocked']:.3f} s vs {a['copy']:.3f} s  "
        f"{verdict(a['blocked'] <= a['copy'])}"
    )
    lines.append(
        f"        (peak {a['blocked_peak'] / MB:.0f} MB vs {a['copy_peak'] / MB:.0f} MB; a step {a['step']:.3f} s, "
        f"{a['step_during_write']:.3f} s while writing; join() waited {a['join']:.2f} s)"
    )
    return lines


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        print("REPORT " + json.dumps(run_worker(args)), flush=True)
        return 0
    if args.dir is None and os.path.isdir("/dev/shm"):
        args.dir = "/dev/shm"
    where = args.dir or tempfile.gettempdir()
    print(f"GPT d={args.d} layers={args.layers} vocab={args.vocab}, AdamW, float32; checkpoints under {where}")
    for processes, name, title in ((1, "single", "1 process x 8 devices"), (2, "multi", "2 processes x 4 devices")):
        if args.only in (None, name):
            start = time.perf_counter()
            for line in summarize(title, launch(args, processes)):
                print(line)
            print(f"({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
