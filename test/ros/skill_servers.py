"""The robot's side in the execution tests: real rclpy action and service servers of the
test-only flash_planner_test_msgs types, each counting and keeping what it received.

`NavigateToPose` (/navigate_to_pose) is shaped like Nav2's: a PoseStamped goal, feedback with
distance_remaining. `Manipulate` (/manipulate) picks, places, opens and waits; `Speak`
(/speak) is a service. Each server's `script` says how its next goals end: "succeed",
"abort", "reject", "fail" (succeeds with success false), "hang" (runs until cancelled) or
"deaf" (runs, ignoring cancels, until `release()`; a service call answers only then).
Goals past the script's end succeed.
"""

from __future__ import annotations

import collections
import threading
import time

from flash_planner.ros.messages import to_fields

FEEDBACKS = 3   # feedback messages per goal before it ends


class ScriptedServer:
    """Shared by the servers: the script, what was received, what was cancelled."""

    def __init__(self):
        self.script: list[str] = []
        self.goals: list[dict] = []
        self.cancels = 0
        self.lock = threading.Lock()
        self.accepted: collections.deque[str] = collections.deque()  # ends of accepted goals

    def next(self, goal) -> str:
        with self.lock:
            self.goals.append(to_fields(goal))
            how = self.script.pop(0) if self.script else "succeed"
            if how != "reject":
                self.accepted.append(how)
            return how

    def end_of_next(self) -> str:
        """The scripted end of the goal that starts executing (goals run in order here)."""
        with self.lock:
            return self.accepted.popleft() if self.accepted else "succeed"


class SkillServers:
    """The three servers on one node; `speak` can be started late (a server that comes
    back)."""

    def __init__(self, context, speak: bool = True, feedbacks: int = FEEDBACKS,
                 pace_s: float = 0.02):
        """`feedbacks` messages per goal, `pace_s` apart (bench/ros_execute.py: none)."""
        import rclpy
        from flash_planner_test_msgs.action import Manipulate, NavigateToPose
        from rclpy.action import ActionServer, CancelResponse, GoalResponse
        from rclpy.callback_groups import ReentrantCallbackGroup

        self.node = rclpy.create_node("skill_servers", context=context)
        self._feedbacks, self._pace = feedbacks, pace_s
        self.nav, self.manip, self.speech = ScriptedServer(), ScriptedServer(), ScriptedServer()
        group = ReentrantCallbackGroup()

        def on_goal(server):
            def decide(goal):
                how = server.next(goal)
                return GoalResponse.REJECT if how == "reject" else GoalResponse.ACCEPT
            return decide

        def on_cancel(server):
            def accept(_handle):
                with server.lock:
                    server.cancels += 1
                return CancelResponse.ACCEPT
            return accept

        self._servers = [
            ActionServer(self.node, NavigateToPose, "/navigate_to_pose",
                         execute_callback=self._navigate, goal_callback=on_goal(self.nav),
                         cancel_callback=on_cancel(self.nav), callback_group=group),
            ActionServer(self.node, Manipulate, "/manipulate",
                         execute_callback=self._manipulate, goal_callback=on_goal(self.manip),
                         cancel_callback=on_cancel(self.manip), callback_group=group)]
        self._types = {"nav": NavigateToPose, "manip": Manipulate}
        self.released = threading.Event()   # ends every "deaf" goal
        self.deaf_answered = threading.Event()
        self._speak = None
        self._group = group
        if speak:
            self.start_speak()

    def start_speak(self) -> None:
        from flash_planner_test_msgs.srv import Speak

        self._speak = self.node.create_service(Speak, "/speak", self._on_speak,
                                               callback_group=self._group)

    def stop_speak(self) -> None:
        if self._speak is not None:
            self.node.destroy_service(self._speak)
            self._speak = None

    def _run(self, handle, how: str, feedback, result):
        """Feedback, then the scripted end."""
        for i in range(self._feedbacks):
            if handle.is_cancel_requested:
                handle.canceled()
                return result
            feedback(i)
            time.sleep(self._pace)
        while how == "hang":
            if handle.is_cancel_requested:
                handle.canceled()
                return result
            time.sleep(0.02)
        self.released.wait() if how == "deaf" else None
        try:
            if how == "abort":
                handle.abort()
            else:
                handle.succeed()
        except Exception:     # the server was destroyed under a deaf goal (a server's death)
            pass
        return result

    def _navigate(self, handle):
        kind = self._types["nav"]
        how = self.nav.end_of_next()
        result = kind.Result()
        if how == "abort":
            result.error_code, result.error_msg = 104, "no valid path to the goal"

        def feedback(i: int) -> None:
            fb = kind.Feedback()
            fb.current_pose = handle.request.pose
            fb.distance_remaining = float(self._feedbacks - i)
            handle.publish_feedback(fb)

        return self._run(handle, how, feedback, result)

    def _manipulate(self, handle):
        kind = self._types["manip"]
        how = self.manip.end_of_next()
        result = kind.Result(success=how not in ("abort", "fail"),
                             message={"abort": "the gripper slipped",
                                      "fail": "nothing there to grasp"}.get(how, "done"))

        def feedback(i: int) -> None:
            handle.publish_feedback(kind.Feedback(progress=(i + 1) / self._feedbacks))

        return self._run(handle, "succeed" if how == "fail" else how, feedback, result)

    def _on_speak(self, request, response):
        how = self.speech.next(request)
        if how == "deaf":
            self.released.wait()
            self.deaf_answered.set()     # the response goes out as this returns
        response.success = how != "fail"
        response.message = "said" if response.success else "the speaker is muted"
        return response

    def release(self) -> None:
        self.released.set()

    def stop_manipulate(self) -> None:
        """The manipulation server leaves the graph (as when its process exits)."""
        self._servers.pop(1).destroy()

    def close(self) -> None:
        self.released.set()
        for server in self._servers:
            server.destroy()
        self.stop_speak()
        self.node.destroy_node()


def main() -> None:
    """The servers alone, spun until SIGINT/SIGTERM (test_launch_execute.py starts them from
    a launch file)."""
    import signal

    import rclpy
    from rclpy.context import Context
    from rclpy.executors import MultiThreadedExecutor

    context = Context()
    rclpy.init(context=context)
    servers = SkillServers(context)
    executor = MultiThreadedExecutor(num_threads=4, context=context)
    executor.add_node(servers.node)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=executor.spin, daemon=True).start()
    print("skill servers up", flush=True)
    stop.wait()
    executor.shutdown(timeout_sec=2)
    servers.close()
    rclpy.shutdown(context=context)


if __name__ == "__main__":
    main()
