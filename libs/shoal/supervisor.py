"""Supervised child processes for ``shoal up`` and the demo.

Each child is started with ``PR_SET_PDEATHSIG`` (it dies with us, even on
``kill -9``), restarted with backoff when it exits unexpectedly, and stopped with
SIGTERM then SIGKILL.

The restart budget is per time window: a child is restarted unless it already was
``max_restarts`` times within the last ``window_s`` seconds, so a process that
crashes once a day is restarted forever while a crash loop is given up. Giving up is
loud: ``child_gave_up`` is logged at error, the child is marked
(:attr:`Child.gave_up`) and the ``on_give_up`` callback runs (``shoal up`` prints it on
stderr and records it in ``up.json``). The backoff before a restart doubles with the
restarts in the window (0.2 s, 0.4 s … at most 5 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import structlog
from msgspec import Struct

log = structlog.get_logger("shoal.supervisor")


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)


class ProcessSpec(Struct, frozen=True, kw_only=True):
    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = {}
    restart: bool = True


class Child:
    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        """Restarts over the child's whole life."""
        self.recent: deque[float] = deque()
        """Monotonic times of the restarts within the supervisor's window."""
        self.gave_up = False
        self.task: asyncio.Task[None] | None = None


class Supervisor:
    """Start, watch and stop a set of child processes."""

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        *,
        base_env: Mapping[str, str] | None = None,
        max_restarts: int = 5,
        window_s: float = 60.0,
        on_give_up: Callable[[str, int], None] | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
    ) -> None:
        self.children = {s.name: Child(s) for s in specs}
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.on_give_up = on_give_up
        self.stdout = stdout
        self.stderr = stderr
        self._stopping = False

    async def _start(self, child: Child) -> None:
        env = {**self.base_env, **child.spec.env}
        child.proc = await asyncio.create_subprocess_exec(
            *child.spec.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self.stdout,
            stderr=self.stderr,
            env=env,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        log.info("child_started", name=child.spec.name, pid=child.proc.pid)

    async def _watch(self, child: Child) -> None:
        while True:
            assert child.proc is not None
            code = await child.proc.wait()
            if self._stopping or not child.spec.restart:
                return
            now = asyncio.get_running_loop().time()
            while child.recent and child.recent[0] <= now - self.window_s:
                child.recent.popleft()
            if len(child.recent) >= self.max_restarts:
                child.gave_up = True
                log.error(
                    "child_gave_up",
                    name=child.spec.name,
                    returncode=code,
                    restarts_in_window=len(child.recent),
                    window_s=self.window_s,
                    restarts=child.restarts,
                )
                if self.on_give_up is not None:
                    self.on_give_up(child.spec.name, code)
                return
            child.recent.append(now)
            child.restarts += 1
            delay = min(5.0, 0.2 * 2 ** (len(child.recent) - 1))  # 0.2 s, 0.4 s … 5 s
            log.warning("child_exited_restarting", name=child.spec.name, returncode=code, delay_s=delay)
            await asyncio.sleep(delay)
            await self._start(child)

    async def start(self) -> None:
        for child in self.children.values():
            await self._start(child)
            child.task = asyncio.create_task(self._watch(child))

    def pid(self, name: str) -> int | None:
        proc = self.children[name].proc
        return None if proc is None else proc.pid

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every child, wait, SIGKILL what is left."""
        self._stopping = True
        procs = [c.proc for c in self.children.values() if c.proc is not None and c.proc.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), timeout_s)
        except TimeoutError:
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await asyncio.gather(*(p.wait() for p in procs))
        for child in self.children.values():
            if child.task is not None:
                child.task.cancel()
        await asyncio.gather(*(c.task for c in self.children.values() if c.task), return_exceptions=True)

    async def __aenter__(self) -> Supervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
