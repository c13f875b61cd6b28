"""Qwen3.5 (dense and MoE) written natively in MindSpore: the decoder layer, the model and ``load``,
composing the backend's layers (``..layers``, ``..gated_deltanet``) on weights laid out for
MindSpore (``..weights``); one-token steps run the layers' decode blocks, compiled once per batch
size where the compile gate allows (``..decode``, ``..compile``; bitwise the PyNative results).
Layout, numerics, tensor and context parallelism: docs/architecture.md, "The native Qwen3.5 ports".
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ParameterTuple, Tensor, nn, ops

from hyper_gen import matmul_widths
from hyper_gen.backends.mindspore import compile as compiling
from hyper_gen.backends.mindspore import decode, layers
from hyper_gen.backends.mindspore.compile import (
    DYNAMIC_COMPILE_AFTER,
    STATIC_CACHE_MULTIPLE,
    CompileGate,
    block,
    check_switches,
)
from hyper_gen.backends.mindspore.gated_deltanet import GatedDeltaNet
from hyper_gen.backends.mindspore.ops import MindSporeOps, dtype_name, new_group
from hyper_gen.backends.mindspore.primitives import add, numpy_dtype, rms_norm, scalar
from hyper_gen.backends.mindspore.weights import Weights, check_dtype
from hyper_gen.cache import DynamicCache
from hyper_gen.kernel_plan import KernelPlan
from hyper_gen.masks import contract_defaults
from hyper_gen.models.qwen3_5 import Qwen3_5Config, describe
from hyper_gen.models.qwen3_5.routing import RoutedExpertsSource
from hyper_gen.models.qwen3_5.shards import EMBED_TOKENS, LayerShard, ModelShard, MoEShard
from hyper_gen.models.weight_update import touches
from hyper_gen.parallel.cp_plan import CPPlan
from hyper_gen.parallel.groups import shard_groups
from hyper_gen.parallel.rank_sum import RankSum
from hyper_gen.parallel.sharded_model import set_parallel, whole_vocabulary
from hyper_gen.parallel.tp_plan import TPPlan
from hyper_gen.token_packing import GroupedPacking, TokenPacking


class DecoderLayer(nn.Cell):
    """Mixer and layers.MLP residual blocks; ``partial_sum`` adds up their row-parallel outputs. The two
    norms' ``1 + w`` live in the mixer's and the layers.MLP's input projections."""

    def __init__(self, cfg: Qwen3_5Config, weights: Weights, shard: LayerShard, layer_idx: int, partial_sum: RankSum):
        super().__init__()
        input_scale = weights.norm_scale(shard.input_norm)
        post_attention_scale = weights.norm_scale(shard.post_attention_norm)
        self.is_attention = not shard.is_linear
        if self.is_attention:
            self.mixer = layers.GatedAttention(cfg, weights, shard.mixer, layer_idx, input_scale)
        else:
            self.mixer = GatedDeltaNet(cfg, weights, shard.mixer, layer_idx, input_scale)
        if isinstance(shard.mlp, MoEShard):
            self.mlp = layers.SparseMoE(weights, shard.mlp, post_attention_scale)
        else:
            self.mlp = layers.dense_mlp(weights, shard.mlp, post_attention_scale)
        self.eps = scalar(cfg.rms_norm_eps, weights.acc)
        self.partial_sum = partial_sum

    def construct(self, x, b, s, cos, sin, attention_mask, cache, cp_step=None, packing=None, compiled=False):
        """A one-token decode step runs the layer's decode blocks (``decode.layer_step``), jitted if
        ``compiled`` (the model's ``CompileGate``); a sequence, or a one-token forward without a
        state (a one-token prompt's Gated DeltaNet, a context-parallel prefill), the mixer's and
        the layers.MLP's ``construct``; a grouped step (``packing`` a ``GroupedPacking``) the latter,
        every group's own core inside the mixer."""
        if s == 1 and (cp_step is None or cp_step.decode) and not isinstance(packing, GroupedPacking):
            out = decode.layer_step(self, x, b, cos, sin, attention_mask, cache, cp_step, compiled)
            if out is not None:
                return out
        h = rms_norm(x, self.eps)
        if self.is_attention:
            x = add(
                x, self.partial_sum(self.mixer.construct(h, b, s, cos, sin, attention_mask, cache, cp_step, packing))
            )
        else:
            x = add(x, self.partial_sum(self.mixer.construct(h, b, s, cache, cp_step, packing)))
        return add(x, self.partial_sum(self.mlp.construct(rms_norm(x, self.eps))))


class Qwen3_5ForCausalLM(RoutedExpertsSource, nn.Cell):
    """Qwen3.5 / Qwen3.5-MoE language model implementing docs/model_contract.md (cache objects).

    Built from this rank's ``ModelShard`` (``hyper_gen.models.qwen3_5.describe``). ``config`` is
    the parsed ``hyper_gen.models.qwen3_5.Qwen3_5Config``; ``vocab_size`` the true vocabulary
    size; ``dtype`` the model dtype (every Parameter is in it; compute-dtype constants are Tensors);
    ``tp_plan`` the ``TPPlan`` it was loaded with. With ``tp_plan.tp > 1`` it also has
    ``parallel_group`` (None: the world group) and ``vocab_parallel = True``: its logits are this
    rank's block of ``plan.padded_vocab(vocab_size) // tp`` columns (generate() gathers them).
    Under context parallelism (``cp_plan.cp > 1``) ``parallel_group`` is None (the whole job,
    tp x cp ranks) and ``vocab_parallel`` False: a tp x cp model gathers its vocabulary blocks over
    its tp group ``tp_group`` itself.
    """

    supports_cache_object = True
    supports_grouped_step = True  # construct(past_key_values=GroupedPacking): several row groups in one forward

    def __init__(self, shard: ModelShard, weights: Weights, group=None, cp_plan: CPPlan = None, cp_group=None):
        super().__init__()
        cfg, plan = shard.config, shard.plan
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        set_parallel(self, plan, group, cp_plan, cp_group, MindSporeOps())
        self.vocab_start, self.vocab_stop = shard.vocab_start, min(shard.vocab_stop, cfg.vocab_size)  # real ids here
        blocks, self.head_columns = weights.lm_head(shard)
        self.lm_head = ParameterTuple(blocks)
        self.embed_tokens = None if shard.lm_head is None else weights.param(weights.vocab_rows(shard, EMBED_TOKENS))
        self.partial_sum = RankSum(MindSporeOps(), plan.tp, group)
        self.layers = nn.CellList(
            [DecoderLayer(cfg, weights, layer, i, self.partial_sum) for i, layer in enumerate(shard.layers)]
        )
        # a dense tp-1 model's compiled decode steps run as segment graphs (decode.segmented_decode)
        self.segments_decode = plan.tp == 1 and all(isinstance(layer.mlp, layers.MLP) for layer in self.layers)
        # its one-graph decode step is compiled for the static cache's buffer length: generate()
        # rounds that length up to a multiple of this (hyper_gen.cache.static_length), so batches
        # of other prompt lengths reuse the graph instead of compiling their own (~1-3 s each)
        whole_step = self.segments_decode and self.cp_plan.cp == 1 and compiling.COMPILED_DECODE
        self.static_cache_multiple = STATIC_CACHE_MULTIPLE if whole_step else 1
        # decode steps of a batch size with a dynamic cache before they run compiled (CompileGate)
        self.decode_compile_after = DYNAMIC_COMPILE_AFTER
        self._compile_gate = CompileGate()
        self.kv_heads = {layer.mixer.num_kv_heads for layer in self.layers if layer.is_attention}
        self.norm = Tensor(weights.norm_scale(shard.final_norm)[None])
        self.eps = scalar(cfg.rms_norm_eps, weights.acc)
        # rotary frequencies over the whole head: [f, f] on the rotary dims, 0 (cos 1, sin 0) after
        rot, d = cfg.rotary_dim, cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
        inv_freq = np.concatenate([inv_freq, inv_freq, np.zeros(d - rot)])
        self.inv_freq = Tensor(inv_freq[None].astype(numpy_dtype(weights.acc)))
        self.generation_defaults: dict = {}

    @property
    def dtype(self):
        return self.lm_head[0].dtype

    def embed(self, input_ids):
        """(B * S, hidden) rows of the input ids."""
        ids = input_ids.reshape(-1)
        vocab_parallel = self.tp_plan.tp > 1
        if vocab_parallel:  # each id's row is on one rank; the others contribute zeros to the sum
            held = (ids >= self.vocab_start) & (ids < self.vocab_stop)
            ids = ops.where(held, ids - self.vocab_start, ops.zeros_like(ids))
        if self.embed_tokens is not None:
            rows = ops.gather(self.embed_tokens, ids, 0)
        else:
            # a tied head: the ids' columns of the LM head blocks
            columns = matmul_widths.block_columns(MindSporeOps(), self.lm_head, self.head_columns, ids.asnumpy())
            rows = columns.transpose(1, 0)
        if not vocab_parallel:
            return rows
        return self.partial_sum(ops.where(held[:, None], rows, ops.zeros_like(rows)))

    def construct(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None, logits_to_keep=0):
        """Contract call (docs/model_contract.md). Without a cache the forward is cacheless (a
        throwaway DynamicCache); without position ids / mask, positions continue from the cache
        and the mask is causal with no padding."""
        if isinstance(past_key_values, GroupedPacking):
            return self._construct_groups(input_ids, past_key_values)
        b, s = input_ids.shape
        cache = past_key_values
        if cache is None:
            cache = DynamicCache(MindSporeOps(), b, s)
        position_ids, attention_mask = contract_defaults(
            MindSporeOps(), cache, b, s, position_ids, attention_mask, dtype_name(self.dtype)
        )
        cp_step = None
        if self.context_parallel is not None:
            cp_step = self.context_parallel.step(cache, s)
            # this rank's slice of the positions in a sharded prefill; the mask keeps its global columns
            input_ids, position_ids = cp_step.local_positions(input_ids, position_ids)
            s = input_ids.shape[1]
        prompt_mask = cache.prompt_mask if cp_step is None and cache.seq_length == 0 else None
        packing = TokenPacking.of(MindSporeOps(), prompt_mask)
        compiled = s == 1 and self._compile_gate.allows(b, cache.is_static, self.decode_compile_after)
        if compiled and (cp_step is None or cp_step.decode):
            logits = decode.segmented_decode(self, input_ids, position_ids, attention_mask, cache, cp_step)
            if logits is not None:
                return {"logits": logits.reshape(b, 1, -1)}
        x = self.embed(input_ids if packing is None else packing.pack(input_ids.reshape(-1, 1)))
        cos, sin = layers.rotary_tables(position_ids, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer.construct(x, b, s, cos, sin, attention_mask, cache, cp_step, packing, compiled)
        if packing is not None:
            x = packing.unpack(x)
        kept = s
        if cp_step is not None and cp_step.sharded:
            x = cp_step.gather_rows(x.reshape(b, -1, x.shape[-1]), logits_to_keep)
            kept = x.shape[1]
            x = x.reshape(b * kept, -1)
        elif logits_to_keep and logits_to_keep < s:
            kept = logits_to_keep
            x = x.reshape(b, s, -1)[:, -kept:].reshape(b * kept, -1)
        # (a prefill's last row is a view: a new graph key)
        logits = block(layers.head_rows, compiled=kept == 1 and compiled)(x, self.eps, self.norm, *self.lm_head)
        return {"logits": whole_vocabulary(self, logits, MindSporeOps()).reshape(b, kept, -1)}

    def _construct_groups(self, input_ids, step: GroupedPacking):
        """One forward over several groups of rows (``token_packing.GroupedPacking``): the packed
        (1, N) tokens through every row-wise block once, each group's mixer cores on its own rows
        (never compiled: the graphs are one-token steps of one batch); the logits of the packed
        rows ``step.keep``, (len(keep), 1, V)."""
        if self.context_parallel is not None:  # (a sharded prefill's rows are split over the ranks)
            raise ValueError("a context-parallel model takes no grouped step: run a forward a group")
        x = self.embed(input_ids)
        for group in step.groups:
            group.cos, group.sin = layers.rotary_tables(group.positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer.construct(x, None, None, None, None, None, None, None, step)
        x = ops.gather(x, Tensor(np.asarray(step.keep, np.int32)), 0)
        logits = layers.head_rows(x, self.eps, self.norm, *self.lm_head)
        return {"logits": whole_vocabulary(self, logits, MindSporeOps()).reshape(len(step.keep), 1, -1)}


def load(
    checkpoint,
    dtype: str = "float32",
    device=None,
    plan: TPPlan = None,
    group=None,
    cp_plan: CPPlan = None,
    kernels=None,
) -> Qwen3_5ForCausalLM:
    """A Qwen3.5 model from a ``hyper_gen.models.checkpoint.Checkpoint``, weights in ``dtype``.

    ``plan``: a ``TPPlan(tp, rank)`` to load this rank's tensor-parallel shard (None: the whole
    model); ``group``: the communication group of the ``tp`` ranks (None: the world group, whose
    size and this process's rank must then be ``tp`` and ``plan.rank``). ``device`` is accepted and
    ignored: MindSpore's device target is chosen for the whole process.
    ``cp_plan``: a ``CPPlan(cp, rank)`` for context parallelism. The world is then the
    ``tp x cp`` mesh (``hyper_gen.parallel.cp_plan.Mesh``, tp innermost: exactly ``tp * cp`` ranks,
    this one at ``(plan.rank, cp_plan.rank)``); with tp > 1 every rank must call this, as it makes
    the rank's tp and cp subgroups (docs/architecture.md), unless ``group`` (the tp group) is given.
    ``kernels``: the kernel plan's spec (``hyper_gen.kernel_plan``: "auto", "plain" or a plan .json);
    the model's choices are ``model.kernel_plan``."""
    check_switches()
    plan = TPPlan.resolve(plan)
    cp_plan = CPPlan.resolve(cp_plan)
    check_dtype(dtype)
    shard = describe(checkpoint, Qwen3_5Config.from_dict(checkpoint.config), plan)  # splits checked, nothing read
    size = plan.tp * cp_plan.cp
    launch = f"msrun --worker_num={size} --local_worker_num={size} --join=True app.py"
    group, cp_group = shard_groups(MindSporeOps(), plan, cp_plan, group, launch, "mindspore", _new_group)
    kernel_plan = KernelPlan.open(kernels, "mindspore", ms.__version__, ms.get_context("runtime_num_threads"))
    kernel_plan.check(matmul_widths.allowed)
    weights = Weights(checkpoint, dtype, kernel_plan)
    model = Qwen3_5ForCausalLM(shard, weights, group, cp_plan, cp_group)
    model.kernel_plan = kernel_plan.used(weights.kernel_keys)
    model.set_train(False)
    return model


def _new_group(name, ranks, member):
    return new_group(name, ranks) if member else None  # MindSpore makes a group on its members only


def prepare_update(model: Qwen3_5ForCausalLM, checkpoint, names):
    """update_weights' conversion (``hyper_gen.models.weight_update``): load's code builds the layers
    and head ``names`` touch; the write moves their parameters' data and constants into the model's."""
    shard = describe(checkpoint, model.config, model.tp_plan)
    w = Weights(checkpoint, dtype_name(model.dtype), model.kernel_plan)
    new = [(model.layers[i], DecoderLayer(model.config, w, layer, i, model.partial_sum))
           for i, layer in enumerate(shard.layers) if touches(layer, names)]  # fmt: skip
    pairs = [(o, n) for old, cell in new for (_, o), (_, n) in zip(old.cells_and_names(), cell.cells_and_names())]
    params = [(o._params[key], p) for o, n in pairs for key, p in n._params.items()]
    params += list(zip(model.lm_head, w.lm_head(shard)[0])) if touches(shard.lm_head or EMBED_TOKENS, names) else []
    if shard.lm_head is not None and touches(EMBED_TOKENS, names):
        params.append((model.embed_tokens, w.param(w.vocab_rows(shard, EMBED_TOKENS))))
    tensors = lambda v: isinstance(v, Tensor) or isinstance(v, tuple) and all(isinstance(t, Tensor) for t in v)  # noqa: E731
    constants = [(o, k, v) for o, n in pairs for k, v in vars(n).items() if tensors(v)]  # conv taps, decay rates
    if touches(shard.final_norm, names):
        constants.append((model, "norm", Tensor(w.norm_scale(shard.final_norm)[None])))
    return lambda: [p.set_data(value) for p, value in params] + [setattr(*c) for c in constants]
