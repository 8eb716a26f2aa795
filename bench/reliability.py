"""Nothing lost: training steps interrupted by Ctrl-C at random points, and steps that cannot run.

Interrupts: a small MLP trains on a (4, 2) mesh beside a CPU twin in eager PyTorch, in lazy mode
(SGD, one ``st.step()`` per step) and with ``st.compile`` (Adam, capturable). Each
step gets a SIGINT from a timer thread at a random moment: while recording, compiling, dispatching,
waiting or reading back, or just after the step. Then every parameter and optimizer state tensor
must be readable and equal to its value either before or after the step in eager torch; the twin
takes the device's state and training goes on. A last stretch of uninterrupted steps must match the
twin step for step. (Lazy mode uses plain SGD, whose update is one op per parameter: an interrupt
inside a multi-op update such as momentum's ``mul_`` then ``add_`` leaves that buffer half updated,
in eager torch as here.)

Failed executions: steps whose program cannot fit (a batch too big for a memory limit, in lazy mode,
in a first ``st.compile`` call, in a frozen ``st.compile`` replay, in eager mode; and a real
address-space limit with no configured limit) must raise ``torch.OutOfMemoryError`` at the step,
keep every parameter and optimizer state at its value before the step, and a retry with a small
batch must train exactly as eager torch. Last, in a subprocess, a program that runs out of memory
while it runs on some devices only (nothing configured refuses it) must raise when its result is read,
not hang while the other devices wait for them in a collective; it also updates a weight and its
momentum in place. It runs twice: with parameter aliasing on (the default, as PyTorch/XLA), the
program had consumed their donated buffers, so they are lost by design and reading them must raise
``st.ConsumedInputError``; with it off (``--param-aliasing 0``, ``XLA_ENABLE_PARAM_ALIASING=0``)
both must keep their values.

Usage::

    python bench/reliability.py                   # 200 interrupts per mode
    python bench/reliability.py --interrupts 50   # quicker

It prints ``interrupts tried / state lost``, ``failed executions tried / state lost`` and, for each
aliasing setting, the failures while running with the state they lost, and exits with status 1 if
any state was lost (other than the donated state with aliasing on, which must say so when read).
"""

from __future__ import annotations

import os

# Before anything imports jax.
os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")

import argparse  # noqa: E402
import copy  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardtensor as st  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
MESH = st.Mesh(range(8), (4, 2), ("data", "model"))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def shard_model(model):
    dev = copy.deepcopy(model).to(st.device())
    st.mark_sharding(dev[0].weight, MESH, ("model", None))
    st.mark_sharding(dev[2].weight, MESH, (None, "model"))
    return dev


def make_optimizer(kind, params, on_device):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2, capturable=on_device)


def batch(rng, n):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def upload(x, y):
    return st.shard(x, MESH, ("data", None)), st.shard(y, MESH, ("data",))


def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def state_tensors(model, opt):
    """name -> tensor (or None where the optimizer has no state yet), parameters and optimizer state."""
    out = {f"param{i}": p for i, p in enumerate(model.parameters())}
    for i, p in enumerate(model.parameters()):
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"param{i}.{key}"] = value
    return out


def cpu_state(model, opt):
    return {k: v.detach().cpu().clone() for k, v in state_tensors(model, opt).items()}


def load_twin(twin, twin_opt, model, opt):
    """Make the twin's parameters and optimizer state those of the device model."""
    device_state = cpu_state(model, opt)
    twin_state = state_tensors(twin, twin_opt)
    with torch.no_grad():
        for p, d in zip(twin.parameters(), model.parameters()):
            p.copy_(d.cpu())
    twin_params = list(twin.parameters())
    for i, p in enumerate(model.parameters()):
        dev_state = opt.state.get(p, {})
        if not dev_state:
            twin_opt.state.pop(twin_params[i], None)
            continue
        twin_opt.state[twin_params[i]] = {
            k: (
                device_state[f"param{i}.{k}"].reshape(twin_state.get(f"param{i}.{k}", v).shape)
                if isinstance(v, torch.Tensor)
                else v
            )
            for k, v in dev_state.items()
        }
    twin_opt.zero_grad(set_to_none=True)


def matches(value, *candidates):
    return any(
        c is not None and value.shape == c.shape and torch.allclose(value, c, rtol=RTOL, atol=ATOL) for c in candidates
    )


def lost_state(model, opt, before, after):
    """Names of state tensors unreadable or equal to neither their value before nor after the step."""
    lost = []
    for name, t in state_tensors(model, opt).items():
        try:
            value = t.detach().cpu()
        except Exception as error:  # noqa: BLE001  (any failure to read is a loss, reported by name)
            lost.append(f"{name}: {type(error).__name__}: {error}"[:200])
            continue
        if not matches(value, before.get(name), after.get(name)):
            lost.append(name)
    return lost


def _interrupt_after(delay):
    def fire():
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


def interrupt_loop(kind, tries, seed=0):
    """(interrupts tried, landed inside the step, steps whose state was lost, resumed correctly?)."""
    rng = random.Random(seed)
    twin = make_model()
    model = shard_model(twin)
    twin_opt, opt = make_optimizer(kind, twin.parameters(), False), make_optimizer(kind, model.parameters(), True)
    step = st.compile(train_step) if kind == "adam" else None

    def device_step(x, y):
        if step is not None:
            return step(model, opt, x, y)
        with st.step():
            loss = train_step(model, opt, x, y)
        return loss

    # the step time, to spread the interrupts over it (the first steps compile)
    for _ in range(3):
        x, y = batch(rng, 32)
        device_step(*upload(x, y)).item()
        train_step(twin, twin_opt, x, y)
    x, y = batch(rng, 32)
    start = time.perf_counter()
    device_step(*upload(x, y)).item()
    span = 1.1 * (time.perf_counter() - start)
    train_step(twin, twin_opt, x, y)

    inside = lost_steps = 0
    for _ in range(tries):
        x, y = batch(rng, 32)
        before = cpu_state(twin, twin_opt)
        train_step(twin, twin_opt, x, y)
        after = cpu_state(twin, twin_opt)
        timer, done = None, False
        try:
            timer = _interrupt_after(rng.uniform(0, span))
            device_step(*upload(x, y)).item()
            done = True
            timer.join()  # the interrupt lands after the step at the latest
            time.sleep(1)  # (not reached: the signal arrives while joining or just after)
        except KeyboardInterrupt:
            inside += not done
        if timer is not None:
            timer.join()
        torch.set_grad_enabled(True)
        opt.zero_grad(set_to_none=True)
        lost = lost_state(model, opt, before, after)
        if lost:
            lost_steps += 1
            print(f"  {kind}: state lost: {', '.join(lost)}", flush=True)
            return tries, inside, lost_steps, False
        load_twin(twin, twin_opt, model, opt)
    resumed = _trains_alike(rng, twin, twin_opt, model, opt, device_step)
    return tries, inside, lost_steps, resumed


def _trains_alike(rng, twin, twin_opt, model, opt, device_step, steps=3, n=32):
    for _ in range(steps):
        x, y = batch(rng, n)
        ref_loss = train_step(twin, twin_opt, x, y)
        loss = device_step(*upload(x, y))
        if not torch.allclose(loss.cpu(), ref_loss, rtol=RTOL, atol=ATOL):
            return False
    return not lost_state(model, opt, {}, cpu_state(twin, twin_opt))


# --- failed executions ---------------------------------------------------------------------------
def failed_executions():
    """[(scenario, state lost?)] for steps refused for memory, each followed by a good retry."""
    results = []
    for kind, where in (
        ("momentum", "lazy"),
        ("adam", "compile"),
        ("adam", "frozen"),
        ("momentum", "eager"),
        ("momentum", "address-space"),
    ):
        results.append((f"{where} ({kind})", _failed_execution(kind, where)))
    return results


def _failed_execution(kind, where):
    rng = random.Random(1)
    twin = make_model()
    model = shard_model(twin)
    twin_opt, opt = make_optimizer(kind, twin.parameters(), False), make_optimizer(kind, model.parameters(), True)
    compiled = st.compile(train_step)

    def device_step(x, y):
        if where in ("compile", "frozen"):
            return compiled(model, opt, x, y)
        if where == "eager":
            with st.eager_mode(True):
                return train_step(model, opt, x, y)
        with st.step():
            loss = train_step(model, opt, x, y)
        return loss

    # 4 MiB / 32 MiB of inputs per device (the address-space case: 8 x 110 MiB do not fit in 512 MiB)
    big = 1 << 18 if where != "address-space" else 1 << 21
    for _ in range(3 if where == "frozen" else 1):  # the frozen case: trace, trace, replay from here on
        x, y = batch(rng, 32)
        train_step(twin, twin_opt, x, y)
        device_step(*upload(x, y)).item()
    before = cpu_state(twin, twin_opt)
    x_big, y_big = upload(torch.randn(big, 16), torch.randint(0, 4, (big,)))
    refused = False
    limit = resource.getrlimit(resource.RLIMIT_AS)
    try:
        if where == "address-space":
            # a real limit, nothing configured: 8 devices x 75 MiB of activations do not fit in 512 MiB
            # more (also less than the share of the host's RAM below which nothing else is checked)
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 29), limit[1]))
        elif where == "frozen":
            st.set_device_memory_limit("1KiB")  # the replay's own (small) program no longer fits
            x_big, y_big = upload(*batch(rng, 32))
        else:
            st.set_device_memory_limit("4MiB")
        replays = st.counter_value("CompileReplay") or 0
        device_step(x_big, y_big).item()
    except torch.OutOfMemoryError as error:
        refused = where != "frozen" or (st.counter_value("CompileReplay") or 0) > replays
        print(f"  {where}: {str(error)[:160]}...", flush=True)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)
        st.set_device_memory_limit(None)
        torch.set_grad_enabled(True)
    del x_big, y_big
    opt.zero_grad(set_to_none=True)
    lost = lost_state(model, opt, before, before)
    if lost:
        print(f"  {where}: state lost: {', '.join(lost)}", flush=True)
    return not refused or bool(lost) or not _trains_alike(rng, twin, twin_opt, model, opt, device_step)


def async_failure(aliasing):
    """Run out of memory while running, on some devices only (no limit refuses the program first):
    the others wait for them in a collective. The program also updates two state tensors in place
    (a weight and its momentum), donated when ``aliasing`` is on. Reading the result must raise, not
    hang; then each state tensor must hold its value from before (aliasing off) or raise
    ``st.ConsumedInputError`` (on). Returns (the error's first line or None, [(name, outcome)])."""
    st.set_param_aliasing(aliasing)
    st.set_device_memory_limit("1TB")  # pretend the devices are big: the program is not refused
    mesh = st.Mesh(range(8), (8,), ("x",))
    torch.manual_seed(0)
    initial = {"weight": torch.rand(8192, 256), "momentum": torch.rand(8192, 256)}
    state = {name: st.shard(value, mesh, ("x", None)) for name, value in initial.items()}
    st.sync(wait=True)
    total = (state["weight"].repeat(1, 8) * 2).sort(1).values[:, :8].sum()  # ~350 MiB per device, then an all-reduce
    state["momentum"].mul_(0.9).add_(total)
    state["weight"].add_(state["momentum"], alpha=-0.1)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), limit[1]))
    message = None
    try:
        total.item()
    except st.ExecutionFailedError as error:
        message = str(error).splitlines()[0][:200]
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)
    outcomes = []
    for name, t in state.items():
        try:
            kept = torch.equal(t.cpu(), initial[name])
            outcomes.append((name, "kept" if kept else "WRONG VALUE"))
        except st.ConsumedInputError as error:
            outcomes.append((name, f"consumed, says so ({str(error)[:90]}...)"))
        except Exception as error:  # noqa: BLE001  (anything else is a loss without a clear word)
            outcomes.append((name, f"UNREADABLE: {type(error).__name__}: {str(error)[:120]}"))
    return message, outcomes


def _start_async_failure(aliasing):
    """The scenario in its own process (the devices left waiting stay stuck), started at once so it
    runs beside the rest."""
    return subprocess.Popen(
        [sys.executable, __file__, "--async-failure", "--param-aliasing", str(int(aliasing))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _async_failure_result(process, timeout=120):
    """(tried, raised, hung, state tensors lost, lost without a clear error) of a scenario started by
    ``_start_async_failure``."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return 1, 0, 1, 0, 0
    lines = out.strip().splitlines()
    for line in lines or [err[-300:]]:
        print("  " + line, flush=True)
    states = [line for line in lines if line.startswith("state ")]
    lost = sum(" kept" not in line for line in states)
    silent = sum(" kept" not in line and "consumed, says so" not in line for line in states)
    return 1, int(any(line.startswith("raised:") for line in lines)), 0, lost, silent + (2 - len(states))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interrupts", type=int, default=200, help="interrupted steps per mode (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-failure", action="store_true", help="only the failure while running (a subprocess)")
    p.add_argument(
        "--param-aliasing",
        type=int,
        choices=(0, 1),
        default=1,
        help="with --async-failure: programs donate what they overwrite (1, the default) or not",
    )
    args = p.parse_args()
    if args.async_failure:
        message, outcomes = async_failure(bool(args.param_aliasing))
        print(f"raised: {message}" if message else "nothing raised")
        for name, outcome in outcomes:
            print(f"state {name}: {outcome}")
        return
    running = {True: _start_async_failure(True)}  # the two settings one after the other (memory)
    lost_any = False
    total = lost_total = 0
    for kind, label in (("sgd", "lazy, SGD"), ("adam", "st.compile, Adam")):
        start = time.perf_counter()
        tried, inside, lost, resumed = interrupt_loop(kind, args.interrupts, args.seed)
        print(
            f"interrupts ({label}): {tried} tried, {inside} inside the step, {lost} state lost, "
            f"training resumed alike: {resumed} ({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
        total, lost_total = total + tried, lost_total + lost
        lost_any |= bool(lost) or not resumed
    print(f"interrupts tried / state lost: {total} / {lost_total}")
    start = time.perf_counter()
    results = failed_executions()
    failed = sum(lost for _, lost in results)
    for name, lost in results:
        outcome = "STATE LOST" if lost else "refused at the step, state kept, retry trains alike"
        print(f"failed execution, {name}: {outcome}")
    print(f"failed executions tried / state lost: {len(results)} / {failed} ({time.perf_counter() - start:.1f} s)")
    for aliasing in (True, False):
        if aliasing not in running:
            running[aliasing] = _start_async_failure(aliasing)
        tried, raised, hung, lost, silent = _async_failure_result(running.pop(aliasing))
        setting = "on (donated)" if aliasing else "off"
        print(
            f"failures while running (out of memory on some devices), parameter aliasing {setting}: {tried} tried, "
            f"{raised} raised on read, {hung} hung, state lost: {lost} of 2, lost without a clear error: {silent}"
        )
        # on, the donated state is lost by design (and must say so); off, nothing may be lost
        lost_any |= raised < tried or bool(silent) or (not aliasing and bool(lost))
    sys.exit(1 if lost_any else 0)


if __name__ == "__main__":
    main()
