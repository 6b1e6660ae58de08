"""The image topic (`planner.image_topic`): its latest frame, attached to every request.

A robot's camera publishes far more often than it asks for plans, so the node keeps only
the newest `sensor_msgs/Image` (sensor-data QoS: best effort, depth 1) and attaches it when a
request is submitted, after the goal's own images, with its age. A frame older than
`planner.image_max_age_s`, or none yet, refuses the request with the reason: a plan about a
scene the camera no longer shows is worse than none. The age is the node's clock minus the
frame's header stamp (its receive time where the stamp is zero); it goes to the result's
telemetry (`image_age_ms`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from ..planning.images import ImageSource
from ..planning.request import PlanRequest, RequestError
from . import convert


class LatestFrame:
    def __init__(self, node, topic: str, max_age_s: float):
        from rclpy.qos import qos_profile_sensor_data
        from sensor_msgs.msg import Image

        self._node, self.topic, self.max_age_s = node, topic, max_age_s
        self._lock = threading.Lock()
        self._frame = None
        self._received = 0.0          # time.monotonic() when the frame arrived
        self._sub = node.create_subscription(Image, topic, self._on_frame,
                                             qos_profile_sensor_data)

    def _on_frame(self, msg) -> None:
        with self._lock:
            self._frame, self._received = msg, time.monotonic()

    def _age_s(self, msg, received: float) -> float:
        stamp = msg.header.stamp
        if stamp.sec == 0 and stamp.nanosec == 0:
            return time.monotonic() - received
        now = self._node.get_clock().now().nanoseconds
        return max(0.0, (now - (stamp.sec * 10**9 + stamp.nanosec)) / 1e9)

    def attach(self, request: PlanRequest) -> PlanRequest:
        """`request` with the latest frame after its own images, or RequestError (no frame
        yet, too old, or not a readable image)."""
        with self._lock:
            msg, received = self._frame, self._received
        where = f"the image topic {self.topic}"
        if msg is None:
            raise RequestError(f"no frame received yet on {where} (planner.image_topic)",
                               "image_topic")
        age = self._age_s(msg, received)
        if self.max_age_s and age > self.max_age_s:
            raise RequestError(f"the latest frame on {where} is {age:.2f} s old, the limit is "
                               f"{self.max_age_s} s (planner.image_max_age_s)", "image_topic")
        source = ImageSource(convert.image_pixels(msg, f"{self.topic} frame"),
                             f"{self.topic} frame", age_ms=age * 1000.0)
        return replace(request, images=tuple(request.images) + (source,))

    def close(self) -> None:
        self._node.destroy_subscription(self._sub)
