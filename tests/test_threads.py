"""Issue 11 §5: threads. Each thread records and runs its own work (its mode and pending graph are
its own, shared state changes under one lock): four threads training four models at once end where
four sequential eager-torch runs end, in lazy, eager and compiled mode; a tensor made in one thread
works in another; one thread's eager mode is not another's."""

import threading

import pytest
import torch
import torch.nn as nn

import shardtensor as st
from _training_helpers import reset_state

THREADS, STEPS = 4, 5


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _make(seed):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(STEPS)]
    return model, batches


def _train(model, batches, mode=None):
    """SGD with momentum; ``mode``: None (eager torch on CPU) or a shardtensor mode."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x, y):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    if mode == "compile":
        step = st.compile(step)
    losses = []
    with st.eager_mode(mode == "eager"):
        for x, y in batches:
            if mode is not None:
                x, y = x.to(st.device()), y.to(st.device())
            if mode == "lazy":
                with st.step():
                    loss = step(x, y)
            else:
                loss = step(x, y)
            losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def _in_threads(work):
    """Run ``work(i)`` in THREADS threads at once; their results, or the first error raised."""
    results, errors = [None] * THREADS, []
    start = threading.Barrier(THREADS)

    def run(i):
        try:
            start.wait()
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 — re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("mode", ["lazy", "eager", "compile"])
def test_threads_train_separate_models_as_sequential_runs(mode):
    expected = [_train(*_make(i)) for i in range(THREADS)]

    def work(i):
        model, batches = _make(i)
        return _train(model.to(st.device()), batches, mode)

    for (losses, params), (ref_losses, ref_params) in zip(_in_threads(work), expected):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)


def test_tensor_made_in_one_thread_works_in_another():
    x = torch.randn(8, 4)
    made = {}

    def producer():  # leaves a pending value behind, and its thread ends
        made["y"] = x.to(st.device()) * 3 + 1

    t = threading.Thread(target=producer)
    t.start()
    t.join()
    torch.testing.assert_close(made["y"].cpu(), x * 3 + 1)
    # and the other way round: a pending tensor of this thread, updated in place in another
    z = x.to(st.device()) * 2
    t = threading.Thread(target=lambda: z.add_(1))
    t.start()
    t.join()
    st.sync()
    torch.testing.assert_close(z.cpu(), x * 2 + 1)


def test_modes_are_per_thread():
    seen = {}
    inside, leave = threading.Event(), threading.Event()

    def eager_thread():
        with st.eager_mode(True):
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=eager_thread)
    t.start()
    inside.wait(30)
    seen["here"] = st.is_eager_mode()
    leave.set()
    t.join()
    assert seen["here"] is False
    assert not st.is_eager_mode()
