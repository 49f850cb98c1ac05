"""A fault suite under load (issue 21): real processes, one fault at a time.

:class:`FaultSuite` starts ``shoal up`` (the command a user runs: embedded
nats-server, every service, emulated node daemons), optionally a second allocator as
a standby (``shoal run allocator`` with the environment of ``shoal up``'s allocator,
read from ``/proc/<pid>/environ``, so the same settings, server and credentials
``<state>/creds/allocator.nk``; kept running by a :class:`shoal.supervisor.Supervisor`
of the harness, as an operator's init system would), drives a steady load of
submissions through the SDK (:class:`shoal.client.Client`, as the admin) and follows
the log with a :class:`shoal.projection.Projection`.

:meth:`FaultSuite.inject` applies one :class:`Fault` (``kill -9`` of a process, or
``SIGSTOP`` for longer than the lease TTL then ``SIGCONT``), measures the wall time
from the fault to the next ``SharesDecided`` and the next ``PlacementDecided`` appended
after the fault (past the stream's last sequence read just after the signal) as the
harness's follower folds them, and then runs the checks:

* ``once``: every accepted submission's ``JobSubmitted`` is in the log exactly once
  (and no submission at all is in it twice);
* ``epochs``: ``SharesDecided`` epochs strictly increase in log order (none duplicated,
  none out of order); ``PlacementDecided`` epochs never go back (the same one again is
  the placer's re-placement when a placed GPU's node is no longer up);
* ``terminal``: every job accepted before the fault reaches a terminal state;
* ``digest``: every service's ``shoal_state_digest`` (its ``/metrics``) equals a fresh
  fold of the log up to the sequence it reports;
* ``orphans``: no process of the installation's sessions outlives its parent
  (reparented, not a descendant of ``shoal up`` or of the harness's supervisor); in
  real mode neither does any process, in any session, whose ``SHOAL_TRAIN_JOB`` names
  a job of the run (a training worker);
* ``leader``: for every leader-elected service, never two processes that report
  ``shoal_leader`` 1 at once, and one leader in the end; a paused process, once
  resumed, is a leader or a standby (or exited and was restarted);
* ``ready``: every service answers ``/readyz`` with 200 again (none hangs).

At the end of a run (:meth:`FaultSuite.finish`) every submission that got no answer is
sent again with its job id, as the SDK's error tells a user to
(:meth:`FaultSuite.settle_unanswered`); those answered join the accepted ones, so the
final ``once`` also covers them, and the notes say how many admission had written
before: ``unanswered`` fails a run where one is still not answered.

The wall-clock times measured include this harness's own follower's latency (it too
reconnects after a NATS server restart).

Real mode (``FaultSuite(real=True)``, :data:`REAL`, :data:`REAL_KW`): ``shoal up`` with
``SHOAL_SIDECAR_MODE=real`` and ``SHOAL_ENTRYPOINTS`` allowing :data:`CNN` in its
environment (it hands them to its node daemons and admission), two nodes of one GPU, and
real jobs of :data:`CNN` on two GPUs (so over both nodes: a leading and a following
sidecar) as the load. Its faults kill -9 the sidecar holding a job's lease
``train.<job>``, or a worker of the job; the result also has ``to_training_s`` (until
the job trains again) and how it restarted, and a hit job that never trains again
fails the row (``no restart``) unless it was allowed no restart and ended ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors

from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus
from shoal.client import Client, ClientError
from shoal.commands.run import CLI_ARGV
from shoal.projection import Projection

LEADER_ELECTED = ("allocator", "placer", "profiler", "trader")

CNN = Path(__file__).resolve().parents[2] / "examples" / "cnn_digits.py"
"""The shipped example a real-mode suite's jobs run (``examples/cnn_digits.py``)."""

REAL_STEPS = 3000
"""Steps of each real job of a real-mode suite (by default): enough to be hit mid-training
(the CNN takes about 4 ms a step on one CPU core here; 300 steps ended within one progress
report, before the suite could hit a job past its first checkpoints)."""

_RESTORED = re.compile(r"shoal\.train: restored step (\d+) from ")
"""The line rank 0 prints when a cold start restored a checkpoint (shoal.train.runtime)."""


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    target: str
    """``admission``, ``allocator-leader``, ``allocator-standby``, ``placer``, ``profiler``,
    ``trader``, ``node-daemon``, ``sidecar``, ``nats``, ``allocator`` (the leader, with
    no standby running); in a real-mode suite (:attr:`FaultSuite.real`) also
    ``sidecar-leader-real`` (the sidecar holding a two-node job's lease ``train.<job>``)
    and ``worker-real`` (one ``shoal.train`` worker process of a running job)."""
    stop_s: float = 0.0
    """0: ``kill -9``; else ``SIGSTOP`` for this long, then ``SIGCONT``."""
    standby: bool = True
    """Whether the standby allocator runs during this fault."""


class Result(msgspec.Struct, kw_only=True):
    fault: str
    to_decision_s: float | None = None
    to_placement_s: float | None = None
    to_training_s: float | None = None
    """Real-mode faults: from the fault to the hit job's first ``ProgressReported`` after
    a ``ReconfigurationCompleted`` of it appended after the fault (it trains again)."""
    failed: list[str] = []
    notes: list[str] = []


def descendants(pid: int) -> set[int]:
    """Every live, non-zombie descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for pid_, ppid, _sid, state in _procs():
        if state != "Z":
            children.setdefault(ppid, []).append(pid_)
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _procs() -> list[tuple[int, int, int, str]]:
    """(pid, ppid, session id, state) of every process."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out.append((int(entry.name), int(fields[1]), int(fields[3]), fields[0]))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def train_job_of(pid: int) -> str | None:
    """The ``SHOAL_TRAIN_JOB`` in the environment of ``pid`` (a real sidecar's worker), if any."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        if item.startswith(b"SHOAL_TRAIN_JOB="):
            return item.split(b"=", 1)[1].decode(errors="replace")
    return None


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str, timeout_s: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")
    except OSError:
        return 0, ""


def _metric(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out.append((dict(s.labels), float(s.value)))
    return out


class Follower:
    """The log as the harness folds it: when each decision was folded, submissions per job."""

    def __init__(self, bus: Bus) -> None:
        self.decisions: list[tuple[float, int]] = []
        """(monotonic time folded, stream sequence) of every ``SharesDecided``."""
        self.placements: list[tuple[float, int]] = []
        """The same for every ``PlacementDecided``."""
        self.submitted: dict[str, int] = {}
        self.reconfigured: list[tuple[float, int, str, int]] = []
        """(monotonic time folded, sequence, job, world size) of every
        ``ReconfigurationCompleted``."""
        self.progress: list[tuple[float, int, str, int]] = []
        """The same, and the iteration, for every ``ProgressReported``."""
        self.restarts: list[tuple[int, str, str]] = []
        """(sequence, job, ``kind from->to``) of every ``ReconfigurationStarted``."""
        self.projection = Projection(bus, listeners=[self._on_event])

    def _on_event(self, seq: int, env: ev.Envelope, state: st.ClusterState) -> None:
        e = env.event
        if isinstance(e, ev.ReconfigurationCompleted):
            self.reconfigured.append((time.monotonic(), seq, e.job_id, e.world_size))
        elif isinstance(e, ev.ProgressReported):
            self.progress.append((time.monotonic(), seq, e.job_id, e.iteration))
        elif isinstance(e, ev.ReconfigurationStarted):
            self.restarts.append((seq, e.job_id, f"{e.kind} {e.from_world}->{e.to_world}"))
        elif isinstance(e, ev.SharesDecided):
            self.decisions.append((time.monotonic(), seq))
        elif isinstance(e, ev.PlacementDecided):
            self.placements.append((time.monotonic(), seq))
        elif isinstance(e, ev.JobSubmitted):
            self.submitted[e.job_id] = self.submitted.get(e.job_id, 0) + 1


async def wait_until(pred: Callable[[], bool], timeout_s: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


class FaultSuite:
    """See the module docstring. Use ``async with FaultSuite(dir) as suite``."""

    def __init__(
        self,
        work_dir: Path,
        *,
        nodes: int = 2,
        gpus_per_node: int = 2,
        submit_every_s: float = 1.0,
        lease_ttl_s: float = 3.0,
        recovery_timeout_s: float = 60.0,
        real: bool = False,
        real_steps: int = REAL_STEPS,
        real_backlog: int = 2,
        real_job_env: dict[str, str] | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.real = real
        """Real mode: the node daemons' sidecars run ``shoal.train`` workers
        (``SHOAL_SIDECAR_MODE=real``, one CPU gloo slot per emulated GPU), admission allows
        :data:`CNN` (``SHOAL_ENTRYPOINTS``), time is not scaled and the load is real jobs
        (see :meth:`_submit_forever`)."""
        self.real_steps = real_steps
        """Steps (``--max-steps``, ``total_iterations``) of each real job."""
        self.real_job_env = dict(real_job_env or {})
        """More ``spec.env`` of each real job (e.g. ``SHOAL_TRAIN_MAX_RESTARTS``)."""
        self.real_backlog = real_backlog
        """Real mode: a job is submitted only while fewer than this many accepted ones
        have not ended."""
        self.state_dir = work_dir / "state"
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.submit_every_s = submit_every_s
        self.lease_ttl_s = lease_ttl_s
        self.recovery_timeout_s = recovery_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.bus: Bus | None = None
        self.follower: Follower | None = None
        self.standby: Any = None  # a shoal.supervisor.Supervisor
        self._standby_err: Any = None  # its stderr file, open while it runs
        self.standby_probe = ""
        self.accepted: dict[str, float] = {}
        """Job id -> monotonic time its submission was accepted."""
        self.refused: list[str] = []
        self._load: asyncio.Task[None] | None = None
        self._sessions: set[int] = set()
        self.results: list[Result] = []
        self.two_leaders: list[str] = []
        self._notes: list[str] = []
        self.replacements = 0
        """``PlacementDecided`` of an epoch already placed (re-placements), at the last check."""
        self._hit_job: str | None = None
        """The job a real-mode fault hit (see :meth:`_real_target`)."""
        """Every round of :meth:`_leaders_now` that found two leaders of one lease: who."""

    # -- life cycle ------------------------------------------------------------------------

    async def __aenter__(self) -> FaultSuite:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def creds(self) -> Path:
        return self.state_dir / "creds"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
        env.update(
            SHOAL_STATE_DIR=str(self.state_dir),
            SHOAL_CATALOG="",
            SHOAL_LEASE_TTL_S=repr(self.lease_ttl_s),
            SHOAL_HEARTBEAT_S="0.5",
            SHOAL_NODE_TIMEOUT_S="4.0",
        )
        if self.real:
            env.update(
                SHOAL_SIDECAR_MODE="real",
                SHOAL_ENTRYPOINTS=json.dumps([[sys.executable, str(CNN)]]),
                SHOAL_REPORT_EVERY_S="0.5",
                # Torch workers take both cores of a small machine: a node daemon's
                # heartbeat may be late by seconds without the node being gone.
                SHOAL_NODE_TIMEOUT_S="15.0",
            )
        return env

    async def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        argv = [*CLI_ARGV, "up", "--nodes", str(self.nodes), "--gpus-per-node", str(self.gpus_per_node)]
        argv += ["--time-scale", "1" if self.real else "20", "--policy", "fifo"]
        self.proc = subprocess.Popen(
            argv,
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=(self.work_dir / "up.err").open("w"),
            text=True,
            start_new_session=True,
        )
        lines = await asyncio.to_thread(self._read_until_running, 90.0)
        self.url = lines["NATS"]
        self.bus = await Bus.connect(self.url, prefix="shoal", creds=str(self.creds / "admin.nk"))
        self.follower = Follower(self.bus)
        await self.follower.projection.start()
        ok = await wait_until(
            lambda: (
                self.follower is not None
                and sum(n.status == st.NODE_UP for n in self.follower.projection.state.nodes.values())
                == self.nodes
            ),
            60,
        )
        if not ok:
            raise RuntimeError(f"nodes never registered; see {self.work_dir / 'up.err'}")
        self._sessions = {sid for pid, _pp, sid, _s in _procs() if pid in descendants(self.proc.pid)}
        self._sessions.add(self.proc.pid)

    def _read_until_running(self, timeout_s: float) -> dict[str, str]:
        assert self.proc is not None and self.proc.stdout is not None
        lines: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError(f"shoal up did not start; see {self.work_dir / 'up.err'}")
            if line.startswith("running"):
                return lines
            key, _, value = line.partition(": ")
            lines.setdefault(key.strip(), value.strip())

    async def stop(self) -> None:
        if self._load is not None:
            self._load.cancel()
            await asyncio.gather(self._load, return_exceptions=True)
        await self.stop_standby()
        if self.follower is not None:
            await self.follower.projection.stop()
        if self.bus is not None:
            await self.bus.close()
        if self.proc is not None and self.proc.poll() is None:
            for pid in descendants(self.proc.pid):  # a fault may leave one stopped
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                await asyncio.to_thread(self.proc.wait, 60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await asyncio.to_thread(self.proc.wait)

    def leftovers(self) -> list[int]:
        """Processes of the installation's sessions still alive (after :meth:`stop`); in
        real mode also any process whose ``SHOAL_TRAIN_JOB`` is one of this run's jobs."""
        return [
            pid
            for pid, _pp, sid, s in _procs()
            if s != "Z" and (sid in self._sessions or (self.real and train_job_of(pid) in self.accepted))
        ]

    def up_info(self) -> dict[str, Any]:
        return dict(json.loads((self.state_dir / "up.json").read_text()))

    # -- the standby allocator ---------------------------------------------------------------

    async def start_standby(self) -> None:
        """A second ``shoal run allocator`` with the environment of ``shoal up``'s."""
        from shoal.supervisor import ProcessSpec, Supervisor

        leader = self.pid_of("allocator")
        assert leader is not None
        raw = Path(f"/proc/{leader}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
        port = _free_port()
        env["SHOAL_METRICS_PORT"] = str(port)
        self.standby_probe = f"http://127.0.0.1:{port}"
        spec = ProcessSpec(name="allocator-standby", argv=(*CLI_ARGV, "run", "allocator"), env=env)
        # Kept open while the standby runs: every restart of it writes here too (a closed
        # file's descriptor would be reused, and a restarted child's log lost or written
        # into whatever reused it).
        self._standby_err = (self.work_dir / "standby.err").open("a")
        self.standby = Supervisor(
            [spec], base_env={}, max_restarts=10, window_s=60.0, stderr=self._standby_err.fileno()
        )
        await self.standby.start()
        ok = await wait_until(lambda: _scrape(self.standby_probe + "/readyz")[0] == 200, 60, 0.5)
        if not ok:
            raise RuntimeError("the standby allocator never got ready")

    async def stop_standby(self) -> None:
        if self.standby is not None:
            await self.standby.stop(timeout_s=15.0)
            self.standby = None
            self.standby_probe = ""
            self._standby_err.close()

    def standby_pid(self) -> int | None:
        if self.standby is None:
            return None
        proc = self.standby.children["allocator-standby"].proc
        return None if proc is None or proc.returncode is not None else int(proc.pid)

    # -- processes ---------------------------------------------------------------------------

    def pid_of(self, service: str, node: str | None = None) -> int | None:
        """The pid of ``shoal up``'s child running ``service`` (a node daemon: of ``node``)."""
        assert self.proc is not None
        for pid in descendants(self.proc.pid):
            argv = cmdline(pid)
            if (
                "run" in argv
                and service in argv
                and "trainer-sidecar" not in argv
                and (node is None or node in argv)
            ):
                return pid
        return None

    def probes(self) -> dict[str, str]:
        """Child name -> probe base URL (``up.json``), the standby's included."""
        out = dict(self.up_info().get("metrics", {}))
        if self.standby_probe:
            out["allocator-standby"] = self.standby_probe
        return out

    async def holder(self) -> str | None:
        assert self.bus is not None
        lease = await self.bus.lease("allocator", "observer", ttl_s=self.lease_ttl_s)
        return await lease.holder_now()

    async def allocator_leader(self) -> int | None:
        holder = await self.holder()
        return int(holder.rsplit("-", 1)[1]) if holder else None

    # -- load --------------------------------------------------------------------------------

    def start_load(self) -> None:
        self._load = asyncio.create_task(self._submit_forever())

    async def _submit_forever(self) -> None:
        n = 0
        while True:
            client = None
            try:
                client = await Client.connect(
                    self.url, "shoal", creds=str(self.creds / "admin.nk"), timeout_s=5.0
                )
                while True:
                    if self.real:
                        await wait_until(lambda: self._unfinished() < self.real_backlog, float("inf"), 0.5)
                    n += 1
                    job_id = f"load-{n:05d}"
                    spec = self._real_spec(n) if self.real else self._emulated_spec(n)
                    try:
                        await client.submit(spec, job_id=job_id)
                        self.accepted[job_id] = time.monotonic()
                    except (ClientError, TimeoutError, nats.errors.Error):
                        self.refused.append(job_id)
                    await asyncio.sleep(self.submit_every_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(0.5)
            finally:
                if client is not None:
                    with contextlib.suppress(Exception):
                        await client.close()

    async def settle_unanswered(self, attempts: int = 5) -> dict[str, int]:
        """Send each submission that got no answer again, with its job id, as a user told
        "submit again with job id ..." does (:meth:`shoal.client.Client.submit_command`):
        each answered one joins :attr:`accepted`, so ``once`` then checks that it is in the
        log exactly once however many attempts reached admission. Counts: ``written``
        (admission had written it: the answer says duplicate), ``now`` (written by this
        attempt), ``never`` (no answer after ``attempts`` tries)."""
        out = {"written": 0, "now": 0, "never": 0}
        if not self.refused:
            return out
        async with await Client.connect(
            self.url, "shoal", creds=str(self.creds / "admin.nk"), timeout_s=5.0
        ) as client:
            for job_id in self.refused:
                n = int(job_id.rsplit("-", 1)[1])
                spec = self._real_spec(n) if self.real else self._emulated_spec(n)
                for _ in range(attempts):
                    try:
                        reply = await client.submit_command(spec, job_id)
                    except (ClientError, TimeoutError, nats.errors.Error):
                        await asyncio.sleep(1.0)
                        continue
                    out["written" if reply.duplicate else "now"] += 1
                    self.accepted[job_id] = time.monotonic()
                    break
                else:
                    out["never"] += 1
        return out

    @staticmethod
    def _emulated_spec(n: int) -> ev.JobSpec:
        gpus = 1 + n % 2
        return ev.JobSpec(
            user=("alice", "bob")[n % 2],
            min_gpus=1,
            max_gpus=gpus,
            requested_gpus=gpus,
            total_iterations=30,
        )

    def report_every_s(self) -> float:
        """Wall seconds between a real job's progress reports (``SHOAL_REPORT_EVERY_S``)."""
        return float(self.env().get("SHOAL_REPORT_EVERY_S", "0.25"))

    def _real_spec(self, n: int) -> ev.JobSpec:
        """:data:`CNN` for :attr:`real_steps` steps on 2 GPUs (so, with one GPU per node,
        over two nodes: a leader and a follower sidecar; ``min_gpus`` 2, or FIFO gives two
        queued jobs one GPU each), checkpointing every 20."""
        return ev.JobSpec(
            user=("alice", "bob")[n % 2],
            min_gpus=2,
            max_gpus=2,
            requested_gpus=2,
            total_iterations=self.real_steps,
            global_batch_size=64,
            entrypoint=(sys.executable, str(CNN), "--max-steps", str(self.real_steps)),
            env={"SHOAL_TRAIN_CHECKPOINT_EVERY": "20", **self.real_job_env},
        )

    def _unfinished(self) -> int:
        """Accepted jobs the harness's fold has not seen end."""
        assert self.follower is not None
        jobs = self.follower.projection.state.jobs
        return sum(j not in jobs or jobs[j].status not in st.FINISHED_STATUSES for j in self.accepted)

    async def stop_load(self) -> None:
        if self._load is not None:
            self._load.cancel()
            await asyncio.gather(self._load, return_exceptions=True)
            self._load = None

    # -- faults ------------------------------------------------------------------------------

    async def _target_pid(self, fault: Fault) -> int | None:
        t = fault.target
        if t in ("allocator-leader", "allocator"):
            # The lease may still name a process that just stopped (the standby stopped
            # for a no-standby fault): wait for a live holder.
            deadline = time.monotonic() + self.recovery_timeout_s
            while time.monotonic() < deadline:
                pid = await self.allocator_leader()
                if pid is not None and alive(pid):
                    return pid
                await asyncio.sleep(0.2)
            return None
        if t == "allocator-standby":
            leader = await self.allocator_leader()
            pids = [p for p in (self.pid_of("allocator"), self.standby_pid()) if p is not None]
            others = [p for p in pids if p != leader]
            return others[0] if others else None
        if t == "node-daemon":
            return self.pid_of("node-daemon", f"node{self.nodes - 1}")
        if t == "nats":
            return int(self.up_info()["server_pid"])
        if t in ("sidecar-leader-real", "worker-real"):
            return await self._real_target(t)
        if t == "sidecar":
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                pid = self._running_sidecar()
                if pid is not None:
                    return pid
                await asyncio.sleep(0.2)
            return None
        return self.pid_of(t)

    async def _real_target(self, target: str) -> int | None:
        """A process of a real job that trains over both nodes and is past its first
        checkpoint (step 20): the sidecar holding its lease ``train.<job>``
        (``sidecar-leader-real``), or its worker hosted by the other sidecar, the
        follower (``worker-real``; any of its workers if none is found there). Sets
        :attr:`_hit_job`."""
        assert self.bus is not None and self.follower is not None and self.proc is not None
        state = self.follower.projection.state
        deadline = time.monotonic() + self.recovery_timeout_s
        while time.monotonic() < deadline:
            for job_id, job in list(state.jobs.items()):
                if not (
                    job.status == st.RUNNING
                    and job.world_size == 2
                    and len({g.node_id for g in job.placement}) == 2
                    and job.iteration >= 40
                ):
                    continue
                lease = await self.bus.lease(f"train.{job_id}", "observer", ttl_s=self.lease_ttl_s)
                holder = await lease.holder_now()
                family = descendants(self.proc.pid)
                leader = int(holder.rsplit("-", 1)[1]) if holder else None
                if leader is None or leader not in family:
                    continue
                self._hit_job = job_id
                if target == "sidecar-leader-real":
                    return leader
                workers = [p for p in family if str(CNN) in cmdline(p) and train_job_of(p) == job_id]
                hosted = [p for p in workers if _ppid(p) != leader]
                if hosted or workers:
                    return (hosted or workers)[0]
            await asyncio.sleep(0.2)
        return None

    def _running_sidecar(self) -> int | None:
        """A live sidecar of a running job: the node daemons log ``sidecar_started`` with
        the job and the pid (a warm spare's command line does not name its job)."""
        assert self.follower is not None and self.proc is not None
        jobs = self.follower.projection.state.jobs
        family = descendants(self.proc.pid)
        for line in reversed((self.work_dir / "up.err").read_text(errors="replace").splitlines()):
            if '"sidecar_started"' not in line:
                continue
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                job = jobs.get(str(entry.get("job_id")))
                if entry.get("pid") in family and job is not None and job.status == st.RUNNING:
                    return int(entry["pid"])
        return None

    async def inject(self, fault: Fault) -> Result:
        assert self.follower is not None
        result = Result(fault=fault.name)
        if fault.standby and self.standby is None:
            await self.start_standby()
        elif not fault.standby and self.standby is not None:
            await self.stop_standby()
        # The installation is steady before the fault: a leader, decisions flowing.
        await wait_until(lambda: bool(self.follower and self.follower.decisions), 60)
        pid = await self._target_pid(fault)
        if pid is None:
            result.failed.append("target")
            result.notes.append(f"no process for {fault.target}")
            self.results.append(result)
            return result
        before_jobs = dict(self.accepted)
        n_dec, n_pl = len(self.follower.decisions), len(self.follower.placements)
        n_rec, n_prog = len(self.follower.reconfigured), len(self.follower.progress)
        hit, self._hit_job = self._hit_job, None
        if hit is not None:
            role = "leader" if fault.target == "sidecar-leader-real" else "worker"
            result.notes.append(f"job {hit}'s {role}")
        restored_before = self._restored_steps(hit)
        leaders_seen: list[int] = []
        at = time.monotonic()
        if fault.stop_s:
            what = " ".join(cmdline(pid)[-4:])
            os.kill(pid, signal.SIGSTOP)
            fence = await self._fence()
            try:
                await self._watch_leaders(fault.stop_s, leaders_seen)
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:  # something killed it while it was stopped
                    result.failed.append("target vanished")
                    result.notes.append(f"pid {pid} ({what}) was gone at SIGCONT")
            result.notes.append(f"pid {pid} stopped {fault.stop_s:g} s")
        else:
            os.kill(pid, signal.SIGKILL)
            fence = await self._fence()
            result.notes.append(f"pid {pid} killed")
        f = self.follower

        def first_after(items: list[tuple[float, int]], start: int) -> float | None:
            for t, seq in items[start:]:
                if seq > fence and t >= at:
                    return t - at
            return None

        def trained_again() -> tuple[float, int] | None:
            """(time, iteration) of ``hit``'s first progress after its first reconfiguration
            completed after the fault."""
            done = [
                seq for t, seq, job, _ in f.reconfigured[n_rec:] if job == hit and seq > fence and t >= at
            ]
            if not done:
                return None
            for t, seq, job, iteration in f.progress[n_prog:]:
                if job == hit and seq > done[0]:
                    return t - at, iteration
            return None

        def trains_again() -> float | None:
            again = trained_again()
            return None if again is None else again[0]

        await wait_until(
            lambda: (
                first_after(f.decisions, n_dec) is not None
                and first_after(f.placements, n_pl) is not None
                and (hit is None or trains_again() is not None or self._ended(hit))
            ),
            self.recovery_timeout_s,
        )
        result.to_decision_s = first_after(f.decisions, n_dec)
        result.to_placement_s = first_after(f.placements, n_pl)
        if hit is not None:
            again = trained_again()
            job = f.projection.state.jobs.get(hit)
            if again is None:
                # Expected only of a job allowed no restart, which must then have failed.
                if not (
                    self.real_job_env.get("SHOAL_TRAIN_MAX_RESTARTS") == "0"
                    and job is not None
                    and job.status == st.FAILED
                ):
                    result.failed.append("no restart")
            else:
                result.to_training_s = again[0]
                before = [i for _t, seq, job, i in f.progress[:n_prog] if job == hit]
                how = [k for seq, job, k in f.restarts if job == hit and seq > fence]
                restored = sorted(step for path, step in self._restored_steps(hit) - restored_before)
                result.notes.append(
                    f"{', '.join(how) or 'no reconfiguration'}; "
                    + (
                        f"restored the checkpoint of step {', '.join(map(str, restored))}; "
                        if restored
                        else "no checkpoint restored; "
                    )
                    + f"first progress report after it at step {again[1]} (last before the fault:"
                    f" step {before[-1] if before else 0}; reports every {self.report_every_s():g} s)"
                )
                result.notes += await self._back_to_size(hit, n_rec, fence, at)
        if result.to_decision_s is None:
            result.failed.append("no decision")
        if result.to_placement_s is None:
            result.failed.append("no placement")
        # After a pause: watch the leases for two TTLs; never two leaders.
        await self._watch_leaders(2 * self.lease_ttl_s, leaders_seen)
        if fault.stop_s and (fault.target.startswith("allocator") or fault.target == "placer"):
            result.notes.append(f"resumed as {await asyncio.to_thread(self._role_of, pid)}")
        result.failed += await self.check(before_jobs, leaders_seen)
        ended = f.projection.state.jobs.get(hit) if hit is not None else None
        if ended is not None and ended.status in st.FINISHED_STATUSES:
            result.notes.append(
                f"job {hit} ended {ended.status}" + (f": {ended.reason}" if ended.reason else "")
            )
        result.notes += self._notes
        self._notes = []
        self.results.append(result)
        return result

    async def _back_to_size(self, job_id: str, n_rec: int, fence: int, at: float) -> list[str]:
        """When ``job_id`` (hit by the fault at ``at``) ran again on as many GPUs as before
        it: a note for the report (none if it had not run)."""
        f = self.follower
        assert f is not None
        before = [w for _t, _seq, job, w in f.reconfigured[:n_rec] if job == job_id]
        if not before:
            return []

        def back() -> float | None:
            for t, seq, job, w in f.reconfigured[n_rec:]:
                if job == job_id and seq > fence and t >= at and w >= before[-1]:
                    return t - at
            return None

        await wait_until(lambda: back() is not None or self._ended(job_id), self.recovery_timeout_s)
        took = back()
        if took is None:
            when = "before it ended" if self._ended(job_id) else f"within {self.recovery_timeout_s:g} s"
            return [f"not back to {before[-1]} GPUs {when}"]
        return [f"back to {before[-1]} GPUs {took:.2f} s after the fault"]

    def _restored_steps(self, job_id: str | None) -> set[tuple[str, int]]:
        """(log, step) of each checkpoint ``job_id``'s workers restored: rank 0 of a cold
        start prints ``shoal.train: restored step N`` to its own log (one per worker),
        under the node daemons' ``<state>/train/<job>/<sidecar>/logs/`` (``worker-<n>.log``, or
        ``<leader>-worker-<n>.log`` for a leader on another node; :mod:`shoal.train.runtime`)."""
        found: set[tuple[str, int]] = set()
        if job_id is None:
            return found
        for path in (self.state_dir / "train" / job_id).glob("*/logs/*worker-*.log"):
            with contextlib.suppress(OSError):
                for line in path.read_text(errors="replace").splitlines():
                    if m := _RESTORED.search(line):
                        found.add((str(path), int(m.group(1))))
        return found

    def _ended(self, job_id: str) -> bool:
        assert self.follower is not None
        job = self.follower.projection.state.jobs.get(job_id)
        return job is not None and job.status in st.FINISHED_STATUSES

    async def _fence(self) -> int:
        """The stream's last sequence just after a fault: what the log held then (a decision
        in flight at the signal) does not count as recovery. With the server itself down,
        what the harness had folded."""
        assert self.bus is not None and self.follower is not None
        try:
            return await asyncio.wait_for(self.bus.last_seq(), 1.0)
        except Exception:
            return self.follower.projection.last_seq

    def _role_of(self, pid: int) -> str:
        """``leader`` or ``standby`` as the process ``pid`` reports it on ``/metrics``."""
        for url in self.probes().values():
            if self._probe_pid(url) == pid:
                _c, text = _scrape(url + "/metrics")
                lead = _metric(text, "shoal_leader")
                return "leader" if lead and lead[0][1] == 1 else "standby"
        return "unknown (restarted?)"

    def _probe_pid(self, url: str) -> int | None:
        if url == self.standby_probe:
            return self.standby_pid()
        for name, u in self.up_info().get("metrics", {}).items():
            if u == url:
                if name.startswith("node-daemon-"):
                    return self.pid_of("node-daemon", name.removeprefix("node-daemon-"))
                return self.pid_of(name)
        return None

    async def _watch_leaders(self, seconds: float, out: list[int]) -> None:
        """Scrape every leader-elected process for ``seconds``; append the largest number of
        processes of one service that said ``shoal_leader 1`` in one round (and note who,
        in :attr:`two_leaders`, when that is more than one)."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            out.append(await asyncio.to_thread(self._leaders_now))
            await asyncio.sleep(0.2)

    def _leaders_now(self) -> int:
        leaders: dict[str, list[str]] = {}
        for name, url in self.probes().items():
            service = "allocator" if name.startswith("allocator") else name
            if service not in LEADER_ELECTED:
                continue
            _c, text = _scrape(url + "/metrics", timeout_s=0.5)
            for labels, value in _metric(text, "shoal_leader"):
                if value == 1:
                    leaders.setdefault(labels.get("lease", service), []).append(name)
        for lease, names in leaders.items():
            if len(names) > 1:
                self.two_leaders.append(f"{lease}: {', '.join(names)}")
        return max((len(v) for v in leaders.values()), default=0)

    # -- checks ------------------------------------------------------------------------------

    async def check(self, jobs: dict[str, float], leaders_seen: list[int]) -> list[str]:
        failed = []
        if not await self.check_once():
            failed.append("once")
        if not await self.check_epochs():
            failed.append("epochs")
        if not await self.check_terminal(list(jobs)):
            failed.append("terminal")
            state = self.follower.projection.state if self.follower is not None else None
            if state is not None:
                left: dict[str, int] = {}
                for j in jobs:
                    status = state.jobs[j].status if j in state.jobs else "not in the log"
                    if status not in st.FINISHED_STATUSES:
                        left[status] = left.get(status, 0) + 1
                self._notes.append(f"not ended after {self.recovery_timeout_s:g} s: {left}")
        if not await self.check_ready():
            failed.append("ready")
        if not await self.check_digests():
            failed.append("digest")
        if not await self.check_orphans():
            failed.append("orphans")
        if max(leaders_seen, default=0) > 1:
            failed.append("leader")
            self._notes.append(f"two leaders at once: {sorted(set(self.two_leaders))}")
            self.two_leaders.clear()
        elif not await self.check_one_leader():
            failed.append("leader")
            self._notes.append("no single leader in the end")
        return failed

    async def _log(self) -> list[tuple[int, ev.Envelope]]:
        assert self.bus is not None
        out: list[tuple[int, ev.Envelope]] = []
        async for batch in self.bus.replay_batches(start_seq=1):
            out.extend(batch)
        return out

    async def check_once(self) -> bool:
        accepted = list(self.accepted)  # before the read: what is accepted meanwhile may be after it
        counts: dict[str, int] = {}
        for _seq, env in await self._log():
            if isinstance(env.event, ev.JobSubmitted):
                counts[env.event.job_id] = counts.get(env.event.job_id, 0) + 1
        return all(counts.get(j) == 1 for j in accepted) and all(c == 1 for c in counts.values())

    async def check_epochs(self) -> bool:
        """``SharesDecided`` epochs strictly increase in log order. ``PlacementDecided``
        epochs never go back; the same epoch again is the placer's designed re-placement
        when a placed GPU's node is no longer up (services/placer), counted in the notes."""
        last = {"shares": (0, 0), "placement": (0, 0)}
        again = 0
        for seq, env in await self._log():
            e = env.event
            if isinstance(e, ev.SharesDecided | ev.PlacementDecided):
                kind = "shares" if isinstance(e, ev.SharesDecided) else "placement"
                before, before_seq = last[kind]
                if e.epoch < before or (e.epoch == before and kind == "shares"):
                    self._notes.append(
                        f"{kind} epoch {e.epoch} at seq {seq} after epoch {before} at seq {before_seq}"
                    )
                    return False
                again += e.epoch == before
                last[kind] = (e.epoch, seq)
        self.replacements = again
        return True

    async def check_terminal(self, jobs: list[str], timeout_s: float | None = None) -> bool:
        assert self.follower is not None
        state = self.follower.projection.state

        def done() -> bool:
            return all(j in state.jobs and state.jobs[j].status in st.FINISHED_STATUSES for j in jobs)

        return await wait_until(done, timeout_s or self.recovery_timeout_s, 0.2)

    async def check_ready(self) -> bool:
        not_ready: dict[str, str] = {}

        async def all_ready() -> bool:
            probes = self.probes()
            codes = await asyncio.gather(
                *(asyncio.to_thread(_scrape, u + "/readyz") for u in probes.values())
            )
            not_ready.clear()
            not_ready.update(
                {
                    name: f"{c} {body.strip()[:120]}"
                    for name, (c, body) in zip(probes, codes, strict=True)
                    if c != 200
                }
            )
            return not not_ready

        deadline = time.monotonic() + self.recovery_timeout_s
        while not await all_ready():
            if time.monotonic() > deadline:
                self._notes.append(f"not ready: {not_ready}")
                return False
            await asyncio.sleep(0.5)
        return True

    async def service_digests(self) -> dict[str, tuple[int, str]]:
        """Child name -> (sequence, digest) from its ``/metrics``."""
        out = {}
        for name, url in self.probes().items():
            _c, text = await asyncio.to_thread(_scrape, url + "/metrics")
            for labels, _v in _metric(text, "shoal_state_digest"):
                out[name] = (int(labels["seq"]), labels["digest"])
        return out

    async def check_digests(self) -> bool:
        digests = await self.service_digests()
        if set(digests) != set(self.probes()):
            return False
        want: dict[int, set[str]] = {}
        for seq, digest in digests.values():
            want.setdefault(seq, set()).add(digest)
        targets = sorted(want)
        fresh = st.ClusterState()
        found: dict[int, str] = {}
        i = 0
        for seq, env in await self._log():
            while i < len(targets) and targets[i] < seq:  # the fold up to targets[i]
                found[targets[i]] = st.digest(fresh)
                i += 1
            st.apply(fresh, env)
        for t in targets[i:]:
            found[t] = st.digest(fresh)
        return all(ds == {found[seq]} for seq, ds in want.items())

    async def check_orphans(self, timeout_s: float = 15.0) -> bool:
        assert self.proc is not None
        proc = self.proc

        def none() -> bool:
            family = descendants(proc.pid) | {proc.pid}
            if self.standby is not None:
                pid = self.standby_pid()
                if pid is not None:
                    family |= {pid} | descendants(pid)
            procs = [(p, sid) for p, _pp, sid, s in _procs() if s != "Z" and p not in family]
            if any(sid in self._sessions for _p, sid in procs):
                return False
            # Real mode: a training worker of this run's jobs in any session.
            return not (self.real and any(train_job_of(p) in self.accepted for p, _sid in procs))

        return await wait_until(none, timeout_s, 0.5)

    async def check_one_leader(self) -> bool:
        return await wait_until(lambda: self._leaders_now() == 1, self.recovery_timeout_s, 0.5)

    async def finish(self) -> Result:
        """Stop the load; every accepted job terminal; the checks once more."""
        await self.stop_load()
        result = Result(fault="(end of run)")
        settled = await self.settle_unanswered()
        leaders: list[int] = []
        await self._watch_leaders(1.0, leaders)
        result.failed = await self.check(dict(self.accepted), leaders)
        result.notes += self._notes
        self._notes = []
        result.notes.append(
            f"{len(self.accepted)} submissions accepted, {len(self.refused)} not answered at first: "
            f"{settled['written']} of them had been written (answered as such when sent again), "
            f"{settled['now']} written when sent again, {settled['never']} never answered"
        )
        if settled["never"]:
            result.failed.append("unanswered")
        result.notes.append(f"{self.replacements} re-placements of an epoch already placed in the log")
        self.results.append(result)
        return result


FULL: tuple[Fault, ...] = (
    Fault(name="SIGSTOP allocator (no standby)", target="allocator", stop_s=5.0, standby=False),
    Fault(name="kill -9 admission", target="admission"),
    Fault(name="kill -9 allocator leader", target="allocator-leader"),
    Fault(name="kill -9 allocator standby", target="allocator-standby"),
    Fault(name="kill -9 placer", target="placer"),
    Fault(name="kill -9 profiler", target="profiler"),
    Fault(name="kill -9 trader", target="trader"),
    Fault(name="kill -9 node daemon", target="node-daemon"),
    Fault(name="kill -9 sidecar (emulated trainer)", target="sidecar"),
    Fault(name="kill -9 NATS server", target="nats"),
    Fault(name="kill -9 authorizer", target="authorizer"),
    Fault(name="SIGSTOP allocator leader (with standby)", target="allocator-leader", stop_s=5.0),
    Fault(name="SIGSTOP placer", target="placer", stop_s=5.0),
    Fault(name="SIGSTOP admission", target="admission", stop_s=5.0),
    Fault(name="SIGSTOP node daemon", target="node-daemon", stop_s=5.0),
    Fault(name="SIGSTOP authorizer", target="authorizer", stop_s=5.0),
)
"""Every fault of the issue that runs with emulated nodes (lease TTL 3 s: pauses of 5 s)."""

REDUCED: tuple[Fault, ...] = (
    Fault(name="kill -9 admission", target="admission"),
    Fault(name="kill -9 allocator leader", target="allocator-leader"),
    Fault(name="kill -9 placer", target="placer"),
    Fault(name="kill -9 node daemon", target="node-daemon"),
    Fault(name="kill -9 NATS server", target="nats"),
    Fault(name="SIGSTOP allocator leader (with standby)", target="allocator-leader", stop_s=5.0),
)


def pauses(stop_s: float = 60.0) -> tuple[Fault, ...]:
    """A ``SIGSTOP`` of ``stop_s`` (then ``SIGCONT``) of every kind of process of an
    installation, one at a time: issue 21's "after a 60 s pause of any process,
    scheduling resumes without anyone restarting ``shoal up``"."""
    return (
        Fault(
            name=f"SIGSTOP {stop_s:g} s allocator (no standby)",
            target="allocator",
            stop_s=stop_s,
            standby=False,
        ),
        Fault(
            name=f"SIGSTOP {stop_s:g} s allocator leader (with standby)",
            target="allocator-leader",
            stop_s=stop_s,
        ),
        Fault(name=f"SIGSTOP {stop_s:g} s allocator standby", target="allocator-standby", stop_s=stop_s),
        Fault(name=f"SIGSTOP {stop_s:g} s admission", target="admission", stop_s=stop_s),
        Fault(name=f"SIGSTOP {stop_s:g} s placer", target="placer", stop_s=stop_s),
        Fault(name=f"SIGSTOP {stop_s:g} s profiler", target="profiler", stop_s=stop_s),
        Fault(name=f"SIGSTOP {stop_s:g} s trader", target="trader", stop_s=stop_s),
        Fault(name=f"SIGSTOP {stop_s:g} s node daemon", target="node-daemon", stop_s=stop_s),
        Fault(name=f"SIGSTOP {stop_s:g} s sidecar (emulated trainer)", target="sidecar", stop_s=stop_s),
        Fault(name=f"SIGSTOP {stop_s:g} s NATS server", target="nats", stop_s=stop_s),
        Fault(name=f"SIGSTOP {stop_s:g} s authorizer", target="authorizer", stop_s=stop_s),
    )


REAL: tuple[Fault, ...] = (
    Fault(name="kill -9 sidecar leader (real mode)", target="sidecar-leader-real", standby=False),
    Fault(name="kill -9 training worker (real mode)", target="worker-real", standby=False),
)
"""The faults of real training (``FaultSuite(real=True)``: 2 nodes of 1 GPU, real
``shoal.train`` workers of :data:`CNN` on CPU with gloo, no standby allocator)."""

NOT_RUN: tuple[tuple[str, str], ...] = ()
"""Faults of the issue this harness does not run, with why (none now: the real-mode
ones are :data:`REAL`, run on an installation of their own)."""


async def run_suite(work_dir: Path, faults: tuple[Fault, ...], **kw: Any) -> list[Result]:
    async with FaultSuite(work_dir, **kw) as suite:
        suite.start_load()
        for fault in faults:
            await suite.inject(fault)
        await suite.finish()
        results = suite.results
    leftovers = suite.leftovers()
    if leftovers:
        results[-1].failed.append("orphans")
        results[-1].notes.append(f"left after stop: {leftovers}")
    return results


REAL_KW: dict[str, Any] = {"real": True, "nodes": 2, "gpus_per_node": 1, "recovery_timeout_s": 180.0}
""":class:`FaultSuite` arguments of the real-mode suite (:data:`REAL`): two nodes of one
GPU each, so that every job spans both; jobs (torch imports on a loaded 2-core machine)
take tens of seconds to start, hence the longer recovery timeout."""


async def run_real_suite(work_dir: Path, **kw: Any) -> list[Result]:
    """:data:`REAL` through :func:`run_suite` with :data:`REAL_KW` (``kw`` overrides)."""
    return await run_suite(work_dir, REAL, **{**REAL_KW, **kw})


def _real_intro(steps: int, heading: str = "#") -> list[str]:
    return [
        f"{heading} Fault suite under load: real training",
        "",
        "`shoal up` with 2 emulated nodes of 1 GPU each in real mode (`SHOAL_SIDECAR_MODE=real`:"
        " one CPU gloo worker slot per emulated GPU; `SHOAL_ENTRYPOINTS` allows only"
        " `examples/cnn_digits.py`), FIFO, time scale 1, lease TTL 3 s, no standby allocator."
        f" Load: the harness submits `cnn_digits.py --max-steps {steps}` (2 GPUs, so every job runs"
        " over both nodes: a leader and a follower sidecar; checkpoint every 20 steps) through the SDK"
        " whenever fewer than 2 accepted jobs have not ended. A sidecar leader is the sidecar that"
        " holds the job's lease `train.<job>`; the killed worker is the one its follower sidecar"
        " hosts. Both are hit once the job has trained past step 40 on both nodes.",
        "",
        "Recovery: to decision / to placement as in faults.md (the next `SharesDecided` /"
        " `PlacementDecided` after the fault; with this load they come when a job ends, so they"
        " include the hit job's recovery and the rest of its run); to training: to the hit job's"
        " first `ProgressReported` after its first `ReconfigurationCompleted` after the fault"
        " (workers restarted from the checkpoint and training).",
    ]


def report(
    results: list[Result],
    *,
    command: str,
    elapsed_s: float,
    submit_every_s: float = 1.0,
    real_steps: int | None = None,
    machine: str = "",
    real_included: bool = False,
    section: bool = False,
) -> str:
    """The report as Markdown; ``real_steps``: of a real-mode run (:data:`REAL`), with its
    ``to training`` column; ``machine``: a line on the machine it ran on (its load);
    ``real_included``: the real-mode suite follows as a section (``section``) of the same
    report, written by the same command."""

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    real = real_steps is not None
    if real:
        assert real_steps is not None
        ran = (
            f"This part of `{command}` took {elapsed_s:.0f} s."
            if section
            else f"Generated by `{command}` in {elapsed_s:.0f} s."
        )
        lines = [*_real_intro(real_steps, "##" if section else "#"), "", f"{ran} {machine}"]
    else:
        lines = [
            "# Fault suite under load",
            "",
            f"Generated by `{command}` in {elapsed_s:.0f} s on this machine. `shoal up` with 2 emulated"
            " nodes of 2 GPUs, FIFO, time scale 20, lease TTL 3 s, a standby `shoal run allocator` (except"
            f" where noted), one submission every {submit_every_s:g} s through the SDK; a pause is a"
            " SIGSTOP, then SIGCONT, as long as its row says."
            " Recovery: wall time from the fault (SIGKILL, or SIGSTOP) to the next `SharesDecided` /"
            " `PlacementDecided` appended after it (past the stream's last sequence read just after the"
            " signal), as the harness's follower folds them. A decision by a service the fault did not"
            " touch counts too, so a small number after a fault of admission, profiler, trader or a node"
            " means scheduling went on; after a kill of the allocator leader it is the standby's take-over"
            " (the lease TTL), after a kill of the NATS server the server's restart and reconnection."
            f"{' ' + machine if machine else ''}",
        ]
    lines += [
        "",
        "| fault | to decision | to placement |" + (" to training |" if real else "") + " checks | notes |",
        "|---|---|---|" + ("---|" if real else "") + "---|---|",
    ]
    for r in results:
        checks = "all passed" if not r.failed else "FAILED: " + ", ".join(r.failed)
        row = f"| {r.fault} | {secs(r.to_decision_s)} | {secs(r.to_placement_s)} |"
        if real:
            row += f" {secs(r.to_training_s)} |"
        lines.append(f"{row} {checks} | {'; '.join(r.notes)} |")
    for name, why in NOT_RUN:
        lines.append(f"| {name} | - | - | not run | {why} |")
    if not real:
        lines += [
            "",
            "The real-mode faults (kill -9 of a sidecar leader and of a training worker) run on an"
            " installation of their own, in real mode: the last section below."
            if real_included
            else "The real-mode faults (kill -9 of a sidecar leader and of a training worker) were"
            " left out of this run: `python benchmarks/faults.py` runs them too (a section of"
            " faults.md), `python benchmarks/faults.py --real` alone.",
        ]
    lines += [
        "",
        "Checks after each fault (libs/shoal/faults.py): once (every accepted submission in the log"
        " exactly once), epochs (decision epochs strictly increase; placement epochs never go back,"
        " and repeat only as the placer's re-placement of an epoch whose node is no longer up),"
        " terminal (every job"
        " accepted before the fault ends), ready (every service's /readyz 200 again), digest (every"
        " service's shoal_state_digest equals a fresh fold of the log at its sequence), orphans (no"
        " process of the installation outlives its parent"
        + (
            "; nor does any process, in any session, whose environment names one of the run's jobs"
            " in SHOAL_TRAIN_JOB: a training worker"
            if real
            else ""
        )
        + "), leader (never two processes leading one lease, one leader in the end)"
        + ("; no restart (real faults: the hit job trained again after the fault)." if real else ".")
        + " At the end of a run every submission that got no answer is sent again with its job id, as"
        " the SDK tells a user to; the end-of-run row's notes count those admission had written, and"
        " unanswered fails a run where one is still not answered (once then covers them too).",
        "",
    ]
    return "\n".join(lines)
