"""Entry point of ``planner_node``: the ``flash_planner`` lifecycle node.

Created: parameters, ``~/task``, ``~/plan`` (topic and action), ``~/telemetry``,
``~/skills`` (the catalog loaded, latched), ``~/execute`` (action), ``~/approve`` and
``~/cancel_execution`` (services), ``~/dry_run``, ``~/execution``, /diagnostics and the image
topic's subscription (``planner.image_topic``), which exist in every lifecycle state (a
request while not active is refused with the reason; a failed model load reads as ERROR on
/diagnostics). configure: parameters -> configs, load
the engine and skill catalog (its bindings checked against the installed interfaces, a client
made for each, their servers looked up on the graph every execution.check_period_s), build
the planner service, warm up.
activate: start serving. deactivate: stop serving (running and queued requests end with the
reason, a running execution is cancelled and waited for, bounded); cleanup frees the model and
the step clients; shutdown does both.
rclpy is imported inside `planner_node_class` and `main` only: this module imports without
ROS 2.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import threading
import time

NODE_NAME = "flash_planner"
MISSING_ROS = ("planner_node needs ROS 2 (rclpy), which is not importable here: "
               "source /opt/ros/jazzy/setup.bash (or your ROS 2 distro) and retry.")
SHUTDOWN_GRACE_S = 5.0  # longest wait for goals in flight (and the executor) at shutdown
RESULT_SEND_S = 0.3     # time left to the executor to send the last goal results
SPARE_THREADS = 4       # executor threads beside the goals': goal, cancel and result requests,
                        # ~/task, timers, lifecycle and parameter services
EXECUTION_THREADS = 2   # the one ~/execute goal (it holds its thread) and a refused second


def executor_threads(values: dict) -> int:
    """Threads the node's MultiThreadedExecutor needs for these parameter values.

    Every ~/plan goal in flight holds an executor thread while it waits for its result: up to
    the engine's max_batch decoding at once (`params.max_batch_bound`: known before configure
    resolves auto) and up to planner.queue_depth queued; the spares keep goal, cancel and
    result requests, ~/task, the timers and the services served meanwhile (a goal beyond that
    is refused by the planner at once, holding a spare only briefly).
    """
    from .params import max_batch_bound

    goals = max_batch_bound(values) + values["planner.queue_depth"]
    return max(os.cpu_count() or 2, goals + SPARE_THREADS + EXECUTION_THREADS)


def free_memory() -> None:
    """Return freed model memory to the system (and the CUDA caching allocator)."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def planner_node_class():
    """The lifecycle node class; defined on call so that rclpy is needed only then."""
    from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
    from rclpy.lifecycle import Node, TransitionCallbackReturn

    from ..planning.execution import ExecutionConfig
    from ..planning.skills import CatalogError
    from ..planning.startup import StartupCancelled, StartupProgress
    from . import convert, params
    from .action_server import PlanActionServer
    from .camera import LatestFrame
    from .diagnostics import (
        BatchRate,
        Budgets,
        DiagnosticsPublisher,
        LatencyWindow,
        execution_values,
        load_values,
        node_status,
        remote_values,
    )
    from .execute_server import ExecuteActionServer, ExecutionSetup
    from .locations import LocationTopic
    from .skills_topic import SkillsTopic
    from .step_clients import RosStepRunner
    from .topics import PlanTopics

    ok, failure = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE

    class PlannerNode(Node):
        """Task in, JSON plan out: the ROS side of `PlannerService`, nothing more.

        The topics, the action server and /diagnostics exist in every state; requests are
        served only while active and are refused with the reason otherwise.
        """

        def __init__(self, **kwargs):
            super().__init__(NODE_NAME, **kwargs)
            self._param_errors = params.declare(self)
            self._planner = self._window = None
            self._phase, self._load_error, self._model = "unconfigured", "", ""
            self._compiled = ""
            self._startup: StartupProgress | None = None   # set while configuring
            self._rate = BatchRate()
            values = params.read(self)
            depths = {k: values[f"qos.{k}_depth"] for k in ("plan", "task", "telemetry")}
            self._diagnostics = DiagnosticsPublisher(
                self, self._diagnose, values["diagnostics.period_s"],
                values["diagnostics.hardware_id"] or socket.gethostname())
            self._camera = (LatestFrame(self, values["planner.image_topic"],
                                        values["planner.image_max_age_s"])
                            if values["planner.image_topic"] else None)
            self._topics = PlanTopics(self, self._service, depths, self._on_result,
                                      self._with_frame, self._execute_task)
            self._action = PlanActionServer(
                self, self._service, f"{self.get_fully_qualified_name()}/plan",
                values["planner.feedback_period_ms"] / 1000.0, self._with_frame)
            self._execute = ExecuteActionServer(
                self, self._execution_setup, f"{self.get_fully_qualified_name()}/execute",
                values["planner.feedback_period_ms"] / 1000.0)
            self._locations = LocationTopic(self, self._set_locations)
            self._skills = SkillsTopic(self)
            self._runner = self._server_check = None
            self._execution = ExecutionConfig()
            self._autostart_timer = None
            if values["autostart"]:
                self._autostart_timer = self.create_timer(
                    0.1, self._autostart, callback_group=MutuallyExclusiveCallbackGroup())

        def _autostart(self) -> None:
            """One shot: configure, then activate if configure succeeded."""
            self._autostart_timer.cancel()
            if self.trigger_configure() == ok:
                self.trigger_activate()

        def _service(self):
            """The planner service while active; `convert.NotServing` with the reason else."""
            planner = self._planner
            if self._phase != "active" or planner is None:
                raise convert.NotServing(convert.not_serving_reason(
                    self._phase, self.get_fully_qualified_name()))
            return planner

        def _with_frame(self, request):
            """`request` with the image topic's latest frame (RequestError: none usable)."""
            return request if self._camera is None else self._camera.attach(request)

        def on_configure(self, state):
            self._startup = StartupProgress(self.get_logger().info)
            self._phase = "configuring"
            try:
                self._load(self._startup)
            except StartupCancelled:
                self._release()
                self.get_logger().info("configure stopped: the node is shutting down")
                return failure
            except Exception as exc:  # bad parameter, missing model, failed warm-up, ...
                self._release()
                self._load_error = convert.error_line(exc)
                self.get_logger().error(f"configure failed: {self._load_error}")
                return failure
            finally:
                self._startup = None
            return ok

        def stop_startup(self, timeout: float) -> bool:
            """Cancel a configure in progress (its load stops at its next progress line)
            and wait, bounded, for it to end -> whether it did (or none was running)."""
            startup = self._startup
            if startup is not None:
                startup.cancel()
            deadline = time.monotonic() + timeout
            while self._phase == "configuring" and time.monotonic() < deadline:
                time.sleep(0.05)
            return self._phase != "configuring"

        def _load(self, startup: StartupProgress) -> None:
            from ..planning.service import PlannerService
            from ..planning.skills import SkillCatalog
            from .binding_types import check_types, typed

            if self._param_errors:
                raise ValueError("; ".join(self._param_errors))
            values = params.read(self)
            engine_config, planner_config, skills_path = params.build_configs(values)
            catalog = SkillCatalog.from_yaml(skills_path)  # before the model: fail fast
            # its bindings against the installed interfaces, then their field types (the gate
            # finds poses by them)
            catalog = typed(catalog, check_types(catalog))
            self._skills.publish(catalog)
            self._planner = PlannerService.load(engine_config, catalog, planner_config,
                                                progress=startup)
            if self._locations.latest is not None:    # sent on ~/locations before the load
                try:
                    self._planner.set_locations(self._locations.latest)
                except CatalogError as exc:
                    self.get_logger().error(f"~/locations not applied: {exc}")
            self._execution = ExecutionConfig(values["execution.max_replans"],
                                              values["execution.approval_timeout_s"],
                                              values["execution.dry_run"])
            if catalog.bindings and values["execution.enabled"]:
                self._runner = RosStepRunner(self, catalog.bindings,
                                             values["execution.check_period_s"])
                self._runner.wait_discovered(catalog.bindings)
                self._check_servers()
                self._server_check = self.create_timer(
                    values["execution.check_period_s"], self._check_servers,
                    callback_group=MutuallyExclusiveCallbackGroup())
            startup.enter("warming up the planner")
            warm_ms = self._planner.warm_up()
            startup.check()
            self._planner.on_result = self._on_result
            self._window = LatencyWindow(values["diagnostics.window"])
            # measured from now: the first status after configure counts the first goals
            self._rate = BatchRate(self._planner.load_report()["tokens"])
            self._model = values["model.path"] or values["model.preset"]
            report = self._planner.engine.compile_report
            self._compiled = (f"yes: {' + '.join(report.parts)}, {report.graphs} graphs in "
                              f"{report.seconds:.1f} s ({report.backend})" if report
                              else "no (eager forwards)")
            self._phase, self._load_error = "inactive", ""
            self.get_logger().info(f"loaded {self._planner.summary()}; warm-up (prefix "
                                   f"prefill, whole blocks per proposer) {warm_ms:.0f} ms")

        def _set_locations(self, table) -> bool:
            """~/locations: the new table for every request from now on (False: no model
            is loaded yet; LocationTopic keeps it for the load)."""
            planner = self._planner
            if planner is None:
                return False
            planner.set_locations(table)
            return True

        def _check_servers(self) -> None:
            """Skills whose server is not on the graph leave the plan grammar until it is
            back (each change logged)."""
            planner, runner = self._planner, self._runner
            if planner is None or runner is None:
                return
            missing = runner.missing(planner.catalog.bindings)
            before = planner.unavailable
            if missing != before:
                for skill in sorted(set(missing) - set(before)):
                    self.get_logger().warning(f"skill {skill} unavailable: {missing[skill]}")
                for skill in sorted(set(before) - set(missing)):
                    self.get_logger().info(f"skill {skill} available again")
                planner.set_unavailable(missing)

        def _execute_task(self, request) -> bool:
            """execution.from_task_topic: a ~/task request is planned and executed (its
            result on ~/execution); False: planned only."""
            if not self.get_parameter("execution.from_task_topic").value:
                return False
            self._execute.run_task(request)
            return True

        def _execution_setup(self) -> ExecutionSetup:
            """What ~/execute needs, or convert.NotServing with the reason."""
            planner = self._service()
            if not self.get_parameter("execution.enabled").value:
                raise convert.NotServing("execution is disabled on this node "
                                         "(execution.enabled is false)")
            if self._runner is None:
                catalog = (self.get_parameter("planner.skills_file").value
                           or "(the installed config/skills.yaml)")
                raise convert.NotServing(
                    f"the skill catalog {catalog} binds no skill to an action or service: "
                    "there is nothing to execute (docs/ros.md, 'Running plans on the robot')")
            return ExecutionSetup(planner, planner.catalog, self._runner, self._execution)

        def on_activate(self, state):
            self._planner.start()
            self._phase = "active"
            self.get_logger().info(f"flash_planner active: ~/task, "
                                   f"{self.get_fully_qualified_name()}/plan (topic and "
                                   "action), ~/telemetry")
            return ok

        def on_deactivate(self, state):
            self._phase = "inactive"
            self.stop_planner("the planner node was deactivated")
            return ok

        def on_cleanup(self, state):
            self._release()
            return ok

        def on_shutdown(self, state):
            self.stop_planner("the planner node is shutting down")
            self._release()
            self._phase = "finalized"
            return ok

        def on_error(self, state):
            self.get_logger().error(f"error while {self._phase}; releasing the model")
            return self.on_shutdown(state)

        def _release(self) -> None:
            if self._server_check is not None:
                self.destroy_timer(self._server_check)
            if self._runner is not None:
                # an execution that outlived stop_planner's wait must not find its clients
                # destroyed under it (rclpy raises InvalidHandle in its thread)
                self._end_execution("the planner node released its step clients")
                self._runner.close()
            self._runner = self._server_check = None
            self._planner = self._window = None
            self._phase, self._model, self._compiled = "unconfigured", "", ""
            free_memory()

        @property
        def phase(self) -> str:
            """unconfigured, configuring, inactive, active or finalized."""
            return self._phase

        def stop_planner(self, reason: str = "the planner node is shutting down") -> None:
            """End every request with `reason`, cancel a running execution, stop the worker,
            then wait (bounded: SHUTDOWN_GRACE_S) for the execution to end (no ROS calls but
            a warning when that wait runs out)."""
            self._execute.cancel_running(reason)
            if self._planner is not None:   # also ends the request of an execution planning
                self._planner.stop(reason=reason)
            self._end_execution(reason)

        def _end_execution(self, reason: str) -> None:
            """Cancel a running execution and wait (bounded) for it: its step's cancel is
            sent and answered on the step clients, so they must outlive it. The executor
            keeps spinning meanwhile (its other threads complete the step's futures)."""
            self._execute.cancel_running(reason)
            if not self._execute.wait_idle(SHUTDOWN_GRACE_S):
                self.get_logger().warning(
                    f"the running execution did not end within {SHUTDOWN_GRACE_S:g} s of its "
                    "cancel; going on without it")

        def executor_threads(self) -> int:
            """Threads of a MultiThreadedExecutor that spins this node alone: its goals
            running and queued at once, plus spares (module function `executor_threads`)."""
            return executor_threads(params.read(self))

        def wait_goals_done(self, timeout: float) -> bool:
            """Wait (bounded) until no action goal is executing."""
            return self._execute.wait_idle(timeout) and self._action.wait_idle(timeout)

        def destroy_node(self):
            self.stop_planner()
            self._execute.close()
            self._action.close()
            self._topics.close()
            self._skills.close()
            if self._camera is not None:
                self._camera.close()
            self._diagnostics.close()
            super().destroy_node()

        def _on_result(self, result) -> None:
            """Every finished request (any thread): ~/plan, ~/telemetry, latency window."""
            self._topics.publish(result)
            window = self._window
            if window is not None:
                window.add(result)

        def _diagnose(self):
            budgets = Budgets(self.get_parameter("diagnostics.ttft_budget_ms").value,
                              self.get_parameter("diagnostics.latency_budget_ms").value)
            service, startup = self._planner, self._startup
            if startup is not None:           # configuring: loading, compiling, warming up
                return node_status("warming up", "", None, budgets, 0, self._model,
                                   startup=startup.values())
            if service is None:
                return node_status(self._phase, self._load_error, self._window, budgets, 0,
                                   self._model, self._compiled)
            backend = remote_values(service.config.backend,
                                    service.remote.health if service.remote else None)
            report = service.load_report()
            load = load_values(report, self._rate.update(report["tokens"]))
            current = self._execute.current
            execution = (execution_values(service.unavailable, current.id if current else "")
                         if self._runner is not None else ())
            return node_status(self._phase, self._load_error, self._window, budgets,
                               report["queued"], self._model, self._compiled, backend,
                               str(service.engine.threads), load, execution)

    return PlannerNode


def main(argv: list[str] | None = None) -> int:
    """Spin the node until SIGINT/SIGTERM, then end goals in flight before exiting.

    rclpy's own signal handler would shut the context down at once, so goals in flight could
    never send their result; here the signal only sets an event, and the shutdown runs in
    order: stop the planner (running and queued goals end ABORTED with the reason), let the
    executor send those results (bounded), then destroy the node and shut rclpy down.
    Exits 2 with one line when ROS 2 is missing.
    """
    try:
        import rclpy
        from rclpy.executors import MultiThreadedExecutor
        from rclpy.signals import SignalHandlerOptions
    except ImportError:
        print(MISSING_ROS, file=sys.stderr)
        sys.exit(2)

    rclpy.init(args=sys.argv if argv is None else argv,
               signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    node = planner_node_class()()
    # Each goal in flight holds an executor thread: room for max_batch running goals and a
    # full queue, plus spares.
    executor = MultiThreadedExecutor(num_threads=node.executor_threads())
    executor.add_node(node)
    spinner = threading.Thread(target=_spin, args=(executor, stop), name="ros-executor")
    spinner.start()
    while not stop.wait(0.2):  # a timed wait, so the signal handler runs promptly
        pass
    node.get_logger().info("shutting down: ending goals in flight")
    if not node.stop_startup(SHUTDOWN_GRACE_S):
        # a graph still compiling (minutes when cold) cannot be interrupted; nothing of
        # it is worth keeping but the cache entries, which are written whole or not at all
        node.get_logger().warning(f"the warm-up did not stop within {SHUTDOWN_GRACE_S:g} s "
                                  "(a graph still compiling); exiting without it")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if node.phase != "finalized":  # not already shut down through the lifecycle service
        _trigger_shutdown(node)
    if node.wait_goals_done(SHUTDOWN_GRACE_S):
        time.sleep(RESULT_SEND_S)  # the executor sends the goals' results meanwhile
    executor.shutdown(timeout_sec=SHUTDOWN_GRACE_S)
    spinner.join(SHUTDOWN_GRACE_S)
    node.destroy_node()
    if rclpy.ok():
        rclpy.shutdown()
    return 0


def _trigger_shutdown(node, tries: int = 20) -> None:
    """The lifecycle's shutdown; retried briefly while a transition that just returned (a
    configure ending as the signal came) is still being completed by rclpy, which refuses
    a shutdown from a transition state."""
    for attempt in range(tries):
        try:
            node.trigger_shutdown()
            return
        except Exception as exc:  # rclpy's RCLError: "Shutdown transition not possible"
            if attempt == tries - 1:
                node.get_logger().warning(f"lifecycle shutdown refused ({exc}); exiting")
                return
            time.sleep(0.1)


def _spin(executor, stop: threading.Event) -> None:
    from rclpy.executors import ExternalShutdownException

    try:
        executor.spin()
    except ExternalShutdownException:
        pass
    finally:
        stop.set()


if __name__ == "__main__":
    sys.exit(main())
