"""Data loading onto the devices: ``MpDeviceLoader`` (PyTorch/XLA's, on shardtensor).

Example::

    loader = st.MpDeviceLoader(torch_loader, st.device(), input_sharding=st.ShardingSpec(mesh, ("data", None)))
"""

from shardtensor.data.loader import MpDeviceLoader  # noqa: F401
