"""Whether programs donate the buffers they overwrite: PyTorch/XLA's input/output ("parameter") aliasing.

A program that overwrites parameters and optimizer state in place may write its results into the
buffers of those inputs (XLA's input/output aliasing, JAX's donation): no second copy of the model
while it runs. The price: if the program then fails while it runs (out of memory on some devices,
a device fault), those inputs are gone. Turning aliasing off keeps every input buffer until the
program is known to have finished, so any failure leaves every tensor with its value from before
the step, at the cost of holding parameters and optimizer state twice while a program runs.

The setting, first one given wins: ``st.set_param_aliasing(True/False)``, then
``SHARDTENSOR_ENABLE_PARAM_ALIASING``, then PyTorch/XLA's ``XLA_ENABLE_PARAM_ALIASING``; default on,
as in PyTorch/XLA. The variables are read when a program is built, so setting one mid-run works.
"""

from __future__ import annotations

import os

from shardtensor.runtime import environ_setting

ENVS = ("SHARDTENSOR_ENABLE_PARAM_ALIASING", "XLA_ENABLE_PARAM_ALIASING")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

_configured: list[bool | None] = [None]  # set_param_aliasing's value (None: the environment decides)
_parsed: list = [None, True]  # (the variables' raw values, what they mean): parsed once per change


def parse(name: str, text: str) -> bool:
    """The boolean an environment variable ``name`` set to ``text`` means (PyTorch/XLA's reading:
    true/false or an integer, nonzero meaning on; also yes/no, on/off).

    Example: ``parse("XLA_ENABLE_PARAM_ALIASING", "0") is False``.
    """
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    try:
        return int(value) != 0
    except ValueError:
        raise ValueError(
            f"{name}={text!r} is not a boolean: set it to 1 (donate the buffers a program overwrites, "
            "the default) or 0 (keep every input until the program has finished, at the cost of memory); "
            "true/false, yes/no and on/off work too."
        ) from None


def enabled_by_environment(environ=os.environ) -> bool:
    """What ``environ`` asks for: ``SHARDTENSOR_ENABLE_PARAM_ALIASING``, else
    ``XLA_ENABLE_PARAM_ALIASING``, else on. Raises ``ValueError`` naming a variable that is not a
    boolean.

    Example: ``enabled_by_environment({"XLA_ENABLE_PARAM_ALIASING": "false"}) is False``.
    """
    if environ is os.environ:  # (read before every replay: the cheap way when nothing changed)
        return _FROM_ENV()
    raw = (environ.get(ENVS[0]), environ.get(ENVS[1]))
    if raw == _parsed[0]:
        return _parsed[1]
    enabled = True
    for name, text in zip(ENVS, raw):
        if text is not None and text.strip():
            enabled = parse(name, text)
            break
    _parsed[:] = [raw, enabled]
    return enabled


_FROM_ENV = environ_setting(lambda *texts: enabled_by_environment(dict(zip(ENVS, texts))), *ENVS)


def param_aliasing_enabled() -> bool:
    """Whether new programs donate the buffers they overwrite (see ``set_param_aliasing``).

    Example: ``st.param_aliasing_enabled()`` is True unless turned off.
    """
    configured = _configured[0]
    return enabled_by_environment() if configured is None else configured


def set_param_aliasing(enabled: bool | None) -> bool:
    """Let programs donate the buffers they overwrite (``True``, the default, as in PyTorch/XLA) or
    keep every input (``False``); ``None`` goes back to the environment's setting
    (``SHARDTENSOR_ENABLE_PARAM_ALIASING``, else ``XLA_ENABLE_PARAM_ALIASING``, else on). Returns the
    setting in force before the call.

    On, a training step writes the new parameters and optimizer state into the buffers of the old
    ones: no second copy while it runs, but a program that fails while it runs (out of memory on some
    devices, a device fault) consumes them: reading one then raises ``st.ConsumedInputError``. Off,
    no program donates anything: any failure leaves every tensor with its value from before the step
    and the step can be retried, at the cost of holding the overwritten tensors twice while a program
    runs (and each program waits for the one before it to finish). Programs compiled under the other
    setting are not reused.

    Example::

        previous = st.set_param_aliasing(False)   # e.g. while probing the largest batch that fits
        ...
        st.set_param_aliasing(previous)
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_param_aliasing expects True, False or None (the environment's setting), got {enabled!r}")
    previous = param_aliasing_enabled()
    _configured[0] = enabled
    return previous
