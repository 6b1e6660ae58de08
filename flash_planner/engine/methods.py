"""The speculative methods a request or an engine may name (no torch: request checks use it).

  auto    every proposer the files provide, each cycle routed to the one measured faster
  dflash  the DFlash block-diffusion drafter (a drafter directory)
  mtp     the checkpoint's own multi-token-prediction head (`mtp.*`, Qwen3.5/3.6)
  none    plain greedy decoding
"""

METHODS = ("auto", "dflash", "mtp", "none")
