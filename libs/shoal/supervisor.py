"""Supervised child processes for ``shoal up`` and the demo.

Each child is started with ``PR_SET_PDEATHSIG`` (it dies with us, even on
``kill -9``), restarted with backoff when it exits unexpectedly (up to
``max_restarts``), and stopped with SIGTERM then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Mapping, Sequence

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
        self.task: asyncio.Task[None] | None = None


class Supervisor:
    """Start, watch and stop a set of child processes."""

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        *,
        base_env: Mapping[str, str] | None = None,
        max_restarts: int = 5,
        stdout: int | None = None,
        stderr: int | None = None,
    ) -> None:
        self.children = {s.name: Child(s) for s in specs}
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.max_restarts = max_restarts
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
            if child.restarts >= self.max_restarts:
                log.error("child_gave_up", name=child.spec.name, returncode=code, restarts=child.restarts)
                return
            child.restarts += 1
            delay = min(5.0, 0.2 * 2**child.restarts)
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
