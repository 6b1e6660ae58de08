"""The server awaits a request's result without a thread of its own: a thread per waiting
request (asyncio.to_thread) capped the requests in flight at the default executor's size
(cores + 4: 6 on two cores, under max_batch 8), and answers that were ready waited for a
thread while their clients sat idle."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from flash_planner.planning.request import PlanRequest, PlanResult
from flash_planner.planning.ticket import PlanTicket
from flash_planner.server.app import result_of

TIMEOUT = 30


def _result(ticket: PlanTicket) -> PlanResult:
    return PlanResult(ticket.id, ticket.request.task, success=True, plan=[])


def test_results_arrive_while_every_executor_thread_is_busy():
    """The loop's only executor thread is held: eight tickets resolved from another thread,
    in reverse order, all reach their awaiting coroutines, each its own result."""
    tickets = [PlanTicket(PlanRequest("wave", id=f"r{i}"), None) for i in range(8)]
    hold = threading.Event()

    async def main() -> list[PlanResult]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        held = loop.run_in_executor(None, hold.wait, TIMEOUT)
        waits = [result_of(t) for t in tickets]
        threading.Thread(target=lambda: [t.resolve(_result(t)) for t in reversed(tickets)]
                         ).start()
        try:
            return await asyncio.wait_for(asyncio.gather(*waits), TIMEOUT)
        finally:
            hold.set()
            await held

    results = asyncio.run(main())
    assert [r.request_id for r in results] == [t.id for t in tickets]


def test_done_callbacks_run_once_late_ones_at_once_and_a_broken_one_is_contained():
    ticket = PlanTicket(PlanRequest("wave", id="a"), None)
    seen = []
    ticket.add_done_callback(lambda r: 1 / 0)            # logged, the others still run
    ticket.add_done_callback(lambda r: seen.append(("early", r.request_id)))
    result = _result(ticket)
    ticket.resolve(result)
    ticket.add_done_callback(lambda r: seen.append(("late", r.request_id)))
    assert seen == [("early", "a"), ("late", "a")]
    assert ticket.result(0) is result
