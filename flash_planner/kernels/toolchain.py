"""Turning a Triton toolchain that cannot build for this GPU into one clear error.

Thor's compute capability is 11.0 under CUDA 13. A Triton whose bundled ptxas predates it
(Triton 3.6's ptxas-blackwell, for one) fails the first kernel launch with
`ptxas fatal: Value 'sm_110a' is not defined for option 'gpu-name'`, deep in a traceback.
Both ways out are named here: a newer Triton, or the CUDA toolkit's own ptxas named by the
variable the failing tool reads. Triton 3.5 and later build sm_90 and newer with their
`ptxas-blackwell`, which reads TRITON_PTXAS_BLACKWELL_PATH; TRITON_PTXAS_PATH names only the
older `ptxas` (seen on an H200 with Triton 3.6: TRITON_PTXAS_PATH set, the same failure).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

OLD_PTXAS = re.compile(r"(?:(ptxas[\w-]*)[^\n]*)?Value '(sm_\w+)' is not defined for option "
                       r"'gpu-name'")


class ToolchainError(RuntimeError):
    """Triton's compiler cannot build kernels for this GPU; the message says how to fix it."""


def toolchain_error(exc: BaseException) -> ToolchainError | None:
    """The clear error for `exc` when it is a ptxas that does not know the GPU, else None."""
    found = OLD_PTXAS.search(str(exc))
    if found is None:
        return None
    try:
        import triton

        version = f"Triton {triton.__version__}"
    except ImportError:
        version = "Triton"
    tool, target = found.groups()
    if tool is None:            # the tool unnamed: both variables (Triton 3.5+ and older)
        tool, variable = "ptxas", "TRITON_PTXAS_BLACKWELL_PATH (TRITON_PTXAS_PATH before 3.5)"
    else:
        variable = "TRITON_" + tool.upper().replace("-", "_") + "_PATH"
    example = variable.split()[0]
    return ToolchainError(
        f"{version}'s {tool} cannot build kernels for {target} (this GPU; Thor is sm_110 "
        f"under CUDA 13). Install a Triton whose bundled ptxas knows it, or point {variable} "
        f"at the CUDA toolkit's ptxas (e.g. {example}=/usr/local/cuda/bin/ptxas), then "
        "start again.")


def guarded(fn: Callable[..., Any], proven: Callable[[], None] | None = None
            ) -> Callable[..., Any]:
    """`fn` (a kernel's launcher, or Triton's compile) with a toolchain failure raised as
    `ToolchainError`. `proven` runs after the first call that succeeded: a kernel that
    compiled and ran proves the toolchain, so a caller can put `fn` itself back in place and
    keep the wrapper off the hot path."""
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:
            clear = toolchain_error(exc)
            if clear is None:
                raise
            raise clear from exc
        if proven is not None:
            proven()
        return out

    call.__name__ = getattr(fn, "__name__", "kernel")
    call.__wrapped__ = fn
    return call
