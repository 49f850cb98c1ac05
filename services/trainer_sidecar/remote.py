"""Workers of a real-mode job on other nodes: started by the leader, run by the followers.

A job placed on several nodes has one sidecar per node. The leader's
:class:`~shoal.train.controller.Controller` starts the workers for GPUs on its own
node as its children; for a GPU on another node it asks that node's sidecar of the
same job (a *follower*) to start the worker, through :class:`RemoteWorkers`, and
gets back a :class:`RemoteProcess`: a handle with the interface of a local process
(``pid``, ``returncode``, ``wait``, ``kill``, ``send_signal``). The follower's
:class:`WorkerHost` starts the worker as its own child, with the environment the
leader computed plus its own, and the GPU resolved to a device on its own node
(:func:`shoal.train.launch.launch_local`); the worker dies with the follower
(``PR_SET_PDEATHSIG``) and connects back to the leader's control server and
rendezvous store by address.

Wire (core NATS request/reply, JSON, on subjects outside every stream, so nothing
is stored):

* ``<P>.sidecar.<job>.<node>.spawn``: :class:`SpawnRequest` -> :class:`SpawnReply`
  (idempotent per leader and worker id, so a retried request never starts two);
* ``<P>.sidecar.<job>.<node>.signal``: :class:`SignalRequest` -> :class:`StatusReply`;
* ``<P>.sidecar.<job>.<node>.status``: :class:`StatusRequest` -> :class:`StatusReply`;
* ``<P>.sidecar.<job>.<node>.adopt``: :class:`AdoptRequest` -> :class:`SpawnReply` (a new
  leader takes over a worker the follower runs for the leader that handed over to it);
* ``<P>.sidecar.<job>.exited``: :class:`ExitNote`, published by a follower when a
  worker it hosts exits.

Exit notes are at-most-once, so the leader also polls each follower that hosts its
workers every ``poll_s``: a worker the follower no longer knows, or a follower
that is gone (no responders: its sidecar process died, and its workers with it) or
silent for ``lost_after`` polls, counts as an exit with code ``-SIGKILL``. The
controller handles such exits as worker deaths (forced scale-in with recovery).

Who may run workers: a follower kills the workers of a leader that no longer holds
the job's lease (``drop_others``, checked by the sidecar at every lease tick), so
the workers of a leader that died do not outlive it on other nodes. The exception is
a leader that handed over (``keep``): its workers live on until the next leader adopts
them (``adopt``: they are then that leader's) or the sidecar stops keeping them.

These subjects are under ``<P>.sidecar.>``, which only the ``sidecar`` and ``admin``
identities may use (:mod:`shoal.auth`). What a follower runs comes from the job's spec in
the log, never from the request alone: a spawn whose command is not the job's
``entrypoint``, or whose environment sets a variable the job's ``env`` does not (with
that value) other than the trainer's ``SHOAL_TRAIN_*`` and torchrun's, is refused
(:func:`launch_refusal`). So the sidecar of a job, compromised by the job's own code on
one node, cannot run another program on the job's other nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from shoal.events import GpuRef
from shoal.train.config import ENV_PREFIX
from shoal.train.launch import LaunchRequest, launch_local

log = structlog.get_logger("shoal.sidecar.remote")

LOST = -signal.SIGKILL
"""Exit code of a remote worker whose follower is gone."""


TORCHRUN_ENV = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"}
)
"""The variables a leader adds for a script without the trainer API (torchrun's)."""


def launch_refusal(launch: LaunchRequest, argv: Sequence[str], env: Mapping[str, str]) -> str:
    """Why a follower whose job has entrypoint ``argv`` and ``env`` (its spec, read from
    the log) refuses to run ``launch``; ``""`` when it may.

    The command must be exactly the entrypoint. Every variable must be one of the job's
    own with the same value, a trainer option (``SHOAL_TRAIN_*``, which the job's env
    may set too) or one of :data:`TORCHRUN_ENV`."""
    if tuple(launch.argv) != tuple(argv):
        return f"the command {list(launch.argv)[:4]!r} is not the job's entrypoint"
    for key, value in launch.env.items():
        if key.startswith(ENV_PREFIX) or key in TORCHRUN_ENV:
            continue
        if env.get(key) != value:
            return f"the variable {key!r} is not the job's (spec.env)"
    return ""


class SpawnRequest(msgspec.Struct, frozen=True, kw_only=True):
    leader: str
    request: LaunchRequest


class SpawnReply(msgspec.Struct, frozen=True, kw_only=True):
    pid: int = 0
    error: str = ""


class SignalRequest(msgspec.Struct, frozen=True, kw_only=True):
    leader: str
    worker: int
    signal: int


class StatusRequest(msgspec.Struct, frozen=True, kw_only=True):
    leader: str


class StatusReply(msgspec.Struct, frozen=True, kw_only=True):
    workers: dict[int, int | None] = {}
    """Worker id -> exit code (None: running), for the asking leader's workers."""


class AdoptRequest(msgspec.Struct, frozen=True, kw_only=True):
    leader: str
    """The new leader."""
    previous: str
    """The leader that handed over; the worker must be one the follower runs for it."""
    worker: int


class ExitNote(msgspec.Struct, frozen=True, kw_only=True):
    leader: str
    node: str
    worker: int
    returncode: int


def subject(prefix: str, job_id: str, *tokens: str) -> str:
    """``<prefix>.sidecar.<job>.<tokens…>``."""
    return ".".join((prefix, "sidecar", job_id, *tokens))


class RemoteSpawnError(RuntimeError):
    """A follower refused to start a worker, or none answered in time."""


# -- the leader's side --------------------------------------------------------------------


class RemoteProcess:
    """A worker that a follower runs for this leader (see the module docstring)."""

    def __init__(self, owner: RemoteWorkers, node: str, worker: int, pid: int) -> None:
        self.owner = owner
        self.node = node
        self.worker = worker
        self.pid = pid
        self.returncode: int | None = None
        self.lost = False
        """It was lost with its node's sidecar (no answer, or the sidecar no longer knows
        it), not seen to exit: the controller does not give its GPU back after recovery."""
        self._exited = asyncio.Event()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.owner.signal(self, sig)

    def exited(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._exited.set()


class RemoteWorkers:
    """The leader's launcher for workers on other nodes; see the module docstring.

    Args:
        nc: the NATS connection.
        prefix: the installation's subject prefix.
        job_id: the job.
        leader: this leader's lease holder id (the followers key its workers by it).
        spawn_timeout_s: how long a spawn waits for the node's sidecar to answer (it
            may still be starting: the node daemons start a job's sidecars together).
        poll_s: how often each follower that hosts workers is asked for their state.
        lost_after: unanswered polls after which a follower's workers count as dead.
    """

    def __init__(
        self,
        nc: NatsClient,
        prefix: str,
        job_id: str,
        leader: str,
        *,
        spawn_timeout_s: float = 60.0,
        poll_s: float = 1.0,
        lost_after: int = 3,
        request_timeout_s: float = 2.0,
    ) -> None:
        self.nc = nc
        self.prefix = prefix
        self.job_id = job_id
        self.leader = leader
        self.spawn_timeout_s = spawn_timeout_s
        self.poll_s = poll_s
        self.lost_after = lost_after
        self.request_timeout_s = request_timeout_s
        self.procs: dict[tuple[str, int], RemoteProcess] = {}
        self._sub: Subscription | None = None
        self._poller: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._misses: dict[str, int] = {}

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(subject(self.prefix, self.job_id, "exited"), cb=self._on_exit)
        self._poller = asyncio.create_task(self._poll())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(
            *(t for t in (self._poller, *self._tasks) if t is not None), return_exceptions=True
        )
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def launch(self, request: LaunchRequest) -> RemoteProcess:
        """Ask the sidecar on ``request.gpu``'s node to start the worker.

        Raises:
            RemoteSpawnError: the follower refused (an unknown GPU, say), or no sidecar
                of the job answered on that node within ``spawn_timeout_s``.
        """
        node = request.gpu.node_id
        payload = msgspec.json.encode(SpawnRequest(leader=self.leader, request=request))
        deadline = time.monotonic() + self.spawn_timeout_s
        waited_for = "no sidecar of the job on that node"
        while True:
            try:
                msg = await self.nc.request(
                    subject(self.prefix, self.job_id, node, "spawn"), payload, timeout=self.request_timeout_s
                )
                break
            except nats.errors.NoRespondersError:
                waited_for = "no sidecar of the job on that node"
            except nats.errors.TimeoutError:
                waited_for = "the node's sidecar did not answer"
            if time.monotonic() > deadline:
                raise RemoteSpawnError(
                    f"cannot start worker {request.worker} on {node}/{request.gpu.index}: "
                    f"{waited_for} within {self.spawn_timeout_s}s"
                )
            await asyncio.sleep(0.2)
        try:
            reply = msgspec.json.decode(msg.data, type=SpawnReply)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise RemoteSpawnError(
                f"node {node} answered the start of worker {request.worker} with {exc}"
            ) from None
        if reply.error:
            raise RemoteSpawnError(f"node {node} refused worker {request.worker}: {reply.error}")
        proc = RemoteProcess(self, node, request.worker, reply.pid)
        self.procs[(node, request.worker)] = proc
        return proc

    async def adopt(self, node: str, previous: str, worker: int) -> RemoteProcess | None:
        """Take over ``worker``, which ``node``'s sidecar runs for the leader ``previous``
        (a handover); ``None`` when it does not run it (any more) or does not answer."""
        payload = msgspec.json.encode(AdoptRequest(leader=self.leader, previous=previous, worker=worker))
        try:
            msg = await self.nc.request(
                subject(self.prefix, self.job_id, node, "adopt"), payload, timeout=self.request_timeout_s
            )
            reply = msgspec.json.decode(msg.data, type=SpawnReply)
        except Exception as exc:
            log.warning("remote_adopt_failed", job_id=self.job_id, node=node, worker=worker, error=str(exc))
            return None
        if reply.error:
            log.warning(
                "remote_adopt_refused", job_id=self.job_id, node=node, worker=worker, error=reply.error
            )
            return None
        proc = RemoteProcess(self, node, worker, reply.pid)
        self.procs[(node, worker)] = proc
        return proc

    def signal(self, proc: RemoteProcess, sig: int) -> None:
        task = asyncio.create_task(self._signal(proc, sig))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _signal(self, proc: RemoteProcess, sig: int) -> None:
        payload = msgspec.json.encode(SignalRequest(leader=self.leader, worker=proc.worker, signal=sig))
        try:
            msg = await self.nc.request(
                subject(self.prefix, self.job_id, proc.node, "signal"),
                payload,
                timeout=self.request_timeout_s,
            )
        except nats.errors.NoRespondersError:
            self._lost(proc.node, "no sidecar of the job answers on the node")
            return
        except Exception as exc:  # the poll settles it
            log.warning(
                "remote_signal_failed", job_id=self.job_id, node=proc.node, worker=proc.worker, error=str(exc)
            )
            return
        try:
            reply = msgspec.json.decode(msg.data, type=StatusReply)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # the poll settles it
            log.warning("remote_signal_bad_reply", job_id=self.job_id, node=proc.node, error=str(exc))
            return
        self._settle(proc.node, reply, only=(proc.worker,))

    async def _on_exit(self, msg: Msg) -> None:
        try:
            note = msgspec.json.decode(msg.data, type=ExitNote)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return
        if note.leader == self.leader and (proc := self.procs.pop((note.node, note.worker), None)):
            proc.exited(note.returncode)

    def _settle(self, node: str, reply: StatusReply, only: tuple[int, ...] | None = None) -> None:
        """Mark the workers of ``node`` that the follower reports exited (or does not know)."""
        for (n, wid), proc in list(self.procs.items()):
            if n != node or (only is not None and wid not in only):
                continue
            rc = reply.workers.get(wid, LOST)
            if rc is not None:
                self.procs.pop((n, wid), None)
                proc.lost = wid not in reply.workers
                proc.exited(rc)

    def _lost(self, node: str, why: str) -> None:
        lost = [(key, p) for key, p in self.procs.items() if key[0] == node]
        if lost:
            log.warning(
                "remote_workers_lost", job_id=self.job_id, node=node, why=why, workers=[k[1] for k, _ in lost]
            )
        for key, proc in lost:
            self.procs.pop(key, None)
            proc.lost = True
            proc.exited(LOST)

    def _missed(self, node: str) -> None:
        """One more poll of ``node`` without an answer; its workers are lost at ``lost_after``."""
        self._misses[node] = self._misses.get(node, 0) + 1
        if self._misses[node] >= self.lost_after:
            self._lost(node, f"its sidecar did not answer {self.lost_after} polls")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            for node in sorted({n for n, _ in self.procs}):
                payload = msgspec.json.encode(StatusRequest(leader=self.leader))
                try:
                    msg = await self.nc.request(
                        subject(self.prefix, self.job_id, node, "status"),
                        payload,
                        timeout=self.request_timeout_s,
                    )
                except nats.errors.NoRespondersError:
                    self._lost(node, "no sidecar of the job answers on the node")
                    continue
                except nats.errors.TimeoutError:
                    self._missed(node)
                    continue
                except Exception as exc:  # the connection is reconnecting: try again next round
                    log.warning("remote_poll_failed", job_id=self.job_id, node=node, error=str(exc))
                    continue
                try:
                    reply = msgspec.json.decode(msg.data, type=StatusReply)
                except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                    # Not an answer: counted as a missed poll, never the end of the poller.
                    log.warning("remote_poll_bad_reply", job_id=self.job_id, node=node, error=str(exc))
                    self._missed(node)
                    continue
                self._misses.pop(node, None)
                self._settle(node, reply)


# -- the follower's side --------------------------------------------------------------------


class _Hosted:
    def __init__(self, leader: str, worker: int, proc: asyncio.subprocess.Process) -> None:
        self.leader = leader
        self.worker = worker
        self.proc = proc
        self.started = time.monotonic()


class WorkerHost:
    """A follower's service that runs the workers a leader asks for; see the module docstring.

    Args:
        nc: the NATS connection.
        prefix: the installation's subject prefix.
        job_id: the job.
        node_id: this node.
        resolve: the device index (CUDA) or slot (CPU) of a GPU of this node; raises
            ``OrderError`` (or any ``ValueError``) for a GPU this node does not have.
        log_dir: where the hosted workers' output goes.
        refuse: a reason to refuse spawns now (this sidecar leads the job), or ``""``.
        argv: the job's entrypoint and ``env`` its variables, from its spec in the log:
            a spawn request must match them (:func:`launch_refusal`). None (tests that
            build a host by hand): any command.
    """

    def __init__(
        self,
        nc: NatsClient,
        prefix: str,
        job_id: str,
        node_id: str,
        *,
        resolve: Callable[[GpuRef], int],
        log_dir: Path,
        refuse: Callable[[], str] = lambda: "",
        argv: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.nc = nc
        self.argv = argv
        self.env = dict(env or {})
        self.prefix = prefix
        self.job_id = job_id
        self.node_id = node_id
        self.resolve = resolve
        self.log_dir = log_dir
        self.refuse = refuse
        self.hosted: dict[tuple[str, int], _Hosted] = {}
        self._subs: list[Subscription] = []
        self._watchers: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        handlers = (
            ("spawn", self._on_spawn),
            ("signal", self._on_signal),
            ("status", self._on_status),
            ("adopt", self._on_adopt),
        )
        for name, cb in handlers:
            self._subs.append(
                await self.nc.subscribe(subject(self.prefix, self.job_id, self.node_id, name), cb=cb)
            )

    def running(self) -> list[_Hosted]:
        return [h for h in self.hosted.values() if h.proc.returncode is None]

    def leaders(self) -> set[str]:
        """Leaders that have workers running here."""
        return {h.leader for h in self.running()}

    async def drop_others(
        self, holder: str | None, *, grace_s: float = 0.0, keep: Collection[str] = ()
    ) -> None:
        """Kill the workers of every leader but ``holder`` and those in ``keep`` (leaders
        that handed over), started over ``grace_s`` ago, and forget the exited ones: their
        leader no longer holds the job's lease."""
        now = time.monotonic()
        spared = {holder, *keep}
        doomed = [h for h in self.hosted.values() if h.leader not in spared and now - h.started >= grace_s]
        running = [h for h in doomed if h.proc.returncode is None]
        if running:
            log.warning(
                "orphaned_workers_killed",
                job_id=self.job_id,
                leaders=sorted({h.leader for h in running}),
                holder=holder,
                workers=[h.worker for h in running],
            )
        for h in running:
            with contextlib.suppress(ProcessLookupError):
                h.proc.kill()
        await asyncio.gather(*(h.proc.wait() for h in running), return_exceptions=True)
        for h in doomed:
            self.hosted.pop((h.leader, h.worker), None)

    def release(self, leader: str, workers: Collection[int]) -> dict[int, asyncio.subprocess.Process]:
        """Hand the running ``workers`` of ``leader`` to this node's own sidecar (it leads
        now and adopts them): they are no longer hosted, and stay its children."""
        out = {}
        for wid in workers:
            hosted = self.hosted.get((leader, wid))
            if hosted is not None and hosted.proc.returncode is None:
                del self.hosted[(leader, wid)]
                out[wid] = hosted.proc
        return out

    async def close(self, drain_s: float = 0.0) -> None:
        """Stop answering; give running workers ``drain_s`` to exit on their own (a leaving
        worker finishes its graceful scale-in), then kill them."""
        running = self.running()
        if running and drain_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(h.proc.wait() for h in running), return_exceptions=True), drain_s
                )
        for h in self.running():
            with contextlib.suppress(ProcessLookupError):
                h.proc.kill()
        await asyncio.gather(*(h.proc.wait() for h in running), return_exceptions=True)
        # Let the watchers publish the exits before the subscriptions go.
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    async def _reply(self, msg: Msg, reply: msgspec.Struct) -> None:
        if msg.reply:
            await msg.respond(msgspec.json.encode(reply))

    async def _on_spawn(self, msg: Msg) -> None:
        try:
            req = msgspec.json.decode(msg.data, type=SpawnRequest)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            await self._reply(msg, SpawnReply(error=f"malformed spawn request: {exc}"))
            return
        launch = req.request
        async with self._lock:  # one start at a time: a retried request finds the first one
            known = self.hosted.get((req.leader, launch.worker))
            if known is not None:
                await self._reply(msg, SpawnReply(pid=known.proc.pid))
                return
            reason = self.refuse()
            if not reason and launch.job_id != self.job_id:
                reason = f"this is the sidecar of job {self.job_id}, not {launch.job_id}"
            if not reason and self.argv is not None:
                reason = launch_refusal(launch, self.argv, self.env)
            if not reason and launch.gpu.node_id != self.node_id:
                reason = f"GPU {launch.gpu.node_id}/{launch.gpu.index} is not on node {self.node_id}"
            index = -1
            if not reason:
                try:
                    index = self.resolve(launch.gpu)
                except ValueError as exc:
                    reason = str(exc)
            if reason:
                log.error(
                    "spawn_refused",
                    job_id=self.job_id,
                    leader=req.leader,
                    worker=launch.worker,
                    reason=reason,
                )
                await self._reply(msg, SpawnReply(error=reason))
                return
            named = msgspec.structs.replace(launch, log_name=f"{req.leader}-worker-{launch.worker}.log")
            try:
                proc = await launch_local(named, device_index=index, log_dir=self.log_dir)
            except OSError as exc:
                await self._reply(msg, SpawnReply(error=f"cannot start {launch.argv[:1]}: {exc}"))
                return
            hosted = _Hosted(req.leader, launch.worker, proc)
            self.hosted[(req.leader, launch.worker)] = hosted
        watcher = asyncio.create_task(self._watch(hosted))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        log.info(
            "remote_worker_started",
            job_id=self.job_id,
            leader=req.leader,
            worker=launch.worker,
            pid=proc.pid,
            gpu=f"{launch.gpu.node_id}/{launch.gpu.index}",
        )
        await self._reply(msg, SpawnReply(pid=proc.pid))

    async def _watch(self, hosted: _Hosted) -> None:
        rc = await hosted.proc.wait()
        log.info(
            "remote_worker_exited",
            job_id=self.job_id,
            leader=hosted.leader,
            worker=hosted.worker,
            returncode=rc,
        )
        note = ExitNote(leader=hosted.leader, node=self.node_id, worker=hosted.worker, returncode=rc)
        with contextlib.suppress(Exception):  # the leader's poll finds it otherwise
            await self.nc.publish(subject(self.prefix, self.job_id, "exited"), msgspec.json.encode(note))

    def _status(self, leader: str) -> StatusReply:
        return StatusReply(
            workers={h.worker: h.proc.returncode for h in self.hosted.values() if h.leader == leader}
        )

    async def _on_signal(self, msg: Msg) -> None:
        try:
            req = msgspec.json.decode(msg.data, type=SignalRequest)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return
        hosted = self.hosted.get((req.leader, req.worker))
        if hosted is not None and hosted.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                hosted.proc.send_signal(req.signal)
        await self._reply(msg, self._status(req.leader))

    async def _on_adopt(self, msg: Msg) -> None:
        try:
            req = msgspec.json.decode(msg.data, type=AdoptRequest)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            await self._reply(msg, SpawnReply(error=f"malformed adopt request: {exc}"))
            return
        async with self._lock:
            hosted = self.hosted.get((req.previous, req.worker))
            if hosted is None or hosted.proc.returncode is not None:
                await self._reply(msg, SpawnReply(error=f"no running worker {req.worker} of {req.previous}"))
                return
            del self.hosted[(req.previous, req.worker)]
            hosted.leader = req.leader  # its exit note now goes to the new leader
            self.hosted[(req.leader, req.worker)] = hosted
        log.info("remote_worker_adopted", job_id=self.job_id, leader=req.leader, worker=req.worker)
        await self._reply(msg, SpawnReply(pid=hosted.proc.pid))

    async def _on_status(self, msg: Msg) -> None:
        try:
            req = msgspec.json.decode(msg.data, type=StatusRequest)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return
        await self._reply(msg, self._status(req.leader))
