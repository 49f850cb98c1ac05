"""The supervisor's restart backoff and budget on real child processes."""

from __future__ import annotations

import asyncio
import sys

from shoal.supervisor import ProcessSpec, Supervisor
from structlog.testing import capture_logs


async def test_a_crashing_child_is_restarted_after_0_2_s_doubling_then_given_up() -> None:
    """docs/operations.md: the backoff starts at 0.2 s and doubles with each restart in
    the window; one crash past the budget and the child is given up, loudly."""
    gave_up: list[tuple[str, int]] = []
    spec = ProcessSpec(name="crasher", argv=(sys.executable, "-c", "raise SystemExit(3)"))
    supervisor = Supervisor(
        [spec], max_restarts=3, window_s=60.0, on_give_up=lambda n, c: gave_up.append((n, c))
    )
    with capture_logs() as logs:
        await supervisor.start()
        try:
            async with asyncio.timeout(30):
                while not gave_up:
                    await asyncio.sleep(0.05)
        finally:
            await supervisor.stop(timeout_s=5.0)
    delays = [e["delay_s"] for e in logs if e["event"] == "child_exited_restarting"]
    assert delays == [0.2, 0.4, 0.8]
    assert gave_up == [("crasher", 3)]
    assert supervisor.children["crasher"].gave_up
