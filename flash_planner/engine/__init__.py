"""ROS-free inference engine: checkpoints, models, caches, decoding."""
