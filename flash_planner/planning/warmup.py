"""The planner service's warm-up (`PlannerService.warm_up`), and the error of a model that
loaded but cannot decode: one line naming the model and the cause, which every front door
(`plan`, `serve`, the node's configure) shows as it is."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from ..engine.engine import Engine
from ..engine.generate import GenerationSettings, generate
from ..engine.loop.speculative import NonFiniteLogits

log = logging.getLogger(__name__)
WARM_UP_TASK = "say OK"


def warm_up(service) -> float:
    """PlannerService.warm_up (its docstring) of `service` (which calls this: no import
    back); ms."""
    t0 = time.perf_counter()
    if service.config.backend == "remote":
        return 0.0
    # the requests' own effort, so that the cached prefix is theirs
    ids, prefix = service.prompt(WARM_UP_TASK, "", service.config.enable_thinking,
                                 reasoning_effort=service.config.reasoning_effort)
    # within the context: a prompt that does not fit is every request's error to report
    engine = service.engine
    cfg = engine.config
    tokens = min(2 * cfg.max_block, cfg.max_context - len(ids) - 1)
    if tokens < 1:
        return (time.perf_counter() - t0) * 1000.0
    settings = GenerationSettings(max_new_tokens=tokens, ignore_eos=True)
    for method in [*(m for m in engine.proposers if m != "auto"), "none"]:
        try:
            generate(engine, ids, replace(settings, method=method), prefix=prefix)
        except Exception as exc:   # the model cannot serve: each front door says why
            raise warm_up_error(engine, exc, method) from exc
    for proposer in engine.proposers.values():
        proposer.forget()
    engine.compile_in_background(release=True)    # after the warm-up: not beside it
    return (time.perf_counter() - t0) * 1000.0


class WarmUpError(RuntimeError):
    """`PlannerService.warm_up` failed: the model at `model` loaded but cannot decode.

    Loading checks files, shapes and dtypes; only running the model finds NaN or Inf
    weights, a kernel that fails on this device or memory that runs out. `broken_weights`:
    the model is at fault (non-finite logits), not the run (a kernel, memory); the CLI exits
    2 for it, as for a checkpoint it cannot load, else 1. The engine's exception is the
    `__cause__`.
    """

    names_itself = True      # its message is the whole story (ros/convert.error_line)

    def __init__(self, model: str, reason: str, broken_weights: bool = False):
        super().__init__(f"warm-up of {model} failed: {reason}")
        self.model, self.reason, self.broken_weights = model, reason, broken_weights


def warm_up_error(engine: Engine, exc: Exception, method: str) -> WarmUpError:
    """The WarmUpError for `exc`, raised while warming `engine` up with `method`."""
    model = engine.config.model_path
    if isinstance(exc, NonFiniteLogits):
        dtype = str(engine.dtype).removeprefix("torch.")
        return WarmUpError(model, f"the model produced non-finite logits (NaN or Inf) at "
                           f"position {exc.position} ({dtype} on {engine.device}): its "
                           f"weights hold NaN or Inf, or its activations overflow {dtype}",
                           broken_weights=True)
    # the front doors print one line; the traceback of an unexpected failure (a kernel,
    # memory) stays within reach of whoever turns the log level up
    log.debug("warm-up of %s (method %s) failed", model, method, exc_info=True)
    return WarmUpError(model, f"{_first_line(exc)} (decoding with method {method})")


def _first_line(exc: BaseException) -> str:
    """`Type: first line of the message`: a kernel's compile error spans many lines."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
