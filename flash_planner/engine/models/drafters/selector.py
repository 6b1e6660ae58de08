"""DFlash2's candidate selector: drafts walked through the top-K candidates of each position.

The drafter's logits at block position t (the target's head on its hidden h_t, after the
output multiplier and softcap) give the K most likely tokens C_t and their unary scores
U_t. A pair (a, b) of a predecessor a and a candidate b in C_t scores

    S_t(a, b) = U_t(b) + < A[a] * (P h_t), B[b] >

with P = `hidden_projection` (H -> r) and the codebooks A = `predecessor_codebook`,
B = `successor_codebook` [V, r] (stored without a `.weight` suffix). One path is walked from
the anchor: position 1's predecessor is the anchor, each later one's is the candidate chosen
before it. Greedy requests take the best pair score (ties: the higher unary score, the
candidates being sorted); sampled ones draw from the scores with the request's noise.
Verification stays a chain. Facts: z-lab's DFlash2 reference, vLLM's port.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()        # sizes checked with the config (DraftConfig.check_target)
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))

    def edge_scores(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft rows' hidden [n, H] and logits [n, V], the anchor [1] -> candidates [n, K]
        and pair scores [n, K, K] in fp32: scores[t, i, j] = S_t(pred_i, cand[t, j]) with
        pred_i = cand[t-1, i], and the anchor for every i at t = 0."""
        unary, cand = logits.float().topk(self.top_k, dim=-1)                 # sorted
        preds = torch.cat((anchor.reshape(1, 1).expand(1, self.top_k), cand[:-1]))
        query = self.hidden_projection(hidden).float()                        # [n, r]
        a = self.predecessor_codebook[preds].float() * query[:, None, :]      # [n, K, r]
        b = self.successor_codebook[cand].float()                             # [n, K, r]
        return cand, unary[:, None, :] + a @ b.transpose(1, 2)


def walk(cand: torch.Tensor, scores: torch.Tensor,
         choose: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
    """The drafts [n] of one path through candidates [n, K] under pair scores [n, K, K].

    choose(row, t) picks an index into row [K] (the scores of position t's candidates after
    the predecessor chosen at t-1); None is the greedy argmax. Indices stay on the device."""
    pick = choose or (lambda row, t: row.argmax())
    idx = pick(scores[0, 0], 0)
    chosen = [idx]
    for t in range(1, cand.shape[0]):
        idx = pick(scores[t, idx], t)
        chosen.append(idx)
    return cand.gather(1, torch.stack(chosen).reshape(-1, 1))[:, 0]
