"""Fixtures for the ROS adapter tests: checkpoints, and a stand-in for the ROS 2 Python API.

`fake_ros` installs minimal modules named rclpy, rclpy.lifecycle, rclpy.action, ...,
std_msgs, diagnostic_updater, rcl_interfaces and flash_planner_interfaces (for the test's
duration only), so that the node's own logic runs here without ROS. The message classes are
generated from the real .msg/.action files and check field names and types the way rosidl's
generated setters do. The fakes mirror the documented API surface the node uses; they are no
proof that real rclpy behaves the same (test_node_runtime.py is, where ROS 2 is installed).
"""

from __future__ import annotations

import enum
import sys
import threading
import types
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from flash_planner.ros.interface_spec import read_action, read_fields
from flash_planner.train.tiny import write_tiny_checkpoint

IFACE = Path(__file__).resolve().parents[2] / "flash_planner_interfaces"
INTS = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "byte"}
PY_TYPES = {"bool": bool, "string": str, "float32": float, "float64": float,
            **dict.fromkeys(INTS, int)}


def pytest_configure(config):
    """Register launch_testing's marker, so test_launch.py collects quietly without it."""
    config.addinivalue_line("markers", "launch_test: a launch_testing entry point")


@pytest.fixture(scope="session")
def endless_dir(tmp_path_factory):
    """A tiny checkpoint whose lm_head is zero: greedy decoding emits token 0 forever.

    Token 0 is <|endoftext|>, which is not an EOS id of the tiny model, so a request runs to
    max_new_tokens: a deterministic long-running request for cancellation tests.
    """
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("endless"))
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"].zero_()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


# ---- messages generated from the interface files
class FakeTime:
    __slots__ = ("sec", "nanosec")

    def __init__(self, sec: int = 0, nanosec: int = 0):
        self.sec, self.nanosec = sec, nanosec


def message_type(name: str, fields: list[tuple[str, str]], nested: dict[str, type]) -> type:
    """A message class with rosidl-like checked setters for `fields`."""
    names = tuple(n for _, n in fields)
    kinds = dict((n, t) for t, n in fields)

    def default(type_: str):
        if type_ in PY_TYPES:
            return PY_TYPES[type_]()
        return nested[type_]()

    def __init__(self, **kw):
        for field in names:
            object.__setattr__(self, field, default(kinds[field]))
        for key, value in kw.items():
            setattr(self, key, value)

    def __setattr__(self, key, value):
        if key not in names:
            raise AttributeError(f"{name} has no field {key!r}")
        type_ = kinds[key]
        want = PY_TYPES.get(type_) or nested[type_]
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float:
            ok = isinstance(value, float)
        assert ok, f"{name}.{key} ({type_}) set to {type(value).__name__} {value!r}"
        object.__setattr__(self, key, value)

    return type(name, (), {"__slots__": names, "__init__": __init__,
                           "__setattr__": __setattr__})


def interface_modules() -> dict[str, types.ModuleType]:
    """std_msgs.msg.String and flash_planner_interfaces' msg/action types."""
    nested: dict[str, type] = {"builtin_interfaces/Time": FakeTime}
    telemetry = message_type("PlanTelemetry", read_fields(IFACE / "msg/PlanTelemetry.msg"),
                             nested)
    nested["PlanTelemetry"] = telemetry
    sections = read_action(IFACE / "action/Plan.action")
    plan = type("Plan", (), {s.capitalize(): message_type(f"Plan_{s}", f, nested)
                             for s, f in sections.items()})
    string = message_type("String", [("string", "data")], nested)
    return {
        "std_msgs": types.ModuleType("std_msgs"),
        "std_msgs.msg": _module("std_msgs.msg", String=string),
        "flash_planner_interfaces": types.ModuleType("flash_planner_interfaces"),
        "flash_planner_interfaces.msg": _module("flash_planner_interfaces.msg",
                                                PlanTelemetry=telemetry),
        "flash_planner_interfaces.action": _module("flash_planner_interfaces.action",
                                                   Plan=plan),
    }


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


# ---- rclpy stand-ins
class Record:
    """Keyword arguments as attributes (QoSProfile, descriptors, ranges, ...)."""

    def __init__(self, *args, **kw):
        self.args = args
        self.__dict__.update(kw)


class Logger:
    def __init__(self):
        self.lines: list[tuple[str, str]] = []

    def _log(self, level: str, text: str) -> None:
        self.lines.append((level, text))

    def info(self, text):
        self._log("info", text)

    def warning(self, text):
        self._log("warning", text)

    def error(self, text):
        self._log("error", text)

    def debug(self, text):
        self._log("debug", text)


class Publisher:
    def __init__(self, msg_type, topic, qos):
        self.msg_type, self.topic, self.qos = msg_type, topic, qos
        self.messages: list = []
        self.destroyed = False
        self.event = threading.Event()

    def publish(self, msg):
        assert not self.destroyed, f"publish on destroyed publisher {self.topic}"
        assert isinstance(msg, self.msg_type)
        self.messages.append(msg)
        self.event.set()


class TransitionCallbackReturn(enum.Enum):
    SUCCESS = 0
    FAILURE = 1
    ERROR = 2


class LifecycleNode:
    """The slice of rclpy.lifecycle.Node the planner uses; transitions call the callbacks."""

    def __init__(self, node_name, *, parameter_overrides=(), **kw):
        self.name = node_name
        self.overrides = {p.name: p.value for p in parameter_overrides}
        self.params: dict[str, object] = {}
        self.descriptors: dict[str, object] = {}
        self.logger = Logger()
        self.timers, self.publishers, self.subscriptions = [], [], []

    def declare_parameter(self, name, value, descriptor=None, ignore_override=False):
        assert name not in self.params, f"parameter {name} declared twice"
        if name in self.overrides and not ignore_override:
            override = self.overrides[name]
            if type(override) is not type(value):
                raise TypeError(f"Trying to set parameter '{name}' to {override!r} of type "
                                f"{type(override).__name__}, expecting {type(value).__name__}")
            ranges = getattr(descriptor, "integer_range", None) or \
                getattr(descriptor, "floating_point_range", None)
            if ranges and not ranges[0].from_value <= override <= ranges[0].to_value:
                raise ValueError(f"Parameter {name} out of range")
            value = override
        self.params[name], self.descriptors[name] = value, descriptor
        return Record(name=name, value=value)

    def get_parameter(self, name):
        return Record(name=name, value=self.params[name])

    def get_logger(self):
        return self.logger

    def get_clock(self):
        return Record(now=lambda: Record(to_msg=lambda: FakeTime(1, 2)))

    def get_fully_qualified_name(self):
        return f"/{self.name}"

    def create_timer(self, period, callback, callback_group=None):
        timer = Record(period=period, callback=callback, cancelled=False)
        timer.cancel = lambda: setattr(timer, "cancelled", True)
        self.timers.append(timer)
        return timer

    def create_publisher(self, msg_type, topic, qos):
        pub = Publisher(msg_type, topic, qos)
        self.publishers.append(pub)
        return pub

    def destroy_publisher(self, pub):
        pub.destroyed = True

    def create_subscription(self, msg_type, topic, callback, qos):
        sub = Record(msg_type=msg_type, topic=topic, callback=callback, qos=qos,
                     destroyed=False)
        self.subscriptions.append(sub)
        return sub

    def destroy_subscription(self, sub):
        sub.destroyed = True

    def publisher(self, topic):
        """The latest live publisher on `topic` (test helper)."""
        return [p for p in self.publishers if p.topic == topic][-1]

    def trigger_configure(self):
        return self.on_configure(None)

    def trigger_activate(self):
        return self.on_activate(None)

    def trigger_deactivate(self):
        return self.on_deactivate(None)

    def trigger_cleanup(self):
        return self.on_cleanup(None)


class ActionServer:
    def __init__(self, node, action_type, name, execute_callback, *, callback_group=None,
                 goal_callback=None, handle_accepted_callback=None, cancel_callback=None):
        self.node, self.action_type, self.name = node, action_type, name
        self.execute_callback, self.goal_callback = execute_callback, goal_callback
        self.handle_accepted_callback, self.cancel_callback = (handle_accepted_callback,
                                                               cancel_callback)
        self.callback_group, self.destroyed = callback_group, False
        node.action_server = self

    def destroy(self):
        self.destroyed = True


class GoalHandle:
    """A ServerGoalHandle stand-in: request, goal_id, cancel flag, terminal state, feedback."""

    def __init__(self, action_type, goal, uuid=tuple(range(16))):
        self.action_type, self.request = action_type, goal
        self.goal_id = Record(uuid=list(uuid))
        self.cancel = threading.Event()
        self.state = "executing"
        self.feedback: list = []
        self.first_feedback = threading.Event()

    @property
    def is_cancel_requested(self):
        return self.cancel.is_set() and self.state == "executing"

    def execute(self):
        self.executed = True

    def publish_feedback(self, feedback):
        assert isinstance(feedback, self.action_type.Feedback)
        self.feedback.append(feedback)
        self.first_feedback.set()

    def _end(self, state):
        assert self.state == "executing", f"goal already {self.state}"
        self.state = state

    def succeed(self):
        self._end("succeeded")

    def abort(self):
        self._end("aborted")

    def canceled(self):
        self._end("canceled")


class Updater:
    def __init__(self, node, period=1.0):
        self.node, self.period, self.tasks, self.hwid = node, period, [], ""
        node.params.setdefault("diagnostic_updater.period", period)
        node.updater = self

    def add(self, name, fn):
        self.tasks.append((name, fn))

    def setHardwareID(self, hwid):  # noqa: N802 (diagnostic_updater's name)
        self.hwid = hwid

    def run(self):
        """Run every task once, as the updater's timer does; returns the statuses."""
        out = []
        for name, fn in self.tasks:
            stat = Status(name)
            out.append(fn(stat))
        return out


class Status:
    def __init__(self, name):
        self.name, self.level, self.message, self.values = name, b"\x02", "", []

    def summary(self, level, message):
        assert isinstance(level, bytes) and len(level) == 1, level
        self.level, self.message = level, str(message)

    def add(self, key, value):
        assert isinstance(key, str) and isinstance(value, str), (key, value)
        self.values.append((key, value))


def ros_modules() -> dict[str, types.ModuleType]:
    """Every module name the node, its action server and its topics import."""
    enums = {"GoalResponse": enum.Enum("GoalResponse", "REJECT ACCEPT"),
             "CancelResponse": enum.Enum("CancelResponse", "REJECT ACCEPT")}
    return {
        "rclpy": _module("rclpy"),
        "rclpy.lifecycle": _module("rclpy.lifecycle", Node=LifecycleNode,
                                   TransitionCallbackReturn=TransitionCallbackReturn),
        "rclpy.action": _module("rclpy.action", ActionServer=ActionServer, **enums),
        "rclpy.callback_groups": _module("rclpy.callback_groups",
                                         MutuallyExclusiveCallbackGroup=Record,
                                         ReentrantCallbackGroup=Record),
        "rclpy.qos": _module("rclpy.qos", QoSProfile=Record,
                             DurabilityPolicy=Record(TRANSIENT_LOCAL="transient_local"),
                             ReliabilityPolicy=Record(RELIABLE="reliable")),
        "rclpy.parameter": _module("rclpy.parameter", Parameter=Record),
        "rcl_interfaces": _module("rcl_interfaces"),
        "rcl_interfaces.msg": _module("rcl_interfaces.msg", ParameterDescriptor=Record,
                                      IntegerRange=Record, FloatingPointRange=Record),
        "diagnostic_updater": _module("diagnostic_updater", Updater=Updater),
        **interface_modules(),
    }


@pytest.fixture
def fake_ros(monkeypatch):
    """Install the stand-in modules for this test; returns them by name."""
    modules = ros_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(modules=modules, GoalHandle=GoalHandle,
                                 Plan=modules["flash_planner_interfaces.action"].Plan,
                                 String=modules["std_msgs.msg"].String,
                                 Parameter=lambda name, value: Record(name=name, value=value))
