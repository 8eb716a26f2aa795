"""Builds shardtensor's C++ device extension (``shardtensor/tensor/device_guard.cpp``) with the
package, so that the first ``import shardtensor`` compiles nothing. The metadata is in pyproject.toml.

The module is compiled against the torch of the build environment: the tested release that
pyproject's ``[build-system]`` pins (``pip install .``, ``python -m build``), or the target
environment's own with ``pip install --no-build-isolation`` (the Makefile's way: no second torch to
set up). It is optional: without torch at build time, or without a C++ compiler, the package
installs without it, and ``import shardtensor`` builds it on first use (or warns in one line).
"""

import hashlib
import pathlib
import sys

from setuptools import setup

SOURCE = "shardtensor/tensor/device_guard.cpp"
INCLUDED = [
    "shardtensor/tensor/replay_guard.h",
    "shardtensor/tensor/replay_passes.h",
    "shardtensor/tensor/replay_state.h",
]  # (one unit)
# compiled into the module: import uses it only if its sources are still these files
# (shardtensor.tensor.device._source_bytes and _source_id compute the same)
SOURCE_ID = int(
    hashlib.sha256(b"".join(pathlib.Path(f).read_bytes() for f in [SOURCE, *INCLUDED])).hexdigest()[:16], 16
)


def _extension_build():
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # --no-build-isolation into an environment without torch
        print(
            "shardtensor: torch is not importable at build time; the C++ device extension will be built "
            "on first import instead",
            file=sys.stderr,
        )
        return {}

    # distutils' compiler rather than ninja: one source file gains nothing from ninja
    class OptionalBuildExtension(BuildExtension.with_options(use_ninja=False)):
        """torch's BuildExtension, except that a failed build (no compiler, a broken one) installs the
        package without the module instead of failing the install."""

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as e:  # noqa: BLE001  (torch's compiler checks raise several kinds)
                first_line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
                print(
                    f"shardtensor: could not compile the C++ device extension ({first_line[:200]}); it will be "
                    "built on first import instead",
                    file=sys.stderr,
                )

    extension = CppExtension(
        "shardtensor.tensor._device_ext",
        [SOURCE],
        depends=INCLUDED,
        # -g0: no debug info (a smaller wheel and a faster build); the module is a few trivial functions
        extra_compile_args=["-g0", f"-DSHARDTENSOR_SOURCE_ID={SOURCE_ID:#x}ULL"],
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(**_extension_build())
