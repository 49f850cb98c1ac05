"""No silent task death (issue 21): a watched task that dies fails its process; a kept
loop is started again after a failure."""

from __future__ import annotations

import asyncio

from shoal import tasks
from shoal.runtime import EXIT_FAILED, run_service
from shoal.settings import Settings


def test_a_dead_critical_task_fails_the_service() -> None:
    async def serve(settings: Settings, stop: asyncio.Event) -> None:
        async def follower() -> None:
            await asyncio.sleep(0.01)
            raise RuntimeError("the log went away")

        tasks.critical(asyncio.create_task(follower(), name="follower"))
        await stop.wait()  # a service that would otherwise run on forever

    settings = Settings.load({}, state_dir="/nonexistent", drain_timeout_s=5.0)
    assert run_service(serve, settings, service_name="t") == EXIT_FAILED
    assert "follower" in tasks.died


async def test_a_cancelled_critical_task_is_no_death() -> None:
    deaths: list[str] = []
    remove = tasks.add_fail_hook(lambda name, exc: deaths.append(name))
    try:
        task = tasks.critical(asyncio.create_task(asyncio.sleep(10), name="sleeper"))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert deaths == []
    finally:
        remove()


async def test_keep_running_restarts_a_failing_loop() -> None:
    runs = 0
    stop = asyncio.Event()

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise ConnectionError("no server")
        stop.set()

    await asyncio.wait_for(
        tasks.keep_running(loop, name="beats", stop=stop, first_delay_s=0.01, max_delay_s=0.02), 5
    )
    assert runs == 3
