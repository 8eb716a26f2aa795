"""Test set-up: 8 simulated CPU devices, set before jax is imported."""
import os

os.environ.setdefault("SHARDTENSOR_CPU_DEVICES", "8")
os.environ.setdefault("SHARDTENSOR_PLATFORM", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
