"""The target model: Qwen3 dense or the Qwen3.5/3.6 hybrid, one decoder stack for both; the
MLP of a layer is the mixture of experts (moe.py) where the config says so.

Parameter names follow Hugging Face (`embed_tokens`, `layers.{i}.self_attn.q_proj`,
`layers.{i}.linear_attn.in_proj_qkv`, `norm`, `lm_head`), so checkpoints load without
renaming. Each layer is split into dense parts and a token mixer; `forward` runs them as the
segment plan later backends compile: segment 0 = embedding + layer 0 `pre_mixer`; segment i =
layer i-1 `post_mixer` + layer i `pre_mixer`; the last = final `post_mixer` + norm + lm_head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...config import LINEAR_ATTENTION, ModelConfig
from ...state.cache import InferenceState
from ..graphs.compiled import StaticForward
from .attention import Attention
from .context import ForwardContext
from .gdn import GatedDeltaNet
from .inference import inference
from .layers import MLP, RMSNorm, embedding
from .moe import RoutingRecord, SparseMoeBlock
from .packing import PackedRows
from .segments import build_segments, layer_arity


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = Attention(cfg, layer_idx)
        zc = cfg.zero_centred_norm
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc)
        self.mlp = (SparseMoeBlock(cfg.moe, cfg.hidden_size) if cfg.is_sparse_layer(layer_idx)
                    else MLP(cfg.hidden_size, cfg.intermediate_size))

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.is_linear else self.self_attn

    def pre_mixer(self, x: torch.Tensor):
        """Dense: input norm and the mixer's projections -> (mixer inputs, post inputs)."""
        return self.mixer.pre(self.input_layernorm(x))

    def mix(self, inputs: tuple[torch.Tensor, ...], ctx: ForwardContext) -> torch.Tensor:
        """The token mixer: reads and writes the inference state."""
        return self.mixer.mix(inputs, ctx)

    def post_mixer(self, x: torch.Tensor, core: torch.Tensor,
                   post: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Dense: mixer output projection, residual, MLP, residual."""
        x = x + self.mixer.post(core, post)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class ForwardOutput:
    logits: torch.Tensor          # [B, T or 1, vocab] float32
    taps: list[torch.Tensor]      # per requested layer id, its output [B, T, hidden]
                                  # (the last layer's after the final norm)
    finite: torch.Tensor | None = None   # [B, rows]: 1 where a row's logits are finite
                                         # (compiled forwards; None: not computed)


class TorchDense:
    """Runs the dense segments eagerly: the reference every other backend is checked against."""

    name = "torch"

    def __init__(self, segments: list[nn.Module]):
        self.segments = segments

    def run(self, index: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.segments[index](*tensors)


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        # A plain list: the segments share the parameters above and must not register them
        # again under other names.
        self.segments = build_segments(self)
        self.arity = [layer_arity(layer) for layer in self.layers]
        self.dense = TorchDense(self.segments)
        self.moe_blocks = [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
        # decode and verify blocks through compiled static-shape graphs (compiled.py): on
        # the engine's state, and on a batch's slots (engine.batch_slots)
        self.static: StaticForward | None = None
        self.batch_static: StaticForward | None = None

    @property
    def output_weight(self) -> torch.Tensor:
        """[vocab, hidden]: lm_head's weight, or the embedding's when they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_static(self, runner: StaticForward | None) -> None:
        """Run the blocks `runner.accepts` through its compiled graphs (None: all eager)."""
        self.static = runner

    def set_dense(self, runner) -> None:
        """Run the dense segments with another backend (same `run(index, *tensors)`)."""
        self.dense = runner

    def _embed_images(self, ids: torch.Tensor, rows: torch.Tensor, vectors: torch.Tensor
                      ) -> tuple[torch.Tensor, ...]:
        """Segment 0 (eager, any dense backend) with an image's embeddings at `rows`."""
        if ids.shape[0] != 1:
            raise ValueError("image embeddings go into one sequence's block")
        x = self.embed_tokens(ids).clone()
        x[0, rows] = vectors.to(x.dtype)
        mix, post = self.layers[0].pre_mixer(x)
        return (x, *mix, *post)

    @inference
    def forward(self, ids: torch.Tensor, state: InferenceState, *, record_steps: bool = False,
                taps: tuple[int, ...] = (), all_logits: bool = False,
                routing: RoutingRecord | None = None,
                real_rows: Sequence[int] | None = None,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope_positions: torch.Tensor | None = None) -> ForwardOutput:
        """Run ids [B, T] at the state's next positions; the caller commits rows afterwards.

        record_steps keeps each GDN row's k, delta and decay (not the state) for `state.commit(n)`.
        taps: layer ids whose outputs to return (id L = output of decoder layer L; the last
        layer's after the final norm, which is what upstream drafters and MTP heads consume).
        all_logits: logits of every row (verify) instead of the last row only (prefill).
        routing: collects each sparse layer's expert ids (MoE targets; telemetry); of a batch
        (B > 1), the real rows' alone, in batch order.
        real_rows: of a batch, each row's real rows (the rest is padding): the eager dense
        parts run on those alone (packing.py), and every row's logits are computed.
        image_rows: (rows [K], embeddings [K, hidden]) of one sequence's block whose tokens
        are an image's (the vision tower's output in place of the token embedding);
        rope_positions: [3, T] the block's (t, h, w) rotary positions (mRoPE, images).
        Both run eager.
        """
        plain = image_rows is None and rope_positions is None
        runner = next((r for r in (self.static, self.batch_static)
                       if plain and r is not None and r.accepts(ids, state, record_steps)),
                      None)
        if runner is not None:
            try:
                logits, tapped, finite = runner.run(ids, state, record_steps, taps,
                                                    all_logits, routing)
            except BaseException:
                state.reset()
                raise
            return ForwardOutput(logits, tapped, finite)
        b, t = ids.shape
        n = len(self.layers)
        packed = (PackedRows(real_rows or [t] * b, t, ids.device)
                  if b > 1 or real_rows is not None else None)
        ctx = ForwardContext.open(state, b, t, self.cfg.rope, self.embed_tokens.weight.dtype,
                                  ids.device, record_steps, rope_positions)
        for block in self.moe_blocks:
            block.record = routing
        try:
            wanted = {layer: i for i, layer in enumerate(taps)}
            tapped: list[torch.Tensor] = [ids.new_zeros(0)] * len(taps)
            if image_rows is not None:
                outs = self._embed_images(ids, *image_rows)
            else:
                outs = self.dense.run(0, ids if packed is None else packed.pack(ids))
            for i, layer in enumerate(self.layers):
                n_mix = self.arity[i][0]
                x, mix, post = outs[0], outs[1:1 + n_mix], outs[1 + n_mix:]
                if packed is None:
                    core = layer.mix(mix, ctx)
                else:
                    core = packed.pack(layer.mix(tuple(packed.unpack(m) for m in mix), ctx))
                if i + 1 < n:
                    outs = self.dense.run(i + 1, x, core, *post)
                    if i in wanted:
                        tapped[wanted[i]] = outs[0] if packed is None else packed.unpack(outs[0])
                    continue
                # The last segment is per-row: run it on the last row only unless every
                # row's logits, or the last layer's output, are wanted (or the rows are a
                # batch's, packed).
                rows = (slice(None) if all_logits or i in wanted or packed is not None
                        else slice(-1, None))
                x_out, logits = self.dense.run(n, x[:, rows], core[:, rows],
                                               *(p[:, rows] for p in post))
                if packed is not None:
                    x_out, logits = packed.unpack(x_out), packed.unpack(logits)
                if i in wanted:  # as transformers' hidden_states[L]: after the final norm
                    tapped[wanted[i]] = self.norm(x_out)
            return ForwardOutput(logits if all_logits else logits[:, -1:], tapped)
        except BaseException:
            # The mixers update state in place: after a failed forward it is unreliable.
            state.reset()
            raise
        finally:
            for block in self.moe_blocks:
                block.record = None
