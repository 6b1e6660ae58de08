"""Entry point of the ``planner_node`` executable.

For now this is a placeholder: it starts a plain rclpy node named ``flash_planner`` that
says the planner service is not wired yet and spins. The lifecycle node with the ``~/plan``
action server and diagnostics replaces it in a later change. rclpy is imported lazily so
that this module (and ``flash_planner``) imports on machines without ROS 2.
"""

from __future__ import annotations

import sys

NODE_NAME = "flash_planner"


def main(argv: list[str] | None = None) -> int:
    """Run the placeholder node; exit 2 with one clear line when ROS 2 is missing."""
    try:
        import rclpy
        from rclpy.executors import ExternalShutdownException
    except ImportError:
        print(
            "planner_node needs ROS 2 (rclpy), which is not importable here: "
            "source /opt/ros/jazzy/setup.bash (or your ROS 2 distro) and retry.",
            file=sys.stderr,
        )
        sys.exit(2)

    args = sys.argv if argv is None else argv
    rclpy.init(args=args)
    node = rclpy.create_node(NODE_NAME)
    try:
        node.get_logger().info("flash_planner is running; the planner service is not wired yet.")
        rclpy.spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
