"""The Qwen3.5/3.6 multi-token-prediction head (`mtp.*`), in the upstream checkpoint layout.

Tensors: `fc` [H, 2H], `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm` (zero-centred
RMSNorms), and `layers.0.*`, one full-attention decoder layer shaped like the target's (gated
q_proj, q/k norms, partial RoPE, dense MLP). Embedding and lm_head are the target's.

One row at position q: x = fc(cat(pre_fc_norm_embedding(embed(token_{q+1})),
pre_fc_norm_hidden(h_q))), embedding first, then the layer at RoPE position q with its own KV
cache, then `norm`; logits = lm_head(out) predict token_{q+2}. h_q is the target's last hidden
state after its final norm. A further draft feeds the head its own normed output and its own
draft at position q+1. (Order, normed hidden and positions as in vLLM's `qwen3_5_mtp` and
SGLang's Qwen3.5 nextn; FACTS.md section 13.)
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ...config import FULL_ATTENTION, ConfigError, ModelConfig
from ...state.cache import InferenceState
from ..graphs.compiled_drafts import StaticHead
from ..qwen.context import ForwardContext
from ..qwen.inference import inference
from ..qwen.layers import RMSNorm
from ..qwen.target import DecoderLayer


def head_config(cfg: ModelConfig) -> ModelConfig:
    """The head's own model config: one full-attention layer, the target's shapes. Its
    `InferenceState` is built from this (a KV cache of one layer, no recurrent state)."""
    if not cfg.is_hybrid:
        raise ConfigError(f"{cfg.model_type} is a dense Qwen3 model: only Qwen3.5/3.6 hybrid "
                          "checkpoints carry an MTP head")
    if cfg.mtp_layers != 1:
        raise ConfigError(f"mtp_num_hidden_layers is {cfg.mtp_layers}; the MTP proposer runs "
                          "heads of exactly one layer (every Qwen3.5/3.6 release)")
    if cfg.mtp_dedicated_embeddings:
        raise ConfigError("mtp_use_dedicated_embeddings is true: heads with their own "
                          "embedding table are not supported (Qwen3.5/3.6 share the target's)")
    return replace(cfg, num_layers=1, layer_types=(FULL_ATTENTION,))


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = head_config(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zero_centred=True)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zero_centred=True)
        self.layers = nn.ModuleList([DecoderLayer(self.cfg, 0)])
        self.norm = RMSNorm(h, eps, zero_centred=True)
        # compiled rows (compiled_drafts.py), when set: on the proposer's own state, and
        # on a batch's head slots
        self.static: StaticHead | None = None
        self.batch_static: StaticHead | None = None

    def logit_input(self, out: torch.Tensor) -> torch.Tensor:
        """What the target's lm_head reads of the head's output: the output itself (a
        Flash-Next module mixes its streams first: flash_next_mtp.py)."""
        return out

    def fuse(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input: fc over the normed embedding, then the normed hidden state."""
        return self.fc(torch.cat((self.pre_fc_norm_embedding(embedded),
                                  self.pre_fc_norm_hidden(hidden)), dim=-1))

    @inference
    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, state: InferenceState
                ) -> torch.Tensor:
        """Rows at the head state's next positions -> normed outputs [B, T, H].

        embedded [B, T, H]: the embedding of each row's next token; hidden [B, T, H]: the
        normed hidden state the row continues (the target's, or the head's own output).
        The caller commits the rows (`state.commit`) or forgets them (`state.truncate`)."""
        for runner in (self.static, self.batch_static):
            if runner is not None and runner.accepts(embedded, state):
                return runner.run(embedded, hidden, state)
        b, t, _ = embedded.shape
        ctx = ForwardContext.open(state, b, t, self.cfg.rope, embedded.dtype, embedded.device)
        x = self.fuse(embedded, hidden)
        layer = self.layers[0]
        mix, post = layer.pre_mixer(x)
        x = layer.post_mixer(x, layer.mix(mix, ctx), post)
        return self.norm(x)
