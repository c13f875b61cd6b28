"""A ZeRO-3-style MindSpore LM and its unsharded twin, for the step-synced generate tests.

Both are the RFC-contract stub of stub_mindspore.py (same numpy weights from stub_weights.py, the
same math in :func:`stub_forward`):

- :class:`Zero3StubLM` keeps only its rank's 1/world of every weight's rows as Parameters, and
  its ``construct`` all-gathers every shard (``mindspore.ops.AllGather`` over the world group)
  before using it, on every call, as ZeRO-3 / FSDP do: a rank that stops calling forward leaves
  the others waiting in those all-gathers. It declares ``collective_forward = True`` and offers
  ``unshard()`` / ``reshard()`` (gather once, then drop), which generate(unshard_params=True) uses;
- :class:`UnshardedStubLM` holds the whole weights and runs no collective.

Each records its forwards (``calls``: "prefill" / "decode" / "dummy") and the Zero3 model counts
its all-gathers (``gathers``), so a test can tell which rank stepped how.
"""

import math

import mindspore as ms
import numpy as np
from mindspore import ops
from stub_weights import stub_weights

from hyper_gen import GenerationConfig

VOCAB = 64

# The rollout tests' inputs: each rank its own left-padded prompts (rank 0: 2 rows, rank 1: 3 rows
# of other widths); with EOS 2, greedy, rank 0's rows are all done after step 3 (EOS at steps 3
# and 2), rank 1's at step 11 (no EOS, EOS at step 8, no EOS): rank 0 finishes 8 steps earlier.
EOS = 2
PROMPTS = {
    0: [[14, 48], [59, 17, 36, 5]],
    1: [[22, 16, 12], [26, 52, 27, 26], [44, 57, 38, 50, 53, 16]],
}
GREEDY = GenerationConfig(max_new_tokens=12, eos_token_id=EOS, pad_token_id=0)
SEEDED = GREEDY.replace(do_sample=True, seed=3, temperature=1.3)


def left_padded(prompts):
    """(ids, mask) int64 arrays of ``prompts`` left-padded with 0 (no prompt uses token 0)."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
    return ids, (ids > 0).astype(np.int64)


def stub_forward(w, heads, input_ids, position_ids, attention_mask, past_key_values):
    """stub_mindspore.MindSporeStubLM's forward on the weights ``w`` (name -> whole tensor)."""
    b, s = input_ids.shape
    h = ops.gather(w["embed"], input_ids, 0) + ops.gather(w["positions"], position_ids, 0)
    hd = h.shape[-1] // heads

    def split(x):
        return x.reshape(b, s, heads, hd).swapaxes(1, 2)

    q, k, v = split(ops.matmul(h, w["wq"])), split(ops.matmul(h, w["wk"])), split(ops.matmul(h, w["wv"]))
    if past_key_values is not None:
        k = ops.cat((past_key_values[0][0], k), 2)
        v = ops.cat((past_key_values[0][1], v), 2)
    scores = ops.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(hd)
    if attention_mask is not None:
        scores = scores + attention_mask
    attn = ops.matmul(ops.softmax(scores, -1), v)
    h = h + ops.matmul(attn.swapaxes(1, 2).reshape(b, s, -1), w["wo"])
    h = h + ops.matmul(ops.tanh(ops.matmul(h, w["w_up"])), w["w_down"])
    return {"logits": ops.matmul(h, w["lm_head"]), "past_key_values": [(k, v)]}


def _kind(input_ids, past_key_values):
    """What generate() asked for: a cached decode step, a prefill, or a step-synced dummy step."""
    if past_key_values is not None:
        return "decode"
    return "dummy" if tuple(input_ids.shape) == (1, 1) else "prefill"


class UnshardedStubLM(ms.nn.Cell):
    """The whole model on every rank: no collectives."""

    vocab_size = VOCAB

    def __init__(self, dtype=ms.float32, **kwargs):
        super().__init__()
        weights = stub_weights(vocab_size=VOCAB, **kwargs)
        self.heads = weights.pop("heads")
        self.names = list(weights)
        for name, value in weights.items():
            setattr(self, name, ms.Parameter(ms.Tensor(np.asarray(value)).astype(dtype), name=name))
        self.calls = []

    def construct(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None):
        self.calls.append(_kind(input_ids, past_key_values))
        w = {name: getattr(self, name) for name in self.names}
        return stub_forward(w, self.heads, input_ids, position_ids, attention_mask, past_key_values)


class Zero3StubLM(ms.nn.Cell):
    """Rank ``rank`` of ``world`` keeps rows [rank * n / world, (rank + 1) * n / world) of every
    weight; every forward all-gathers them (AllGather stacks along axis 0: the whole weight)."""

    collective_forward = True  # every forward runs collectives: generate keeps the ranks stepping together
    vocab_size = VOCAB  # declared, so a bad token id fails before any forward

    def __init__(self, rank, world, dtype=ms.float32, **kwargs):
        super().__init__()
        weights = stub_weights(vocab_size=VOCAB, **kwargs)
        self.heads = weights.pop("heads")
        self.names = list(weights)
        for name, value in weights.items():
            value = np.asarray(value)
            rows = value.shape[0] // world
            assert rows * world == value.shape[0], (name, value.shape, world)
            shard = value[rank * rows : (rank + 1) * rows]
            setattr(self, name, ms.Parameter(ms.Tensor(shard).astype(dtype), name=name))
        self._all_gather = ops.AllGather()  # the world group
        self._whole = None  # name -> whole weight, between unshard() and reshard()
        self.calls = []
        self.gathers = 0  # all-gathers run (one per weight gathered)

    def _gather_all(self):
        self.gathers += len(self.names)
        return {name: self._all_gather(getattr(self, name)) for name in self.names}

    def unshard(self):
        """Gather every weight once and keep it until :meth:`reshard` (generate(unshard_params=True))."""
        self._whole = self._gather_all()

    def reshard(self):
        self._whole = None

    def construct(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None):
        self.calls.append(_kind(input_ids, past_key_values))
        w = self._whole if self._whole is not None else self._gather_all()
        return stub_forward(w, self.heads, input_ids, position_ids, attention_mask, past_key_values)
