"""Which proposers an engine loads for its `method` (methods.py), and the errors when one
is missing: auto loads the DFlash drafter when a drafter directory is given and the MTP head
when the checkpoint has `mtp.*` weights, and an `AutoProposer` routes each cycle among them
and plain decoding (with neither, plain decoding); dflash and mtp load that one or fail
naming what is missing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..checkpoint import Checkpoint, load_mtp_head
from ..config import ConfigError, EngineConfig
from ..models.drafters.dflash import load_drafter
from ..state.cache import InferenceState
from ..state.slots import SlotStates
from ..weights.bytes import module_bytes
from .acceptance import think_token_ids
from .auto_proposer import AutoProposer
from .mtp_proposer import MTPProposer
from .proposer import DFlashProposer, Proposer

log = logging.getLogger(__name__)

WHY_MISSING = {
    "dflash": "dflash needs a DFlash drafter directory (drafter_path / --drafter)",
    "mtp": "mtp needs a Qwen3.5/3.6 checkpoint with its mtp.* head, loaded with method mtp "
           "or auto",
    "auto": "auto routes among the proposers an engine loads with method auto",
}


@dataclass(frozen=True)
class ProposerBytes:
    weights: int      # the proposers' own parameters (drafter, MTP head)
    kv: int           # the MTP head's KV cache


def moe_draft_lengths(longest: int) -> tuple[int, ...]:
    """The draft lengths auto measures on an MoE target: powers of two up to the longest."""
    return tuple(sorted({k for k in (1, 2, 4, 8) if k < longest} | {longest}))


def build_proposers(config: EngineConfig, checkpoint: Checkpoint, state: InferenceState,
                    dtype: torch.dtype, device: torch.device
                    ) -> tuple[dict[str, Proposer], ProposerBytes]:
    model = checkpoint.model
    proposers: dict[str, Proposer] = {}
    weights = kv = 0
    if config.method == "dflash" and not config.drafter_path:
        raise ConfigError(f"method 'dflash': {WHY_MISSING['dflash']}")
    if config.method in ("auto", "dflash") and config.drafter_path:
        drafter = load_drafter(config.drafter_path, checkpoint.config, dtype, device,
                               config.weights)
        dflash = DFlashProposer(drafter, model.embed_tokens, model.output_weight,
                                window=config.window,
                                seed_window=config.window_seed, block_size=config.block_size)
        if dflash.block_size > config.max_block:
            raise ConfigError(f"the drafter's block size {dflash.block_size} exceeds "
                              f"max_block {config.max_block}")
        proposers["dflash"] = dflash
        weights += module_bytes(drafter)
    want_mtp = config.method == "mtp" or (config.method == "auto" and checkpoint.mtp_weights
                                          and checkpoint.config.is_hybrid)
    if want_mtp:
        head = load_mtp_head(checkpoint, dtype, device)
        head_state = InferenceState(head.cfg, capacity=state.capacity, max_steps=1,
                                    kv_dtype=state.kv.k.dtype, compute_dtype=dtype,
                                    device=device)
        proposers["mtp"] = MTPProposer(head, model, head_state, steps=config.mtp_steps,
                                       chunk=config.prefill_chunk)
        weights += module_bytes(head)
        kv += head_state.nbytes.kv
    if config.method == "auto" and proposers:
        # On an MoE target a longer verify block reads more experts: auto also chooses the
        # draft length there; on a dense one each proposer drafts its longest
        lengths = ({name: moe_draft_lengths(p.block_size - 1) for name, p in proposers.items()}
                   if checkpoint.config.is_moe else None)
        proposers["auto"] = AutoProposer(dict(proposers), think_token_ids(checkpoint.tokenizer),
                                         lengths=lengths)
    if config.method == "auto" and not proposers:
        log.info("method auto: no drafter directory and no MTP head in %s; plain decoding",
                 checkpoint.path)
    return proposers, ProposerBytes(weights, kv)


def fork_proposers(proposers: dict[str, Proposer], head_slots: SlotStates | None = None,
                   row: int = 0) -> dict[str, Proposer]:
    """An engine's proposers for another request decoding at the same time: each forked
    (same weights, its own state; the MTP head's cache row `row` of `head_slots`, where
    given, so that forks draft together), auto routing among the forks."""
    forks = {name: p.fork(head_slots, row) if isinstance(p, MTPProposer) else p.fork()
             for name, p in proposers.items() if name != "auto"}
    auto = proposers.get("auto")
    if isinstance(auto, AutoProposer):
        forks["auto"] = auto.fork(dict(forks))
    return forks
