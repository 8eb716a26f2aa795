"""`st.rendezvous` and `st.mesh_reduce` in a single process (no job): the process's own value, and
clear errors for bad arguments. Across processes: tests/test_launch.py (`sharded_rows`)."""

import pytest
import torch

import shardtensor as st


def test_single_process_rendezvous_returns_the_own_payload():
    assert st.rendezvous("init") == [b""]
    assert st.rendezvous("init", b"abc") == [b"abc"]  # the same tag again
    assert st.rendezvous("init", bytearray(b"xy"), replicas=[0]) == [b"xy"]


def test_single_process_mesh_reduce_applies_reduce_fn_to_the_own_value():
    t = torch.arange(6.0).reshape(2, 3)
    torch.testing.assert_close(st.mesh_reduce("t", t, lambda ts: torch.stack(ts).sum(0)), t)
    assert st.mesh_reduce("loss", 2.5, lambda xs: sum(xs) / len(xs)) == 2.5
    # a tensor on the device arrives on the CPU
    on_device = st.mesh_reduce("dev", t.to(st.device()), lambda ts: ts[0])
    assert on_device.device.type == "cpu"
    torch.testing.assert_close(on_device, t)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="rendezvous sends bytes, got str.*mesh_reduce"):
        st.rendezvous("t", "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty str tag"):
        st.rendezvous("")
    with pytest.raises(ValueError, match="non-empty str tag"):
        st.mesh_reduce("", 1.0, sum)
    with pytest.raises(ValueError, match=r"replicas must be distinct process indices in 0..0 .*got \[1\]"):
        st.rendezvous("t", replicas=[1])
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        st.rendezvous("t", timeout=0)
