"""A one-layer attention LM following the RFC contract (returns its past as (K, V) per layer), in torch."""

import math

import numpy as np
import torch
from stub_weights import stub_weights

from hyper_gen import GenerateMixin


class TorchStubLM(GenerateMixin, torch.nn.Module):
    def __init__(self, dtype=torch.float32, returns_cache=True, **kwargs):
        super().__init__()
        weights = stub_weights(**kwargs)
        self.heads = weights.pop("heads")
        self.returns_cache = returns_cache
        for name, value in weights.items():
            self.register_parameter(name, torch.nn.Parameter(torch.from_numpy(np.asarray(value)).to(dtype)))
        self.forward_calls = []

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None):
        self.forward_calls.append(tuple(input_ids.shape))
        b, s = input_ids.shape
        h = self.embed[input_ids] + self.positions[position_ids]
        hd = h.shape[-1] // self.heads

        def split(x):
            return x.view(b, s, self.heads, hd).transpose(1, 2)

        q, k, v = split(h @ self.wq), split(h @ self.wk), split(h @ self.wv)
        if past_key_values is not None:
            k = torch.cat([past_key_values[0][0], k], dim=2)
            v = torch.cat([past_key_values[0][1], v], dim=2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        if attention_mask is not None:
            scores = scores + attention_mask
        attn = torch.softmax(scores, dim=-1) @ v
        h = h + attn.transpose(1, 2).reshape(b, s, -1) @ self.wo
        h = h + torch.tanh(h @ self.w_up) @ self.w_down
        out = {"logits": h @ self.lm_head}
        if self.returns_cache:
            out["past_key_values"] = [(k, v)]
        return out
