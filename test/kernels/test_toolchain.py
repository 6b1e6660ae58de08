"""A Triton whose ptxas does not know the GPU fails with one message naming both fixes, from
the engine's kernels (dispatch) and from the kernels report."""

from __future__ import annotations

import pytest

from flash_planner.kernels import dispatch
from flash_planner.kernels.toolchain import ToolchainError, guarded, toolchain_error

# what Triton 3.6's bundled ptxas printed on an H100 asked for Thor's target
PTXAS = ("PTXASError: PTXAS error: Internal Triton PTX codegen error\n`ptxas` stderr:\n"
         "ptxas-blackwell fatal   : Value 'sm_110a' is not defined for option 'gpu-name'")


def test_an_old_ptxas_becomes_one_message_naming_both_fixes():
    clear = toolchain_error(RuntimeError(PTXAS))
    assert isinstance(clear, ToolchainError)
    text = str(clear)
    assert "sm_110a" in text and "TRITON_PTXAS_PATH" in text and "Install a Triton" in text
    assert "\n" not in text
    assert toolchain_error(RuntimeError("out of memory")) is None


def test_a_kernel_launch_that_hits_it_raises_the_clear_error(monkeypatch):
    def launch(*_):
        raise RuntimeError(PTXAS)

    monkeypatch.setitem(dispatch.TRITON_OPS, "gdn_steps", guarded(launch))
    monkeypatch.setattr(dispatch, "_backend", "triton")
    with pytest.raises(ToolchainError, match="TRITON_PTXAS_PATH"):
        dispatch.gdn_steps(*[dispatch.torch.zeros(1)] * 6)
    other = guarded(lambda: (_ for _ in ()).throw(ValueError("a shape")))
    with pytest.raises(ValueError, match="a shape"):
        other()


def test_every_engine_kernel_is_guarded_until_it_has_run_once(monkeypatch):
    fresh, missing = dispatch._triton_ops()
    assert fresh and not missing, "Triton is importable here"
    assert all(getattr(fn, "__wrapped__", None) is not None for fn in fresh.values())
    monkeypatch.setitem(dispatch.TRITON_OPS, "accept_rows", fresh["accept_rows"])
    monkeypatch.setattr(dispatch, "_backend", "triton")
    torch = dispatch.torch
    drafts, logits = torch.tensor([[1, 2]]), torch.randn(1, 3, 8)
    dispatch.accept_rows(drafts, logits, torch.zeros(1, 2, dtype=torch.bool), 1, 0.0)
    # the toolchain is proven: the kernel is called directly from now on
    assert dispatch.TRITON_OPS["accept_rows"] is fresh["accept_rows"].__wrapped__
