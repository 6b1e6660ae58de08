"""The target model: Qwen3 dense or the Qwen3.5/3.6 hybrid, one decoder stack for both.

Parameter names follow Hugging Face (`embed_tokens`, `layers.{i}.self_attn.q_proj`,
`layers.{i}.linear_attn.in_proj_qkv`, `norm`, `lm_head`), so checkpoints load without
renaming. Each layer is split into dense parts and a token mixer; `forward` runs them as the
segment plan later backends compile: segment 0 = embedding + layer 0 `pre_mixer`; segment i =
layer i-1 `post_mixer` + layer i `pre_mixer`; the last = final `post_mixer` + norm + lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache import InferenceState
from ..config import LINEAR_ATTENTION, ModelConfig
from .attention import Attention
from .context import ForwardContext
from .gdn import GatedDeltaNet
from .layers import MLP, RMSNorm, rope_cos_sin


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
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.is_linear else self.self_attn

    def pre_mixer(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Dense: input norm and the mixer's projections."""
        return self.mixer.pre(self.input_layernorm(x))

    def mix(self, inputs: tuple[torch.Tensor, ...], ctx: ForwardContext) -> torch.Tensor:
        """The token mixer: reads and writes the inference state."""
        return self.mixer.mix(inputs, ctx)

    def post_mixer(self, x: torch.Tensor, core: torch.Tensor,
                   inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Dense: mixer output projection, residual, MLP, residual."""
        x = x + self.mixer.post(core, inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class ForwardOutput:
    logits: torch.Tensor          # [B, T or 1, vocab] float32
    taps: list[torch.Tensor]      # per requested layer id, its output [B, T, hidden]


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (h @ weight.T).float()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, state: InferenceState, *, record_steps: bool = False,
                taps: tuple[int, ...] = (), all_logits: bool = False) -> ForwardOutput:
        """Run ids [B, T] at the state's next positions; the caller commits rows afterwards.

        record_steps keeps per-step GDN checkpoints so `state.commit(n)` may keep fewer rows.
        taps: layer ids whose outputs to return (id L = output of decoder layer L).
        all_logits: logits of every row (verify) instead of the last row only (prefill).
        """
        b, t = ids.shape
        start = state.begin(t, record_steps)
        try:
            positions = torch.arange(start, start + t, device=ids.device).expand(b, t)
            dtype = self.embed_tokens.weight.dtype
            cos, sin = rope_cos_sin(positions, self.cfg.rope.rotary_dim, self.cfg.rope.theta,
                                    dtype)
            ctx = ForwardContext(state, start, positions, cos, sin, record_steps)
            wanted = {layer: i for i, layer in enumerate(taps)}
            tapped: list[torch.Tensor] = [ids.new_zeros(0)] * len(taps)
            x = self.embed_tokens(ids)
            inputs = self.layers[0].pre_mixer(x)
            for i, layer in enumerate(self.layers):
                core = layer.mix(inputs, ctx)
                x = layer.post_mixer(x, core, inputs)
                if i in wanted:
                    tapped[wanted[i]] = x
                if i + 1 < len(self.layers):
                    inputs = self.layers[i + 1].pre_mixer(x)
            h = self.norm(x if all_logits else x[:, -1:])
            return ForwardOutput(self.logits(h), tapped)
        except BaseException:
            # The mixers update state in place: after a failed forward it is unreliable.
            state.reset()
            raise
