"""Counters and timed metrics, with PyTorch/XLA's names and report format.

*Counters* count events: ``CachedCompile`` / ``UncachedCompile`` (a graph found in, or added to,
the in-memory executable cache), ``MarkStep`` (``sync()`` calls), ``ExecuteReplicated`` (program
runs), ``TransferToDevice`` / ``TransferFromDevice``, ``PersistentCacheHit`` /
``PersistentCacheMiss`` (XLA compilations served by, or missing from, the on-disk cache of
``initialize_cache``; a program loaded from shardtensor's own program cache counts as a hit too),
``PersistentProgramHit`` / ``PersistentProgramMiss`` / ``PersistentProgramStored`` /
``PersistentProgramUnusable`` / ``PersistentProgramSkipped`` (that program cache:
``graph.program_store``), and ``Decomposition::<aten op>`` (ops that ran through a torch decomposition
instead of a direct lowering: the place to look when a model is slower than expected).

*Metrics* keep samples: ``CompileTime`` (tracing, lowering and XLA compilation of one graph),
``ExecuteTime`` (launching one program; also reported as ``ExecuteReplicatedTime``, PyTorch/XLA's
SPMD name), ``LazyTracing`` (the wall time from the first op recorded after a graph ran to the
start of the next graph: the Python time of building one step, the model's and shardtensor's) and
``TransferToDeviceTime`` / ``TransferFromDeviceTime`` where the transfer code times itself. Times
are in nanoseconds, as in PyTorch/XLA's ``metric_data``.

JAX runs programs asynchronously: ``ExecuteTime`` is the time to launch a program (plus the wait
with ``sync(wait=True)``); the device time shows up in whatever waits for the result.

Example::

    st.clear_all()
    for x, y in batches:
        train_step(x, y); st.sync()
    print(st.short_metrics_report())
    st.counter_value("UncachedCompile")     # 1: the loop compiled once
    st.metric_data("CompileTime")[0]        # 1 sample
"""

from __future__ import annotations

import collections
import time

# PyTorch/XLA keeps the last 1024 samples of each metric (its report's rates and percentiles use
# them; TotalSamples and Accumulator cover every sample).
MAX_SAMPLES = 1024

_COUNTS: collections.Counter = collections.Counter()
# perf_counter_ns() + this = nanoseconds since the epoch (timestamps without a second clock read)
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


# --------------------------------------------------------------------------- counters


def increment(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` (creating it).

    Example::

        increment("MyEvent")
        counter_value("MyEvent")   # 1
    """
    _COUNTS[name] += n


def counter_value(name: str) -> int | None:
    """The value of counter ``name``, or None if it never counted (PyTorch/XLA's convention).

    Example::

        counter_value("CachedCompile")
    """
    return _COUNTS.get(name)


def counter_names() -> list[str]:
    """Names of the counters that have counted something, sorted.

    Example::

        [n for n in counter_names() if n.startswith("Decomposition::")]
    """
    return sorted(_COUNTS)


def counters() -> dict[str, int]:
    """A snapshot of every counter.

    Example::

        before = counters(); step(); after = counters()
    """
    return dict(_COUNTS)


def clear_counters() -> None:
    """Reset every counter (they disappear from the report and ``counter_names()``).

    Example::

        clear_counters(); counter_value("MarkStep")   # None
    """
    _COUNTS.clear()


# --------------------------------------------------------------------------- metrics


class Metric:
    """Samples of one measured quantity: a count, a sum and the last ``MAX_SAMPLES`` values.

    ``kind`` chooses how the report prints values: ``"time"`` (nanoseconds), ``"bytes"`` or
    ``"number"``. Hot code keeps the object and calls ``add`` (no name lookup).

    Example::

        m = metric("MyTime")
        m.add(1500)          # 1.5 us
    """

    __slots__ = ("name", "kind", "count", "total", "samples")

    def __init__(self, name: str, kind: str = "time"):
        if kind not in _FORMATS:
            raise ValueError(f"metric kind must be one of {sorted(_FORMATS)}, got {kind!r}")
        self.name, self.kind = name, kind
        self.count = 0
        self.total: float = 0
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=MAX_SAMPLES)

    def add(self, value: float) -> None:
        """Add one sample (its timestamp is now, in nanoseconds since the epoch)."""
        self.count += 1
        self.total += value
        self.samples.append((time.time_ns(), value))

    def add_since(self, start_ns: int) -> None:
        """Add the time elapsed since ``start_ns`` (a ``time.perf_counter_ns()`` value).

        One clock read gives both the sample and its timestamp: hot paths call this per run.
        """
        end = time.perf_counter_ns()
        value = end - start_ns
        self.count += 1
        self.total += value
        self.samples.append((end + _EPOCH_OFFSET_NS, value))

    def clear(self) -> None:
        self.count = 0
        self.total = 0
        self.samples.clear()


_METRICS: dict[str, Metric] = {}


def metric(name: str, kind: str = "time", aliases: tuple = ()) -> Metric:
    """The metric called ``name``, created on first use; ``aliases`` are other names of the same one.

    Example::

        execute = metric("ExecuteTime", aliases=("ExecuteReplicatedTime",))
    """
    m = _METRICS.get(name)
    if m is None:
        m = _METRICS[name] = Metric(name, kind)
    for alias in aliases:
        _METRICS.setdefault(alias, m)
    return m


class timed:
    """Time a block into metric ``name`` (nanoseconds).

    Example::

        with timed("TransferFromDeviceTime"):
            host = np.asarray(array)
    """

    __slots__ = ("metric", "start")

    def __init__(self, name: str):
        self.metric = metric(name)

    def __enter__(self):
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        self.metric.add_since(self.start)
        return False


def metric_names() -> list[str]:
    """Names of the metrics that have samples, sorted.

    Example::

        "CompileTime" in metric_names()
    """
    return sorted(name for name, m in _METRICS.items() if m.count)


def metric_data(name: str) -> tuple[int, float, list[tuple[int, float]]] | None:
    """``(total_samples, accumulator, [(timestamp_ns, value), ...])`` of a metric, or None.

    As in PyTorch/XLA: times are in nanoseconds, the accumulator sums every sample, and the list
    holds the most recent samples (at most ``MAX_SAMPLES``).

    Example::

        count, total_ns, samples = metric_data("CompileTime")
    """
    m = _METRICS.get(name)
    if m is None or not m.count:
        return None
    return m.count, m.total, list(m.samples)


def clear_metrics() -> None:
    """Drop every metric's samples (they disappear from the report and ``metric_names()``).

    Example::

        clear_metrics(); metric_data("CompileTime")   # None
    """
    for m in _METRICS.values():
        m.clear()


def clear_all() -> None:
    """Clear every metric and every counter.

    Example::

        clear_all(); step(); print(metrics_report())   # this step only
    """
    clear_metrics()
    clear_counters()


# --------------------------------------------------------------------------- report


def _format_time(ns) -> str:
    """PyTorch/XLA's time format: ``01m02s003ms004.005us``, leading zero units left out."""
    us = ns / 1000.0
    whole_ms, us = divmod(us, 1000.0)
    whole_s, ms = divmod(int(whole_ms), 1000)
    whole_m, s = divmod(whole_s, 60)
    h, m = divmod(whole_m, 60)
    parts: list[str] = []
    for value, unit, width in ((h, "h", 2), (m, "m", 2), (s, "s", 2), (ms, "ms", 3)):
        if value or parts:
            parts.append(f"{value:0{width}d}{unit}")
    parts.append(f"{us:07.3f}us")
    return "".join(parts)


def _format_bytes(n) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1024.0 or unit == "TB":
            return f"{value:.2f}{unit}"
        value /= 1024.0
    return f"{value:.2f}PB"  # unreachable; keeps linters quiet


_FORMATS = {"time": _format_time, "bytes": _format_bytes, "number": lambda v: f"{float(v):.2f}"}
_PERCENTILES = (1, 5, 10, 20, 50, 80, 90, 95, 99)


def _metric_text(name: str, m: Metric) -> str:
    fmt = _FORMATS[m.kind]
    samples = list(m.samples)
    lines = [f"Metric: {name}", f"  TotalSamples: {m.count}", f"  Accumulator: {fmt(m.total)}"]
    span_s = (samples[-1][0] - samples[0][0]) / 1e9 if samples else 0.0
    if span_s > 0:
        lines.append(f"  ValueRate: {fmt(sum(v for _, v in samples) / span_s)} / second")
        lines.append(f"  Rate: {len(samples) / span_s:g} / second")
    values = sorted(v for _, v in samples)
    if values:
        # the sample at rank floor(p * n), as PyTorch/XLA picks it
        picks = (values[min(len(values) - 1, p * len(values) // 100)] for p in _PERCENTILES)
        lines.append("  Percentiles: " + "; ".join(f"{p}%={fmt(v)}" for p, v in zip(_PERCENTILES, picks)))
    return "\n".join(lines) + "\n"


def _counter_text(name: str) -> str:
    return f"Counter: {name}\n  Value: {_COUNTS[name]}\n"


def metrics_report() -> str:
    """Every metric with samples, then every counter, in PyTorch/XLA's format.

    Example::

        print(metrics_report())
        # Metric: CompileTime
        #   TotalSamples: 1
        #   Accumulator: 412ms318.020us
        #   Percentiles: 1%=412ms318.020us; 5%=412ms318.020us; ...
        # Counter: CachedCompile
        #   Value: 9
    """
    parts = [_metric_text(name, _METRICS[name]) for name in metric_names()]
    parts += [_counter_text(name) for name in counter_names()]
    return "".join(parts)


SHORT_REPORT_COUNTERS = ("CachedCompile", "MarkStep")
SHORT_REPORT_METRICS = (
    "CompileTime",
    "ExecuteTime",
    "ExecuteReplicatedTime",
    "TransferToDeviceTime",
    "TransferFromDeviceTime",
)


def short_metrics_report(counter_names: list | None = None, metric_names: list | None = None) -> str:
    """The report for a few names (PyTorch/XLA's defaults when None), plus every
    ``Decomposition::`` counter (they mark ops without a direct lowering, as ``aten::`` counters
    mark CPU fallbacks in PyTorch/XLA). Names with no data are left out.

    Example::

        print(short_metrics_report())
        print(short_metrics_report(["UncachedCompile"], ["LazyTracing"]))
    """
    counters_wanted = list(counter_names or SHORT_REPORT_COUNTERS)
    counters_wanted += sorted(n for n in _COUNTS if n.startswith("Decomposition::") and n not in counters_wanted)
    parts = []
    for name in metric_names or SHORT_REPORT_METRICS:
        m = _METRICS.get(name)
        if m is not None and m.count:
            parts.append(_metric_text(name, m))
    parts += [_counter_text(name) for name in counters_wanted if name in _COUNTS]
    return "".join(parts)


# --------------------------------------------------------------------------- JAX's persistent cache


class _CacheLookups:
    """Turns JAX's compilation-cache events into PersistentCacheHit / PersistentCacheMiss.

    JAX announces each compilation that consults the persistent cache, then a hit; a compilation
    that ends without a hit was a miss. Events arrive on the compiling thread, in order. JAX also
    "consults" the cache when no directory is set (it finds nothing): those are not counted.
    """

    waiting = False

    @classmethod
    def on_event(cls, event: str, **_: str | int) -> None:
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            import jax

            cls.waiting = bool(jax.config.jax_compilation_cache_dir)  # type: ignore[attr-defined]  # (a dynamic option)
        elif event == "/jax/compilation_cache/cache_hits":
            cls.waiting = False
            increment("PersistentCacheHit")

    @classmethod
    def on_duration(cls, event: str, duration_secs: float, **_: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and cls.waiting:
            cls.waiting = False
            increment("PersistentCacheMiss")


def _listen_to_jax() -> None:
    # Registered once at import, so the counters also work when the cache was turned on through
    # JAX's own configuration (JAX_COMPILATION_CACHE_DIR). JAX calls these only while compiling.
    from jax import monitoring

    monitoring.register_event_listener(_CacheLookups.on_event)
    monitoring.register_event_duration_secs_listener(_CacheLookups.on_duration)


_listen_to_jax()
