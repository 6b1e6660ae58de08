"""Weight bytes one target forward reads, per format, for Qwen3.6-27B, Qwen3-4B and
Qwen3.6-35B-A3B shapes, and bytes per verify forward by block size (MoE against dense).

Decode on Jetson AGX Thor is bound by reading the weights (273 GB/s), so bytes per forward
set a floor on the time of one forward. The models are built on the meta device from their
config.json shapes (no data), their Linears swapped for each format's module exactly as the
loader does at `--weights`, and the engine's own count (`bytes_per_forward`) is printed
beside an analytic count from the config's numbers alone. Per row: GB per forward, the
floor in ms at 273 GB/s, and floor tokens/s at 1 token per forward and at the DFlash tokens
per cycle given (each cycle is one target forward; the drafter's own reads are not counted).

A mixture of experts reads, per sparse layer, the experts its rows chose: one token reads
top-k (8 of 256 for the 35B-A3B), a verify block of n rows the union. The second table gives
bytes per verify forward by n: the analytic bound for independent routing, E(1 - (1 - k/E)^n)
experts per layer, and the same model scaled by the distinct experts measured on real routing
(a tiny random-weight Qwen3.5-MoE with 256 experts, 8 per token, written by transformers,
over consecutive tokens of its own greedy continuation: each window of n rows is what a fully
accepted verify block of n rows routes). A dense model reads the same bytes for every n.
A third table gives the vision tower's bytes (a vision-language target's images). A fourth
gives the state a verify cycle moves besides the weights (engine/state/traffic.py, from the
engine's own state buffers on the meta device: KV rows, GDN state and kept rows, conv windows,
Flash-Next's windows and indexer keys) for a 16-row verify at a context of CONTEXT tokens,
batch 1 and 8, beside the NVFP4 weights one forward reads.

    python bench/weight_bytes.py [--tokens-per-cycle 6.43] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from flash_planner.engine.checkpoint import load_checkpoint
from flash_planner.engine.config import ModelConfig
from flash_planner.engine.models.qwen.moe import RoutingRecord
from flash_planner.engine.models.qwen.target import TargetModel
from flash_planner.engine.state.cache import InferenceState
from flash_planner.engine.weights.bytes import bytes_per_forward
from flash_planner.engine.weights.experts import plan_experts
from flash_planner.engine.weights.load import plan_linears
from flash_planner.engine.weights.scheme import UNQUANTIZED

THOR_GBPS = 273.0
FORMATS = ("bf16", "fp8", "nvfp4", "int4")

# config.json shapes (FACTS.md section 2; Qwen3-4B as published)
QWEN3_6_27B = {
    "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
    "head_dim": 256, "vocab_size": 248320, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                        "partial_rotary_factor": 0.25},
    "eos_token_id": 248044, "mtp_num_hidden_layers": 1,
}
QWEN3_4B = {
    "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960, "rope_parameters": {"rope_type": "default",
                                                          "rope_theta": 1e6},
    "eos_token_id": 151645,
}
# the Qwen3_5MoeTextConfig defaults, which are the 35B-A3B's (FACTS.md section 14)
QWEN3_6_35B_A3B = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "vocab_size": 248320, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
    "num_experts_per_tok": 8, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                        "partial_rotary_factor": 0.25},
    "eos_token_id": 248044, "mtp_num_hidden_layers": 1,
}
TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
             num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")
# the language model's width the merger projects to
TARGETS = {"Qwen3.6-27B": 5120, "Qwen3.6-35B-A3B": 2048}
MODELS = {"Qwen3.6-27B": QWEN3_6_27B, "Qwen3-4B": QWEN3_4B, "Qwen3.6-35B-A3B": QWEN3_6_35B_A3B}
# Qwen3.8-Flash-Next's text config as third-party copies of the published config.json give it
# (not checked against the file itself): 48 layers (3 GDN : 1 attention with the QSA
# indexer), 512 experts of 640, 10 per token, one PLE layer (layer 2) with 16 n-gram heads
QWEN3_8_FLASH_NEXT = {
    "model_type": "qwen4_exp_text", "hidden_size": 2560, "num_hidden_layers": 48,
    "num_attention_heads": 24, "num_key_value_heads": 2, "head_dim": 256,
    "vocab_size": 248320, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_value_head_dim": 128,
    "moe_intermediate_size": 640, "shared_expert_intermediate_size": 640, "num_experts": 512,
    "num_experts_per_tok": 10, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                        "partial_rotary_factor": 0.25},
    "eos_token_id": 248044, "hc_count": 4, "hc_lowrank": 320, "ple_layer_ids": [2],
    "ple_embed_dim": 2560, "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000, "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 128, "indexer_n_heads": 4, "indexer_kv_heads": 1,
    "indexer_head_dim": 128, "indexer_budget": 2048, "indexer_compress_ratio": 4,
    "output_gate_type": "sigmoid",
}
# its builds: every Linear in one format, or NVFP4 experts with bf16 elsewhere
FLASH_NEXT_BUILDS = {"bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8"),
                     "nvfp4 experts, bf16 else": ("bf16", "nvfp4"),
                     "nvfp4": ("nvfp4", "nvfp4")}
BLOCKS = (1, 2, 4, 8, 16)


def meta_model(raw: dict, weights: str) -> TargetModel:
    """The target on the meta device, its Linears as `weights` would load them."""
    cfg = ModelConfig.from_hf_dict(raw)
    with torch.device("meta"):
        model = TargetModel(cfg)
    model = model.to(torch.bfloat16)
    plan_linears(model, lambda ours: ours, UNQUANTIZED, weights, ValueError)
    plan_experts(model, lambda ours: ours, set(), UNQUANTIZED, weights, ValueError)
    return model


def independent_touch(experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts n rows choose when each picks k of E independently."""
    return experts * (1 - (1 - top_k / experts) ** rows)


def measured_touch(blocks=BLOCKS, tokens: int = 96) -> dict[int, float]:
    """Mean distinct experts per sparse layer over windows of n consecutive rows, from the
    routing of a tiny Qwen3.5-MoE with 256 experts, 8 per token (its own greedy text)."""
    from flash_planner.train.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = load_checkpoint(write_tiny_checkpoint(tmp, "hybrid_moe", experts=(256, 8),
                                                     init=0.25))
    cfg, model = ckpt.config, ckpt.model
    state = InferenceState(cfg, tokens + 16, 1, torch.float32, torch.float32,
                           torch.device("cpu"))
    ids = ckpt.tokenizer.encode("pick up the red cup and place it on the kitchen table",
                                add_special_tokens=False)
    new = torch.tensor([ids])
    while len(ids) < tokens:                  # greedy continuation, one token at a time
        logits = model(new, state).logits[0, -1]
        state.commit(new.shape[1])
        ids.append(int(logits.argmax()))
        new = torch.tensor([ids[-1:]])
    state.reset()
    record = RoutingRecord()
    model(torch.tensor([ids]), state, routing=record, all_logits=True)   # every row routed
    out = {}
    for n in blocks:
        counts = [len(set(layer[t:t + n].flatten().tolist())) for layer in record.ids
                  for t in range(len(ids) - n + 1)]
        out[n] = sum(counts) / len(counts)
    return out


def verify_rows(fmt: str = "nvfp4") -> list[dict]:
    """Bytes per verify forward of n rows for the 35B-A3B (bound and measured) and the 27B."""
    moe = ModelConfig.from_hf_dict(QWEN3_6_35B_A3B).moe
    e, k = moe.num_experts, moe.top_k
    measured = measured_touch()
    scale = {n: measured[n] / independent_touch(256, 8, n) for n in BLOCKS}
    sparse, dense = meta_model(QWEN3_6_35B_A3B, fmt), meta_model(QWEN3_6_27B, fmt)
    dense_gb = bytes_per_forward(dense) / 1e9
    out = []
    for n in BLOCKS:
        bound = independent_touch(e, k, n)
        real = bound * scale[n]
        gb_bound = bytes_per_forward(sparse, bound) / 1e9
        gb_real = bytes_per_forward(sparse, real) / 1e9
        out.append({"rows": n, "format": fmt, "experts_bound": bound, "experts_measured": real,
                    "measured_tiny": measured[n], "gb_bound": gb_bound, "gb_measured": gb_real,
                    "ms_bound": gb_bound / THOR_GBPS * 1e3,
                    "ms_measured": gb_real / THOR_GBPS * 1e3,
                    "gb_27b": dense_gb, "ms_27b": dense_gb / THOR_GBPS * 1e3})
    return out


def _linear_bytes(n: int, k: int, fmt: str, keep: bool) -> float:
    """One Linear [n, k] in `fmt` (keep: left in bf16 by the recipe)."""
    if fmt == "bf16" or keep:
        return 2 * n * k
    if fmt == "fp8":    # e4m3 bytes + fp32 scale per 128x128 block
        return n * k + 4 * -(-n // 128) * -(-k // 128)
    if fmt == "nvfp4":  # half a byte per weight + an e4m3 scale per 16 + one fp32 scale
        return n * k / 2 + n * k / 16 + 4
    groups = -(-k // 128)   # int4: half a byte + fp32 scale and uint8 zero per 128 along K
    return n * -(-k // 2) + 5 * n * groups


def forward_bytes(raw: dict, fmt: str) -> int:
    """The engine's count for one token: an MoE reads top-k experts per layer."""
    model = meta_model(raw, fmt)
    moe = model.cfg.moe
    return bytes_per_forward(model, moe.top_k if moe else None)


def _mlp_bytes(raw: dict, fmt: str) -> float:
    """One layer's MLP for one token: dense, or shared expert + top-k experts + router and
    shared-expert gate (both kept in bf16)."""
    h = raw["hidden_size"]
    if "num_experts" not in raw:
        return 3 * _linear_bytes(raw["intermediate_size"], h, fmt, False)
    mi, si = raw["moe_intermediate_size"], raw["shared_expert_intermediate_size"]
    return (3 * raw["num_experts_per_tok"] * _linear_bytes(mi, h, fmt, False)
            + 3 * _linear_bytes(si, h, fmt, False) + 2 * (raw["num_experts"] + 1) * h)


def analytic_bytes(raw: dict, fmt: str) -> float:
    """Bytes per forward from the config's numbers alone (norm weights included)."""
    h, layers = raw["hidden_size"], raw["num_hidden_layers"]
    hd, heads, kv = raw["head_dim"], raw["num_attention_heads"], raw["num_key_value_heads"]
    hybrid = raw["model_type"].startswith("qwen3_5")
    total = 0.0
    for i in range(layers):
        total += _mlp_bytes(raw, fmt) + 2 * 2 * h                       # MLP, two norms
        if hybrid and (i + 1) % raw["full_attention_interval"]:
            dk, hk = raw["linear_key_head_dim"], raw["linear_num_key_heads"]
            dv, hv = raw["linear_value_head_dim"], raw["linear_num_value_heads"]
            conv = 2 * hk * dk + hv * dv
            total += (_linear_bytes(conv, h, fmt, False) + _linear_bytes(hv * dv, h, fmt, False)
                      + 2 * _linear_bytes(hv, h, fmt, True)                # in_proj_a/b
                      + _linear_bytes(h, hv * dv, fmt, False)              # out_proj
                      + 2 * (conv * raw["linear_conv_kernel_dim"] + 2 * hv + dv))
        else:
            q = heads * hd * (2 if hybrid else 1)                            # gated q
            total += (_linear_bytes(q, h, fmt, False) + 2 * _linear_bytes(kv * hd, h, fmt, False)
                      + _linear_bytes(h, heads * hd, fmt, False) + 2 * 2 * hd)
    return total + 2 * h + 2 * raw["vocab_size"] * h                         # norm, output


def flash_next_rows(tokens_per_cycle: float) -> list[dict]:
    """Qwen3.8-Flash-Next's bytes per token by build: the engine's count of its Linears and
    the 10 experts a token reads, plus the PLE rows it reads (16 rows of 160 per PLE layer, in
    the table's storage: FP8 as Qwen publishes it, bf16 in the bf16 build); the n-gram table
    itself (51.2B parameters) is never read whole."""
    from flash_planner.engine.models.flash_next.flash_next import FlashNextModel

    cfg = ModelConfig.from_hf_dict(QWEN3_8_FLASH_NEXT)
    fn = cfg.flash_next
    with torch.device("meta"):
        base = FlashNextModel(cfg).to(torch.bfloat16)
    table = sum(ple_table_rows(fn, i) for i in range(len(fn.ple_layers)))
    out = []
    for build, (linears, experts) in FLASH_NEXT_BUILDS.items():
        with torch.device("meta"):
            model = FlashNextModel(cfg).to(torch.bfloat16)
        plan_linears(model, lambda ours: ours, UNQUANTIZED, linears, ValueError)
        plan_experts(model, lambda ours: ours, set(), UNQUANTIZED, experts, ValueError)
        row_bytes = 2 if build == "bf16" else 1
        ple = len(fn.ple_layers) * fn.ple_embed_dim        # 16 rows of 160 per PLE layer
        gb = (bytes_per_forward(model, cfg.moe.top_k) + ple * row_bytes) / 1e9
        floor_ms = gb / THOR_GBPS * 1e3
        out.append({"build": build, "gb": gb, "floor_ms": floor_ms,
                    "tok_s_al1": 1e3 / floor_ms, "tok_s_dflash": tokens_per_cycle * 1e3 / floor_ms,
                    "table_gb": table * fn.ple_embed_dim // fn.ngram_heads * row_bytes / 1e9,
                    "params_b": sum(p.numel() for p in base.parameters()) / 1e9})
    return out


def ple_table_rows(fn, ple_index: int) -> int:
    """Rows of one PLE layer's n-gram table: its heads' prime sizes summed."""
    from flash_planner.engine.models.flash_next.ngram import head_sizes

    return sum(head_sizes(fn.ngram_vocab_base, fn.ngram_heads, ple_index))


def tower_rows() -> list[dict]:
    """Each model's vision tower (bench/vision.py's dimensions) in bf16: bytes read once per
    new image, not per decoded token (an image's embeddings are then cached by content)."""
    from flash_planner.engine.models.qwen.vision import VisionConfig, VisionTower

    out = []
    for name, width in TARGETS.items():
        with torch.device("meta"):
            model = VisionTower(VisionConfig.from_hf_dict({**TOWER, "out_hidden_size": width},
                                                          "bench"))
        params = sum(p.numel() for p in model.parameters())
        out.append({"model": name, "params_m": params / 1e6, "gb_bf16": 2 * params / 1e9,
                    "floor_ms": 2 * params / (THOR_GBPS * 1e9) * 1e3})
    return out


CONTEXT = 2048
TRAFFIC_MODELS = {"Qwen3.6-27B": QWEN3_6_27B, "Qwen3.6-35B-A3B": QWEN3_6_35B_A3B,
                  "Qwen3.8-Flash-Next": QWEN3_8_FLASH_NEXT}


def traffic_rows(rows_per_verify: int = 16, context: int = CONTEXT) -> list[dict]:
    """Per model and batch: the state bytes one verify cycle reads and writes (by part and
    in all) beside the nvfp4 weight bytes of that forward (a batch reads the weights once)."""
    from flash_planner.engine.state.traffic import TrafficModel

    out = []
    for name, raw in TRAFFIC_MODELS.items():
        cfg = ModelConfig.from_hf_dict(raw)
        state = InferenceState(cfg, context + rows_per_verify, rows_per_verify, torch.bfloat16,
                               torch.bfloat16, torch.device("meta"))
        one = TrafficModel.of(state).cycle(rows_per_verify, context)
        weights = (flash_next_rows(1.0)[-1]["gb"] * 1e9 if cfg.flash_next is not None
                   else forward_bytes(raw, "nvfp4"))
        for batch in (1, 8):
            t = one.times(batch)
            gdn_written = sum(t.part(p)[1] for p in ("gdn state", "gdn rows", "conv"))
            out.append({"model": name, "batch": batch, "rows": rows_per_verify,
                        "context": context, "read_gb": t.read / 1e9,
                        "written_gb": t.written / 1e9, "gdn_written_gb": gdn_written / 1e9,
                        "weights_gb": weights / 1e9, "parts": t.as_dict()})
    return out


def rows(tokens_per_cycle: float) -> list[dict]:
    out = []
    for name, raw in MODELS.items():
        for fmt in FORMATS:
            engine = forward_bytes(raw, fmt)
            floor_ms = engine / (THOR_GBPS * 1e9) * 1e3
            out.append({"model": name, "format": fmt, "gb": engine / 1e9,
                        "analytic_gb": analytic_bytes(raw, fmt) / 1e9, "floor_ms": floor_ms,
                        "tok_s_al1": 1e3 / floor_ms,
                        "tok_s_dflash": tokens_per_cycle * 1e3 / floor_ms})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens-per-cycle", type=float, default=6.43,
                    help="DFlash tokens per cycle to scale the floor by (default: the demo's "
                    "measured figure, bench/plan.py)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--png-dir", type=Path, default=None,
                    help="write the chart there (make bench: docs/img)")
    args = ap.parse_args()
    table = rows(args.tokens_per_cycle)
    verify = verify_rows()
    if args.png_dir is not None:
        from charts import grouped_bars

        models = list(dict.fromkeys(r["model"] for r in table))
        formats = list(dict.fromkeys(r["format"] for r in table))
        gb = {(r["model"], r["format"]): r["gb"] for r in table}
        print(grouped_bars(args.png_dir / "bytes_per_forward.png",
                           "weight bytes one target forward reads, by format (GB)", models,
                           {f: [gb.get((m, f), 0.0) for m in models] for f in formats},
                           "GB per forward", f"bench/weight_bytes.py; Thor floor "
                           f"{THOR_GBPS:.0f} GB/s: ms per forward = GB / {THOR_GBPS / 1000:.3f}",
                           "{:.1f}"))
    vision = tower_rows()
    flash = flash_next_rows(args.tokens_per_cycle)
    traffic = traffic_rows()
    if args.json:
        print(json.dumps({"forward": table, "verify": verify, "vision": vision,
                          "flash_next": flash, "state_traffic": traffic}))
        return
    print(f"weights read per target forward; Thor floor at {THOR_GBPS:.0f} GB/s; DFlash at "
          f"{args.tokens_per_cycle} tokens/cycle")
    print(f"{'model':<12} {'format':<6} {'GB':>7} {'analytic':>9} {'floor ms':>9} "
          f"{'tok/s AL1':>10} {'tok/s DFlash':>13}")
    for r in table:
        print(f"{r['model']:<12} {r['format']:<6} {r['gb']:7.2f} {r['analytic_gb']:9.2f} "
              f"{r['floor_ms']:9.1f} {r['tok_s_al1']:10.1f} {r['tok_s_dflash']:13.1f}")
    print("\nbytes per verify forward of n rows, nvfp4; experts per layer of the 35B-A3B's 256 "
          "(bound: independent routing; measured: scaled by a 256-expert test model's routing)")
    print(f"{'rows':>4} {'experts bound':>13} {'measured':>9} {'35B-A3B GB':>11} {'measured':>9} "
          f"{'floor ms':>9} {'27B GB':>7} {'floor ms':>9}")
    for r in verify:
        print(f"{r['rows']:>4} {r['experts_bound']:13.1f} {r['experts_measured']:9.1f} "
              f"{r['gb_bound']:11.2f} {r['gb_measured']:9.2f} {r['ms_measured']:9.1f} "
              f"{r['gb_27b']:7.2f} {r['ms_27b']:9.1f}")
    print(f"\nQwen3.8-Flash-Next ({flash[0]['params_b']:.1f}B parameters besides its n-gram "
          f"table), bytes per token: its Linears, 10 experts and 16 PLE rows")
    print(f"{'build':<26} {'GB':>6} {'table GB':>9} {'floor ms':>9} {'tok/s AL1':>10} "
          f"{'tok/s DFlash':>13}")
    for r in flash:
        print(f"{r['build']:<26} {r['gb']:6.2f} {r['table_gb']:9.1f} {r['floor_ms']:9.1f} "
              f"{r['tok_s_al1']:10.1f} {r['tok_s_dflash']:13.1f}")
    print("\nthe vision tower, bf16 (bench/vision.py's dimensions): read once per new image, "
          "not per token")
    print(f"{'model':<16} {'params M':>9} {'GB':>6} {'floor ms':>9}")
    for r in vision:
        print(f"{r['model']:<16} {r['params_m']:9.1f} {r['gb_bf16']:6.3f} {r['floor_ms']:9.2f}")
    print(f"\nstate one verify cycle moves besides the weights: {traffic[0]['rows']} rows at a "
          f"context of {traffic[0]['context']} tokens (engine/state/traffic.py; bf16 KV, float32 "
          f"GDN state), beside the nvfp4 weights of that forward (read once per batch; MoE: "
          f"one row's experts)")
    print(f"{'model':<19} {'batch':>5} {'read GB':>8} {'written GB':>11} {'GDN written':>12} "
          f"{'weights GB':>11} {'state/weights':>14}")
    for r in traffic:
        print(f"{r['model']:<19} {r['batch']:>5} {r['read_gb']:8.3f} {r['written_gb']:11.3f} "
              f"{r['gdn_written_gb']:12.3f} {r['weights_gb']:11.2f} "
              f"{(r['read_gb'] + r['written_gb']) / r['weights_gb']:14.2f}")


if __name__ == "__main__":
    main()
