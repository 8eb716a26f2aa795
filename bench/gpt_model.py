"""The GPT the benches train and save (token embedding tied to the output, learned positions, pre-norm
attention + MLP blocks): plain torch, no device setup, so any bench (or bench worker) can import it.

Example::

    from gpt_model import GPT
    model = GPT(vocab=1024, seq=128, d=256, heads=4, layers=4)   # gelu="tanh": GELU's tanh form
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads, gelu="none"):
        super().__init__()
        self.heads, self.gelu = heads, gelu  # gelu: F.gelu's approximate ('none' exact, 'tanh')
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate=self.gelu))


class GPT(nn.Module):
    def __init__(self, vocab=1024, seq=128, d=256, heads=4, layers=4, gelu="none"):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, gelu) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()
