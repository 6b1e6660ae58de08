"""ROS-free planning: prompts, plan parsing and validation, the request queue."""
