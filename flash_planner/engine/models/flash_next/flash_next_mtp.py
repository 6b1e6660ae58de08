"""Qwen3.8-Flash-Next's multi-token-prediction module (`mtp.*`), which transformers drops.

Written from the structure of SGLang's `Qwen4ExpForCausalLMMTP` (the public implementation
that serves it; its description, not its code): a one-layer Flash-Next model, the layer a
full-attention one with the QSA indexer and the MoE, no PLE, fed with a fusion of the next
token's embedding and the target's 4-stream hyper state after its last layer (before its
final mix):

    e = fc_embedding(pre_fc_norm_embedding(embed(token_{q+1})))          [H]
    R = pre_fc_norm_hidden(hyper_q)   (one zero-centred norm over all hc * H)
    streams_i = e + fc_hidden(R_i)    for each stream i                   [hc * H]

then the layer, whose output streams are what a further draft continues, and its own final
mix (`hyper_connection_mixer`), which the target's lm_head reads. Tensor names are ours
under `mtp.`, as Qwen3.5/3.6 heads name theirs; checked against no published file (none was
fetched here).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ...config import FULL_ATTENTION, ConfigError, ModelConfig
from ...state.cache import InferenceState
from ..qwen.context import ForwardContext
from ..qwen.inference import inference
from ..qwen.layers import RMSNorm
from .flash_next import FlashNextLayer
from .hyper import HyperMixer


def flash_head_config(cfg: ModelConfig) -> ModelConfig:
    """The module's own config: one full-attention layer, no PLE, the target's shapes."""
    if cfg.mtp_layers != 1:
        raise ConfigError(f"mtp_num_hidden_layers is {cfg.mtp_layers}; the MTP proposer runs "
                          "modules of exactly one layer")
    return replace(cfg, num_layers=1, layer_types=(FULL_ATTENTION,),
                   flash_next=replace(cfg.flash_next, ple_layers=()))


class FlashNextHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = flash_head_config(cfg)
        fn, h, eps = cfg.flash_next, cfg.hidden_size, cfg.rms_norm_eps
        self.hc = fn.hc_count
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zero_centred=True)
        self.pre_fc_norm_hidden = RMSNorm(fn.hc_count * h, eps, zero_centred=True)
        self.fc_embedding = nn.Linear(h, h, bias=False)
        self.fc_hidden = nn.Linear(h, h, bias=False)
        self.layers = nn.ModuleList([FlashNextLayer(self.cfg, 0)])
        self.hyper_connection_mixer = HyperMixer(h, fn.hc_count, fn.hc_lowrank, eps,
                                                 gates=False)
        self.static = self.batch_static = None        # eager only

    def fuse(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = self.fc_embedding(self.pre_fc_norm_embedding(embedded))
        streams = self.fc_hidden(self.pre_fc_norm_hidden(hidden).unflatten(-1, (self.hc, -1)))
        return (e.unsqueeze(-2) + streams).flatten(-2)

    @inference
    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, state: InferenceState
                ) -> torch.Tensor:
        """Rows at the module's next positions -> their output streams [B, T, hc * H]
        (what a further draft continues; `logit_input` gives what lm_head reads).
        embedded [B, T, H]: each row's next token's embedding; hidden [B, T, hc * H]: the
        hyper state the row continues (the target's, or this module's own output)."""
        b, t, _ = embedded.shape
        ctx = ForwardContext.open(state, b, t, self.cfg.rope, embedded.dtype, embedded.device)
        return self.layers[0](self.fuse(embedded, hidden), None, None, ctx)

    def logit_input(self, out: torch.Tensor) -> torch.Tensor:
        """The output streams' final mix [.., H]: what the target's lm_head reads."""
        return self.hyper_connection_mixer(out)[0]
