"""float32 products follow torch.set_float32_matmul_precision (and PyTorch/XLA's set_mat_mul_precision):
the setting reaches every product's lowering (its precision in the StableHLO), keys the executable
cache, and 'highest' (torch's default) still matches eager torch."""

import re

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st

# torch's setting -> what the StableHLO of a dot / convolution says (JAX writes no attribute for DEFAULT)
EXPECTED = {"highest": "[HIGHEST, HIGHEST]", "high": "[HIGH, HIGH]", "medium": None}


@pytest.fixture
def restore_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def _products(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(r"= stablehlo\.(dot_general|convolution)\b", line)]


def _precisions(fn, *args) -> set:
    lines = _products(st.export(fn, *[a.to(st.device()) for a in args]).mlir_text())
    assert lines, "no product in the program"
    return {_precision_of(line) for line in lines}


def _precision_of(line: str):
    """'[HIGH, HIGH]' from a dot's ``precision = [...]`` or a convolution's ``precision_config``."""
    found = re.findall(r"precision (HIGHEST|HIGH|DEFAULT)>", line) or re.findall(r"precision = \[(\w+), (\w+)\]", line)
    if not found:
        return None
    names = [n for f in found for n in ((f,) if isinstance(f, str) else f)]
    return "[" + ", ".join(names) + "]"


def _linear(x, w, b):
    return F.linear(x, w, b)


def _bmm_einsum(a, b):
    return torch.einsum("bij,bjk->bik", a, b) + torch.bmm(a, b)


def _baddbmm(a, b):
    return torch.baddbmm(a[:, :, :1], a, b, alpha=0.5)


def _conv(x, w):
    return F.conv2d(x, w, padding=1)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


CASES = {
    "matmul": (lambda a, b: a @ b, (4, 8), (8, 3)),
    "linear": (_linear, (2, 5, 8), (6, 8), (6,)),
    "einsum+bmm": (_bmm_einsum, (2, 4, 8), (2, 8, 3)),
    "baddbmm": (_baddbmm, (2, 4, 8), (2, 8, 4)),
    "conv2d": (_conv, (1, 2, 6, 6), (3, 2, 3, 3)),
    "sdpa": (_sdpa, (1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)),
}


@pytest.mark.parametrize("setting", list(EXPECTED))
@pytest.mark.parametrize("case", list(CASES))
def test_each_setting_reaches_the_products_lowering(case, setting, restore_precision):
    fn, *shapes = CASES[case]
    args = [torch.randn(s) for s in shapes]
    torch.set_float32_matmul_precision(setting)
    assert _precisions(fn, *args) == {EXPECTED[setting]}


def test_backward_products_follow_the_setting(restore_precision):
    torch.set_float32_matmul_precision("high")
    w = torch.randn(6, 8)

    def loss_grad(x, w):
        w = w.detach().requires_grad_()
        (x @ w.t()).square().sum().backward()
        return w.grad

    assert _precisions(loss_grad, torch.randn(4, 8), w) == {"[HIGH, HIGH]"}


def test_bf16_products_are_left_alone(restore_precision):
    # torch's setting is about float32; a bf16 product has nothing to choose (its operands are bf16)
    torch.set_float32_matmul_precision("medium")
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 3, dtype=torch.bfloat16)
    torch.testing.assert_close((a.to(st.device()) @ b.to(st.device())).cpu(), a @ b)


def test_a_change_makes_another_program_and_is_part_of_the_cache_key(restore_precision):
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    xs, ws = x.to(st.device()), w.to(st.device())
    st.clear_executables()

    def compiles():
        data = st.metric_data("CompileTime")
        return data[0] if data else 0

    def run():
        before = compiles()
        y = (xs @ ws).cpu()
        return y, compiles() - before

    torch.set_float32_matmul_precision("highest")
    st.sync()  # the uploads
    y, compiled = run()
    torch.testing.assert_close(y, x @ w)  # 'highest' still matches torch on the CPU
    assert compiled == 1
    assert run()[1] == 0
    torch.set_float32_matmul_precision("medium")
    assert run()[1] == 1  # another program: the setting is read when the op is recorded
    torch.set_float32_matmul_precision("highest")
    assert run()[1] == 0  # back to the first one: found in the cache


def test_compiled_function_retraces_at_a_new_setting(restore_precision):
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    xs, ws = x.to(st.device()), w.to(st.device())
    step = st.compile(lambda a, b: a @ b)
    for _ in range(3):  # frozen after two traces
        torch.testing.assert_close(step(xs, ws).cpu(), x @ w)
    traces = st.counter_value("CompileTrace")
    torch.set_float32_matmul_precision("high")
    step(xs, ws).cpu()
    assert st.counter_value("CompileTrace") == traces + 1  # the frozen replay was recorded at 'highest'


def test_highest_matches_torch_for_linear_and_conv(restore_precision):
    torch.set_float32_matmul_precision("highest")
    x, w, b = torch.randn(3, 5, 32), torch.randn(16, 32), torch.randn(16)
    torch.testing.assert_close(F.linear(*(t.to(st.device()) for t in (x, w, b))).cpu(), F.linear(x, w, b))
    xi, wi = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3)
    torch.testing.assert_close(_conv(xi.to(st.device()), wi.to(st.device())).cpu(), _conv(xi, wi))


def test_pytorch_xla_names(restore_precision):
    assert st.get_mat_mul_precision() == "highest"  # torch's default stays
    for xla_name, torch_name in (("default", "medium"), ("high", "high"), ("highest", "highest")):
        st.set_mat_mul_precision(xla_name)
        assert torch.get_float32_matmul_precision() == torch_name
        assert st.get_mat_mul_precision() == xla_name
    with pytest.raises(ValueError, match="'highest', 'high' or 'default'"):
        st.set_mat_mul_precision("medium")
