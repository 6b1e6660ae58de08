"""Publishing the node's health on ``/diagnostics`` (diagnostic_msgs/DiagnosticArray).

Our own small publisher instead of diagnostic_updater, which has no PyPI wheel: one timer,
one status named ``<node>: planner`` (diagnostic_updater's naming, so rqt_robot_monitor and
diagnostic_aggregator group it the same way), a hardware id, and the level, message and
key/values that `diagnostics.node_status` computes. rclpy and the message types are imported
when the publisher is built.
"""

from __future__ import annotations

from collections.abc import Callable

from .diagnostics import KeyValues

TOPIC = "/diagnostics"
StatusFn = Callable[[], tuple[int, str, KeyValues]]


def status_message(name: str, hardware_id: str, level: int, message: str,
                   values: KeyValues):
    """One DiagnosticStatus (level is 0/1/2 = OK/WARN/ERROR; it travels as a byte)."""
    from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

    return DiagnosticStatus(level=bytes([level]), name=name, message=message,
                            hardware_id=hardware_id,
                            values=[KeyValue(key=k, value=v) for k, v in values])


class DiagnosticsPublisher:
    """Publishes `status()` on /diagnostics every `period_s` seconds, in every node state."""

    def __init__(self, node, status: StatusFn, period_s: float, hardware_id: str):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

        self._node, self._status, self._array = node, status, DiagnosticArray
        self.name = f"{node.get_name()}: planner"
        self.hardware_id = hardware_id
        self._pub = node.create_publisher(DiagnosticArray, TOPIC, 10)
        self._timer = node.create_timer(period_s, self.publish,
                                        callback_group=MutuallyExclusiveCallbackGroup())

    def publish(self) -> None:
        """Publish the current status now (the timer calls this)."""
        level, message, values = self._status()
        msg = self._array(status=[status_message(self.name, self.hardware_id, level, message,
                                                 values)])
        msg.header.stamp = self._node.get_clock().now().to_msg()
        self._pub.publish(msg)

    def close(self) -> None:
        self._node.destroy_timer(self._timer)
        self._node.destroy_publisher(self._pub)
