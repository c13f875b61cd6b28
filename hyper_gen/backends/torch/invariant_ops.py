"""The batch-invariant arithmetic of the torch Qwen3.5 port: each op gives a row the same bits
whatever else is in the tensor, and prefill, chunked prefill and decode compute a position alike.

Why each exists (measured on torch 2.13 CPU, AVX2):

- sums: torch's ``sum`` / ``mean`` over a contiguous last axis gave a row other bits among 96 rows than
  among 8 (a (B, H, S, 64) l2-norm, S = 12 vs 1); ``tree_sum`` adds halves elementwise instead, an
  order fixed by the axis length alone. Every reduction of the mode is one (norms, l2-norms,
  attention's dot products and softmax sums, the delta rule's state products).
- elementwise: torch runs a vectorised loop and finishes a tensor's last few elements with the
  scalar function; for ``sigmoid``, ``silu``, ``softplus`` (and ``log1p``) the two round differently,
  so an element's bits depend on where the tensor ends. ``exp``, ``log``, ``rsqrt``, ``+ - * /``
  agree, so ``sigmoid`` / ``silu`` / ``softplus`` are written with those.
- the causal conv: ``conv1d`` over a sequence and a decode window's sum are different sums; both
  are ``conv`` here, K products added left to right.
- the delta rule: prefill's chunked form and decode's step compute in different orders; here both
  run the recurrent step (HF's elementwise ``torch_recurrent_gated_delta_rule`` form), one
  position at a time. Chosen by measurement of what is exact, not fast: prefill costs a Python
  step per position and layer (docs/performance.md, "Batch-invariant mode").
- attention: ``scaled_dot_product_attention`` picks its key and query blocks from the lengths, so
  a query's sums depend on the batch's padding and on how many queries run. ``attention`` here
  moves each row's keys to start at column 0 (left padding removed), scores a query by products
  summed over the head dim, and sums the softmax over blocks of ``KEY_BLOCK`` keys aligned to
  the row's own positions, the blocks folded in order (``cumsum``): masked and trailing keys add
  exact zeros, so the result is the row's alone.
"""

from __future__ import annotations

import torch

KEY_BLOCK = 64
QUERY_BLOCK = 16  # queries scored at a time (bounds the (queries, keys, head dim) products' memory)


# ------------------------------------------------------------------------------------------ sums


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The sum over ``dim`` (kept, size 1) as a tree of elementwise halves, zero-padded to a power of
    two: each element's order of additions depends on the axis length only."""
    n = x.shape[dim]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, width - n]
        x = torch.nn.functional.pad(x, pad)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x


def mean(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return tree_sum(x, dim) / x.shape[dim]


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` over the last axis (HF's RMSNorm core), its mean a ``tree_sum``."""
    return x * torch.rsqrt(mean(x * x) + eps)


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(tree_sum(x * x) + eps)


# ----------------------------------------------------------------------------------- elementwise


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def sigmoid_like(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid`` of a low-precision ``x``: computed in float32, rounded once."""
    wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    return sigmoid(wide).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """HF's ``F.silu`` of a low-precision ``x`` computes in float32 and rounds once: so here."""
    wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    return (wide / (1.0 + torch.exp(-wide))).to(x.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """torch's ``softplus`` (threshold 20), its ``log1p`` as ``log(u) * y / (u - 1)`` (exact ops)."""
    y = torch.exp(torch.clamp(x, max=20.0))
    u = 1.0 + y
    log1p = torch.where(u == 1.0, y, torch.log(u) * y / torch.where(u == 1.0, torch.ones_like(u), u - 1.0))
    return torch.where(x > 20.0, x, log1p)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis, its sum a ``tree_sum`` (the MoE router's)."""
    weights = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return weights / tree_sum(weights)


# ------------------------------------------------------------------------------ Gated DeltaNet


def causal_conv(full: torch.Tensor, weight: torch.Tensor, length: int) -> torch.Tensor:
    """Depthwise causal conv of the last ``length`` positions of ``full`` (B, C, K - 1 + length):
    K products added left to right (the same sum in a prefill and in a decode window)."""
    k = weight.shape[-1]
    out = full[..., 0:length] * weight[:, 0:1]
    for j in range(1, k):
        out = out + full[..., j : j + length] * weight[:, j : j + 1]
    return out


def delta_step(query, key, value, decay, beta, state):
    """One position of the gated delta rule, HF's elementwise recurrent form.

    query/key (B, H, Dk) l2-normalised (query pre-scaled), value (B, H, Dv), decay/beta (B, H),
    state (B, H, Dk, Dv), all in the compute dtype. Returns output (B, H, Dv) and the new state."""
    state = state * torch.exp(decay)[..., None, None]
    kv_mem = tree_sum(state * key.unsqueeze(-1), -2).squeeze(-2)
    delta = (value - kv_mem) * beta.unsqueeze(-1)
    state = state + key.unsqueeze(-1) * delta.unsqueeze(-2)
    return tree_sum(state * query.unsqueeze(-1), -2).squeeze(-2), state


def recurrent_delta_rule(query, key, value, decay, beta, state):
    """(B, H, S, ...) inputs -> output (B, H, S, Dv) and the final state, one ``delta_step`` per
    position (a zero state if None: a row's left padding, all zeros, leaves it exactly zero)."""
    b, h, s, dk = key.shape
    if state is None:
        state = value.new_zeros(b, h, dk, value.shape[-1])
    else:
        state = state.to(value.dtype)
    outs = []
    for t in range(s):
        out, state = delta_step(query[:, :, t], key[:, :, t], value[:, :, t], decay[:, :, t], beta[:, :, t], state)
        outs.append(out)
    return torch.stack(outs, dim=2), state


# ------------------------------------------------------------------------------------ attention


def _left_aligned(x: torch.Tensor, first: torch.Tensor, width: int, fill) -> torch.Tensor:
    """Each batch row of x (B, ..., T, D) shifted left by ``first[b]`` columns along axis -2 and
    padded to ``width`` with ``fill``."""
    b, t = x.shape[0], x.shape[-2]
    columns = torch.arange(width, device=x.device)[None, :] + first[:, None]  # (B, width)
    inside = columns < t
    index = columns.clamp(max=t - 1).view(b, *([1] * (x.dim() - 3)), width, 1).expand(*x.shape[:-2], width, x.shape[-1])
    shifted = torch.gather(x, -2, index)
    keep = inside.view(b, *([1] * (x.dim() - 3)), width, 1)
    return torch.where(keep, shifted, torch.full_like(shifted[..., :1, :1], fill))


def attention(query, key, value, mask, scale: float, compute_dtype) -> torch.Tensor:
    """Softmax attention with a reduction order fixed by the row alone (module doc).

    query (B, H, S, D); key / value (B, KV, T, D) (GQA: query heads ``[j g, (j+1) g)`` share KV
    head j); mask additive (B or 1, 1, S, T), masked entries the dtype's most negative value.
    Returns (B, H, S, D) in the query's dtype."""
    b, h, s, d = query.shape
    kv, t = key.shape[1], key.shape[2]
    groups = h // kv
    mask = mask.expand(b, 1, s, t)
    visible = (mask == 0).any(dim=2)[:, 0]  # (B, T): the row's real, written keys
    first = torch.where(visible.any(-1), visible.to(torch.int8).argmax(-1), 0)  # leading padding
    width = -(-t // KEY_BLOCK) * KEY_BLOCK
    lowest = torch.finfo(compute_dtype).min
    keys = _left_aligned(key.to(compute_dtype), first, width, 0.0)  # (B, KV, W, D)
    values = _left_aligned(value.to(compute_dtype), first, width, 0.0)
    bias = _left_aligned(mask.to(compute_dtype).transpose(-1, -2), first, width, lowest).transpose(-1, -2)
    bias = bias.reshape(b, 1, 1, s, width)  # (B, 1, 1, S, W)
    q = query.to(compute_dtype).reshape(b, kv, groups, s, d)
    k = keys[:, :, None, None]  # (B, KV, 1, 1, W, D)
    v = values[:, :, None, None].reshape(b, kv, 1, 1, width // KEY_BLOCK, KEY_BLOCK, d)
    outs = []
    for start in range(0, s, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, s)
        scores = tree_sum(q[:, :, :, start:stop, None, :] * k).squeeze(-1) * scale + bias[..., start:stop, :]
        top = scores.amax(dim=-1, keepdim=True)
        weights = torch.exp(scores - top)  # (B, KV, G, s', W)
        blocks = weights.reshape(*weights.shape[:-1], -1, KEY_BLOCK)
        total = tree_sum(blocks).squeeze(-1).cumsum(dim=-1)[..., -1:]  # (B, KV, G, s', 1)
        weighted = tree_sum(blocks.unsqueeze(-1) * v, -2).squeeze(-2)  # (B, KV, G, s', nblocks, D)
        out = weighted.cumsum(dim=-2)[..., -1, :] / total
        outs.append(out)
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(b, h, s, d).to(query.dtype)
