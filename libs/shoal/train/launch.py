"""Starting a job's worker processes: the handle the controller needs, and the local launcher.

The :class:`~shoal.train.controller.Controller` never starts a process itself: it
builds a :class:`LaunchRequest` (the command, the environment it computed, the GPU)
and hands it to a *launcher*, which returns a :class:`WorkerProcess`. The default
launcher (:func:`launch_local`) starts a child of this process. The real sidecar
adds a launcher for GPUs of other nodes, which asks that node's sidecar of the same
job to run the request with :func:`launch_local` and returns a handle that speaks to
it over the bus (``shoal_services.trainer_sidecar.remote``). Both handles have the
small part of :class:`asyncio.subprocess.Process` the controller uses.

A request's ``env`` is the job's part of the environment only (``SHOAL_TRAIN_*``,
``spec.env``, torchrun's variables); whoever starts the process adds its own
environment and resolves the GPU to a device on its own node, since device
indices are per node.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import msgspec

from shoal.events import GpuRef


class WorkerProcess(Protocol):
    """What the controller does with a worker process (a subset of ``asyncio``'s ``Process``)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


class LaunchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One worker to start: also the payload of a remote spawn request."""

    job_id: str
    worker: int
    """The controller's worker id (unique per controller, not per job)."""
    gpu: GpuRef
    argv: tuple[str, ...]
    env: dict[str, str]
    """The job's variables; the launcher adds its process environment and the visible devices."""
    device: str = "cpu"
    """``cpu`` or ``cuda``: whether ``CUDA_VISIBLE_DEVICES`` names the GPU's local index."""
    log_name: str = ""
    """File name of the worker's stdout/stderr in the launcher's log directory."""


Launcher = Callable[[LaunchRequest], Awaitable[WorkerProcess]]


# Runs in the new process before the worker's own command: the worker dies with the
# process that started it (PR_SET_PDEATHSIG survives exec), and one whose parent is
# already gone does not start. Done here rather than in a ``preexec_fn``, which makes
# ``subprocess`` fork the whole (torch-sized) parent instead of vfork it and holds the
# event loop up to a quarter of a second per worker.
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dying_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that it gets SIGKILL when this process dies (Linux; as is elsewhere)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *argv]


def worker_env(
    request: LaunchRequest, device_index: int, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The full environment of a worker started on this node for ``request``.

    The sidecar's NATS credentials are left out: a worker runs the job's own code and
    talks only to its sidecar, never to the bus (:mod:`shoal.auth`)."""
    env = {**(os.environ if base is None else base), **request.env}
    for secret in ("NATS_CREDS", "SHOAL_NATS_CREDS", "SHOAL_SIDECAR_CREDS", "SHOAL_SIDECAR_TOKEN"):
        env.pop(secret, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_VISIBLE_DEVICES"] = str(device_index) if request.device == "cuda" else ""
    return env


async def launch_local(
    request: LaunchRequest, *, device_index: int, log_dir: Path
) -> asyncio.subprocess.Process:
    """Start ``request`` as a child of this process that dies with it (:func:`dying_with_parent`).

    Args:
        request: what to run.
        device_index: the GPU's device index on this node (CUDA) or its CPU slot.
        log_dir: the worker's output goes to ``log_dir / request.log_name``.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    logf = open(log_dir / (request.log_name or f"worker-{request.worker}.log"), "ab")  # noqa: SIM115
    try:
        return await asyncio.create_subprocess_exec(
            *dying_with_parent(request.argv),
            env=worker_env(request, device_index),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
        )
    finally:
        logf.close()
