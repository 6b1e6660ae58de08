"""A planner served by the real app (server/app.py) on uvicorn in this process, for tests that
talk to it with real clients (the `openai` client, the MCP SDK's through `flash-planner mcp`)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import closing

from flash_planner.engine.engine import Engine, EngineConfig
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog
from flash_planner.server.app import ServerState, create_app

TIMEOUT = 300


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcess:
    """create_app's app on uvicorn in a thread of this process."""

    def __init__(self, model: str, drafter: str | None, name: str):
        import uvicorn

        engine = Engine.load(EngineConfig(model, drafter_path=drafter, device="cpu",
                                          dtype="fp32", max_context=1024))
        self.service = PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()),
                                      PlannerConfig(queue_depth=4))
        self.service.start()
        state = ServerState(model_name=name)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(
            create_app(state, lambda: self.service), host="127.0.0.1", port=self.port,
            log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"
        from openai import OpenAI

        self.client = OpenAI(base_url=self.url + "/v1", api_key="none", timeout=TIMEOUT,
                             max_retries=0)
        deadline = time.monotonic() + TIMEOUT
        while state.service is None:      # the app's load thread hands the service over
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
