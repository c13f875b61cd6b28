"""The RFC-contract stub LM of stub_torch.py, in MindSpore, with the same numpy weights."""

import math

import mindspore as ms
import numpy as np
from mindspore import ops
from stub_weights import stub_weights

from hyper_gen import GenerateMixin


class MindSporeStubLM(GenerateMixin, ms.nn.Cell):
    def __init__(self, dtype=ms.float32, returns_cache=True, **kwargs):
        super().__init__()
        weights = stub_weights(**kwargs)
        self.heads = weights.pop("heads")
        self.returns_cache = returns_cache
        self.names = list(weights)
        for name, value in weights.items():
            setattr(self, name, ms.Parameter(ms.Tensor(np.asarray(value)).astype(dtype), name=name))
        self.forward_calls = []

    def construct(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None):
        self.forward_calls.append(tuple(input_ids.shape))
        b, s = input_ids.shape
        h = ops.gather(self.embed, input_ids, 0) + ops.gather(self.positions, position_ids, 0)
        hd = h.shape[-1] // self.heads

        def split(x):
            return x.reshape(b, s, self.heads, hd).swapaxes(1, 2)

        q, k, v = split(ops.matmul(h, self.wq)), split(ops.matmul(h, self.wk)), split(ops.matmul(h, self.wv))
        if past_key_values is not None:
            k = ops.cat((past_key_values[0][0], k), 2)
            v = ops.cat((past_key_values[0][1], v), 2)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(hd)
        if attention_mask is not None:
            scores = scores + attention_mask
        attn = ops.matmul(ops.softmax(scores, -1), v)
        h = h + ops.matmul(attn.swapaxes(1, 2).reshape(b, s, -1), self.wo)
        h = h + ops.matmul(ops.tanh(ops.matmul(h, self.w_up)), self.w_down)
        out = {"logits": ops.matmul(h, self.lm_head)}
        if self.returns_cache:
            out["past_key_values"] = [(k, v)]
        return out
