"""Clocks, injected wherever time is read, so emulation can run faster than real time.

Every process of one emulated installation shares the same ``origin`` and ``scale``:
virtual now = origin + (wall now − origin) × scale. Events are stamped with the
virtual time, so the log, the fold (attained service) and the policies all live in
the same (virtual) seconds as the simulator's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, virtual_s: float) -> None: ...


class WallClock:
    """Real time."""

    scale = 1.0

    def now(self) -> float:
        return time.time()

    async def sleep(self, virtual_s: float) -> None:
        await asyncio.sleep(max(0.0, virtual_s))


class ScaledClock:
    """Virtual time running ``scale`` times faster than the wall clock since ``origin``."""

    def __init__(self, scale: float, origin: float | None = None) -> None:
        if scale <= 0:
            raise ValueError(f"time scale must be positive, got {scale}")
        self.scale = scale
        self.origin = time.time() if origin is None else origin

    def now(self) -> float:
        return self.origin + (time.time() - self.origin) * self.scale

    def to_wall(self, virtual_s: float) -> float:
        """A virtual duration in wall seconds."""
        return virtual_s / self.scale

    async def sleep(self, virtual_s: float) -> None:
        await asyncio.sleep(max(0.0, virtual_s / self.scale))


def make_clock(scale: float = 1.0, origin: float | None = None) -> WallClock | ScaledClock:
    return WallClock() if scale == 1.0 and origin is None else ScaledClock(scale, origin)
