"""Tiny random-weight checkpoints in genuine Hugging Face format, for smoke runs and tests.

The weights are written by transformers' own `save_pretrained` and the tokenizer is the
planner's byte-level BPE (`train/tokenizer.py`) trained on a small corpus, so loading goes
through exactly the path a downloaded checkpoint takes. Kinds: `hybrid` (Qwen3_5ForCausalLM,
text-only), `hybrid_vl` (Qwen3_5ForConditionalGeneration, text under model.language_model),
`dense` (Qwen3ForCausalLM), and the mixture-of-experts ones: `hybrid_moe`
(Qwen3_5MoeForCausalLM, the Qwen3.6-35B-A3B family), `hybrid_moe_vl`
(Qwen3_5MoeForConditionalGeneration) and `dense_moe` (Qwen3MoeForCausalLM, Qwen3-30B-A3B
style, with layer 1 a dense MLP), and `flash_next` (Qwen4ExpForCausalLM, Qwen3.8-Flash-Next:
FLASH_NEXT) and `flash_next_vl` (Qwen4ExpForConditionalGeneration, as published, with a
vision tower). `mtp=True` adds a random MTP head (`mtp.*`, the layout of
Qwen3.5/3.6 releases; its MLP is a mixture of experts in the MoE kinds) to a hybrid kind.
Sizes: `tiny` (~0.1M parameters) and `bench` (~60M parameters, a decode benchmark config).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tokenizer import train_tokenizer

QWEN_EOS = 151645  # <|im_end|>
KINDS = ("hybrid", "hybrid_vl", "dense", "hybrid_moe", "hybrid_moe_vl", "dense_moe",
         "flash_next", "flash_next_vl")
# Qwen3.8-Flash-Next's additions at tiny sizes (transformers 5.24's qwen4_exp_text): PLE on
# layer 1 with small prime tables, an indexer whose budget (2 blocks of 4) a 12-token prompt
# exceeds, 4 streams of rank-16 hyper-connections
FLASH_NEXT = dict(hc_count=4, hc_lowrank=16, ple_layer_ids=[1], ngram_size=3,
                  heads_per_ngram=2, ngram_vocab_size_base=101,
                  make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, indexer_n_heads=2,
                  indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                  indexer_compress_ratio=4, output_gate_type="sigmoid")
# The MoE kinds' expert shapes: 8 experts, 2 per token; the 35B-A3B has 256, 8 per token
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CORPUS = [
    "pick up the red cup and place it on the kitchen table",
    "navigate to the charging dock and wait for five seconds",
    "open the top drawer, take the blue screwdriver, close the drawer",
    'say "hello" to the operator, then move the green box to shelf 3',
    '{"plan": [{"skill": "navigate_to", "args": {"target": "table"}}]}',
    "The robot should first find the object, then grasp it carefully.",
]

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, vocab=384, init=0.08),
    "bench": dict(hidden_size=640, intermediate_size=1792, num_hidden_layers=12,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                  linear_value_head_dim=64, vocab=4096, init=0.03),
}


def _hf_config(kind: str, size: str, vocab: int, eos: int, rotary: float, init: float | None,
               moe: dict, layers: int | None = None, attention_every: int = 2,
               flash: dict | None = None):
    from transformers import (
        Qwen3_5Config,
        Qwen3_5MoeConfig,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    dims = dict(SIZES[size])
    dims.pop("vocab")
    default_init = dims.pop("init")
    if layers is not None:
        dims["num_hidden_layers"] = layers
    common = dict(vocab_size=vocab, rms_norm_eps=1e-6, eos_token_id=eos, pad_token_id=0,
                  max_position_embeddings=4096, initializer_range=init or default_init,
                  tie_word_embeddings=False)
    if kind in ("dense", "dense_moe"):
        for key in [k for k in dims if k.startswith("linear_")]:
            dims.pop(key)
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if kind == "dense_moe":
            return Qwen3MoeConfig(**common, **dims, **moe, rope_parameters=rope,
                                  norm_topk_prob=True, mlp_only_layers=[1])
        return Qwen3Config(**common, **dims, rope_parameters=rope)
    rotary_pairs = int(dims["head_dim"] * rotary) // 2
    third = rotary_pairs // 3
    text = dict(**common, **dims, linear_conv_kernel_dim=4,
                layer_types=[("full_attention" if (i + 1) % attention_every == 0
                              else "linear_attention")
                             for i in range(dims["num_hidden_layers"])],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": rotary,
                                 "mrope_section": [rotary_pairs - 2 * third, third, third]})
    if kind.startswith(("hybrid_moe", "flash_next")):
        text.pop("intermediate_size")
        text.update(moe, shared_expert_intermediate_size=64)
    if kind.startswith("flash_next"):
        from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

        text["rope_parameters"].pop("mrope_section")
        text.update(FLASH_NEXT, **(flash or {}))
        if kind == "flash_next":
            return Qwen4ExpTextConfig(**text)
        return Qwen4ExpConfig(text_config=text, vision_config=dict(
            depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
            out_hidden_size=dims["hidden_size"], patch_size=4, temporal_patch_size=2,
            spatial_merge_size=2, num_position_embeddings=16), tie_word_embeddings=False)
    if kind in ("hybrid", "hybrid_moe"):
        return (Qwen3_5TextConfig if kind == "hybrid" else Qwen3_5MoeTextConfig)(**text)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                  out_hidden_size=dims["hidden_size"], patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=16)
    wrapper = Qwen3_5Config if kind == "hybrid_vl" else Qwen3_5MoeConfig
    return wrapper(text_config=text, vision_config=vision, tie_word_embeddings=False)


HF_CLASSES = {"hybrid": "Qwen3_5ForCausalLM", "hybrid_vl": "Qwen3_5ForConditionalGeneration",
              "dense": "Qwen3ForCausalLM", "hybrid_moe": "Qwen3_5MoeForCausalLM",
              "hybrid_moe_vl": "Qwen3_5MoeForConditionalGeneration",
              "dense_moe": "Qwen3MoeForCausalLM", "flash_next": "Qwen4ExpForCausalLM",
              "flash_next_vl": "Qwen4ExpForConditionalGeneration"}


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Give norms and GDN gates non-trivial values (their defaults are 0/1 constants)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            elif ".ple.conv1d" in name:          # Flash-Next's PLE conv starts at zero
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)


def write_tiny_checkpoint(path: str | Path, kind: str = "hybrid", size: str = "tiny",
                          seed: int = 0, max_shard_size: str | None = None,
                          rotary: float = 0.5, init: float | None = None,
                          mtp: bool = False, experts: tuple[int, int] | None = None,
                          layers: int | None = None, attention_every: int = 2,
                          qwen_vocab: bool = False, flash: dict | None = None) -> Path:
    """Write a random-weight checkpoint + tokenizer to `path` and return it.

    init: the weights' initializer_range (default per size). Larger values give logits a
    wider spread, closer to a trained LM's (0.25 gives logit std ~2 on `tiny`).
    experts: (num_experts, num_experts_per_tok) of the MoE kinds (default: MOE's).
    layers: the depth (default per size); attention_every: in the hybrid kinds, every n-th
    layer is full attention and the others Gated DeltaNet (Qwen3.5/3.6 use 4: 3 GDN, then 1
    attention).
    qwen_vocab: the real Qwen3 tokenizer and its 151,936-row embedding (`qwen_vocab.py`;
    fetched once) instead of the small trained BPE.
    flash: settings over FLASH_NEXT's (kind `flash_next`, transformers >= 5.24).
    """
    import transformers

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if qwen_vocab:
        from .qwen_vocab import QWEN_VOCAB_SIZE, copy_tokenizer

        copy_tokenizer(path)
        vocab, eos = QWEN_VOCAB_SIZE, QWEN_EOS
    else:
        ids = train_tokenizer(CORPUS * 4, path, vocab_size=min(SIZES[size]["vocab"], 512) - 16)
        vocab = max(SIZES[size]["vocab"], ids["vocab_size"])
        eos = ids["eos_id"]
    torch.manual_seed(seed)
    moe = dict(MOE, **(dict(zip(("num_experts", "num_experts_per_tok"), experts))
                       if experts else {}))
    cfg = _hf_config(kind, size, vocab, eos, rotary, init, moe, layers, attention_every,
                     flash)
    cls = getattr(transformers, HF_CLASSES[kind])
    model = cls(cfg).eval()
    _perturb(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    if mtp:
        if kind.startswith("dense"):
            raise ValueError("dense Qwen3 checkpoints have no MTP head")
        add_tiny_mtp_head(path, seed)
    return path


def add_tiny_mtp_head(path: Path, seed: int = 0, scale: float = 1.0) -> None:
    """Add random `mtp.*` tensors and `mtp_num_hidden_layers: 1` to a hybrid checkpoint.

    The layer is a transformers Qwen3.5 full-attention decoder layer (its tensor names are
    the ones releases use under `mtp.layers.0.`), plus `fc` [H, 2H] and the three norms (a
    Flash-Next checkpoint: its module, `_flash_next_mtp`);
    sharded checkpoints get an extra shard listed in the index, as releases have.
    `scale` multiplies the random weights (larger: sharper draft logits)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config") or raw
    cfg = AutoConfig.from_pretrained(str(path))
    cfg = getattr(cfg, "text_config", cfg)
    torch.manual_seed(seed + 7)
    h = cfg.hidden_size
    gen = torch.Generator().manual_seed(seed + 8)
    if cfg.model_type.startswith("qwen4_exp"):
        tensors = _flash_next_mtp(cfg, seed, scale, gen)
    else:
        moe = getattr(cfg, "num_experts", 0)
        layer = (Qwen3_5MoeDecoderLayer if moe else Qwen3_5DecoderLayer)(
            cfg, cfg.layer_types.index("full_attention"))
        _perturb(layer, seed + 7)
        tensors = {f"mtp.layers.0.{k}": v * (scale if v.dim() >= 2 else 1.0)
                   for k, v in per_expert(layer.state_dict()).items()}
        tensors["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.1 * scale
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            tensors[f"mtp.{norm}.weight"] = 0.2 * torch.randn(h, generator=gen)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    index = path / "model.safetensors.index.json"
    if index.is_file():
        save_file(tensors, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
        entries = json.loads(index.read_text())
        entries["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
        index.write_text(json.dumps(entries, indent=2))
    else:
        weights = load_file(str(path / "model.safetensors"))
        save_file({**weights, **tensors}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    (path / "config.json").write_text(json.dumps(raw, indent=2))


def _flash_next_mtp(cfg, seed: int, scale: float, gen: torch.Generator) -> dict:
    """A Flash-Next MTP module's random tensors (engine/models/flash_next/flash_next_mtp.py): one
    transformers Qwen4-Exp decoder layer with the indexer (no PLE), its final mixer, the
    fusion's two norms and two projections."""
    import copy

    from transformers.models.qwen4_exp.modeling_qwen4_exp import (
        Qwen4ExpTextDecoderLayer,
        Qwen4ExpTextGatedResidual,
    )

    one = copy.deepcopy(cfg)
    one.layer_types, one.ple_layer_ids, one.num_hidden_layers = ["indexed_attention"], [], 1
    layer, mixer = Qwen4ExpTextDecoderLayer(one, 0), Qwen4ExpTextGatedResidual(one, False)
    _perturb(layer, seed + 7)
    h, hc = cfg.hidden_size, cfg.hc_count
    tensors = {f"mtp.layers.0.{k}": v * (scale if v.dim() >= 2 else 1.0)
               for k, v in per_expert(layer.state_dict()).items()}
    tensors.update({f"mtp.hyper_connection_mixer.{k}": v
                    for k, v in mixer.state_dict().items()})
    for name in ("fc_embedding", "fc_hidden"):
        tensors[f"mtp.{name}.weight"] = torch.randn(h, h, generator=gen) * 0.1 * scale
    for name, dim in (("pre_fc_norm_embedding", h), ("pre_fc_norm_hidden", hc * h)):
        tensors[f"mtp.{name}.weight"] = 0.2 * torch.randn(dim, generator=gen)
    return tensors


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused in-memory experts (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]) as the per-expert tensors checkpoints store."""
    out = {}
    for name, t in tensors.items():
        parent, _, leaf = name.rpartition(".")
        if not parent.endswith("experts") or leaf not in ("gate_up_proj", "down_proj"):
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if leaf == "down_proj":
                out[f"{parent}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{parent}.{e}.gate_proj.weight"] = gate
                out[f"{parent}.{e}.up_proj.weight"] = up
    return out


def _dflash2_tensors(hidden: int, vocab: int, num_layers: int, settings: dict,
                     gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random DFlash2 convs (near identity: tap 0 about 1) and selector, published names."""
    k, groups, rank = (settings["conv_kernel_size"], hidden // settings["conv_group_size"],
                       settings["selector_rank"])
    out = {}
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.3 * torch.randn(2, k, hidden, generator=gen)
            base[:, 0] += 1.0
            out[f"layers.{i}.{conv}.base_kernel"] = base
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = 0.1 * torch.randn(
                2 * k * groups, hidden, generator=gen)
    out["candidate_selector.hidden_projection.weight"] = 0.3 * torch.randn(rank, hidden,
                                                                           generator=gen)
    for book in ("predecessor_codebook", "successor_codebook"):
        out[f"candidate_selector.{book}"] = torch.randn(vocab, rank, generator=gen)
    return out


def write_tiny_drafter(path: str | Path, target: str | Path, num_layers: int = 2,
                       block_size: int = 8, layer_types: list[str] | None = None,
                       sliding_window: int | None = 6, tap_ids: list[int] | None = None,
                       omit_tap_ids: bool = False, seed: int = 0, extra: dict | None = None,
                       intermediate: int | None = None, dflash2: dict | None = None) -> Path:
    """Write a random DFlash drafter for the checkpoint at `target`, in the upstream format.

    config.json is a transformers Qwen3Config plus `architectures: ["DFlashDraftModel"]`,
    `dflash_config` {target_layer_ids, mask_token_id, block_size} and `num_target_layers`;
    the weights are a transformers Qwen3 decoder stack's `layers.*` and `norm` plus `fc` and
    `hidden_norm` (no embeddings, no lm_head: those are the target's). omit_tap_ids leaves
    target_layer_ids out of the config, so loaders must apply the upstream fallback rule.
    intermediate: the drafter's MLP width (default twice the target's hidden size).
    dflash2: write a DFlash2 drafter in its published layout instead, with these
    dflash_config settings over the defaults (conv_kernel_size 2, conv_group_size 16,
    selector_rank 8, selector_top_k 4): `is_causal: false`, every layer a two-sided
    sliding window, random convs around each sublayer and a random candidate selector
    (codebooks stored without a `.weight` suffix).
    """
    import json

    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3Model

    from ..engine.models.drafters.dflash import default_tap_ids

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target) / "config.json").read_text())
    text = tcfg.get("text_config") or tcfg
    hidden, vocab, n_target = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    types = layer_types or ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=intermediate or 2 * hidden,
                      num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      initializer_range=0.1, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      layer_types=types, use_sliding_window=sliding_window is not None,
                      sliding_window=sliding_window)
    body = Qwen3Model(cfg)
    _perturb(body, seed)
    tensors = {k: v.contiguous() for k, v in body.state_dict().items()
               if not k.startswith("embed_tokens")}
    gen = torch.Generator().manual_seed(seed + 2)
    if omit_tap_ids:
        taps = list(default_tap_ids(n_target, num_layers))
    else:
        taps = tap_ids or [1, n_target - 2]
    tensors["fc.weight"] = torch.randn(hidden, len(taps) * hidden, generator=gen) * 0.05
    tensors["hidden_norm.weight"] = 1 + 0.2 * torch.randn(hidden, generator=gen)
    raw = cfg.to_dict()
    raw.update(architectures=["DFlashDraftModel"], num_target_layers=n_target,
               dflash_config={"mask_token_id": vocab - 1, "block_size": block_size,
                              **({} if omit_tap_ids else {"target_layer_ids": taps})})
    if dflash2 is not None:
        settings = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                    "selector_top_k": 4, **dflash2}
        tensors.update(_dflash2_tensors(hidden, vocab, num_layers, settings, gen))
        raw.update(architectures=["DFlash2DraftModel"], is_causal=False)
        raw["dflash_config"].update(settings)
    raw.update(extra or {})
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
