"""flash_planner: an on-robot task planner with DFlash speculative decoding.

Importing the package pulls in neither rclpy nor TensorRT; those load lazily inside the
modules that need them.
"""

__version__ = "0.1.0"
