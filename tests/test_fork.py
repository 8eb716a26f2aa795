"""Issue 12 §1: DataLoader workers forked from a process that runs JAX.

Forked workers used to hang for ever: torch seeds every device in each new worker
(``torch.manual_seed``), and seeding shardtensor's device built a JAX key, waiting for JAX threads
the fork did not copy. Now ``torch.shardtensor._is_in_bad_fork()`` is true in such a worker (torch
then skips the device, as for CUDA), seeding never starts JAX, and a worker that uses shardtensor
raises a RuntimeError naming the fix instead of waiting.

The loaders here fork from the test process itself, with the DataLoader's ``timeout``: a worker
that hangs makes the loop raise after ``_TIMEOUT`` seconds instead of blocking the suite.
"""

import multiprocessing
import os
import pathlib
import subprocess
import sys
import traceback
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import shardtensor as st
from _training_helpers import reset_state

_TIMEOUT = 20  # seconds a forked worker may take for one batch before the loop raises
_JAX_FORK_WARNING = r"os\.fork\(\) was called"  # JAX's own warning at every fork of a process running it
MESH_8 = st.Mesh(range(8), (8,), ("data",))
ROOT = pathlib.Path(__file__).resolve().parents[1]  # the subprocess imports this checkout's shardtensor


@pytest.fixture(autouse=True)
def _jax_running():
    """Each test forks a process where shardtensor has run a program (so JAX's threads exist)."""
    reset_state()
    assert (torch.arange(4.0, device=st.device()) * 2).sum().item() == 12.0
    yield
    reset_state()


def _dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(24, 4, generator=g), torch.randint(0, 10, (24,), generator=g))


def _forking_loader(dataset, **kwargs):
    """A DataLoader with 2 workers started the default way (fork on Linux up to Python 3.13)."""
    return DataLoader(dataset, batch_size=4, num_workers=2, timeout=_TIMEOUT, **kwargs)


def test_mp_device_loader_with_forked_workers_yields_the_plain_loaders_batches():
    expected = list(DataLoader(_dataset(), batch_size=4))
    loader = st.MpDeviceLoader(_forking_loader(_dataset()), st.device())
    spec_loader = st.MpDeviceLoader(
        _forking_loader(_dataset()), st.device(), input_sharding=st.ShardingSpec(MESH_8, ("data", None))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _epoch in range(2):  # the workers are forked again for each pass
            got = [(x.cpu(), y.cpu()) for x, y in loader]
            assert len(got) == len(expected) == 6
            for (x, y), (ex, ey) in zip(got, expected):
                torch.testing.assert_close(x, ex, rtol=0, atol=0)
                torch.testing.assert_close(y, ey, rtol=0, atol=0)
        sharded = [x for x, _ in spec_loader]
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == []  # no fork alarm
    for x, (ex, _) in zip(sharded, expected):
        assert x.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"
        torch.testing.assert_close(x.cpu(), ex, rtol=0, atol=0)


def test_plain_dataloader_with_forked_workers_works_after_shardtensor_ran():
    expected = list(DataLoader(_dataset(), batch_size=4))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_JAX_FORK_WARNING, category=RuntimeWarning)
        got = list(_forking_loader(_dataset()))
    assert len(got) == len(expected)
    for (x, y), (ex, ey) in zip(got, expected):
        torch.testing.assert_close(x, ex, rtol=0, atol=0)
        torch.testing.assert_close(y, ey, rtol=0, atol=0)


class _WorkerFacts(Dataset):
    """Each item says whether the process it was made in counts as a bad fork, and its pid."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([int(torch.shardtensor._is_in_bad_fork()), os.getpid()])


def test_workers_forked_after_jax_started_are_bad_forks_and_the_parent_is_not():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_JAX_FORK_WARNING, category=RuntimeWarning)
        facts = torch.cat(list(DataLoader(_WorkerFacts(), batch_size=1, num_workers=2, timeout=_TIMEOUT)))
    assert facts[:, 0].tolist() == [1, 1, 1, 1]
    assert os.getpid() not in facts[:, 1].tolist()
    assert not torch.shardtensor._is_in_bad_fork()
    assert not st.runtime.forked_after_start()


class _UsesShardtensor(Dataset):
    """A dataset that (wrongly) computes on the devices inside its worker."""

    def __init__(self, how):
        self.how = how
        self.data = torch.arange(8.0, device=st.device())

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if self.how == "op":
            return self.data[i].cpu()
        if self.how == "random":
            return torch.randn(2, device=st.device()).cpu()
        return st.shard(torch.ones(8), MESH_8, ("data",)).cpu()  # an upload


def _child_pids():
    return {p.pid for p in multiprocessing.active_children()}


def _message_of_the_error(batches, match):
    """Iterate ``batches`` expecting a RuntimeError matching ``match``; its message. Then check that
    the loader's workers have exited.

    The error's traceback holds the torch DataLoader iterator, in a reference cycle: left to the
    garbage collector, the iterator could not tell its workers to stop (the collector closes its
    queues first) and would wait 5 s for each. Clearing the traceback's frames lets it go at once.
    """
    before = _child_pids()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_JAX_FORK_WARNING, category=RuntimeWarning)
        with pytest.raises(RuntimeError, match=match) as info:
            list(batches)
    traceback.clear_frames(info.tb)
    assert _child_pids() <= before  # the iterator went, and stopped and joined its workers
    return str(info.value)


@pytest.mark.parametrize("how", ["op", "random", "upload"])
def test_a_worker_that_uses_shardtensor_raises_naming_the_fix(how):
    message = _message_of_the_error(
        _forking_loader(_UsesShardtensor(how)), match="forked from a process that was running JAX"
    )
    assert "multiprocessing_context='spawn'" in message


def test_mp_device_loader_stops_the_workers_before_it_raises_their_error():
    # the error's traceback would keep the torch iterator (and so its workers) alive until a garbage
    # collection, which then waits 5 s per worker: MpDeviceLoader lets the iterator go first
    before = _child_pids()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_JAX_FORK_WARNING, category=RuntimeWarning)
        with pytest.raises(RuntimeError, match="forked from a process that was running JAX") as info:
            list(st.MpDeviceLoader(_forking_loader(_UsesShardtensor("op")), st.device()))
        assert _child_pids() <= before  # the workers have exited (the error still holds its traceback)
    assert "multiprocessing_context='spawn'" in str(info.value)


class _HandsOutShardedTensors(Dataset):
    """A dataset whose items are tensors already on the devices (no op in the worker)."""

    def __init__(self):
        self.items = [torch.full((2,), float(i), device=st.device()) for i in range(4)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_a_worker_that_hands_out_device_tensors_raises_instead_of_crashing():
    # collate moves a worker's batch into shared storage of the batch's device; the shardtensor
    # device has no torch storage, and torch's null allocator used to crash the worker
    message = _message_of_the_error(
        _forking_loader(_HandsOutShardedTensors()), match="cannot allocate .* torch storage on the shardtensor device"
    )
    assert "return CPU tensors from the dataset" in message


def test_torch_storage_on_the_device_is_refused_clearly():
    with pytest.raises(RuntimeError, match="cannot allocate 8 bytes of torch storage on the shardtensor device"):
        torch.UntypedStorage(8, device=st.device())
    assert torch.UntypedStorage(0, device=st.device()).nbytes() == 0


_FRESH = r"""
import warnings
warnings.simplefilter("error")   # any warning fails this script
import torch
from torch.utils.data import DataLoader, TensorDataset
import shardtensor as st
from jax._src import xla_bridge

torch.manual_seed(0)             # plain torch code: seeding must not start JAX
assert not xla_bridge.backends_are_initialized(), "torch.manual_seed started JAX"
ds = TensorDataset(torch.arange(12.0).reshape(6, 2))
batches = list(DataLoader(ds, batch_size=2, num_workers=2, timeout=20))
assert torch.equal(torch.cat([b for (b,) in batches]), ds.tensors[0])
assert not xla_bridge.backends_are_initialized(), "the DataLoader workers started JAX"

a = torch.randn(4, 3, device=st.device()).cpu()   # the seed given above reaches shardtensor's key
st.manual_seed(0)
torch.testing.assert_close(torch.randn(4, 3, device=st.device()).cpu(), a, rtol=0, atol=0)
print("ok")
"""


def test_seeding_and_forked_workers_in_plain_torch_code_start_no_jax():
    """Importing shardtensor changes nothing for a script that seeds torch and forks DataLoader
    workers: JAX stays unstarted (so the process stays single-threaded, and nothing warns)."""
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
