"""The files of `make check`, the quick tier (marked `quick`; `make test` runs everything).

Chosen to touch every part in a few minutes on two cores: every module of the package loads
(test_every_module_loads.py), the import rules, the docs and lint hold, and one fast file
per room proves its behaviour: the speculative loop's losslessness, acceptance, the GDN
commit and the kernels interpreted against their references, the plan grammar and parsing,
the service's queue, the server, the ROS conversions and parameters. Left to `make test`:
compile proofs (test_compile, compiled forwards), the llama.cpp build, the soaks, colcon,
batching across engines, training.
"""

from __future__ import annotations

QUICK = (
    "test_every_module_loads.py", "test_imports.py", "test_docs.py", "test_lint.py",
    "engine/test_speculative.py", "engine/test_acceptance.py", "engine/test_window.py",
    "engine/test_traffic.py", "engine/test_step_checkpoints.py", "engine/test_generate.py",
    "engine/test_constraint.py", "engine/test_mtp.py", "engine/test_dflash.py",
    "engine/test_quantized_weights.py",
    "kernels/test_kernels.py", "kernels/test_gdn_reference.py", "kernels/test_gdn_chunked.py",
    "kernels/test_vendor_gemm.py",
    "planning/test_parse.py", "planning/test_skills.py", "planning/test_steps.py",
    "planning/test_request_prompt.py", "planning/test_plan_grammar.py",
    "planning/test_bindings.py", "planning/test_gate.py",
    "planning/test_service.py", "server/test_serve.py", "test_cli.py",
    "ros/test_ros_convert.py", "ros/test_ros_params.py", "ros/test_ros_diagnostics.py",
    "ros/test_node_requests.py",
)


def is_quick(item) -> bool:
    return item.nodeid.split("::", 1)[0].removeprefix("test/") in QUICK
