"""Hot-path kernels of the speculative loop, each a Triton kernel beside its torch reference.

Imported as ``flash_planner.kernels`` (``flash_planner/kernels`` is a symlink to this folder).
This package imports only torch and triton.
"""
