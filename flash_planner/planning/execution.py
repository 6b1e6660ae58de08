"""Running a plan on the robot: each step's goal sent to the server its binding names, in
order, behind the safety gate, replanning when a step fails. ROS-free: the sending is a
`StepRunner`'s (ros/step_clients.py on the robot, any object with the same two methods in a
test), the planning a `Replanner`'s (the planner service), the approvals `Approvals`'.

The contract (docs/ros.md, "Running plans on the robot"):
- A plan is a tree (plan_tree.py): steps in order, retries and fallbacks among them, run with
  BehaviorTree.CPP's semantics; a failed step inside a retry or a fallback is no failed run
  while the structure can recover, and a plan given as BT XML (bt.py) runs the same way.
- Nothing is sent for a plan unless all of it passes the gate first (gate.py, `check_plan`:
  every step bound, every bound server on the graph, every goal filled, finite and inside the
  catalog's limits, workspace and location table). A replanned plan passes the gate again
  before it runs; a plan the gate refuses is replanned like a failed step (nothing of it was
  sent), with the refusal as the reason.
- A step with `approve: true` is sent only after an operator approves that plan's step; a
  denial or the approval timeout ends the run (an operator's "no" is not a failure to replan
  around).
- A step that is rejected, aborted, timed out (and its cancel confirmed by the server) or
  whose server was away when it was due ends that plan; the planner is asked again (the task,
  the steps done and the failed step with its reason: `prompt.progress_section`) at most
  `max_replans` times, and the new plan runs from there.
- A step whose end was never confirmed (a cancel the server did not confirm, a service call
  past its timeout, a server that left the graph while its goal ran) ends the run, never
  replanned: its work may still be running, and a new plan could send it again.
- Cancelling the run cancels the running step's goal and sends nothing after it; a cancel
  wins over an approval that arrives with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import plan_tree
from .bindings import Binding
from .bt import BtError, from_bt_xml
from .gate import GateError, check_plan
from .parse import PlanError, loads, validate_plan
from .prompt import progress_section
from .skills import SkillCatalog

# A step's terminal states besides "succeeded" (ExecutePlan.action's failed_state): the
# runner's, and the run's own (denied, gate, no_plan, canceled by the caller).
RUNNER_STATES = ("rejected", "aborted", "canceled", "timed_out", "unavailable", "unconfirmed")
# replanned while replans are left (a cancel is not; nor is a step whose end is unconfirmed)
REPLANNED = ("rejected", "aborted", "timed_out", "unavailable", "gate")
POLL_S = 0.05   # how often a wait looks at the cancel flag


@dataclass(frozen=True)
class StepOutcome:
    """How one sent step ended: `state` "succeeded" or one of RUNNER_STATES; `reason` a line
    naming the server and what it said; `result` the server's result message as fields."""

    state: str
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    # whether the goal is known to have ended on its server (or never started): False for a
    # server that left the graph while the goal ran, whose work may go on
    ended: bool = True

    @property
    def ok(self) -> bool:
        return self.state == "succeeded"

    @property
    def replannable(self) -> bool:
        return self.state in REPLANNED and self.ended


@dataclass(frozen=True)
class StepEvent:
    """One feedback message: a step's state change (ExecutePlan.action's feedback)."""

    plan_index: int
    step_index: int
    skill: str
    state: str   # planning, waiting_approval, sent, running, succeeded, failed, dry_run,
    #              replanning
    detail: str = ""
    message: Any = None   # the goal (sent, dry_run), the server's feedback (running), the
    #                       result (succeeded, failed)
    path: str = ""        # the step's node in the plan's tree (plan_tree.label; a flat
    #                       plan's: the index)


class StepRunner(Protocol):
    def available(self, binding: Binding) -> bool:
        """Whether the binding's server is on the graph now."""

    def run(self, binding: Binding, goal: dict[str, Any],
            on_feedback: Callable[[dict[str, Any]], None],
            cancelled: threading.Event) -> StepOutcome:
        """Send one goal (nothing when `cancelled` is already set) and wait (at most the
        binding's timeout) for its end; on `cancelled` cancel the goal on its server and
        return "canceled". A timeout whose cancel the server does not confirm is
        "unconfirmed"; a server gone from the graph while the goal runs "unavailable" with
        `ended` False."""


class Replanner(Protocol):
    def __call__(self, task: str, context: str, scene: tuple[str, ...], progress: str,
                 cancelled: threading.Event) -> list[dict[str, Any]]:
        """The validated steps of a plan for `task` (`progress`: the replan section, "" the
        first time), or PlanFailed with the planner's reason."""


class PlanFailed(RuntimeError):
    """The planner gave no plan (a refusal, an invalid answer, a full queue, ...)."""


@dataclass(frozen=True)
class ExecutionConfig:
    max_replans: int = 2
    approval_timeout_s: float = 60.0
    dry_run: bool = False


@dataclass
class ExecutionResult:
    success: bool = False
    steps_done: int = 0
    failed_step: int = -1
    failed_skill: str = ""
    failed_state: str = ""
    error: str = ""
    replans: int = 0
    plans: list[list[dict[str, Any]]] = field(default_factory=list)

    def succeed(self) -> ExecutionResult:
        """Done: a failure a replan recovered from is not the run's (`replans` counts it)."""
        self.success, self.failed_step, self.failed_skill = True, -1, ""
        self.failed_state, self.error = "", ""
        return self

    def fail(self, step: int, skill: str, state: str, error: str) -> ExecutionResult:
        self.success, self.failed_step, self.failed_skill = False, step, skill
        self.failed_state, self.error = state, error
        return self


class Approvals:
    """Steps waiting for an operator (thread-safe): the run waits, `answer` decides. A step
    is named by its execution, its plan (0, then 1 after the first replan, ...) and its index
    in that plan, so that an answer meant for one plan's step never lands on another's."""

    def __init__(self):
        self._cond = threading.Condition()
        self._waiting: dict[tuple[str, int, int], str] = {}  # (execution, plan, step) -> skill
        self._answers: dict[tuple[str, int, int], bool] = {}

    def wait(self, execution_id: str, step: int, skill: str, timeout_s: float,
             cancelled: threading.Event, plan_index: int = 0) -> str:
        """"approved", "denied", "timed_out" or "canceled" (a cancel wins over an approval
        that came with it)."""
        key = (execution_id, plan_index, step)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._waiting[key] = skill
            try:
                while key not in self._answers:
                    left = deadline - time.monotonic()
                    if cancelled.is_set():
                        return "canceled"
                    if left <= 0:
                        return "timed_out"
                    self._cond.wait(min(left, POLL_S))
                if cancelled.is_set():
                    return "canceled"
                return "approved" if self._answers.pop(key) else "denied"
            finally:
                self._waiting.pop(key, None)
                self._answers.pop(key, None)

    def answer(self, execution_id: str, step: int, approve: bool, plan_index: int = 0
               ) -> tuple[bool, str]:
        """(accepted, message): whether that plan's step of that execution waits for this
        answer; the message names what waits when it does not."""
        with self._cond:
            if not execution_id:   # the one waiting, when only one execution waits
                ids = {e for e, _, _ in self._waiting}
                if len(ids) == 1:
                    execution_id = ids.pop()
            key = (execution_id, plan_index, step)
            if key not in self._waiting:
                waiting = ", ".join(f"{e} plan {p} step {s} ({k})"
                                    for (e, p, s), k in self._waiting.items())
                return False, (f"no step {step} of plan {plan_index} of execution "
                               f"{execution_id or '(any)'} waits for approval (waiting: "
                               f"{waiting or 'none'})")
            self._answers[key] = approve
            self._cond.notify_all()
            return True, (f"plan {plan_index} step {step} ({self._waiting[key]}) of execution "
                          f"{execution_id} {'approved' if approve else 'denied'}")

    def waiting(self) -> list[tuple[str, int, int, str]]:
        """(execution, plan, step, skill) of each step that waits."""
        with self._cond:
            return [(e, p, s, k) for (e, p, s), k in self._waiting.items()]


def steps_of(plan_json: str, catalog: SkillCatalog) -> list[dict[str, Any]]:
    """The validated plan of a plan given as JSON ({"plan": [...]} or the list of nodes,
    retries and fallbacks among them) or as a BehaviorTree.CPP v4 XML tree (bt.py: its
    leaves the catalog's skills); PlanError names what is wrong."""
    if plan_json.lstrip().startswith("<"):
        try:
            obj: Any = from_bt_xml(plan_json, catalog)
        except BtError as exc:
            raise PlanError(f"plan_json is not a tree we run: {exc}") from None
    else:
        try:
            obj = loads(plan_json)
        except ValueError as exc:
            raise PlanError(f"plan_json is not valid JSON: {exc}") from None
    return validate_plan({"plan": obj} if isinstance(obj, list) else obj, catalog)


class Execution:
    """One run of a task (or a given plan) on the robot; `run` in one thread, `cancel` from
    any other."""

    def __init__(self, execution_id: str, catalog: SkillCatalog, runner: StepRunner,
                 replanner: Replanner, approvals: Approvals, config: ExecutionConfig,
                 on_event: Callable[[StepEvent], None] = lambda e: None,
                 on_dry_run: Callable[[dict[str, Any]], None] = lambda g: None):
        self.id, self.catalog, self.runner = execution_id, catalog, runner
        self.replanner, self.approvals, self.config = replanner, approvals, config
        self.on_event, self.on_dry_run = on_event, on_dry_run
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def run(self, task: str = "", context: str = "", scene: tuple[str, ...] = (),
            steps: list[dict[str, Any]] | None = None) -> ExecutionResult:
        """Run `steps` (a plan given as is) or plan `task` first, then run it."""
        out = ExecutionResult()
        done: list[dict[str, Any]] = []
        progress = ""
        while True:
            plan_index = len(out.plans)
            if steps is None:
                self.on_event(StepEvent(plan_index, -1, "", "planning" if not progress
                                        else "replanning", task))
                try:
                    steps = self.replanner(task, context, scene, progress, self.cancelled)
                except PlanFailed as exc:
                    return out.fail(-1, "", "no_plan", f"no plan: {exc}")
            out.plans.append(steps)
            if self.cancelled.is_set():
                return out.fail(-1, "", "canceled", "the execution was cancelled")
            tree = plan_tree.tree_of(steps)     # validated: the planner's or steps_of's
            leaves = plan_tree.leaves(tree)
            c = self.catalog
            try:
                goals, away = check_plan(steps, c.bindings, c.locations, c.workspace,
                                         self.runner.available, self.config.dry_run)
            except GateError as exc:
                index, outcome = exc.step, StepOutcome(
                    "gate", f"refused by the safety gate, nothing sent: {exc}")
                out.fail(index, exc.skill, "gate", outcome.reason)
            else:
                if self.config.dry_run:
                    self._dry_run(plan_index, leaves, goals, away)
                    return out.succeed()
                failed = self._run_plan(plan_index, tree, goals, out, done)
                if failed is None:
                    return out.succeed()
                index, outcome = failed
                skill = leaves[index].step["skill"]
                out.fail(index, skill, outcome.state, f"step {index}"
                         f"{plan_tree.at_node(leaves[index].path)} ({skill}) "
                         f"{outcome.state}: {outcome.reason}")
            if not outcome.replannable or out.replans >= self.config.max_replans \
                    or self.cancelled.is_set() or not task:
                if outcome.replannable and not task and outcome.state != "gate":
                    out.error += " (a plan given as is, without a task, is not replanned)"
                return out
            out.replans += 1
            progress = progress_section(done, leaves[index].step, f"{outcome.state}: "
                                        f"{outcome.reason}")
            steps = None

    def _dry_run(self, plan_index: int, leaves: list[plan_tree.Leaf], goals,
                  away: dict[int, str]) -> None:
        """Each goal as it would be sent, and which servers are away now (a dry run does
        not refuse them: it says so); every step of a tree, in written order."""
        for leaf in leaves:
            i, step, goal = leaf.index, leaf.step, goals[leaf.index]
            binding = self.catalog.bindings[step["skill"]]
            record = {"execution_id": self.id, "plan_index": plan_index, "step_index": i,
                      "step_path": plan_tree.label(leaf.path), "skill": step["skill"],
                      "kind": binding.kind, "type": binding.type, "server": binding.server,
                      "server_available": i not in away, "goal": goal}
            self.on_dry_run(record)
            note = f"; {away[i]} now" if i in away else ""
            self.on_event(StepEvent(plan_index, i, step["skill"], "dry_run",
                                    f"would send to {binding.server} (dry run{note})", goal,
                                    plan_tree.label(leaf.path)))

    def _run_plan(self, plan_index: int, tree: plan_tree.Sequence, goals,
                  out: ExecutionResult, done: list[dict[str, Any]]
                  ) -> tuple[int, StepOutcome] | None:
        """Run the plan's tree (plan_tree.run: steps in order; a retry or a fallback goes on
        past a failed step inside it); the index and outcome of the step whose failure
        failed the plan, or None. A failure no structure may recover from (a cancel, a
        denial, an end the runner could not confirm) stops the whole run at once."""
        failures: list[tuple[int, StepOutcome]] = []

        def run_leaf(leaf: plan_tree.Leaf) -> bool:
            outcome = self._run_step(plan_index, leaf, goals[leaf.index])
            if outcome.ok:
                out.steps_done += 1
                done.append(leaf.step)
                return True
            failures.append((leaf.index, outcome))
            if not outcome.replannable:
                raise _Stopped
            return False

        try:
            if plan_tree.run(tree, run_leaf):
                return None
        except _Stopped:
            pass
        if failures:
            return failures[-1]
        last = plan_tree.leaves(tree)[-1]   # an inverted success failed the tree
        return last.index, StepOutcome("aborted", "the plan's tree failed: a step under "
                                       "an invert succeeded")

    def _run_step(self, plan_index: int, leaf: plan_tree.Leaf, goal) -> StepOutcome:
        """One step: its approval where the binding asks, its goal sent, its end."""
        i, skill, path = leaf.index, leaf.step["skill"], plan_tree.label(leaf.path)
        binding = self.catalog.bindings[skill]

        def event(state: str, detail: str, message: Any = None) -> None:
            self.on_event(StepEvent(plan_index, i, skill, state, detail, message, path))

        if self.cancelled.is_set():
            return StepOutcome("canceled", "the execution was cancelled; nothing sent")
        if binding.approve:
            event("waiting_approval", f"execution {self.id} plan {plan_index} step {i}: "
                  f"call ~/approve (timeout {self.config.approval_timeout_s:g} s)", goal)
            answer = self.approvals.wait(self.id, i, skill, self.config.approval_timeout_s,
                                         self.cancelled, plan_index)
            if answer != "approved":
                why = {"denied": "the operator denied it; nothing sent",
                       "timed_out": f"no approval within "
                                    f"{self.config.approval_timeout_s:g} s (refused); "
                                    "nothing sent",
                       "canceled": "the execution was cancelled; nothing sent"}[answer]
                return StepOutcome("denied" if answer != "canceled" else "canceled", why)
        if self.cancelled.is_set():    # cancelled while the operator answered
            return StepOutcome("canceled", "the execution was cancelled; nothing sent")
        event("sent", f"{binding.kind} {binding.server}", goal)
        outcome = self.runner.run(binding, goal,
                                  lambda fb: event("running", binding.server, fb),
                                  self.cancelled)
        event("succeeded" if outcome.ok else "failed", outcome.reason, outcome.result)
        return outcome


class _Stopped(Exception):
    """A step's failure that ends the whole run, whatever structure it is in."""


def service_replanner(service) -> Replanner:
    """A Replanner on a planner service (`submit`, `cancel`): each plan a request of its own,
    cancelled with the execution."""
    from .request import PlanRequest  # the service's own request type; no engine import

    def plan(task: str, context: str, scene: tuple[str, ...], progress: str,
             cancelled: threading.Event) -> list[dict[str, Any]]:
        request = PlanRequest(task=task, context=context, scene=tuple(scene),
                              progress=progress)
        ticket = service.submit(request)
        done = threading.Event()
        ticket.add_done_callback(lambda _: done.set())   # woken at once, not by a poll
        while not done.wait(POLL_S):
            if cancelled.is_set():
                try:
                    service.cancel(request.id)
                except ValueError:   # it finished meanwhile
                    pass
                done.wait()
        result = ticket.result()
        if not result.success:
            raise PlanFailed(result.error)
        return result.plan

    return plan
