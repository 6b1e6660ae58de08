"""Weight bytes one target forward reads, per format, for Qwen3.6-27B and Qwen3-4B shapes.

Decode on Jetson AGX Thor is bound by reading the weights (273 GB/s), so bytes per forward
set a floor on the time of one forward. The models are built on the meta device from their
config.json shapes (no data), their Linears swapped for each format's module exactly as the
loader does at `--weights`, and the engine's own count (`bytes_per_forward`) is printed
beside an analytic count from the config's numbers alone. Per row: GB per forward, the
floor in ms at 273 GB/s, and floor tokens/s at 1 token per forward and at the DFlash tokens
per cycle given (each cycle is one target forward; the drafter's own reads are not counted).

    python bench/weight_bytes.py [--tokens-per-cycle 4.66] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

from flash_planner.engine.config import ModelConfig
from flash_planner.engine.models.target import TargetModel
from flash_planner.engine.weights.bytes import bytes_per_forward
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
MODELS = {"Qwen3.6-27B": QWEN3_6_27B, "Qwen3-4B": QWEN3_4B}


def meta_model(raw: dict, weights: str) -> TargetModel:
    """The target on the meta device, its Linears as `weights` would load them."""
    cfg = ModelConfig.from_hf_dict(raw)
    with torch.device("meta"):
        model = TargetModel(cfg)
    model = model.to(torch.bfloat16)
    plan_linears(model, lambda ours: ours, UNQUANTIZED, weights, ValueError)
    return model


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


def analytic_bytes(raw: dict, fmt: str) -> float:
    """Bytes per forward from the config's numbers alone (norm weights included)."""
    h, inter, layers = raw["hidden_size"], raw["intermediate_size"], raw["num_hidden_layers"]
    hd, heads, kv = raw["head_dim"], raw["num_attention_heads"], raw["num_key_value_heads"]
    hybrid = raw["model_type"].startswith("qwen3_5")
    total = 0.0
    for i in range(layers):
        total += 3 * _linear_bytes(inter, h, fmt, False) + 2 * 2 * h   # MLP, two norms
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


def rows(tokens_per_cycle: float) -> list[dict]:
    out = []
    for name, raw in MODELS.items():
        for fmt in FORMATS:
            engine = bytes_per_forward(meta_model(raw, fmt))
            floor_ms = engine / (THOR_GBPS * 1e9) * 1e3
            out.append({"model": name, "format": fmt, "gb": engine / 1e9,
                        "analytic_gb": analytic_bytes(raw, fmt) / 1e9, "floor_ms": floor_ms,
                        "tok_s_al1": 1e3 / floor_ms,
                        "tok_s_dflash": tokens_per_cycle * 1e3 / floor_ms})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens-per-cycle", type=float, default=4.66,
                    help="DFlash tokens per cycle to scale the floor by (default: the demo's "
                    "measured figure, bench/plan.py)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    table = rows(args.tokens_per_cycle)
    if args.json:
        print(json.dumps(table))
        return
    print(f"weights read per target forward; Thor floor at {THOR_GBPS:.0f} GB/s; DFlash at "
          f"{args.tokens_per_cycle} tokens/cycle")
    print(f"{'model':<12} {'format':<6} {'GB':>7} {'analytic':>9} {'floor ms':>9} "
          f"{'tok/s AL1':>10} {'tok/s DFlash':>13}")
    for r in table:
        print(f"{r['model']:<12} {r['format']:<6} {r['gb']:7.2f} {r['analytic_gb']:9.2f} "
              f"{r['floor_ms']:9.1f} {r['tok_s_al1']:10.1f} {r['tok_s_dflash']:13.1f}")


if __name__ == "__main__":
    main()
