"""What Qwen3.8-Flash-Next (`qwen4_exp`, transformers 5.24) adds to the Qwen3.5/3.6 MoE hybrid.

- Hyper-connections: the residual is `hc_count` streams; before each mixer and each MoE a
  low-rank mixer (rank `hc_lowrank`) reads a normed copy of the streams into one input, and
  the block's output goes back into each stream with its own gate. No input norms, no final
  norm: the last mix of the streams feeds lm_head.
- Per-layer embeddings (PLE) on `ple_layers`: hashed 2- and 3-gram ids of the tokens index one
  prime-sized table per head, `heads_per_ngram` heads per order; the rows are projected, gated
  against each stream and passed through a dilated depthwise conv.
- The QSA token indexer on the full-attention layers: each query keeps the `budget` best of
  the complete blocks of `compress_ratio` keys, plus the incomplete tail.
- The GDN's output gate activation (`output_gate_type`: sigmoid in the published model).

`parse` is called by `ModelConfig.from_hf_dict`; its errors name the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the layer types qwen4_exp configs use: the published files say full_attention for layers
# that run the indexer, transformers says indexed_attention
INDEXED_ATTENTION = "indexed_attention"
GATE_ACTIVATIONS = ("sigmoid", "silu")


@dataclass(frozen=True)
class IndexerConfig:
    n_heads: int
    head_dim: int
    budget: int             # tokens of complete blocks a query keeps at most
    compress_ratio: int     # keys averaged into one block

    @property
    def block_topk(self) -> int:
        return self.budget // self.compress_ratio


@dataclass(frozen=True)
class FlashNextConfig:
    hc_count: int
    hc_lowrank: int
    ple_layers: tuple[int, ...]      # 0-indexed decoder layers with a PLE module
    ple_embed_dim: int
    ple_conv_kernel: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_base: int
    ngram_vocab_divisor: int
    seed: int
    ngram_parts: int                 # shards the checkpoint splits each n-gram table into
    output_gate: str                 # the GDN output gate's activation
    eos_id: int                      # the first EOS id: the n-gram history restarts after it
    indexer: IndexerConfig | None

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_conv_window(self) -> int:
        """Rows of history the PLE conv reads: (kernel - 1) x its dilation (ngram_size)."""
        return (self.ple_conv_kernel - 1) * self.ngram_size


def _int(cfg: dict, key: str, default: Any, where: str, error: type[Exception],
         low: int = 1) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise error(f"{where}: field '{key}' must be an integer >= {low}, got {value!r}")
    return value


def parse(cfg: dict[str, Any], hidden: int, head_dim: int, rotary_dim: int,
          layer_types: tuple[str, ...], linear: str, eos_ids: tuple[int, ...], where: str,
          error: type[Exception]) -> FlashNextConfig:
    hc = _int(cfg, "hc_count", 4, where, error, low=2)
    ple_ids = cfg.get("ple_layer_ids") or []
    if not isinstance(ple_ids, list) or any(not isinstance(i, int) for i in ple_ids):
        raise error(f"{where}: ple_layer_ids must be a list of layer numbers (1-indexed)")
    ple_layers = tuple(sorted({i - 1 for i in ple_ids}))
    bad = [i + 1 for i in ple_layers if not 0 <= i < len(layer_types)
           or layer_types[i] != linear]
    if bad:
        raise error(f"{where}: ple_layer_ids {bad} are not linear-attention layers of the "
                    f"{len(layer_types)} (PLE runs on those alone)")
    ngram = _int(cfg, "ngram_size", 3, where, error, low=2)
    heads = _int(cfg, "heads_per_ngram", 8, where, error)
    embed = _int({"ple_embed_dim": cfg.get("ple_embed_dim") or hidden}, "ple_embed_dim", None,
                 where, error)
    if ple_layers and embed % ((ngram - 1) * heads):
        raise error(f"{where}: ple_embed_dim {embed} is not a multiple of the "
                    f"{(ngram - 1) * heads} n-gram heads")
    if ple_layers and not eos_ids:
        raise error(f"{where}: PLE needs eos_token_id (its n-gram history restarts there)")
    gate = cfg.get("output_gate_type") or cfg.get("hidden_act", "silu")
    if gate not in GATE_ACTIVATIONS:
        raise error(f"{where}: output_gate_type {gate!r} is not one of {GATE_ACTIVATIONS}")
    return FlashNextConfig(
        hc_count=hc, hc_lowrank=_int(cfg, "hc_lowrank", 320, where, error),
        ple_layers=ple_layers, ple_embed_dim=embed,
        ple_conv_kernel=_int(cfg, "ple_conv_kernel_size", 4, where, error),
        ngram_size=ngram, heads_per_ngram=heads,
        ngram_vocab_base=_int(cfg, "ngram_vocab_size_base", 20_000_000, where, error, low=2),
        ngram_vocab_divisor=_int(cfg, "make_ngram_vocab_size_divisible_by", 128, where, error),
        seed=_int(cfg, "seed", 1234, where, error, low=0),
        ngram_parts=_int(cfg, "split_ngram_parts", 512, where, error),
        output_gate=gate, eos_id=eos_ids[0] if eos_ids else -1,
        indexer=_indexer(cfg, head_dim, rotary_dim, where, error))


def _indexer(cfg: dict, head_dim: int, rotary_dim: int, where: str,
             error: type[Exception]) -> IndexerConfig | None:
    names = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
             "indexer_compress_ratio")
    given = {n: cfg.get(n) for n in names}
    if all(v is None for v in given.values()):
        return None
    missing = [n for n, v in given.items() if v is None]
    if missing:
        raise error(f"{where}: the QSA indexer needs {missing} too")
    for name in names:
        _int(cfg, name, None, where, error)
    if given["indexer_kv_heads"] != 1:
        raise error(f"{where}: indexer_kv_heads must be 1, got {given['indexer_kv_heads']}")
    if given["indexer_budget"] % given["indexer_compress_ratio"]:
        raise error(f"{where}: indexer_budget {given['indexer_budget']} is not a multiple of "
                    f"indexer_compress_ratio {given['indexer_compress_ratio']}")
    if rotary_dim > given["indexer_head_dim"]:
        raise error(f"{where}: the rotary dims ({rotary_dim} of head_dim {head_dim}) exceed "
                    f"indexer_head_dim {given['indexer_head_dim']}")
    return IndexerConfig(given["indexer_n_heads"], given["indexer_head_dim"],
                         given["indexer_budget"], given["indexer_compress_ratio"])

