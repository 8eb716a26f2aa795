"""The package carries what a library on PyPI is expected to: a license, metadata, a typing marker."""

import inspect
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_license_metadata_and_typing_marker():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    for key in ("authors", "keywords", "classifiers", "requires-python", "readme"):
        assert project[key], key
    assert (ROOT / "shardtensor" / "py.typed").exists()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["shardtensor"]


def test_declared_torch_range_is_the_tested_one():
    """Only torch 2.13 is tested: the dependency says so, and the README names the supported versions."""
    import torch

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if d.startswith("torch")]
    assert torch_dep == "torch>=2.13,<2.14"
    assert torch.__version__.startswith("2.13")
    assert "**Supported versions.**" in (ROOT / "README.md").read_text()


def test_all_names_the_public_api():
    import shardtensor as st

    assert len(st.__all__) == len(set(st.__all__))
    for name in st.__all__:
        assert hasattr(st, name), name
    public = {n for n, v in vars(st).items() if not n.startswith("_") and not isinstance(v, type(st))}
    assert public <= set(st.__all__), sorted(public - set(st.__all__))


def _unannotated(fn) -> list[str]:
    """The parameters of ``fn`` without an annotation, and '->' when its return has none."""
    signature = inspect.signature(fn)
    missing = [
        name
        for name, p in signature.parameters.items()
        if name not in ("self", "cls") and p.annotation is inspect.Parameter.empty
    ]
    if fn.__name__ != "__init__" and signature.return_annotation is inspect.Signature.empty:
        missing.append("->")
    return missing


_PUBLIC_DUNDERS = ("__init__", "__new__", "__call__", "__iter__", "__next__", "__enter__", "__exit__")


def _own_methods(cls) -> dict:
    """name -> function of the public methods (and properties) ``cls`` defines in shardtensor."""
    out = {}
    for name, value in vars(cls).items():
        if name.startswith("_") and name not in _PUBLIC_DUNDERS:
            continue
        fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if inspect.isfunction(fn) and fn.__module__.startswith("shardtensor"):
            out[name] = fn
    return out


def test_public_api_is_annotated():
    """Every function in shardtensor.__all__ and every public method of its classes is fully annotated
    (mypy, configured in pyproject.toml, then checks the bodies against these types)."""
    import shardtensor as st

    missing = {}
    for name in st.__all__:
        obj = getattr(st, name)
        if inspect.isclass(obj):
            for method, fn in _own_methods(obj).items():
                if _unannotated(fn):
                    missing[f"{name}.{method}"] = _unannotated(fn)
        elif callable(obj) and _unannotated(obj):
            missing[name] = _unannotated(obj)
    assert not missing, missing


def test_lint_and_type_check_configuration():
    """ruff and mypy are configured as the package promises (make lint runs both, make test too)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert tool["ruff"]["line-length"] == 120
    assert {"E", "F", "W", "B", "UP", "I", "SIM"} <= set(tool["ruff"]["lint"]["select"])
    assert tool["mypy"]["check_untyped_defs"] is True and tool["mypy"]["files"] == ["shardtensor"]
    assert "lint" in (ROOT / "Makefile").read_text().split("\ntest:")[1].split("\n")[0]


def test_the_package_carries_its_compiled_device_guard():
    """Installing the package compiles the C++ device guard (setup.py), so ``import shardtensor``
    loads it from the package and builds nothing (a lazy build would live in torch's extension cache)."""
    import torch

    from shardtensor.tensor import device

    how_to = (
        "the package was installed without its compiled module (no compiler, or installed before "
        "setup.py existed): reinstall it (`make install` / `pip install --no-build-isolation -e .`) "
        "or build it in place: `python setup.py build_ext --inplace`"
    )
    assert device.EXT is not None, how_to
    assert device.EXT.__name__ == "shardtensor.tensor._device_ext", f"{how_to}; loaded {device.EXT.__file__}"
    assert pathlib.Path(device.EXT.__file__).parent == pathlib.Path(device.__file__).parent
    built_for, built_from = device.EXT.TORCH_VERSION, device.EXT.SOURCE_ID
    assert built_for == torch.__version__.split("+")[0]
    assert built_from == device._source_id(device._source_bytes())
