"""64-bit types: torch's int64 and float64 stay exact on the devices, while the user's own JAX keeps
its setting (x64 off by default, or on if the user turned it on), before, between and after
shardtensor's calls, including calls that raise, and on the threads of MpDeviceLoader.

The main check runs in a fresh interpreter, so the process-wide value is the user's alone (JAX's
default, then turned on by the user), untouched by anything else the test suite imported."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch

import shardtensor as st
from shardtensor import runtime

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, torch
    from torch.utils.data import DataLoader, TensorDataset, default_collate

    import shardtensor as st

    def user_view():  # what the user's own JAX code gets
        return jax.config.jax_enable_x64, jnp.array(1).dtype.name, jnp.array(1.0).dtype.name

    OFF, ON = (False, "int32", "float32"), (True, "int64", "float64")

    def check_user(where, expected):
        assert user_view() == expected, (where, user_view())

    mesh = st.Mesh(range(8), (4, 2), ("x", "y"))
    big = torch.tensor([[2**40 + 1, -(2**41) + 3, 7, 2**33 - 1]] * 8, dtype=torch.int64)  # beyond int32
    fine = 1 + 1e-12 * torch.arange(32, dtype=torch.float64).reshape(8, 4)  # float32 cannot hold these

    def step(a, f):
        return a.sum(0) * 3 + a[0], f * (1 + 1e-12) - 1, (a * 2**20).max(), (f - 1).sum()

    def everything(user):
        def same(got, want, where, expected=user):
            # integers exactly; float64 to 1e-15, a few units of its last place near 1 (a fused
            # multiply-add may round once where torch rounds twice), where float32 would be 1e-7 off
            for g, w in zip(got, want):
                g = g.cpu()
                assert g.dtype == w.dtype, (where, g.dtype, w.dtype)
                exact = not w.is_floating_point()
                torch.testing.assert_close(g, w, rtol=0, atol=0 if exact else 1e-15, msg=lambda m: f"{where}: {m}")
            check_user(where, expected)

        want = step(big, fine)
        a, f = st.shard(big, mesh, ("x", None)), st.shard(fine, mesh, ("x", "y"))
        check_user("st.shard", user)
        same(step(a, f), want, "lazy")
        with st.eager_mode(True):
            same(step(a, f), want, "eager")
        compiled = st.compile(step)
        replays = st.counter_value("CompileReplay") or 0
        for i in range(3):
            same(compiled(a, f), want, f"st.compile call {i}")
        assert st.counter_value("CompileReplay") > replays  # the last call replayed the frozen program
        same([torch.arange(4, device=st.device()) * 2**40], [torch.arange(4) * 2**40], "a factory")
        torch.manual_seed(2**40 + 5)  # a seed beyond 32 bits reaches shardtensor's key whole
        r1 = torch.randint(2**40, 2**41, (64,), device=st.device()).cpu()
        torch.manual_seed(2**40 + 5)
        r2 = torch.randint(2**40, 2**41, (64,), device=st.device()).cpu()
        assert r1.dtype == torch.int64 and torch.equal(r1, r2) and bool(((r1 >= 2**40) & (r1 < 2**41)).all())
        check_user("random numbers", user)

        # calls that raise leave the user's setting as it was
        index = st.shard(torch.tensor([0, 9]), mesh, (None,))
        for where, call, error in [
            ("an op that raises", lambda: a @ f, RuntimeError),
            ("a failed on-device check", lambda: a[index].cpu(), IndexError),
            ("st.compile of a function that raises", lambda: st.compile(lambda x: x.view(3, -1))(a), RuntimeError),
        ]:
            try:
                call()
            except error:
                pass
            else:
                raise AssertionError(f"{where}: nothing raised")
            check_user(where, user)

        # MpDeviceLoader: its transfer threads upload int64 / float64 exactly; the user's collate_fn,
        # on the loader's reader thread, sees the user's setting
        seen_by_collate = []
        def collate(rows):
            seen_by_collate.append(user_view())
            return default_collate(rows)
        loader = st.MpDeviceLoader(DataLoader(TensorDataset(big * 3, fine), batch_size=4, collate_fn=collate),
                                   st.device(), input_sharding=st.ShardingSpec(mesh, ("x", None)))
        for i, (x, y) in enumerate(loader):
            rows = slice(4 * i, 4 * i + 4)
            same([x, y, x + 2**40, y * (1 + 1e-12)],
                 [big[rows] * 3, fine[rows], big[rows] * 3 + 2**40, fine[rows] * (1 + 1e-12)], f"loader batch {i}")
        assert i == 1 and seen_by_collate == [user, user], seen_by_collate

        # the user's own thread-local choice around shardtensor calls is theirs again after each call
        inverse = ON if user == OFF else (False, "int32", "float32")
        with jax.enable_x64(user == OFF):
            same(step(a, f), want, "inside the user's jax.enable_x64(...)", inverse)
        check_user("the end", user)

    check_user("after import", OFF)
    everything(OFF)
    jax.config.update("jax_enable_x64", True)  # the user's choice: it stays on
    everything(ON)
    print("OK")
""")


def test_64_bit_values_exact_and_the_users_jax_setting_kept():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SHARDTENSOR_", "JAX_"))}
    env.update(
        SHARDTENSOR_CPU_DEVICES="8",
        SHARDTENSOR_PLATFORM="cpu",
        XLA_FLAGS=os.environ.get("SHARDTENSOR_TEST_COMPILE_FLAGS", ""),
    )  # the suite's cheap compiles
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]


def test_the_scope_puts_back_what_the_thread_had():
    """In this process too: shardtensor never changes JAX's global value, and its scope restores the
    thread's own, also when the block raises."""
    user = jax.config.jax_enable_x64
    x = st.shard(torch.tensor([2**40, 3]), st.Mesh(range(8), (8,)), (None,))
    assert torch.equal((x * 2).cpu(), torch.tensor([2**41, 6]))
    assert jax.config.jax_enable_x64 == user
    for inside in (False, True):
        with jax.enable_x64(inside):
            with pytest.raises(ZeroDivisionError), runtime.x64_scope():
                assert jnp.array(1).dtype == jnp.int64
                raise ZeroDivisionError
            assert jax.enable_x64.value is inside
            assert runtime.with_x64(lambda: jnp.array(1.0).dtype)() == jnp.float64
            assert jax.enable_x64.value is inside
    assert jax.config.jax_enable_x64 == user
