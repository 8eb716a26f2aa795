"""Issue 4 §2: metrics and counters with PyTorch/XLA's names, API and report format."""

import re
import time

import pytest
import torch

import shardtensor as st
from _training_helpers import fresh_executable_cache, mesh_4x2, reset_state
from shardtensor import metrics

# One block of PyTorch/XLA's report: a metric (rates only with samples at two moments) or a counter.
TIME = r"(\d\dh)?(\d\dm)?(\d\ds)?(\d{3}ms)?\d{3}\.\d{3}us"
VALUE = rf"({TIME}|-?\d+\.\d\d[KMGT]?B|-?\d+\.\d\d)"
PERCENTILES = "; ".join(f"{p}%={VALUE}" for p in (1, 5, 10, 20, 50, 80, 90, 95, 99))
METRIC_BLOCK = (
    rf"Metric: \S+\n  TotalSamples: \d+\n  Accumulator: {VALUE}\n"
    rf"(  ValueRate: {VALUE} / second\n  Rate: [0-9.e+-]+ / second\n)?"
    rf"  Percentiles: {PERCENTILES}\n"
)
COUNTER_BLOCK = r"Counter: \S+\n  Value: \d+\n"
REPORT = re.compile(rf"({METRIC_BLOCK})*({COUNTER_BLOCK})*")


@pytest.fixture(autouse=True)
def _clean():
    reset_state()
    st.clear_all()
    yield
    reset_state()


def _steps(n=3):
    """n identical in-place steps on a sharded tensor: one graph, compiled once."""
    fresh_executable_cache()  # an earlier test may have compiled the same graph
    x = st.shard(torch.ones(8, 4), mesh_4x2(), ("data", None))
    st.clear_all()
    for _ in range(n):
        x.mul_(2).add_(1)
        st.sync()
    return x


def test_counters_and_metrics_of_a_known_program():
    fresh_executable_cache()
    x = _steps(3)
    assert st.counter_value("UncachedCompile") == 1
    assert st.counter_value("CachedCompile") == 2  # the second and third steps reuse the program
    assert st.counter_value("MarkStep") == 3
    assert st.counter_value("ExecuteReplicated") == 3
    assert st.counter_value("PersistentCacheHit") is None  # no persistent cache in this process
    assert st.metric_data("CompileTime")[0] == 1
    assert st.metric_data("ExecuteTime")[0] == 3
    assert st.metric_data("ExecuteReplicatedTime") == st.metric_data("ExecuteTime")  # SPMD's name
    assert st.metric_data("LazyTracing")[0] == 3  # one sample per graph built
    assert {"CompileTime", "ExecuteTime", "ExecuteReplicatedTime", "LazyTracing"} <= set(st.metric_names())
    torch.testing.assert_close(x.cpu(), torch.full((8, 4), 15.0))
    assert st.counter_value("TransferFromDevice") == 1


def test_metric_data_is_total_accumulator_and_timestamped_samples():
    before = time.time_ns()
    _steps(2)
    total, accumulator, samples = st.metric_data("ExecuteTime")
    assert total == len(samples) == 2
    assert accumulator == sum(v for _, v in samples) > 0  # nanoseconds
    for stamp, value in samples:
        assert before - 10**9 <= stamp <= time.time_ns() + 10**9
        assert value > 0
    assert st.metric_data("NoSuchMetric") is None
    assert st.counter_value("NoSuchCounter") is None


def test_report_has_pytorch_xla_format():
    _steps(2)
    report = st.metrics_report()
    assert REPORT.fullmatch(report), report
    assert "Metric: CompileTime\n  TotalSamples: 1\n  Accumulator: " in report
    assert "Metric: ExecuteTime\n  TotalSamples: 2\n" in report
    assert "Counter: CachedCompile\n  Value: 1\n" in report
    assert "Counter: MarkStep\n  Value: 2\n" in report
    # metrics first, then counters, each sorted by name
    names = re.findall(r"^(Metric|Counter): (\S+)$", report, re.M)
    kinds = [k for k, _ in names]
    assert kinds == sorted(kinds, key=lambda k: k == "Counter")
    metric_names = [n for k, n in names if k == "Metric"]
    counter_names = [n for k, n in names if k == "Counter"]
    assert metric_names == sorted(metric_names) and counter_names == sorted(counter_names)
    # two samples at two moments: rates are shown
    assert "Metric: ExecuteTime\n  TotalSamples: 2\n  Accumulator: " in report
    block = report.split("Metric: ExecuteTime\n")[1].split("Metric:")[0]
    assert "ValueRate: " in block and "Rate: " in block


def test_short_report_defaults_names_and_decomposition_counters():
    _steps(2)
    metrics.increment("Decomposition::aten.fake_op.default")
    short = st.short_metrics_report()
    assert REPORT.fullmatch(short), short
    for name in (
        "Metric: CompileTime",
        "Metric: ExecuteTime",
        "Metric: ExecuteReplicatedTime",
        "Counter: CachedCompile",
        "Counter: MarkStep",
        "Counter: Decomposition::aten.fake_op.default",
    ):
        assert name in short
    assert "UncachedCompile" not in short and "LazyTracing" not in short
    chosen = st.short_metrics_report(["UncachedCompile"], ["LazyTracing"])
    assert chosen.startswith("Metric: LazyTracing\n")
    assert "Counter: UncachedCompile\n  Value: 1\n" in chosen
    assert "CompileTime" not in chosen and "Decomposition::aten.fake_op.default" in chosen
    assert st.short_metrics_report(["NoSuchCounter"], ["NoSuchMetric"]) == (
        "Counter: Decomposition::aten.fake_op.default\n  Value: 1\n"
    )


def test_clear_functions():
    _steps(1)
    assert st.counter_names() and st.metric_names()
    st.clear_counters()
    assert st.counter_names() == [] and st.counter_value("MarkStep") is None
    assert "Counter:" not in st.metrics_report() and "Metric: CompileTime" in st.metrics_report()
    st.clear_metrics()
    assert st.metric_names() == [] and st.metric_data("CompileTime") is None
    assert st.metrics_report() == ""
    _steps(1)  # counting starts again
    assert st.counter_value("MarkStep") == 1 and st.metric_data("ExecuteTime")[0] == 1
    st.clear_all()
    assert st.metrics_report() == "" and st.counters() == {}


def test_value_formats_and_percentiles():
    m = metrics.metric("TestOnlyBytes", kind="bytes")
    for v in range(1, 101):  # 1..100 bytes
        m.add(v)
    report = metrics.metrics_report()
    block = report.split("Metric: TestOnlyBytes\n")[1].split("Metric:")[0].split("Counter:")[0]
    assert "  TotalSamples: 100\n  Accumulator: 4.93KB\n" in block  # 5050 bytes
    # the sample at rank floor(p * n / 100) of the sorted values
    assert (
        "  Percentiles: 1%=2.00B; 5%=6.00B; 10%=11.00B; 20%=21.00B; 50%=51.00B; 80%=81.00B; "
        "90%=91.00B; 95%=96.00B; 99%=100.00B\n"
    ) in block
    assert metrics._format_time(6378) == "006.378us"
    assert metrics._format_time(186062970) == "186ms062.970us"
    assert metrics._format_time(9969486408) == "09s969ms486.408us"
    assert metrics._format_time(63123456789) == "01m03s123ms456.789us"
    assert metrics._format_bytes(919.44 * 2**20) == "919.44MB"
    with metrics.timed("TestOnlyTimer"):
        pass
    assert st.metric_data("TestOnlyTimer")[0] == 1
    st.clear_metrics()


def test_compile_time_is_apart_from_execute_time():
    """The first step compiles ahead of its run: CompileTime gets the compilation, ExecuteTime only
    launches (and the executable is not compiled a second time when it runs)."""
    fresh_executable_cache()
    x = st.shard(torch.ones(8, 12), mesh_4x2(), ("data", None))
    st.clear_all()
    (x.exp() * 3).sum().cpu()
    compile_ns = st.metric_data("CompileTime")[1]
    execute_ns = st.metric_data("ExecuteTime")[1]
    assert st.metric_data("CompileTime")[0] == 1 and compile_ns > execute_ns


def test_eager_mode_records_no_lazy_tracing():
    x = st.shard(torch.ones(8, 4), mesh_4x2(), ("data", None))
    st.clear_all()
    with st.eager_mode(True):
        y = x + 1
        y = y * 2
    assert st.metric_data("LazyTracing") is None
    assert st.metric_data("ExecuteTime")[0] >= 2
    torch.testing.assert_close(y.cpu(), torch.full((8, 4), 4.0))


def test_transfer_timers_record_uploads_and_readbacks():
    st.clear_all()
    x = st.shard(torch.randn(8, 4), st.Mesh(range(8), (4, 2), ("x", "y")), ("x", None))
    x.cpu()
    for name in ("TransferToDeviceTime", "TransferFromDeviceTime"):
        samples, total, data = st.metric_data(name)
        assert samples >= 1 and total > 0 and data, name
