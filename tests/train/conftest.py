"""Fixtures for the elastic-training tests: a controller over real worker processes.

Every test gets a unique job id; the ``leak_check`` fixture fails the test if any
process started with that job id (``SHOAL_TRAIN_JOB``) is still alive at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from shoal import events as ev  # noqa: E402
from shoal.events import GpuRef  # noqa: E402
from shoal.settings import Settings  # noqa: E402
from shoal.train.config import TrainConfig  # noqa: E402
from shoal.train.controller import Controller, OrderError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CNN = REPO / "examples" / "cnn_digits.py"
NODE = "n0"
_jobs = itertools.count(1)


def gpus(n: int, node: str = NODE) -> tuple[GpuRef, ...]:
    return tuple(GpuRef(node, i) for i in range(n))


def cpu_slots(count: int) -> Callable[[GpuRef], int]:
    def index(g: GpuRef) -> int:
        if g.node_id != NODE or not 0 <= g.index < count:
            raise OrderError(f"unknown GPU {g.node_id}/{g.index}: node {NODE} has slots 0..{count - 1}")
        return g.index

    return index


def processes_of(job_id: str) -> list[int]:
    """Live (non-zombie) processes whose environment names ``job_id``."""
    needle = f"SHOAL_TRAIN_JOB={job_id}\0".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read() + b"\0"
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            found.append(int(pid))
    return found


@pytest.fixture
def job_id() -> Iterator[str]:
    job = f"tj{os.getpid()}x{next(_jobs)}"
    yield job
    deadline = time.monotonic() + 10
    while processes_of(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = processes_of(job)
    assert not leaked, f"leaked worker processes {leaked}"


class Recorder:
    """Collects emitted events and lets a test wait for one."""

    def __init__(self) -> None:
        self.events: list[ev.Event] = []
        self.changed = asyncio.Event()

    async def __call__(self, event: ev.Event) -> None:
        self.events.append(event)
        self.changed.set()

    def of(self, cls: type) -> list:
        return [e for e in self.events if isinstance(e, cls)]

    async def wait_for(self, pred: Callable[[], object], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met in {timeout}s; events: {self.events[-8:]}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), 0.1)
            except TimeoutError:
                pass


async def wait_steps(ctl: Controller, steps: int, timeout: float = 60.0) -> int:
    """Until the job made ``steps`` more steps; returns the step reached."""
    start = ctl.progress.step if ctl.progress else 0
    deadline = time.monotonic() + timeout
    while ctl.progress is None or ctl.progress.step < start + steps:
        assert time.monotonic() < deadline, f"no progress beyond step {start} in {timeout}s"
        await asyncio.sleep(0.02)
    return ctl.progress.step


@pytest.fixture
async def make_controller(tmp_path: Path, job_id: str) -> AsyncIterator[Callable[..., Controller]]:
    made: list[Controller] = []

    def make(*, argv: list[str] | None = None, slots: int = 4, max_gpus: int = 4, **kw: object) -> Controller:
        train = kw.pop("train", None) or TrainConfig(collective_timeout_s=10, rendezvous_timeout_s=45)
        ctl = Controller(
            job_id=job_id,
            argv=argv or [sys.executable, str(CNN), "--max-steps", "1000000", "--float64"],
            workdir=tmp_path / "work",
            gpu_index=cpu_slots(slots),
            max_gpus=max_gpus,
            emit=kw.pop("emit", None) or Recorder(),
            train=train,
            report_every_s=0.2,
            **kw,  # type: ignore[arg-type]
        )
        made.append(ctl)
        return ctl

    yield make
    for ctl in made:
        await ctl.close(checkpoint=False)


def cnn_spec(steps: int, max_gpus: int) -> ev.JobSpec:
    """A job that trains the example CNN for ``steps`` steps on up to ``max_gpus`` workers."""
    return ev.JobSpec(
        user="u",
        max_gpus=max_gpus,
        requested_gpus=max_gpus,
        total_iterations=steps,
        entrypoint=(sys.executable, str(CNN), "--max-steps", str(steps)),
    )


def order(job_id: str, epoch: int, n: int) -> ev.Reconfigure:
    return ev.Reconfigure(job_id=job_id, epoch=epoch, gpus=gpus(n))


def read_trace(trace: Path) -> list[dict]:
    rows = []
    for f in sorted(trace.glob("steps-*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows


def real_sidecar_settings(prefix: str, state_dir: Path) -> Settings:
    """Settings of a node daemon whose sidecars run real ``shoal.train`` workers (one CPU
    slot per fake GPU), reporting progress every 0.2 s."""
    return Settings.load(
        env={"SHOAL_SIDECAR_MODE": "real"}, state_dir=str(state_dir), prefix=prefix, report_every_s=0.2
    )
