"""Reading a view of a computed tensor (``x[i].item()``, ``logits[:, -1].cpu()``) reads the base and
replays the view ops with torch on the host when the base is not much larger than the view: no
program is compiled for each new index. A small view of a large tensor still runs a program (it reads
only itself). Values are compared with the same views of a CPU tensor.
"""

import torch

import shardtensor as st
from _training_helpers import reset_state


def _count(name):
    return st.counter_value(name) or 0


def test_views_of_a_computed_tensor_compile_nothing():
    reset_state()
    mesh = st.Mesh(range(8), (4, 2), ("x", "y"))
    cpu = torch.arange(30.0).reshape(5, 6) * 2
    x = st.shard(torch.arange(30.0).reshape(5, 6), mesh, ("x", None)) * 2  # 5 rows over 4: stored padded
    st.sync()
    compiles, runs = _count("UncachedCompile"), _count("ExecuteReplicated")
    for i in range(5):
        torch.testing.assert_close(x[i].cpu(), cpu[i])
        assert x[i, -1].item() == cpu[i, -1].item()
    torch.testing.assert_close(x.t()[1:3].cpu(), cpu.t()[1:3])
    torch.testing.assert_close(x.unbind(1)[4].cpu(), cpu.unbind(1)[4])  # one output of several
    torch.testing.assert_close(x.view(3, 10)[:, ::3].cpu(), cpu.view(3, 10)[:, ::3])
    assert x[1:3].t().cpu().is_contiguous()
    assert (_count("UncachedCompile"), _count("ExecuteReplicated")) == (compiles, runs)


def test_a_small_view_of_a_large_tensor_and_storage_views_still_run_a_program():
    reset_state()
    big = st.shard(torch.randn(256, 512), st.Mesh(range(8), (8,), ("x",)), ("x", None)) * 1
    st.sync()
    runs = _count("ExecuteReplicated")
    torch.testing.assert_close(big[3, :4].cpu(), big.cpu()[3, :4])  # 16 bytes of 512 KiB: a program
    assert _count("ExecuteReplicated") > runs
    small = torch.arange(12.0).to(st.device()) + 1
    st.sync()
    torch.testing.assert_close(
        small.as_strided((3, 2), (4, 1), 1).cpu(), (torch.arange(12.0) + 1).as_strided((3, 2), (4, 1), 1)
    )
