"""Issue 11 §6: the executable cache is bounded (least recently used out first), configurable, and
counts its evictions; an evicted program compiles again and gives the same result."""

import pytest
import torch

import shardtensor as st
from _training_helpers import fresh_executable_cache, reset_state
from shardtensor.graph import execute
from shardtensor.graph.executable_cache import ExecutableCache

MESH = st.Mesh(range(8), (8,), ("x",))


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    previous = st.set_executable_cache_size(50)
    fresh_executable_cache()
    yield
    st.set_executable_cache_size(previous)
    reset_state()


def _evictions():
    return st.counter_value("ExecutableCacheEvictions") or 0


def _run(n):
    """One small program per ``n`` (a new input shape each); its result against eager torch."""
    t = torch.arange(n, dtype=torch.float32)
    x = st.shard(t, MESH, (None,))
    torch.testing.assert_close((x * 2 + 1).cpu(), t * 2 + 1)


def test_200_keys_keep_at_most_50_entries_and_count_150_evictions():
    """The cache's own arithmetic, on 200 keys (200 real compilations would take a minute here)."""
    cache = ExecutableCache()
    before = _evictions()
    for n in range(200):
        cache[("program", n)] = object()
        assert len(cache) <= 50
    assert len(cache) == 50 and _evictions() - before == 150
    assert ("program", 149) not in cache and ("program", 150) in cache


def test_distinct_shapes_beyond_the_bound_evict_and_an_evicted_program_recompiles():
    st.set_executable_cache_size(3)
    before, compiles = _evictions(), st.counter_value("UncachedCompile") or 0
    for n in range(1, 9):
        _run(n)
        assert len(execute._EXECUTABLES) <= 3
    assert len(execute._EXECUTABLES) == 3
    assert _evictions() - before == 5
    assert (st.counter_value("UncachedCompile") or 0) - compiles == 8
    _run(8)  # the most recent: still cached
    _run(1)  # evicted long ago: compiles again, same values
    assert (st.counter_value("UncachedCompile") or 0) - compiles == 9
    assert _evictions() - before == 6


def test_recently_used_programs_stay_and_eager_ops_are_bounded_too():
    st.set_executable_cache_size(3)
    for n in (1, 2, 3, 1, 4):  # 1 was used again after 2 and 3: 2 goes first
        _run(n)
    compiles = st.counter_value("UncachedCompile") or 0
    _run(1)
    assert st.counter_value("UncachedCompile") == compiles
    _run(2)
    assert st.counter_value("UncachedCompile") == compiles + 1
    with st.eager_mode(True):
        for n in range(1, 4):  # two ops per shape: six single-op programs
            _run(n)
    assert len(execute._SINGLE_NODE) <= 3


def test_bad_sizes_are_refused():
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="positive integer"):
            st.set_executable_cache_size(bad)
    assert st.executable_cache_size() == 50
