"""Every kernel declares its specializations, and the engine launches only declared ones.

The engine runs real speculative decoding (tiny hybrid target, replayed drafts with
rejections, so every kernel runs) with the Triton kernels forced on (interpreted on CPU),
in fp32 and bf16, with FP8 and plain KV caches; each recorded launch must be one of the
kernel's declared specs (the same argument types, warps, stages and constexpr values, except
those derived from head sizes, which differ between the tiny model and the declared shapes).
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.loop.proposer import ReplayProposer
from flash_planner.kernels import dispatch
from flash_planner.kernels.report import MODULES, all_specs
from flash_planner.kernels.specs import kernel_name, record_launches


def _jit_functions(module) -> dict[str, object]:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, (JITFunction, InterpretedFunction))}


@pytest.mark.parametrize("name", MODULES)
def test_every_jit_kernel_declares_specs_and_every_helper_is_used(name):
    module = importlib.import_module(f"flash_planner.kernels.{name}")
    jit = _jit_functions(module)
    kernels = {n for n in jit if n.endswith("_kernel")}
    assert kernels, f"{name}: no @triton.jit kernel found"
    declared = {kernel_name(spec.kernel) for spec in module.SPECS}
    assert kernels <= declared, f"{name}: {sorted(kernels - declared)} declare no specs"
    sources = {n: inspect.getsource(f.fn) for n, f in jit.items()}
    for helper in set(jit) - kernels:  # device functions: called by another jit function
        callers = [n for n, text in sources.items() if n != helper and f"{helper}(" in text]
        assert callers, f"{name}: {helper} is neither a kernel nor called by one"
    assert all(spec.constexprs or spec.types for spec in module.SPECS)


# Triton runs on a CPU only in its interpreter: with a GPU the engines live on it
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [("fp32", "fp32"), ("fp32", "fp8"), ("bf16", "bf16"), ("bf16", "fp8")]
# The weight-only GEMMs run only for quantized checkpoints and the MoE GEMMs only for MoE
# targets, neither of which this dense-MLP hybrid run loads; test_weight_gemm.py and
# test_moe_gemm.py check that their launches are declared specs.
QUANTIZED_ONLY = {"_gemm_tiles_kernel", "_gemm_rows_kernel"}


def test_engine_launches_only_declared_specs_and_every_spec_is_launched(hybrid_dir,
                                                                         make_engine):
    specs, used = all_specs(), set()
    for dtype, kv in CONFIGS:
        engine = make_engine(hybrid_dir, dtype=dtype, kv_dtype=kv, device=DEVICE)
        prompt = engine.tokenizer.encode("put the apple in the fridge",
                                         add_special_tokens=False)
        ref = list(range(5, 11))  # two cycles: one rejects at once, one partly accepts
        replay = ReplayProposer(ref, engine.model_config.vocab_size, block_size=4,
                                error_at=[0, 2])
        dispatch.set_backend("triton")
        try:
            with record_launches() as launches:
                generate(engine, prompt, GenerationSettings(len(ref), ignore_eos=True),
                         proposer=replay)
        finally:
            dispatch.set_backend("auto")
        for launch in launches:
            matching = [spec for spec in specs if spec.admits(launch)]
            assert matching, (f"{dtype}/{kv}: undeclared launch of {launch.name}: "
                              f"{launch.types} {launch.constexprs}")
            used.update(spec.label for spec in matching)
    expected = {spec.label for spec in specs if spec.name not in QUANTIZED_ONLY}
    assert expected <= used, f"declared but never launched: {sorted(expected - used)}"


def test_admits_rejects_another_dtype_or_flag():
    from flash_planner.kernels.kv_append.kernel import SPECS

    declared = SPECS[0]
    other = type(declared)(declared.kernel, "x", {**declared.types, "rows": "*fp16"},
                           declared.constexprs)
    assert declared.admits(declared) and not declared.admits(other)
    flipped = type(declared)(declared.kernel, "x", declared.types,
                             {**declared.constexprs, "QUANT": True})
    assert not declared.admits(flipped)
    resized = type(declared)(declared.kernel, "x", declared.types,
                             {**declared.constexprs, "BLOCK_D": 64})
    assert declared.admits(resized)  # a head size, not a different specialization
