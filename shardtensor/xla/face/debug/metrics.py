"""``torch_xla.debug.metrics`` (``met``) under the face: shardtensor's counters and timers, which keep
PyTorch/XLA's names and report format (``CompileTime``, ``ExecuteReplicatedTime``, ``UncachedCompile``,
``CachedCompile``, ``MarkStep`` ...)."""

from __future__ import annotations

import shardtensor as st

metrics_report = st.metrics_report
short_metrics_report = st.short_metrics_report
counter_names = st.counter_names
counter_value = st.counter_value
metric_names = st.metric_names
metric_data = st.metric_data
clear_counters = st.clear_counters
clear_metrics = st.clear_metrics
clear_all = st.clear_all


def executed_fallback_ops() -> list[str]:
    """The ops that ran on the host instead of the devices (PyTorch/XLA's ``aten::*`` counters):
    shardtensor lowers every op it runs, or runs it through a torch decomposition
    (``Decomposition::<op>`` counters), so this lists only such ``aten::`` counters if any exist."""
    return sorted(name for name in st.counter_names() if name.startswith("aten::"))
