"""The Qwen3.8-Flash-Next target (`qwen4_exp`): the Qwen3.5/3.6 MoE hybrid with
hyper-connections (hyper.py), per-layer n-gram embeddings (ple.py) and the QSA indexer on its
full-attention layers (indexer.py); parameter names as transformers saves them.

A layer: PLE adds to the streams (its layers only); a hyper-mixer reads the streams into the
mixer's input (GDN, or gated attention over the keys the indexer keeps), whose output goes
back into each stream by its gate; a second hyper-mixer does the same around the MoE. The
last mixer of the streams feeds lm_head (no final norm).

`forward` has the target's signature (models/qwen/target.py), a batch's slots included; one
sequence's decode and verify blocks run compiled where the engine compiles
(graphs/compiled_flash_next.py), the rest eager; no dense segment backends or images yet.
Taps (what a drafter or MTP head reads of layer L): the mean of layer L's output streams,
the one H-wide summary of the residual that needs no learned weights (it is what every
stream's share of the residual holds before a mixer weighs it); of the last layer, the last
mixer's output, which is what lm_head reads, as a plain target's taps of its last layer are
after the final norm. Tap ids
`num_layers` .. `num_layers + hc - 1` (`mtp_taps`) are the streams of the state after the
last layer, which the MTP module (flash_next_mtp.py) continues.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...config import LINEAR_ATTENTION, ModelConfig
from ...state.cache import InferenceState
from ..qwen.attention import Attention
from ..qwen.context import ForwardContext
from ..qwen.gdn import GatedDeltaNet
from ..qwen.inference import inference
from ..qwen.layers import apply_rope, embedding
from ..qwen.moe import RoutingRecord, SparseMoeBlock
from ..qwen.target import ForwardOutput, TorchDense
from .hyper import HyperMixer, inject
from .indexer import QSAIndexer
from .ngram import NGramTable
from .ple import PLE
from .qsa_attention import qsa_cache_attention


class FlashNextLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        fn = cfg.flash_next
        self.is_linear = cfg.layer_types[layer_idx] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = Attention(cfg, layer_idx)
            if fn.indexer is not None:
                self.self_attn.indexer = QSAIndexer(cfg, layer_idx)
        self.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size)
        self.ple = (PLE(cfg, layer_idx, fn.ple_layers.index(layer_idx))
                    if layer_idx in fn.ple_layers else None)
        mixer = (cfg.hidden_size, fn.hc_count, fn.hc_lowrank, cfg.rms_norm_eps)
        self.attn_hyper_connection = HyperMixer(*mixer)
        self.mlp_hyper_connection = HyperMixer(*mixer)

    def forward(self, streams: torch.Tensor, ids: torch.Tensor, history: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        if self.ple is not None:
            streams = streams + self.ple(streams, ids, history, ctx)
        h, gates = self.attn_hyper_connection(streams)
        if self.is_linear:
            mix, post = self.linear_attn.pre(h)
            out = self.linear_attn.post(self.linear_attn.mix(mix, ctx), post)
        else:
            out = self.attend(h, ctx)
        streams = inject(streams, out, gates)
        h, gates = self.mlp_hyper_connection(streams)
        return inject(streams, self.mlp(h), gates)

    def step_static(self, streams: torch.Tensor, emb: torch.Tensor | None,
                    cache: tuple[torch.Tensor, ...], ple: tuple[torch.Tensor, ...] | None,
                    index_keys: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, key_rows: torch.Tensor, valid: torch.Tensor,
                    window_rows: torch.Tensor):
        """`forward` with static shapes (graphs/compiled_flash_next.py) -> (the streams, the
        MoE's expert ids). emb: the PLE layer's n-gram rows, ple: its (window, kept rows,
        rows kept); cache as static_graphs.layer_cache; index_keys: the indexer's raw keys."""
        if self.ple is not None:
            streams = streams + self.ple.forward_static(streams, emb, *ple)
        h, gates = self.attn_hyper_connection(streams)
        if self.is_linear:
            mix, post = self.linear_attn.pre(h)
            core = self.linear_attn.mix_static(mix, valid, window_rows, cache)
            out = self.linear_attn.post(core, post)
        else:
            out = self.attend_static(h, cache, index_keys, cos, sin, positions, key_rows)
        streams = inject(streams, out, gates)
        h, gates = self.mlp_hyper_connection(streams)
        out, ids = self.mlp.routed(h, valid)
        return inject(streams, out, gates), ids

    def attend_static(self, h: torch.Tensor, cache: tuple[torch.Tensor, ...],
                      index_keys: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor, key_rows: torch.Tensor) -> torch.Tensor:
        """`attend` on static shapes: the rows written at `positions` of the cache (and of
        the indexer's keys), attention over its first `key_rows` rows, in one op."""
        attn = self.self_attn
        if not hasattr(attn, "indexer"):
            mix, post = attn.pre(h)
            return attn.post(attn.mix_static(mix, cos, sin, positions, key_rows, cache), post)
        ix = attn.indexer
        mix, post = attn.pre(h)
        q, k_scale, v_scale = attn.write_static(mix, cos, sin, positions, cache)
        index_q, index_k = ix.project(h, cos, sin)
        ix.store(index_keys, index_k, positions)
        b, t = q.shape[:2]
        out = qsa_cache_attention(q, cache[0], cache[1], index_q, index_keys, positions,
                                  key_rows, k_scale, v_scale, attn.head_dim ** -0.5,
                                  ix.k_layernorm.weight, ix.k_layernorm.eps, ix.ratio,
                                  ix.topk, ix.rope.rotary_dim, ix.rope.theta)
        return attn.post(out.reshape(b, t, attn.num_heads * attn.head_dim), post)

    def attend(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Gated attention over the cache, reading only the keys the indexer keeps."""
        attn = self.self_attn
        (q, k, v), post = attn.pre(h)
        mask = (attn.indexer.select(h, ctx) if hasattr(attn, "indexer")
                else ctx.causal_mask)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        kv = ctx.state.kv
        kv.append(attn.layer_idx, k, v, ctx.positions)
        keys, values = kv.read(attn.layer_idx, ctx.key_length)
        return attn.post(attn.attend(q, keys, values, mask), post)


class FlashNextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        fn = cfg.flash_next
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(FlashNextLayer(cfg, i) for i in range(cfg.num_layers))
        self.hyper_connection_mixer = HyperMixer(cfg.hidden_size, fn.hc_count, fn.hc_lowrank,
                                                 cfg.rms_norm_eps, gates=False)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.moe_blocks = [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
        self.ple_layers = [layer.ple for layer in self.layers if layer.ple is not None]
        # the MTP module's taps: the streams of the state after the last layer, one id per
        # stream past the layers' (each H wide, as every other tap, so that proposers' taps
        # concatenate and split alike)
        self.mtp_taps = tuple(range(cfg.num_layers, cfg.num_layers + fn.hc_count))
        self.segments: list = []          # no dense segments: eager only
        self.dense = TorchDense(self.segments)
        self.static = self.batch_static = None

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_static(self, runner) -> None:
        """The compiled forwards of one sequence (graphs/compiled_flash_next.py), or None."""
        self.static = runner

    def set_dense(self, runner) -> None:
        raise ValueError("a Flash-Next target runs its dense parts in torch only "
                         "(dense_backend torch)")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(x) if self.lm_head is not None else x @ self.embed_tokens.weight.T
        return out.float()

    @inference
    def forward(self, ids: torch.Tensor, state: InferenceState, *, record_steps: bool = False,
                taps: tuple[int, ...] = (), all_logits: bool = False,
                routing: RoutingRecord | None = None,
                real_rows: Sequence[int] | None = None,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope_positions: torch.Tensor | None = None) -> ForwardOutput:
        """As `TargetModel.forward` (no images). A batch's padding rows (past `real_rows`)
        run too: each slot commits no more than its real rows, which come before them and
        never read them."""
        b, t = ids.shape
        if image_rows is not None or rope_positions is not None:
            raise ValueError("a Flash-Next target takes text only here")
        if self.static is not None and self.static.accepts(ids, state, record_steps):
            try:
                logits, tapped, finite = self.static.run(ids, state, record_steps, taps,
                                                         all_logits, routing)
            except BaseException:
                state.reset()
                raise
            return ForwardOutput(logits, tapped, finite)
        ctx = ForwardContext.open(state, b, t, self.cfg.rope, self.embed_tokens.weight.dtype,
                                  ids.device, record_steps)
        for block in self.moe_blocks:
            block.record = routing
        try:
            history = state.flash.open(ids)
            streams = self.embed_tokens(ids).repeat(1, 1, self.cfg.flash_next.hc_count)
            wanted = {layer: i for i, layer in enumerate(taps)}
            tapped: list[torch.Tensor] = [ids.new_zeros(0)] * len(taps)
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                streams = layer(streams, ids, history, ctx)
                if i in wanted and i != last:
                    tapped[wanted[i]] = streams.unflatten(-1, (-1, self.cfg.hidden_size)
                                                          ).mean(dim=-2)
            rows = slice(None) if all_logits or last in wanted else slice(-1, None)
            h = self.cfg.hidden_size
            for s, tap in enumerate(self.mtp_taps):
                if tap in wanted:
                    tapped[wanted[tap]] = streams[..., s * h:(s + 1) * h]
            final, _ = self.hyper_connection_mixer(streams[:, rows])
            if last in wanted:
                tapped[wanted[last]] = final
            logits = self.logits(final)
            return ForwardOutput(logits if all_logits else logits[:, -1:], tapped)
        except BaseException:
            state.reset()
            raise
        finally:
            for block in self.moe_blocks:
                block.record = None


# the checkpoint's tensors of each PLE layer that the module computes itself (the hasher's)
PLE_BUFFERS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")
# an FP8 n-gram shard's scale beside it (ngram.NGramTable says which shapes)
NGRAM_SCALES = ("weight_scale", "weight_scale_inv")


def open_ngram_tables(model: FlashNextModel, files: dict, names_of, error: type[Exception]
                     ) -> set[str]:
    """Open each PLE layer's n-gram table in the checkpoint's shards (never loaded: rows are
    read as they are needed); returns the tensor names it accounts for. The shards must hold
    the rows the layer's hashes index (`ngram_vocab_size_base` and the head count decide
    how many)."""
    known: set[str] = set()
    for i, layer in enumerate(model.layers):
        if layer.ple is None:
            continue
        base = names_of(f"layers.{i}.ple.ple_embedding.")
        stem = base + "ngram_embedding.shard_"
        shards = sorted((n for n in files if n.startswith(stem) and n.endswith(".weight")
                         and n[len(stem):-len(".weight")].isdigit()),
                        key=lambda n: int(n[len(stem):-len(".weight")]))
        if not shards:
            raise error(f"{base}ngram_embedding.shard_*: the n-gram table of PLE layer {i} "
                        "is missing")
        scales = [next(((files[n], n) for n in (f"{w.removesuffix('.weight')}.{suffix}"
                                               for suffix in NGRAM_SCALES) if n in files), None)
                  for w in shards]
        table = NGramTable([(files[n], n) for n in shards], scales, error)
        need, dim = layer.ple.hasher.rows, model.cfg.flash_next.ple_embed_dim
        if table.rows < need or table.dim * model.cfg.flash_next.ngram_heads != dim:
            raise error(f"{base}ngram_embedding: {table.rows} rows of {table.dim}, the "
                        f"hashes need {need} rows of {dim // model.cfg.flash_next.ngram_heads}")
        layer.ple.table = table
        known |= set(shards) | {base + name for name in PLE_BUFFERS}
        known |= {name for _, name in filter(None, scales)}
    return known
