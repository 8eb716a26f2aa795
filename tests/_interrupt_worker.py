"""What tests/test_ctrl_c.py runs in fresh processes: real Ctrl-Cs (SIGINT sent to the process) at chosen
delays or at chosen points of a call, then every tensor compared with eager torch. Prints one JSON report.

    python tests/_interrupt_worker.py first_calls ROOT DELAY_CONTACT DELAY_STEP DELAY_SAVE SAVE_KIND
    python tests/_interrupt_worker.py load ROOT TRIALS
    python tests/_interrupt_worker.py replay FROZEN_TRIALS TRACE_TRIALS
    python tests/_interrupt_worker.py no_read_loops CALLS

A delay of ``-`` sends no signal (the run then reports how long each phase took: the timeline the
test picks its delays from).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import threading
import time
import warnings

warnings.simplefilter("ignore")  # (torch.distributed's "disabled" warnings: the report is the last line)
os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardtensor as st  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def ctrl_c_after(fn, delay):
    """Run ``fn`` with a SIGINT sent to this process ``delay`` seconds after it starts (None: none);
    if ``fn`` returns first, the signal lands just after it. Returns (what ended it: "returned" or the
    exception's type, seconds ``fn`` ran)."""
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)) if delay is not None else None
    start = time.perf_counter()
    outcome = "returned"
    try:
        try:
            if timer is not None:
                timer.start()
            fn()
        finally:
            took = time.perf_counter() - start
            if timer is not None:
                timer.join()
                for _ in range(1000):  # (the signal lands here at the latest, inside)
                    pass
    except BaseException as error:  # noqa: BLE001  (DCP wraps a KeyboardInterrupt in a BaseException of its own)
        outcome = type(error).__name__
    torch.set_grad_enabled(True)  # (a Ctrl-C inside torch.no_grad()'s __enter__ leaves it off, as in torch)
    return outcome, took


def close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL)


def twin_model(seed: int = 0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batches(count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(count)]


def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def state_tensors(model, opt) -> dict:
    out = {f"param{i}": p for i, p in enumerate(model.parameters())}
    for i, p in enumerate(model.parameters()):
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"param{i}.{key}"] = value
    return out


def on_host(model, opt) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state_tensors(model, opt).items()}


def load_twin(twin, twin_opt, model, opt) -> None:
    """The twin takes the device model's parameters and optimizer state."""
    with torch.no_grad():
        for p, d in zip(twin.parameters(), model.parameters()):
            p.copy_(d.cpu())
    for tp, p in zip(twin.parameters(), model.parameters()):
        twin_opt.state.pop(tp, None)
        if opt.state.get(p):
            twin_opt.state[tp] = {
                k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()
            }


def classify(now: dict, *candidates: dict) -> dict:
    """name -> index of the first candidate (before, after...) each tensor equals, or -1 (neither)."""
    return {k: next((i for i, c in enumerate(candidates) if k in c and close(v, c[k])), -1) for k, v in now.items()}


# --- a process's first contact, first lazy step and first save -------------------------------------
def first_calls(root: str, delays: list, save_kind: str) -> dict:
    """Ctrl-C during the first move to the devices, the first lazy step (recording, compiling, running,
    reading) and the first checkpoint save: later steps must equal eager torch, later saves and loads
    must work and give the same tensors."""
    report: dict = {"took": {}, "ended": {}, "problems": []}
    twin, data = twin_model(), batches(5)
    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))
    placed: list = []

    def contact():  # (torch imports DTensor and sympy at the first op on a tensor subclass)
        placed.append(copy.deepcopy(twin).to(st.device()))

    report["ended"]["contact"], report["took"]["contact"] = ctrl_c_after(contact, delays[0])
    model = placed[0] if placed else copy.deepcopy(twin).to(st.device())  # (interrupted: moved again)
    st.mark_sharding(model[0].weight, mesh, ("model", None))
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(twin.parameters(), lr=0.05)
    st.sync(wait=True)

    def upload(x, y):
        return st.shard(x, mesh, ("data", None)), st.shard(y, mesh, ("data",))

    before = on_host(twin, twin_opt)
    train_step(twin, twin_opt, *data[0])
    after = on_host(twin, twin_opt)

    def first_step():
        with st.step():
            loss = train_step(model, opt, *upload(*data[0]))
        loss.item()

    report["ended"]["step"], report["took"]["step"] = ctrl_c_after(first_step, delays[1])
    opt.zero_grad(set_to_none=True)
    states = classify(on_host(model, opt), before, after)
    report["problems"] += [
        f"{k} after the first step: neither its value before nor after" for k, c in states.items() if c < 0
    ]
    load_twin(twin, twin_opt, model, opt)
    try:
        for i, (x, y) in enumerate(data[1:4], 1):  # later steps give torch's results
            expected = train_step(twin, twin_opt, x, y)
            with st.step():
                loss = train_step(model, opt, *upload(x, y))
            bad = [k for k, v in on_host(model, opt).items() if not close(v, on_host(twin, twin_opt)[k])]
            if not close(loss.cpu(), expected) or bad:
                report["problems"].append(f"step {i} differs from eager torch: loss, {bad}")
    except Exception as error:  # noqa: BLE001  (reported: a broken process is what is tested)
        report["problems"].append(f"a later step raised {type(error).__name__}: {error}"[:400])

    state = {"model": model.state_dict(), "step": 7}
    expected_state = {k: v.cpu() for k, v in model.state_dict().items()}

    managers: list = []

    def first_save():
        if save_kind == "save":
            st.checkpoint.save(state, os.path.join(root, "first"))
            return
        manager = st.checkpoint.CheckpointManager(os.path.join(root, "first_managed"), save_interval=1)
        managers.append(manager)
        if save_kind == "manager.save":
            manager.save(1, state)
        else:
            manager.save_async(1, state)
            manager.join()

    report["ended"]["save"], report["took"]["save"] = ctrl_c_after(first_save, delays[2])
    try:  # later saves and loads work and give the same tensors
        for j, spec in enumerate([("data", "model"), None]):
            path = os.path.join(root, f"again{j}")
            st.checkpoint.save(state, path)
            target = {"model": _zeros_like(model.state_dict(), mesh, spec), "step": 0}
            st.checkpoint.load(target, path)
            _compare(report, f"load {j}", target, expected_state)
        # (the interrupted manager itself, if it was made: a slot it lost would make save_async wait for ever)
        manager = (managers or [st.checkpoint.CheckpointManager(os.path.join(root, "managed"), save_interval=1)])[0]
        manager.save(1, state)
        manager.save_async(2, state)
        manager.join()
        for step in (1, 2):
            target = {"model": _zeros_like(model.state_dict(), mesh, ("model", None)), "step": 0}
            manager.load(step, target)
            _compare(report, f"manager load {step}", target, expected_state)
    except BaseException as error:  # noqa: BLE001  (reported: a broken process is what is tested)
        report["problems"].append(f"a later save or load raised {type(error).__name__}: {error}"[:400])
    return report


def _zeros_like(state_dict, mesh, spec):
    out = {}
    for k, v in state_dict.items():
        zeros = torch.zeros(v.shape, dtype=v.dtype)
        out[k] = zeros if spec is None else st.shard(zeros, mesh, spec[: v.dim()])
    return out


def _compare(report, what, target, expected) -> None:
    if target["step"] != 7:
        report["problems"].append(f"{what}: step {target['step']}, saved 7")
    bad = [k for k, v in expected.items() if not torch.equal(target["model"][k].cpu(), v)]
    if bad:
        report["problems"].append(f"{what}: {bad} differ from what was saved")


# --- loads interrupted at their end -----------------------------------------------------------------
class CtrlCAtCall:
    """A SIGINT sent to this process at the ``at``-th Python call made after ``arm()``: the signal lands
    at the next point the interpreter looks, as a real Ctrl-C arriving then would."""

    def __init__(self):
        self.count, self.at = 0, 0

    def arm(self, at: int) -> None:
        self.count, self.at = 0, at
        sys.settrace(self._trace)

    def _trace(self, frame, event, arg):
        if event == "call":
            self.count += 1
            if self.count == self.at:
                sys.settrace(None)
                os.kill(os.getpid(), signal.SIGINT)

    def run(self, fn, at: int, armed: bool = True):
        """Run ``fn`` with the signal at its ``at``-th call (0: none), counting from its start, or from
        an ``arm(at)`` made inside it (``armed=False``: a hook arms it). Returns (what ended it, the
        calls counted)."""
        self.count, self.at = 0, at
        outcome = "returned"
        try:
            try:
                if armed:
                    self.arm(at)
                fn()
            finally:
                sys.settrace(None)
                for _ in range(1000):  # (a signal sent as fn returned lands here, inside)
                    pass
        except BaseException as error:  # noqa: BLE001  (DCP wraps a KeyboardInterrupt in a BaseException of its own)
            outcome = type(error).__name__
        sys.settrace(None)
        self.at = 0
        torch.set_grad_enabled(True)  # (a Ctrl-C inside torch.no_grad()'s __enter__ leaves it off, as in torch)
        return outcome, self.count


def load(root: str, trials: int) -> dict:
    """A model and its optimizer (Stateful: st.checkpoint.load calls their load_state_dict) loaded with a
    Ctrl-C at points spread over the end of the load, from when DCP has read everything (its call of the
    model's load_state_dict) to the return, where the values go into the targets: all of them must keep
    their values or all take the checkpoint's."""

    mesh = st.Mesh(range(8), (4, 2), ("a", "b"))

    def model_and_optimizer(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]).to(st.device())
        st.mark_sharding(model[0].weight, mesh, ("a", "b"))
        st.mark_sharding(model[1].weight, mesh, ("a", None))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(4, 8).to(st.device())).sum().backward()
        opt.step()
        opt.zero_grad()
        st.sync(wait=True)
        return model, opt

    path = os.path.join(root, "ck")
    saved_model, saved_opt = model_and_optimizer(1)
    st.checkpoint.save({"model": saved_model, "optim": saved_opt}, path)
    new = on_host(saved_model, saved_opt)
    ctrl_c = CtrlCAtCall()

    def interrupted_load(at):
        model, opt = model_and_optimizer(2)
        hooked: list = []

        def arm_once(*args):  # (the first call: DCP's, once it has read everything)
            if not hooked:
                hooked.append(True)
                ctrl_c.arm(at)

        model.register_load_state_dict_pre_hook(arm_once)
        old = on_host(model, opt)
        ended, calls = ctrl_c.run(lambda: st.checkpoint.load({"model": model, "optim": opt}, path), at, armed=False)
        return calls, ended, old, on_host(model, opt)

    calls, _, _, _ = interrupted_load(0)  # (the first load imports what loads need; then the count)
    calls, _, _, _ = interrupted_load(0)
    report: dict = {"calls": calls, "interrupted": 0, "mixed": []}
    for at in sorted({1 + i * calls // trials for i in range(trials)}):  # (evenly spread: no gap is wider)
        _, ended, old, now = interrupted_load(at)
        report["interrupted"] += ended != "returned"
        changed = [k for k in old if not close(old[k], new[k])]
        loaded = [k for k in changed if close(now[k], new[k])]
        kept = [k for k in changed if close(now[k], old[k])]
        if sorted(loaded) != sorted(changed) and sorted(kept) != sorted(changed):
            report["mixed"].append(f"signal at call {at}: {len(loaded)} loaded, {len(kept)} kept of {len(changed)}")
    return report


# --- frozen replays and the trace calls of st.compile -----------------------------------------------
def replay(frozen_trials: int, trace_trials: int) -> dict:
    """A SIGINT sent at points spread evenly over the Python calls of a frozen call (the signal lands at
    the next point the interpreter looks), and over the traced calls of a new ``st.compile`` step from
    its optimizer step on: a frozen call leaves the parameters and optimizer state all before the step
    or all after; a traced call leaves every parameter at the same step (SGD updates them all in one
    foreach op, which torch's kernel runs whole), each one's value from before or after."""
    mesh = st.Mesh(range(8), (4, 2), ("data", "model"))
    twin = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    model = copy.deepcopy(twin).to(st.device())
    st.mark_sharding(model[0].weight, mesh, ("model", None))
    adam, twin_adam = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(twin.parameters(), lr=1e-2)
    sgd, twin_sgd = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(twin.parameters(), lr=0.05)
    data = iter(batches(10_000))
    ctrl_c = CtrlCAtCall()
    frozen = st.compile(train_step)
    for _ in range(4):
        x, y = next(data)
        frozen(model, adam, st.shard(x, mesh, ("data", None)), st.shard(y, mesh, ("data",))).item()
        train_step(twin, twin_adam, x, y)
    sgd.register_step_pre_hook(lambda *args: ctrl_c.arm(ctrl_c.at) if ctrl_c.at and not ctrl_c.count else None)
    step_ends: list = []  # the count when the first optimizer step returns
    sgd.register_step_post_hook(lambda *args: step_ends.append(ctrl_c.count))

    def trial(call, opt, twin_opt, steps, at, armed_at_start):
        """(Python calls counted, each tensor's state: the index of the candidate it equals, -1 none;
        the candidates: before, after one step, after two)."""
        opt.zero_grad(set_to_none=True)
        load_twin(twin, twin_opt, model, opt)
        x, y = next(data)
        xs, ys = st.shard(x, mesh, ("data", None)), st.shard(y, mesh, ("data",))
        candidates = [on_host(twin, twin_opt)]
        for _ in range(steps):
            train_step(twin, twin_opt, x, y)
            candidates.append(on_host(twin, twin_opt))
        st.sync(wait=True)
        _, calls = ctrl_c.run(lambda: call(xs, ys), at, armed=armed_at_start)
        opt.zero_grad(set_to_none=True)
        return calls, classify(on_host(model, opt), *candidates), candidates

    def one_frozen_call(xs, ys):
        frozen(model, adam, xs, ys)

    def two_traced_calls(xs, ys):
        traced = st.compile(train_step)  # (its calls 1 and 2 run the Python)
        traced(model, sgd, xs, ys)
        traced(model, sgd, xs, ys)

    report: dict = {"frozen_trials": 0, "frozen_mixed": [], "trace_trials": 0, "trace_split": []}
    calls, _, _ = trial(one_frozen_call, adam, twin_adam, 1, 0, True)  # (no signal: the count)
    for at in sorted({1 + i * calls // frozen_trials for i in range(frozen_trials)}):
        _, states, candidates = trial(one_frozen_call, adam, twin_adam, 1, at, True)
        moved = {c for k, c in states.items() if not close(candidates[0][k], candidates[1][k])}
        report["frozen_trials"] += 1
        if moved != {0} and moved != {1}:
            report["frozen_mixed"].append(f"signal at call {at}: {sorted(states.items())}")
    for _ in range(2):  # (counted from the first optimizer step; the first run also compiles)
        step_ends.clear()
        calls, _, _ = trial(two_traced_calls, sgd, twin_sgd, 2, 10**9, False)
    # most points in that first optimizer step (its foreach update), the others over the rest of both calls
    half = trace_trials * 3 // 4
    points = {1 + i * step_ends[0] // half for i in range(half)}
    points |= {
        step_ends[0] + 1 + i * (calls - step_ends[0]) // (trace_trials - half) for i in range(trace_trials - half)
    }
    for at in sorted(points):
        _, states, _ = trial(two_traced_calls, sgd, twin_sgd, 2, at, False)
        report["trace_trials"] += 1
        if len(set(states.values())) != 1 or -1 in states.values():
            report["trace_split"].append(f"signal at call {at}: {sorted(states.items())}")
    return report


# --- loops that read nothing --------------------------------------------------------------------------
def no_read_loops(calls: int) -> dict:
    """A frozen step that returns nothing, lazy steps and eager ops, each in a loop that never reads a
    result: they must not abort (XLA:CPU ends the process when more than it queues are in flight), stay
    within the bound and train as eager torch."""
    from shardtensor.graph import inflight

    mesh = st.Mesh(range(8), (8,), ("d",))
    torch.manual_seed(0)
    ref = nn.Linear(512, 512)
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    xs, ys = st.shard(x, mesh, ("d", None)), st.shard(y, mesh, ("d", None))
    report: dict = {"bound": inflight.max_in_flight(), "most": {}, "differs": [], "took": {}}
    for kind in ("frozen", "lazy", "eager"):
        model, twin = copy.deepcopy(ref).to(st.device()), copy.deepcopy(ref)
        opt, twin_opt = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(twin.parameters(), lr=1e-3)

        def step(model=model, opt=opt):
            loss = (model(xs) - ys).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

        frozen = st.compile(step)
        n = {"frozen": calls, "lazy": 8, "eager": 4}[kind]
        most, start = 0, time.perf_counter()
        st.eager_mode(kind == "eager")
        try:
            for _ in range(n):
                if kind == "frozen":
                    frozen()
                elif kind == "lazy":
                    with st.step():
                        step()
                else:
                    step()
                most = max(most, inflight.in_flight())
        finally:
            st.eager_mode(False)
        report["most"][kind] = most
        for _ in range(n):
            (twin(x) - y).pow(2).mean().backward()
            twin_opt.step()
            twin_opt.zero_grad()
        for got, expected in ((model.weight, twin.weight), (model.bias, twin.bias)):
            # (Adam over many steps: an element whose gradient is near zero moves by up to lr either way, so
            # kernels that round differently (XLA, torch per CPU ISA) give differences of a fraction of lr)
            if not torch.allclose(got.cpu(), expected, rtol=1e-4, atol=1e-4):
                report["differs"].append(f"{kind}: {float((got.cpu() - expected).abs().max())}")
        report["took"][kind] = time.perf_counter() - start
    return report


def main(scenario: str, args: list) -> dict:
    if scenario == "first_calls":
        delays = [None if a == "-" else float(a) for a in args[1:4]]
        return first_calls(args[0], delays, args[4])
    if scenario == "load":
        return load(args[0], int(args[1]))
    if scenario == "replay":
        return replay(int(args[0]), int(args[1]))
    return no_read_loops(int(args[0]))


if __name__ == "__main__":
    # (Python's own Ctrl-C, as in a terminal: a process started in the background by a non-interactive
    # shell, as some CI runners do, inherits SIGINT ignored and Python then installs no handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = main(sys.argv[1], sys.argv[2:])
    except BaseException as error:  # noqa: BLE001  (a process an interrupt broke: said in the report)
        result = {"problems": [f"the scenario raised {type(error).__name__}: {error}"[:600]]}
    print(json.dumps(result))
