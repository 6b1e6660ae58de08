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
    # Triton 3.5+ builds sm_90 and newer with ptxas-blackwell, which reads its own variable
    assert "sm_110a" in text and "TRITON_PTXAS_BLACKWELL_PATH=" in text
    assert "Install a Triton" in text and "\n" not in text
    older = str(toolchain_error(RuntimeError(
        "ptxas fatal   : Value 'sm_110a' is not defined for option 'gpu-name'")))
    assert "TRITON_PTXAS_PATH=" in older and "BLACKWELL" not in older
    unnamed = str(toolchain_error(RuntimeError("Value 'sm_110a' is not defined for option "
                                               "'gpu-name'")))
    assert "TRITON_PTXAS_BLACKWELL_PATH" in unnamed and "TRITON_PTXAS_PATH" in unnamed
    assert toolchain_error(RuntimeError("out of memory")) is None


def test_a_kernel_launch_that_hits_it_raises_the_clear_error(monkeypatch):
    def launch(*_):
        raise RuntimeError(PTXAS)

    monkeypatch.setitem(dispatch.TRITON_OPS, "gdn_steps", guarded(launch))
    monkeypatch.setattr(dispatch, "_backend", "triton")
    with pytest.raises(ToolchainError, match="TRITON_PTXAS_BLACKWELL_PATH"):
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
    device = "cuda" if torch.cuda.is_available() else "cpu"   # compiled, or interpreted
    drafts, logits = torch.tensor([[1, 2]], device=device), torch.randn(1, 3, 8, device=device)
    dispatch.accept_rows(drafts, logits, torch.zeros(1, 2, dtype=torch.bool, device=device), 1,
                         0.0)
    # the toolchain is proven: the kernel is called directly from now on
    assert dispatch.TRITON_OPS["accept_rows"] is fresh["accept_rows"].__wrapped__


def test_a_compiled_trace_calls_the_launchers_and_changes_nothing(monkeypatch):
    """Inside a torch.compile trace the launchers are picked from a table that never changes
    (dynamo guards on what the trace read), and the first-success swap is not traced."""
    monkeypatch.setattr(dispatch, "_backend", "triton")
    torch = dispatch.torch
    before = dict(dispatch.TRITON_OPS)
    picked = []

    def pick(x):
        picked.append(dispatch._pick("accept_rows", None, x))
        return x + 1

    torch.compile(pick, fullgraph=True, backend="eager")(torch.zeros(2))
    assert picked == [dispatch.LAUNCHERS["accept_rows"]]
    assert dispatch.TRITON_OPS == before
