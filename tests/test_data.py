"""Issue 5 §2: MpDeviceLoader and ShardingSpec(minibatch=True).

Batches come out on st.device() with the shardings input_sharding asks for and the values of the
CPU batches; the errors of PyTorch/XLA's test_mp_input_sharding.py; len, re-iteration, early
break and deletion (no thread left behind), worker errors, batches_per_execution (MarkStep counts),
uneven batches (padded, shape kept) and minibatch divisibility; and a short training loop fed by
the loader, compared with eager PyTorch.
"""

import collections
import copy
import os
import threading
import time
import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import shardtensor as st
from _training_helpers import MLP, fresh_executable_cache, reset_state
from shardtensor.sharding import minibatch_local_tiles

MESH_8 = st.Mesh(range(8), (8,), ("data",))
MESH_42 = st.Mesh(range(8), (4, 2), ("data", "model"))
ALL_8 = "{devices=[8,1]0,1,2,3,4,5,6,7}"


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    yield
    reset_state()


def _batches(n, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*s, generator=g) for s in shapes) for _ in range(n)]


def _wait_stopped(threads, timeout=5.0):
    """True once none of ``threads`` is alive (polling; never hangs)."""
    deadline = time.monotonic() + timeout
    while any(t.is_alive() for t in threads):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _threads_of(loader):
    return list(loader._pipeline.threads)


def _same(dev, cpu):
    assert isinstance(dev, st.ShardedTensor)
    assert dev.shape == cpu.shape and dev.dtype == cpu.dtype
    torch.testing.assert_close(dev.cpu(), cpu, rtol=0, atol=0)


class SlowLoader:
    """``n`` batches; each read takes ``delay`` seconds; raises ``error`` at batch ``fail_at``."""

    def __init__(self, n=100, delay=0.0, fail_at=None, error=None):
        self.n, self.delay, self.fail_at, self.error = n, delay, fail_at, error
        self.started = 0

    def __len__(self):
        return self.n

    def __iter__(self):
        self.started += 1
        for i in range(self.n):
            if i == self.fail_at:
                raise self.error
            time.sleep(self.delay)
            yield torch.full((8, 2), float(i))


# --------------------------------------------------------------------------- shardings and values


def test_tensor_spec_shards_matching_rank_and_replicates_the_rest():
    data = _batches(3, (16, 4), (16,))
    loader = st.MpDeviceLoader(data, st.device(), input_sharding=st.ShardingSpec(MESH_8, ("data", None)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(loader)
    # PyTorch/XLA's rule, said once: the rank-1 tensor of every batch is replicated
    said = [str(w.message) for w in caught if "MpDeviceLoader" in str(w.message)]
    assert len(said) == 1 and "shape (16,)" in said[0] and "uploaded replicated" in said[0], said
    assert len(got) == 3
    for (x, y), (cx, cy) in zip(got, data):
        _same(x, cx)
        _same(y, cy)
        assert x.partition_spec == st.P("data", None) and x.mesh == MESH_8
        assert x.sharding_spec == ALL_8
        assert y.partition_spec is None and y.sharding_spec == "{replicated}"  # rank 1 != spec's 2


def test_dict_spec_key_by_key_and_non_tensor_values_pass_through():
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8, 4, generator=g), "y": torch.arange(16), "ids": ["a", "b"], "step": 7}
    spec = {"x": st.ShardingSpec(MESH_42, ("data", "model")), "y": st.ShardingSpec(MESH_42, (("data", "model"),))}
    (out,) = list(st.MpDeviceLoader([batch], st.device(), input_sharding=spec))
    assert type(out) is dict and list(out) == ["x", "y", "ids", "step"]
    _same(out["x"], batch["x"])
    _same(out["y"], batch["y"])
    assert out["x"].sharding_spec == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert out["y"].sharding_spec == "{devices=[8]0,1,2,3,4,5,6,7}"
    assert out["ids"] == ["a", "b"] and out["step"] == 7


def test_pytorch_xla_input_sharding_cases():
    """test_mp_input_sharding.py: dict spec, tensor spec, None, one spec over a dict."""
    x, y = torch.randn(16, 8), torch.randn(16, 8, 4)
    spec2, spec3 = st.ShardingSpec(MESH_8, ("data", None)), st.ShardingSpec(MESH_8, ("data", None, None))
    (d,) = st.MpDeviceLoader([{"x": x, "y": y}], st.device(), input_sharding={"x": spec2, "y": spec3})
    assert d["x"].sharding_spec == ALL_8 and d["y"].sharding_spec == "{devices=[8,1,1]0,1,2,3,4,5,6,7}"
    (t,) = st.MpDeviceLoader([x], st.device(), input_sharding=spec2)
    assert t.sharding_spec == ALL_8
    (r,) = st.MpDeviceLoader([x], st.device())
    assert r.sharding_spec == "{replicated}" and r.partition_spec is None
    _same(r, x)
    (both,) = st.MpDeviceLoader([{"a": x, "b": x * 2}], st.device(), input_sharding=spec2)
    assert both["a"].sharding_spec == both["b"].sharding_spec == ALL_8
    _same(both["b"], x * 2)


def test_nested_structures_and_non_tensor_leaves():
    Pair = collections.namedtuple("Pair", "first second")
    x, y, z = torch.randn(8, 2), torch.randint(0, 5, (8,)), torch.randn(8, 3)
    batch = ({"a": [x, (y, "text")], "n": None}, Pair(z, 3.5), collections.OrderedDict(k=z), torch.tensor(2))
    (out,) = list(st.MpDeviceLoader([batch], st.device(), input_sharding=st.ShardingSpec(MESH_8, ("data", None))))
    inner, pair, od, scalar = out
    assert type(out) is tuple and type(pair) is Pair and type(od) is collections.OrderedDict
    _same(inner["a"][0], x)
    _same(inner["a"][1][0], y)
    assert inner["a"][1][1] == "text" and inner["n"] is None and pair.second == 3.5
    _same(pair.first, z)
    _same(od["k"], z)
    _same(scalar, torch.tensor(2))
    assert inner["a"][0].sharding_spec == ALL_8 and pair.first.sharding_spec == ALL_8
    assert inner["a"][1][0].sharding_spec == "{replicated}" and scalar.sharding_spec == "{replicated}"


def test_dtypes_and_requires_grad_are_kept():
    batch = (torch.randn(8, 2).to(torch.bfloat16), torch.tensor([True, False] * 4), torch.randn(8, 2).requires_grad_())
    (out,) = list(st.MpDeviceLoader([batch], st.device(), input_sharding=st.ShardingSpec(MESH_8, ("data", None))))
    for dev, cpu in zip(out, batch):
        _same(dev, cpu.detach())
    assert out[2].requires_grad and not out[0].requires_grad


def test_uploads_do_not_alias_the_cpu_batch():
    """Changing a CPU batch after its upload does not change the uploaded tensor."""
    cpu = [torch.zeros(8, 2), torch.zeros(8, 2)]
    out = list(st.MpDeviceLoader(cpu, st.device(), input_sharding=st.ShardingSpec(MESH_8, ("data", None))))
    out.append(next(iter(st.MpDeviceLoader(cpu, st.device()))))  # replicated
    cpu[0].fill_(5.0)
    cpu[1].fill_(5.0)
    assert all(b.cpu().abs().sum().item() == 0.0 for b in out)


# --------------------------------------------------------------------------- errors


def test_dict_spec_with_a_tensor_batch_is_a_value_error():
    loader = st.MpDeviceLoader(
        [torch.randn(8, 2)], st.device(), input_sharding={"x": st.ShardingSpec(MESH_8, ("data", None))}
    )
    with pytest.raises(ValueError) as info:
        next(iter(loader))
    assert str(info.value) == "input batch should be a dict when input sharding is a dict."


def test_key_missing_from_the_spec_is_a_key_error():
    batch = {"x": torch.randn(8, 2), "y": torch.randn(8, 2), "name": "no tensor: needs no spec"}
    loader = st.MpDeviceLoader([batch], st.device(), input_sharding={"x": st.ShardingSpec(MESH_8, ("data", None))})
    with pytest.raises(KeyError) as info:
        next(iter(loader))
    assert info.value.args == ("Keys: ['y'] are missing from input_sharding.",)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"moves batches to st.device\(\)"):
        st.MpDeviceLoader([], "cpu")
    with pytest.raises(ValueError, match="batches_per_execution must be a positive integer"):
        st.MpDeviceLoader([], st.device(), batches_per_execution=0)
    with pytest.raises(TypeError, match="input_sharding is a ShardingSpec"):
        st.MpDeviceLoader([], st.device(), input_sharding=("data", None))
    with pytest.raises(TypeError, match=r"not these: \{'x': 'tuple'\}"):
        st.MpDeviceLoader([], st.device(), input_sharding={"x": ("data", None)})
    assert len(st.MpDeviceLoader([], "shardtensor")) == 0


def _worker_error_case(fail_at):
    loader = st.MpDeviceLoader(SlowLoader(n=5, fail_at=fail_at, error=OSError(5, "disk on fire")), st.device())
    got = []
    with pytest.raises(OSError, match=r"disk on fire") as info:
        for b in loader:
            got.append(b.cpu()[0, 0].item())
    return loader, got, info.value


def test_worker_exception_is_raised_in_the_main_thread_after_the_batches_before_it():
    loader, got, error = _worker_error_case(fail_at=3)
    assert got == [0.0, 1.0, 2.0]
    assert type(error) is OSError and error.errno == 5 and error.strerror == "disk on fire"
    original = error.__cause__
    assert type(original) is OSError and original is not error  # the worker's own exception, chained
    frames = [f.name for f in traceback.extract_tb(original.__traceback__)]
    assert "__iter__" in frames and "_read" in frames  # where the loader raised, on the reader thread
    assert any("reading batch 3 from the loader" in n for n in error.__notes__)
    assert _wait_stopped(_threads_of(loader))


def test_loader_failing_on_the_first_batch_does_not_hang():
    _, got, _ = _worker_error_case(fail_at=0)
    assert got == []

    class Broken:
        def __iter__(self):
            raise RuntimeError("cannot even start")

    with pytest.raises(RuntimeError, match="cannot even start"):
        list(st.MpDeviceLoader(Broken(), st.device()))


def test_exception_that_cannot_be_copied_is_raised_as_itself():
    class Picky(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    loader = st.MpDeviceLoader(SlowLoader(n=3, fail_at=1, error=Picky(1, 2)), st.device())
    with pytest.raises(Picky, match="1/2"):
        list(loader)


# --------------------------------------------------------------------------- iteration lifecycle


def test_len_is_the_loaders():
    assert len(st.MpDeviceLoader(SlowLoader(n=7), st.device())) == 7
    dl = DataLoader(TensorDataset(torch.randn(50, 2)), batch_size=8)
    assert len(st.MpDeviceLoader(dl, st.device())) == len(dl) == 7

    class NoLen:
        def __iter__(self):
            return iter([])

    with pytest.raises(TypeError):
        len(st.MpDeviceLoader(NoLen(), st.device()))


def test_each_iter_restarts_and_stops_the_previous_one():
    src = SlowLoader(n=20)
    loader = st.MpDeviceLoader(src, st.device(), loader_prefetch_size=2, device_prefetch_size=2)
    first = iter(loader)
    assert [next(first).cpu()[0, 0].item() for _ in range(3)] == [0.0, 1.0, 2.0]
    old_threads = _threads_of(loader)
    second = iter(loader)
    assert _wait_stopped(old_threads)
    with pytest.raises(StopIteration):  # the replaced iteration is over
        next(first)
    assert [b.cpu()[0, 0].item() for b in second] == [float(i) for i in range(20)]
    assert [b.cpu()[0, 0].item() for b in loader] == [float(i) for i in range(20)]  # and again
    assert src.started == 3


def test_breaking_out_of_the_loop_stops_the_threads():
    loader = st.MpDeviceLoader(SlowLoader(n=1000), st.device(), loader_prefetch_size=1, device_prefetch_size=1)
    for i, _ in enumerate(loader):
        threads = _threads_of(loader)
        if i == 2:
            break
    assert len(threads) == 2 and _wait_stopped(threads)


def test_deleting_the_loader_stops_the_threads():
    loader = st.MpDeviceLoader(SlowLoader(n=1000), st.device(), loader_prefetch_size=2)
    it = iter(loader)
    next(it)
    threads = _threads_of(loader)
    del loader  # the iterator keeps it alive ...
    assert next(it).cpu()[0, 0].item() == 1.0
    del it  # ... until the iterator goes too
    assert _wait_stopped(threads)


def test_a_temporary_loader_is_not_stopped_under_the_loop():
    out = [
        b.cpu()[0, 0].item()
        for b in st.MpDeviceLoader(
            SlowLoader(n=12, delay=0.005), st.device(), loader_prefetch_size=1, device_prefetch_size=1
        )
    ]
    assert out == [float(i) for i in range(12)]


def test_close_and_an_exception_in_the_loop_body_stop_the_threads():
    loader = st.MpDeviceLoader(SlowLoader(n=1000), st.device())
    next(iter(loader))
    threads = _threads_of(loader)
    loader.close()
    assert _wait_stopped(threads, timeout=0.5)

    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            threads = _threads_of(loader)
            raise ZeroDivisionError
    assert _wait_stopped(threads)


def test_several_transfer_threads_keep_the_order():
    loader = st.MpDeviceLoader(
        SlowLoader(n=40), st.device(), host_to_device_transfer_threads=3, loader_prefetch_size=4, device_prefetch_size=2
    )
    assert [b.cpu()[0, 0].item() for b in loader] == [float(i) for i in range(40)]
    assert len(_threads_of(loader)) == 4


def test_no_loader_thread_is_left_behind():
    assert _wait_stopped([t for t in threading.enumerate() if t.name.startswith("MpDeviceLoader")])


# --------------------------------------------------------------------------- syncs


@pytest.mark.parametrize("k, syncs", [(1, 5), (2, 3), (3, 3), (4, 2), (8, 2)])
def test_batches_per_execution_counts_syncs(k, syncs):
    """4 batches: a sync before batches 0, k, 2k, ... and one at the end unless one just ran."""
    loader = st.MpDeviceLoader(SlowLoader(n=4), st.device(), batches_per_execution=k)
    st.clear_counters()
    for _ in loader:
        pass
    assert st.counter_value("MarkStep") == syncs


def test_sync_runs_the_recorded_steps():
    w = torch.zeros(8, 2).to(st.device())
    st.sync()
    loader = st.MpDeviceLoader(SlowLoader(n=4), st.device(), batches_per_execution=2)
    for b in loader:
        w.add_(b)
        pending = w._cell.is_pending()
        assert pending  # recorded, not run: the loader syncs before batches 2 and at the end
    assert not w._cell.is_pending()
    torch.testing.assert_close(w.cpu(), torch.full((8, 2), 6.0))


# --------------------------------------------------------------------------- uneven batches and minibatch


def test_uneven_batch_keeps_its_shape():
    x = torch.randn(7, 3, 4, 4)
    spec = st.ShardingSpec(MESH_8, ("data", None, None, None))
    (out,) = list(st.MpDeviceLoader([x], st.device(), input_sharding=spec))
    _same(out, x)
    assert out.sharding_spec == "{devices=[8,1,1,1]0,1,2,3,4,5,6,7}"
    shards = out.local_shards
    assert len(shards) == 8 and all(s.data.shape == (1, 3, 4, 4) for s in shards)
    assert shards[7].indices[0] == slice(7, 7, 1)  # the last device holds padding only
    direct = st.shard(x, MESH_8, ("data", None, None, None))  # the same as st.shard
    assert direct.shape == x.shape and direct.sharding_spec == out.sharding_spec
    _same(direct, x)
    torch.testing.assert_close((out * 2).sum().cpu(), (x * 2).sum())


def test_minibatch_batch():
    x = torch.randn(8, 3)
    spec = st.ShardingSpec(MESH_8, ("data", None), minibatch=True)
    (out,) = list(st.MpDeviceLoader([x], st.device(), input_sharding=spec))
    _same(out, x)  # one process: the local batch is the global batch
    assert out.sharding_spec == ALL_8
    spec42 = st.ShardingSpec(MESH_42, ("data", "model"), minibatch=True)  # dim 1 uneven: padded
    (out,) = list(st.MpDeviceLoader([torch.arange(12.0).reshape(4, 3)], st.device(), input_sharding=spec42))
    _same(out, torch.arange(12.0).reshape(4, 3))


def test_minibatch_indivisible_batch_is_an_error():
    spec = st.ShardingSpec(MESH_8, ("data", None, None, None), minibatch=True)
    loader = st.MpDeviceLoader([torch.randn(7, 3, 4, 4)], st.device(), input_sharding=spec)
    with pytest.raises(
        RuntimeError,
        match=(
            r"When minibatch is configured, the per-host batch size must be divisible by local runtime "
            r"device count. Per host input data shape = \[7, 3, 4, 4\]; dimension 0 is split into 8 shards"
        ),
    ):
        list(loader)
    with pytest.raises(RuntimeError, match="split into 4 shards"):
        list(
            st.MpDeviceLoader(
                [torch.randn(6, 2)],
                st.device(),
                input_sharding=st.ShardingSpec(MESH_42, ("data", None), minibatch=True),
            )
        )


def test_minibatch_global_shape_math():
    spec = st.ShardingSpec(MESH_42, ("data", None), minibatch=True)
    assert spec.global_shape((8, 3)) == (8, 3)  # one process
    assert spec.global_shape((8, 3), local_device_ids=[4, 5, 6, 7]) == (16, 3)  # process 1 of 2
    assert minibatch_local_tiles(MESH_42, ("data", None), [4, 5, 6, 7]) == (2, 3)
    assert st.ShardingSpec(MESH_42, ("data", None)).global_shape((7, 3), [0, 1]) == (7, 3)  # no minibatch
    # dim 0 over 'model' only: both processes hold both shards (replicas), the global batch is local
    assert st.ShardingSpec(MESH_42, ("model", None), minibatch=True).global_shape((4, 3), [0, 1, 2, 3]) == (4, 3)
    with pytest.raises(RuntimeError, match=r"split into 2 shards over this host's devices"):
        spec.global_shape((3, 3), local_device_ids=[4, 5, 6, 7])
    with pytest.raises(st.ShardingSpecError, match=r"minibatch=True needs a partition spec that splits the batch"):
        st.ShardingSpec(MESH_42, (None, "data"), minibatch=True)


# --------------------------------------------------------------------------- training


def test_training_loop_fed_by_the_loader_matches_eager_pytorch():
    torch.manual_seed(0)
    ref = MLP()
    dev = copy.deepcopy(ref).to(st.device())
    g = torch.Generator().manual_seed(3)
    ds = TensorDataset(torch.randn(96, 16, generator=g), torch.randint(0, 5, (96,), generator=g))
    dl = DataLoader(ds, batch_size=16, shuffle=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    dev_opt = torch.optim.SGD(dev.parameters(), lr=0.1)
    ref_losses = []
    for x, y in dl:
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.detach())

    fresh_executable_cache()
    loader = st.MpDeviceLoader(dl, st.device(), input_sharding=st.ShardingSpec(MESH_8, ("data", None)))
    dev_losses = []
    for i, (x, y) in enumerate(loader):
        assert x.sharding_spec == ALL_8 and y.sharding_spec == "{replicated}"
        if i == 3:
            compiles = st.counter_value("UncachedCompile")
        loss = F.cross_entropy(dev(x), y)
        loss.backward()
        dev_opt.step()
        dev_opt.zero_grad()
        dev_losses.append(loss.detach())
    assert st.counter_value("UncachedCompile") == compiles  # steps 3.. reuse one program
    torch.testing.assert_close(
        torch.stack([v.cpu() for v in dev_losses]), torch.stack(ref_losses), rtol=1e-4, atol=1e-5
    )
    for (name, p_ref), p_dev in zip(ref.named_parameters(), dev.parameters()):
        torch.testing.assert_close(p_dev.cpu(), p_ref.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_loader_uploads_are_counted_and_timed():
    """Uploads on the loader's threads count as PyTorch/XLA's do: TransferToDevice and
    TransferToDeviceTime, one per tensor."""
    mesh = st.Mesh(range(8), (8,), ("fsdp",))
    batches = [(torch.randn(8, 4), torch.randn(8)) for _ in range(3)]
    st.clear_all()
    for _ in st.MpDeviceLoader(batches, st.device(), input_sharding=st.ShardingSpec(mesh, ("fsdp", None))):
        pass
    assert st.counter_value("TransferToDevice") == 6
    assert st.metric_data("TransferToDeviceTime")[0] == 6


# --------------------------------------------------------------------------- issue 11 §6


@pytest.mark.parametrize("spec", [None, "tensor", "dict"])
def test_none_and_other_non_tensor_batches_pass_through(spec):
    spec = {
        "tensor": st.ShardingSpec(MESH_8, ("data", None)),
        "dict": {"x": st.ShardingSpec(MESH_8, ("data", None))},
    }.get(spec)
    batches = [1, None, 2, 3, "end of the loader", (None,), {"x": None}]
    assert list(st.MpDeviceLoader(batches, st.device(), input_sharding=spec)) == batches


class EndlessLoader:
    """New 1 MiB batches for ever: every pass over it is ended early by the loop."""

    def __iter__(self):
        while True:
            yield torch.randn(256, 1024)


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_early_breaks_leak_no_memory():
    """50 passes broken off after two batches, alternately on one loader and on a new one each time.
    A pass that left its prefetched batches (up to 24 MiB here) or its threads behind would grow
    the process by ~1 GiB; the bound allows for the allocator's noise only."""
    spec = st.ShardingSpec(MESH_8, ("data", None))
    kept = st.MpDeviceLoader(EndlessLoader(), st.device(), input_sharding=spec)
    start = None
    for n in range(50):
        loader = kept if n % 2 else st.MpDeviceLoader(EndlessLoader(), st.device(), input_sharding=spec)
        for i, batch in enumerate(loader):
            assert batch.shape == (256, 1024)
            if i == 1:
                break
        del batch, loader
        if n == 9:  # after the allocator's pools have grown to the loop's working set
            start = _rss_mib()
    kept.close()
    assert _wait_stopped([t for t in threading.enumerate() if t.name.startswith("MpDeviceLoader")])
    assert _rss_mib() - start < 200
