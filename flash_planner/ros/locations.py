"""`~/locations` (std_msgs/String, latched): the location table replaced at run time, for
places perception finds. The message holds the table as a catalog's `locations` file does
(YAML or JSON: `NAME: {frame, x, y, yaw}`); a valid one replaces the whole table for every
request from then on (the plan grammar, the prompt's places and the safety gate follow it),
a bad one is logged naming what was wrong and the table stays as it was. A table that comes
before the model is loaded is applied when it is (the subscription is transient-local, so a
latched publisher's table reaches a node started after it).
"""

from __future__ import annotations

from collections.abc import Callable

from ..planning.bindings import BindingError, Location, locations_from_text
from ..planning.skills import CatalogError


class LocationTopic:
    """The subscription; `apply(table)` installs a parsed table (raises CatalogError when the
    catalog cannot take it); `latest` is the last valid table received."""

    def __init__(self, node, apply: Callable[[dict[str, Location]], bool]):
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
        from std_msgs.msg import String

        self._node, self._apply = node, apply
        self.latest: dict[str, Location] | None = None
        self.refused = 0     # tables refused so far
        qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self._sub = node.create_subscription(String, "~/locations", self._on_table, qos)

    def _on_table(self, msg) -> None:
        log = self._node.get_logger()
        try:
            table = locations_from_text(msg.data, "~/locations")
            applied = self._apply(table)
        except (BindingError, CatalogError) as exc:
            self.refused += 1
            log.error(f"~/locations refused, the table stays as it was: {exc}")
            return
        self.latest = table
        log.info(f"~/locations: {len(table)} places ({', '.join(sorted(table))})"
                 + ("" if applied else "; applied when the model is loaded"))
