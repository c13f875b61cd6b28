"""A MindSpore model's one-token decode step, written once for graphs and PyNative: a decoder
layer's ``*_rows`` blocks one by one (``layer_step``), or a dense tp-1 model's stretch of them as
one graph (``segment_rows``; docs/architecture.md, "MindSpore on CPU")."""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, ops

from hyper_gen.backends.mindspore import layers
from hyper_gen.backends.mindspore.compile import block, jitted
from hyper_gen.backends.mindspore.gated_deltanet import delta_step_rows
from hyper_gen.backends.mindspore.primitives import add, on_cpu, rms_norm


def layer_step(layer, x, b, cos, sin, attention_mask, cache, cp_step, compiled: bool):
    """One token per row through a decoder layer's blocks, jitted when ``compiled``; None for a
    Gated DeltaNet layer without a state yet (a one-token prompt: its sequence path runs)."""
    mixer, mlp, eps = layer.mixer, layer.mlp, layer.eps
    if layer.is_attention:
        pre = block(layers.attention_pre_rows, mixer.step_sizes, compiled=compiled)
        q, k, v, gate = pre(x, eps, *mixer.step_weights(), cos, sin)
        out = mixer.attend_one(q, k, v, attention_mask, cache, cp_step, x.dtype)
        mixed = block(layers.attention_out_rows, compiled=compiled)(out, gate, mixer.o_t)
    else:
        states = mixer.decode_states(cache)
        if states is None:
            return None
        rows = block(delta_step_rows, mixer.step_sizes, compiled=compiled)
        idx = mixer.layer_idx
        mixed, cache.conv_states[idx], cache.recurrent_states[idx] = rows(x, *states, eps, *mixer.step_weights(b))
    x = add(x, layer.partial_sum(mixed))
    if isinstance(mlp, layers.MLP):
        out = block(layers.mlp_rows, mlp.inter, compiled=compiled)(x, eps, *mlp.step_weights())
    else:  # MoE: routed on the host
        out = mlp.construct(rms_norm(x, eps))
    return add(x, layer.partial_sum(out))


def write_index(rows: int, position: int) -> Tensor:
    """(rows, 2) int32 pairs (row, ``position``): where a static cache's (B * kv heads, length, D)
    buffers take the token (``write_position``)."""
    return Tensor(np.stack([np.arange(rows), np.full(rows, position)], 1).astype(np.int32))


_scatter_update = ops.TensorScatterUpdate()


def write_position(buffer, row, index):
    """``buffer`` (B, H, T, D) with ``row`` (B, H, 1, D) written at the position ``index``
    (``write_index``) names: one TensorScatterUpdate, which copies the buffer once (a ``where``
    over a one-position mask reads the buffer, the row and the mask for every position: twice the
    time; docs/performance.md)."""
    b, h, t, d = buffer.shape
    return _scatter_update(buffer.reshape(b * h, t, d), index, row.reshape(b * h, d)).reshape(b, h, t, d)


def segment_rows(steps, x, out, gate, *args):
    """Consecutive blocks of a decode step as one graph (``jitted`` by ``run_segment``), the blocks
    ``layer_step`` runs. ``steps`` (static, unrolled at compile time) is a tuple of ``(kind, first
    argument, sizes, intermediate size)``; kinds: ``rope`` / ``rotary`` (the rotary tables the
    ``pre`` steps use: given, or computed from the position ids and inv_freq), ``delta`` (a Gated
    DeltaNet mixer's residual; its new conv and recurrent states are returned), ``pre`` (an
    attention layer up to its core: q, k, v, gate are returned), ``attend`` (the core over a static
    cache's whole buffers, this token's keys and values written at the position the (B * kv heads,
    2) index ``write`` names; the new buffers are returned), ``out`` (the attention output's
    residual; ``out``, ``gate`` are the core's output and ``attention_pre_rows``' gate), ``mlp``
    (the MLP's residual) and ``head`` (final norm and LM head: the logits are returned). Returns
    (x or logits, q, k, v, gate or None, the new states and buffers in layer order)."""
    states = ()
    q = k = v = cos = sin = None
    for kind, at, sizes, inter in steps:
        if kind == "rope":  # the rotary tables, given
            cos, sin = args[at], args[at + 1]
        elif kind == "rotary":  # the rotary tables from the position ids and inv_freq
            cos, sin = layers.rotary_tables(args[at], args[at + 1], x.dtype)
        elif kind == "delta":
            mixed, conv_state, state = delta_step_rows(sizes, x, *args[at : at + 11])
            x = add(x, mixed)
            states = states + (conv_state, state)
        elif kind == "pre":
            q, k, v, gate = layers.attention_pre_rows(sizes, x, *args[at : at + 5], cos, sin)
        elif kind == "attend":  # a static cache: this token written at `write`, then attend_one's ops
            keys = write_position(args[at], k, args[at + 2])
            values = write_position(args[at + 1], v, args[at + 2])
            out = layers.attend_rows(q, keys, values, args[at + 3], sizes[0], x.dtype)
            states = states + (keys, values)
        elif kind == "out":
            x = add(x, layers.attention_out_rows(out, gate, args[at]))
        elif kind == "mlp":
            x = add(x, layers.mlp_rows(inter, x, *args[at : at + 3]))
        else:
            x = layers.head_rows(x, *args[at : at + sizes])
    return x, q, k, v, gate, states


def run_segment(steps: list, x, out, gate, args: list, written: list, cache):
    """Run one ``segment_rows`` graph and store what it wrote in the cache: ``written`` lists its
    layers in order, ("delta", layer index) (conv and recurrent state) or ("attention", layer
    index) (a static cache's key and value buffers). Returns (x or logits, q, k, v, gate)."""
    x, q, k, v, gate, states = jitted(segment_rows, tuple(steps))(x, out, gate, *args)
    for i, (kind, idx) in enumerate(written):
        if kind == "delta":
            cache.conv_states[idx], cache.recurrent_states[idx] = states[2 * i], states[2 * i + 1]
        else:
            cache.keys[idx], cache.values[idx] = states[2 * i], states[2 * i + 1]
    return x, q, k, v, gate


def segmented_decode(model, input_ids, position_ids, attention_mask, cache, cp_step):
    """A compiled step of ``model`` (one token per row) through ``segment_rows`` graphs: with a static
    cache one graph for the whole step after the embedding (rotary tables included), else (a
    dynamic cache, a context-parallel rank's) one from each attention core to the next with the
    cores' PyNative attention between them; None where ``layer_step`` runs instead (tensor
    parallelism, MoE, a Gated DeltaNet layer without a state)."""
    if not model.segments_decode:
        return None
    if any(not layer.is_attention and layer.mixer.decode_states(cache) is None for layer in model.layers):
        return None
    b, dtype = input_ids.shape[0], model.dtype  # (a pending tensor's .dtype waits for MindSpore's op queue)
    # a static cache that has room for the token: its writes and attention join the graph,
    # and the whole step is one graph
    whole = cp_step is None and cache.is_static and cache.seq_length < cache.max_length
    whole = whole and all(layer.mixer.layer_idx in cache.keys for layer in model.layers if layer.is_attention)
    write = {n: write_index(b * n, cache.seq_length) for n in model.kv_heads} if whole else None
    # (the embedding stays PyNative: gathered in the graph, the step was slower)
    x, steps, args = model.embed(input_ids), [], []
    if whole:  # the rotary tables in the graph too
        steps.append(("rotary", len(args), (), 0))
        args += [position_ids, model.inv_freq]
    else:  # each segment graph is given them
        tables = layers.rotary_tables(position_ids, model.inv_freq, dtype)
        steps.append(("rope", len(args), (), 0))
        args += list(tables)
    written, out, gate = [], None, None
    for layer in model.layers:
        mlp, mix, idx = layer.mlp, layer.mixer, layer.mixer.layer_idx
        if layer.is_attention:
            steps.append(("pre", len(args), mix.step_sizes, 0))
            args += [layer.eps, *mix.step_weights()]
            if whole:
                steps.append(("attend", len(args), (mix.acc,), 0))
                args += [cache.keys[idx], cache.values[idx], write[mix.num_kv_heads], attention_mask]
                written.append(("attention", idx))
            else:
                x, q, k, v, gate = run_segment(steps, x, out, gate, args, written, cache)
                out = mix.attend_one(q, k, v, attention_mask, cache, cp_step, dtype)
                steps, args, written = [("rope", 0, (), 0)], list(tables), []
            steps.append(("out", len(args), (), 0))
            args.append(mix.o_t)
        else:
            steps.append(("delta", len(args), mix.step_sizes, 0))
            args += [*mix.decode_states(cache), layer.eps, *mix.step_weights(b)]
            written.append(("delta", idx))
        steps.append(("mlp", len(args), (), mlp.inter))
        args += [layer.eps, *mlp.step_weights()]
    steps.append(("head", len(args), 2 + len(model.lm_head), 0))
    args += [model.eps, model.norm, *model.lm_head]
    logits = run_segment(steps, x, out, gate, args, written, cache)[0]
    if whole and on_cpu():
        # wait here, on the host: an op queued behind a running graph competes with its kernels
        # for the CPU cores while it waits (docs/performance.md); a device's kernels do not
        # share the host's cores, and there this would copy the logits off the device each step
        logits.asnumpy()
    return logits
