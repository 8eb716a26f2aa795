"""Small models, hand-written shardings and a training driver shared by test_training.py and
test_modes.py: train the same model in eager PyTorch on CPU and on st.device() (lazy, eager or
st.compile mode) and compare losses and parameters.

Example::

    ref, dev, ref_losses, dev_losses = run_both(make_mlp, shard_mlp, mesh, batches, sgd, mode="lazy")
    assert_trained_alike(ref, dev, ref_losses, dev_losses)
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardtensor as st

# float32 tolerances (brief: rtol ~1e-4 / atol ~1e-5)
RTOL, ATOL = 1e-4, 1e-5


# --- models ---------------------------------------------------------------------------------------
class MLP(nn.Module):
    """Linear, LayerNorm, GELU, SiLU, dropout; classification over 5 classes."""

    def __init__(self, d_in=16, hidden=20, hidden2=24, n_cls=5, p=0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden2)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(hidden2, n_cls)

    def forward(self, x):
        h = F.gelu(self.ln(self.fc1(x)))
        h = self.drop(F.silu(self.fc2(h)))
        return self.head(h)


class Block(nn.Module):
    """Pre-norm transformer block. Attention is computed twice and averaged — once with
    F.scaled_dot_product_attention(is_causal=True), once as explicit softmax attention with a
    masked_fill causal mask (and attention dropout) — so one small block exercises both. Norms:
    RMSNorm before attention, LayerNorm before the MLP; the MLP gates SiLU with GELU."""

    def __init__(self, d=16, heads=2, T=8, p=0.0):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has zero gradient: Adam would amplify noise
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.attn_drop = nn.Dropout(p)
        self.drop = nn.Dropout(p)
        self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)))

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.heads
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        y1 = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y2 = att @ v
        y = ((y1 + y2) * 0.5).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.drop(self.proj(y))
        a, b = self.fc(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(a) * F.gelu(b))


class TinyLM(nn.Module):
    """Embedding + position embedding, one Block, final LayerNorm, LM head; loss = cross-entropy
    over the vocabulary (lm_loss)."""

    def __init__(self, vocab=30, d=16, T=8, p=0.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(T, d)
        self.block = Block(d, T=T, p=p)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        return self.head(self.ln_f(self.block(x)))


class CNN(nn.Module):
    """Conv2d, BatchNorm2d, ReLU, max pooling, GELU, avg pooling, Linear head."""

    def __init__(self, n_cls=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)  # bias before BatchNorm: zero gradient
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.head = nn.Linear(8 * 2 * 2, n_cls)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.avg_pool2d(F.gelu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class Traces:
    """How many times compiled bodies ran their Python since it was made (``CompileTrace``): a body
    that counted its runs in a list it can reach would change Python state, and never freeze."""

    def __init__(self):
        self._start = st.counter_value("CompileTrace") or 0

    def __len__(self):
        return (st.counter_value("CompileTrace") or 0) - self._start


def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# --- meshes and hand-written shardings -----------------------------------------------------------
def mesh_8():
    return st.Mesh(range(8), (8,), ("d",))


def mesh_4x2():
    return st.Mesh(range(8), (4, 2), ("data", "model"))


def mesh_2x2x2():
    return st.Mesh(range(8), (2, 2, 2), ("a", "b", "c"))


def mesh_1x8():
    return st.Mesh(range(8), (1, 8), ("r", "m"))


def shard_params(model, mesh, specs):
    """``st.mark_sharding`` each named parameter/buffer in ``specs`` (others stay replicated)."""
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    for name, spec in specs.items():
        st.mark_sharding(named[name], mesh, spec)
    return model


# uneven on purpose: 20/8, 5/8 (some shards all padding), 30/4, 6/8, 48/(2*2)...
MLP_SPECS = {  # mesh (8,)
    "fc1.weight": ("d", None),  # 20 rows over 8
    "fc1.bias": ("d",),
    "ln.weight": ("d",),
    "fc2.weight": (None, "d"),  # 20 cols over 8
    "head.weight": ("d", None),  # 5 rows over 8: three shards are all padding
}
LM_SPECS_4x2 = {  # mesh (4, 2)
    "wte.weight": ("data", "model"),  # 30 rows over 4
    "wpe.weight": (None, "model"),
    "block.qkv.weight": ("model", None),
    "block.proj.weight": (None, "model"),
    "block.fc.weight": ("model", "data"),
    "block.fc2.weight": ("data", "model"),
    "block.norm1.weight": ("data",),
    "block.norm2.weight": ("model",),
    "head.weight": ("data", None),  # 30 over 4
}
LM_SPECS_2x2x2 = {  # mesh (2, 2, 2)
    "wte.weight": (("a", "b", "c"), None),  # 30 over 8
    "block.qkv.weight": (("a", "b"), "c"),
    "block.proj.weight": ("c", ("a", "b")),
    "block.fc.weight": (("b", "a"), None),
    "block.fc2.weight": (None, ("a", "c")),
    "block.norm2.weight": ("b",),
    "head.weight": (("a", "c"), "b"),  # 30 over 4
}
CNN_SPECS = {  # mesh (1, 8)
    "conv1.weight": ("m", None, None, None),  # 6 out channels over 8
    "bn1.bias": ("m",),
    "bn1.weight": ("m",),
    "bn1.running_mean": ("m",),
    "conv2.weight": (None, "m", None, None),  # 6 in channels over 8
    "conv2.bias": ("m",),
    "head.weight": ("r", "m"),  # 32 over 8
}


# --- data -----------------------------------------------------------------------------------------
def mlp_batches(n, g, batch=16):
    return [(torch.randn(batch, 16, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(n)]


def lm_batches(n, g, batch=8, T=8, vocab=30):
    return [
        (torch.randint(0, vocab, (batch, T), generator=g), torch.randint(0, vocab, (batch, T), generator=g))
        for _ in range(n)
    ]


def cnn_batches(n, g, batch=8):
    return [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(n)]


# --- training -------------------------------------------------------------------------------------
def make_pair(make_model, seed=0):
    """(CPU model, copy moved to st.device()) with identical initial weights."""
    torch.manual_seed(seed)
    ref = make_model()
    dev = copy.deepcopy(ref).to(st.device())
    return ref, dev


def cross_entropy_step(model, opt, x, y):
    """One training step of a classifier: cross-entropy, backward, ``opt.step()``, ``zero_grad()``;
    the loss (with its graph)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _step_fn(model, opt, loss_fn):
    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()  # a compiled function may not return a tensor that requires grad

    return train_step


def train(model, opt, batches, loss_fn, mode="cpu", compiles=None):
    """Train ``model`` one step per batch; returns the losses as CPU floats.

    ``mode``: ``cpu`` (plain torch), ``lazy`` (``with st.step()``), ``eager`` (``st.eager_mode``) or
    ``compile`` (``st.compile`` of the step). ``compiles``, if a list, receives the UncachedCompile
    counter after each step.
    """
    step = _step_fn(model, opt, loss_fn)
    losses = []

    def record():
        if compiles is not None:
            compiles.append(st.counter_value("UncachedCompile") or 0)

    if mode == "cpu":
        for x, y in batches:
            losses.append(step(x, y).item())
    elif mode == "lazy":
        for x, y in batches:
            with st.step():
                loss = step(x, y)
            losses.append(loss.item())
            record()
    elif mode == "eager":
        with st.eager_mode(True):
            for x, y in batches:
                losses.append(step(x, y).item())
                record()
    elif mode == "compile":
        compiled = st.compile(step)
        for x, y in batches:
            losses.append(compiled(x, y).item())
            record()
    else:
        raise ValueError(mode)
    return losses


def shard_batches(batches, mesh, x_spec, y_spec):
    return [(st.shard(x, mesh, x_spec), st.shard(y, mesh, y_spec)) for x, y in batches]


def run_both(
    make_model,
    specs,
    mesh,
    batches,
    make_opt,
    mode,
    loss_fn=F.cross_entropy,
    x_spec=None,
    y_spec=None,
    seed=0,
    compiles=None,
):
    """Train the model on CPU and on st.device() (parameters sharded by ``specs``) the same way."""
    ref, dev = make_pair(make_model, seed)
    shard_params(dev, mesh, specs)
    ref_opt, dev_opt = make_opt(ref.parameters()), make_opt(dev.parameters())
    ref_losses = train(ref, ref_opt, batches, loss_fn, "cpu")
    x_spec = x_spec or (mesh.axis_names[0],) + (None,) * (batches[0][0].dim() - 1)
    y_spec = y_spec or (mesh.axis_names[0],) + (None,) * (batches[0][1].dim() - 1)
    dev_batches = shard_batches(batches, mesh, x_spec, y_spec)
    dev_losses = train(dev, dev_opt, dev_batches, loss_fn, mode, compiles)
    return ref, dev, ref_losses, dev_losses, ref_opt, dev_opt


def assert_trained_alike(ref, dev, ref_losses, dev_losses, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(torch.tensor(dev_losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    ref_state = ref.state_dict()
    dev_state = dev.state_dict()
    assert ref_state.keys() == dev_state.keys()
    for name, value in ref_state.items():
        got = dev_state[name]
        assert isinstance(got, st.ShardedTensor), name
        torch.testing.assert_close(got.cpu(), value, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def assert_sharding_kept(dev, mesh, specs):
    """The parameters keep the sharding they were given, through training."""
    named = dict(dev.named_parameters())
    named.update(dict(dev.named_buffers()))
    for name, spec in specs.items():
        t = named[name]
        assert t.mesh == mesh, name
        assert tuple(t.partition_spec) == tuple(spec), (name, t.partition_spec, spec)


# --- isolation ------------------------------------------------------------------------------------
def reset_state():
    """Leave no pending work and lazy mode on (tests share one process)."""
    from shardtensor.graph import state

    if state.STATE.eager:
        st.eager_mode(False)
    state.STATE.tracing = False
    state.STATE.execution_guard = None
    try:
        st.sync()
    except Exception:
        state.forget_pending()


def fresh_executable_cache():
    """Forget compiled programs, so that the UncachedCompile counter counts this test's programs only
    (programs are cached process-wide: an earlier test may already have compiled the same one)."""
    from shardtensor.graph import execute

    execute._EXECUTABLES.clear()
