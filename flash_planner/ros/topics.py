"""The planner's topics: ``~/task`` in; ``~/plan`` (JSON) and ``~/telemetry`` out.

Built when the node is created and kept in every lifecycle state, so that a task sent while
the node is not active is answered on ``~/plan`` with the reason instead of vanishing.
``~/plan`` is reliable and transient local, so a late subscriber still gets the last plans.
Results are published from the planner service's worker thread, under a lock that `close`
takes before destroying the publishers. rclpy and the message types are imported when the
topics are built.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..planning.request import PlanRequest, PlanResult, RequestError
from . import convert


class PlanTopics:
    """Publishers and the subscription of the node; `service()` gives the serving planner."""

    def __init__(self, node, service: Callable, depths: dict[str, int],
                 on_result: Callable[[PlanResult], None],
                 with_frame: Callable[[PlanRequest], PlanRequest] = lambda r: r,
                 execute: Callable[[PlanRequest], bool] = lambda r: False):
        """`with_frame` adds the image topic's latest frame to a request (node.py);
        `execute` takes a request to plan and execute, or declines it (False: plan only)."""
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
        from std_msgs.msg import String

        from flash_planner_interfaces.msg import PlanTelemetry

        def qos(depth: int, **kw) -> QoSProfile:
            return QoSProfile(depth=depth, reliability=ReliabilityPolicy.RELIABLE, **kw)

        self._node, self._service, self._on_result = node, service, on_result
        self._with_frame, self._execute = with_frame, execute
        self._string, self._telemetry_type = String, PlanTelemetry
        self._lock = threading.Lock()
        self._plan = node.create_publisher(
            String, "~/plan", qos(depths["plan"], durability=DurabilityPolicy.TRANSIENT_LOCAL))
        self._telemetry = node.create_publisher(PlanTelemetry, "~/telemetry",
                                                qos(depths["telemetry"]))
        self._sub = node.create_subscription(String, "~/task", self._on_task,
                                             qos(depths["task"]))

    def _on_task(self, msg) -> None:
        """A task message: plain text or a JSON request; a refused one gets a failed result."""
        try:
            request = PlanRequest.from_text(msg.data)
            service = self._service()
            request = self._with_frame(request)
        except RequestError as exc:
            self._node.get_logger().warning(f"ignored a ~/task message: {exc}")
            self._on_result(convert.rejected_task(str(exc), msg.data))
            return
        except convert.NotServing as exc:
            self._node.get_logger().warning(f"refused a ~/task message: {exc}")
            self._on_result(convert.refused(str(exc), request.task, request.id))
            return
        if not self._execute(request):
            service.submit(request)  # the result comes back through the service's on_result

    def publish(self, result: PlanResult) -> None:
        """Publish one finished request on ~/plan and ~/telemetry (any thread)."""
        with self._lock:
            if self._plan is None:
                return
            self._plan.publish(self._string(data=convert.plan_topic_json(result)))
            msg = convert.fill(self._telemetry_type(),
                               convert.telemetry_fields(result.telemetry, result.finish_reason))
            msg.stamp = self._node.get_clock().now().to_msg()
            self._telemetry.publish(msg)

    def close(self) -> None:
        """Destroy the subscription and, once no publish is in flight, the publishers."""
        self._node.destroy_subscription(self._sub)
        with self._lock:
            plan, telemetry, self._plan, self._telemetry = self._plan, self._telemetry, None, None
        self._node.destroy_publisher(plan)
        self._node.destroy_publisher(telemetry)
