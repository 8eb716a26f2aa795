"""Run in a process that multiprocessing spawned from a script started with ``python -m shardtensor.xla``
(``torch_xla.launch``, ``xmp.spawn``): install the face, then run the script's top level, as
multiprocessing re-runs a main module (its ``if __name__ == "__main__":`` part does not run here)."""

import os

import shardtensor.xla

shardtensor.xla.install()
__file__ = os.environ["SHARDTENSOR_XLA_SCRIPT"]
with open(__file__, "rb") as _f:
    exec(compile(_f.read(), __file__, "exec"))
