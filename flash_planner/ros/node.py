"""Entry point of ``planner_node``: the ``flash_planner`` lifecycle node.

configure: parameters -> configs, load the engine and skill catalog, build the planner
service, warm up. activate: ``~/task``, ``~/plan`` (topic and action), ``~/telemetry``, start
the service. deactivate undoes activate; cleanup frees the model. /diagnostics is published
in every state, so a failed model load reads as ERROR. rclpy is imported inside
`planner_node_class` and `main` only: this module imports without ROS 2.
"""

from __future__ import annotations

import gc
import os
import sys
import time

NODE_NAME = "flash_planner"
MISSING_ROS = ("planner_node needs ROS 2 (rclpy), which is not importable here: "
               "source /opt/ros/jazzy/setup.bash (or your ROS 2 distro) and retry.")
WARM_UP_PROMPT = [{"role": "user", "content": "Say OK."}]


def warm_up(engine) -> float:
    """One short generation so the first request pays no first-call costs; returns ms."""
    from ..engine.generate import GenerationSettings, generate

    t0 = time.perf_counter()
    generate(engine, WARM_UP_PROMPT, GenerationSettings(max_new_tokens=4, enable_thinking=False))
    return (time.perf_counter() - t0) * 1000.0


def free_memory() -> None:
    """Return freed model memory to the system (and the CUDA caching allocator)."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def planner_node_class():
    """The lifecycle node class; defined on call so that rclpy is needed only then."""
    from diagnostic_updater import Updater
    from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
    from rclpy.lifecycle import Node, TransitionCallbackReturn

    from . import convert, params
    from .action_server import PlanActionServer
    from .diagnostics import Budgets, LatencyWindow, node_status
    from .topics import PlanTopics

    ok, failure = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE

    class PlannerNode(Node):
        """Task in, JSON plan out: the ROS side of `PlannerService`, nothing more."""

        def __init__(self, **kwargs):
            super().__init__(NODE_NAME, **kwargs)
            self._param_errors = params.declare(self)
            self._engine = self._planner = self._window = None
            self._topics = self._action = None
            self._phase, self._load_error = "unconfigured", ""
            self._updater = Updater(self, period=self.get_parameter("diagnostics.period_s").value)
            self._updater.setHardwareID(NODE_NAME)
            self._updater.add("planner", self._diagnose)
            self._autostart_timer = None
            if self.get_parameter("autostart").value:
                self._autostart_timer = self.create_timer(
                    0.1, self._autostart, callback_group=MutuallyExclusiveCallbackGroup())

        def _autostart(self) -> None:
            """One shot: configure, then activate if configure succeeded."""
            self._autostart_timer.cancel()
            if self.trigger_configure() == ok:
                self.trigger_activate()

        def on_configure(self, state):
            self._phase = "configuring"
            try:
                self._load()
            except Exception as exc:  # bad parameter, missing model, out of memory, ...
                self._release()
                self._load_error = convert.error_line(exc)
                self.get_logger().error(f"configure failed: {self._load_error}")
                return failure
            return ok

        def _load(self) -> None:
            from ..engine.engine import Engine
            from ..planning.service import PlannerService
            from ..planning.skills import SkillCatalog

            if self._param_errors:
                raise ValueError("; ".join(self._param_errors))
            values = params.read(self)
            engine_config, planner_config, skills_path = params.build_configs(values)
            catalog = SkillCatalog.from_yaml(skills_path)  # before the model: fail fast
            self._engine = Engine.load(engine_config)
            warm_ms = warm_up(self._engine)
            self._planner = PlannerService(self._engine, catalog, planner_config)
            self._planner.on_result = self._on_result
            self._window = LatencyWindow(values["diagnostics.window"])
            self._phase, self._load_error = "inactive", ""
            self.get_logger().info(
                f"loaded {engine_config.model_path} on {self._engine.device} "
                f"({self._engine.dtype}): {self._engine.memory}; warm-up {warm_ms:.0f} ms")

        def on_activate(self, state):
            values = params.read(self)
            depths = {k: values[f"qos.{k}_depth"] for k in ("plan", "task", "telemetry")}
            self._planner.start()
            self._topics = PlanTopics(self, self._planner, depths, self._on_result)
            action_name = f"{self.get_fully_qualified_name()}/plan"
            self._action = PlanActionServer(self, self._planner, action_name)
            self._phase = "active"
            self.get_logger().info(f"flash_planner active: ~/task, {action_name} (topic and "
                                   "action), ~/telemetry")
            return ok

        def on_deactivate(self, state):
            self._deactivate()
            self._phase = "inactive"
            return ok

        def on_cleanup(self, state):
            self._release()
            return ok

        def on_shutdown(self, state):
            self._deactivate()
            self._release()
            return ok

        def on_error(self, state):
            self.get_logger().error(f"error while {self._phase}; releasing the model")
            return self.on_shutdown(state)

        def _deactivate(self) -> None:
            """Stop the service (ends every goal), then drop the action server and topics."""
            self.stop_planner()
            if self._action is not None:
                self._action.close()
                self._action = None
            if self._topics is not None:
                self._topics.close()
                self._topics = None

        def _release(self) -> None:
            self._planner = self._engine = self._window = None
            self._phase = "unconfigured"
            free_memory()

        def stop_planner(self) -> None:
            """Stop the worker thread without ROS calls (safe after rclpy shut down)."""
            if self._planner is not None:
                self._planner.stop()

        def _on_result(self, result) -> None:
            """Every finished request (any thread): ~/plan, ~/telemetry, latency window."""
            topics, window = self._topics, self._window
            if topics is not None:
                topics.publish(result)
            if window is not None:
                window.add(result)

        def _diagnose(self, stat):
            budgets = Budgets(self.get_parameter("diagnostics.ttft_budget_ms").value,
                              self.get_parameter("diagnostics.latency_budget_ms").value)
            service = self._planner
            depth = service.queue_depth if service is not None else 0
            level, message, values = node_status(self._phase, self._load_error, self._window,
                                                 budgets, depth)
            stat.summary(bytes([level]), message)
            for key, value in values:
                stat.add(key, value)
            return stat

    return PlannerNode


def main(argv: list[str] | None = None) -> int:
    """Spin the node on a MultiThreadedExecutor; exit 2 with one line when ROS 2 is missing."""
    try:
        import rclpy
        from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
    except ImportError:
        print(MISSING_ROS, file=sys.stderr)
        sys.exit(2)

    rclpy.init(args=sys.argv if argv is None else argv)
    node = executor = None
    try:
        node = planner_node_class()()
        # Each waiting goal holds an executor thread: room for a full queue plus spares.
        threads = max(os.cpu_count() or 2, node.get_parameter("planner.queue_depth").value + 4)
        executor = MultiThreadedExecutor(num_threads=threads)
        executor.add_node(node)
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        if node is not None:
            node.stop_planner()
        if executor is not None:
            executor.shutdown()
        if node is not None:
            node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
