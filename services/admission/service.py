"""admission: the front door for commands.

Consumes: request/reply commands on ``<prefix>.cmd.submit_job.<sender>``,
``cmd.cancel_job.<sender>``, ``cmd.set_tickets.<sender>`` and
``cmd.set_user_limits.<sender>`` (queue group
``admission``, so replicas share the load). ``<sender>`` is the user the command is
sent as; the server lets each client identity publish only with its own user there
(:mod:`shoal.auth`), so admission reads the authenticated user from the subject and
refuses a command that user may not send (``user_mismatch``, ``not_owner``,
``forbidden``) before deciding anything.
A request is msgpack, or JSON when the request carries the header
``Content-Type: application/json`` (and then the reply is JSON too).

Decides: :mod:`shoal.admission` (pure) against the folded cluster state.

Publishes: ``JobSubmitted`` / ``JobCancelled`` / ``TicketsSet`` / ``UserRegistered``
(a user's limits), then replies
``CommandAccepted`` (with the job id) or ``CommandRejected`` (with a code and one
message per problem). A rejected command publishes nothing.

Idempotency: ``JobSubmitted`` is appended with ``Nats-Expected-Last-Subject-Sequence: 0``
on ``<prefix>.job.<id>.submitted`` (:meth:`shoal.bus.Bus.publish_first`: after the
newest message there when none there decodes), so however many admission replicas
race, one submission per job id reaches the log; the loser answers as a duplicate
(it compares its spec with the one on the subject, so a different spec is
``job_exists``). A client that retries with the same ``job_id`` therefore never adds
a second job, however late its first attempt is handled; :class:`shoal.client.Client`
gives each ``submit`` call an id of its own and retries with it.

Deadline: a request may carry ``Shoal-Deadline`` (Unix seconds, the instant its sender
stops waiting); without it the deadline is ``default_deadline_s`` after admission read
the request. Once the deadline has passed, admission does not start a write: a request
whose deadline passed while it was queued (in a socket, behind a stopped process, in a
client's reconnect buffer) or while it waited for its job's or user's turn is answered
``deadline_exceeded`` and writes nothing. A write started before the deadline may be
stored after it (its ack can be late); the sender, which has given up, retries with
the same job id and gets the job as a duplicate. The deadline is compared with this
host's clock, so it holds to the accuracy of the clocks' synchronisation.

Concurrency: each request is handled in its own task (at most ``max_in_flight`` at
once; more wait in the subscription's queue). Requests that touch the same job are
handled one after the other (a lock per job id), and so are submissions (and
cancellations) of one user when that user has a limit (``max_active_jobs`` or
``max_gpus``): the decision counts the user's other jobs, so two of them decided at
once could both pass a limit that only one fits. A user's limits are read before the
lock is taken, so a ``UserRegistered`` that sets a first limit while submissions of
that user are in flight applies from the next submission on. Tickets are ordered per
user. The reply is sent as soon as the append is acknowledged; the locks are held until
this process's view has folded the event, so the next decision on that job or user
sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog
from nats.aio.msg import Msg
from shoal import admission, codec
from shoal import events as ev
from shoal.admin_commands import SetUserLimits
from shoal.auth import ADMIN_TOKEN, authorize_command, command_subject
from shoal.bus import AckTimeout, Bus, ConcurrencyConflict, Header, PublishRejected
from shoal.clock import Clock, WallClock
from shoal.ids import new_ulid
from shoal.projection import Projection
from shoal.telemetry import consumer_span

log = structlog.get_logger("shoal.admission")

JSON = "application/json"
COMMANDS = ("submit_job", "cancel_job", "set_tickets", "set_user_limits")

Reply = ev.CommandAccepted | ev.CommandRejected


class KeyedLocks:
    """One :class:`asyncio.Lock` per key, kept only while someone holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, keys: list[str], timeout_s: float) -> AsyncIterator[None]:
        """Hold every lock of ``keys``, taken in sorted order (so two holders of
        overlapping keys cannot deadlock).

        Raises:
            TimeoutError: not all of them within ``timeout_s`` (none is held then).
        """
        keys = sorted(set(keys))
        for key in keys:
            lock, users = self._locks.get(key, (None, 0))
            self._locks[key] = (lock or asyncio.Lock(), users + 1)
        held: list[asyncio.Lock] = []
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                for key in keys:
                    lock = self._locks[key][0]
                    await lock.acquire()
                    held.append(lock)
            yield
        finally:
            for lock in reversed(held):
                lock.release()
            for key in keys:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)


class AdmissionService:
    """Wiring around :mod:`shoal.admission`."""

    def __init__(
        self,
        bus: Bus,
        projection: Projection,
        limits: admission.Limits,
        clock: Clock | None = None,
        *,
        accept_submitted_at: bool = False,
        mqtt_bridge: bool = False,
        default_deadline_s: float = 10.0,
        max_in_flight: int = 256,
    ) -> None:
        self.bus = bus
        self.mqtt_bridge: Any = None
        """With ``mqtt_bridge=True``, a :class:`~shoal_services.admission.mqtt.MqttBridge`
        started and stopped with the service (MQTT devices submit through it)."""
        if mqtt_bridge:
            from shoal_services.admission.mqtt import MqttBridge

            self.mqtt_bridge = MqttBridge(bus.nc, bus.names.prefix)
        self.accept_submitted_at = accept_submitted_at
        """Trace replay (emulate mode): record ``SubmitJob.submitted_at`` as the arrival
        instant when it is not in the future. Off in production."""
        self.clock = clock or WallClock()
        self.projection = projection
        self.limits = limits
        self._subs: list[Any] = []
        self.default_deadline_s = default_deadline_s
        """The deadline of a request without a ``Shoal-Deadline`` header, from when it is read."""
        self.locks = KeyedLocks()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        for name in COMMANDS:
            self._subs.append(
                await self.bus.nc.subscribe(
                    command_subject(self.bus.names.prefix, name, "*"), queue="admission", cb=self._on_request
                )
            )
        if self.mqtt_bridge is not None:
            await self.mqtt_bridge.start()

    async def stop(self) -> None:
        if self.mqtt_bridge is not None:
            await self.mqtt_bridge.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.drain()
        self._subs.clear()
        if self._tasks:  # requests already read are answered before the connection closes
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _on_request(self, msg: Msg) -> None:
        """Start handling one request in a task of its own and return, so that the next
        one is read at once; with ``max_in_flight`` tasks running, wait for one to end."""
        received = time.time()
        await self._slots.acquire()
        task = asyncio.create_task(self._serve(msg, received))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _serve(self, msg: Msg, received: float) -> None:
        headers = msg.headers or {}
        as_json = headers.get(Header.CONTENT_TYPE.value, "").startswith(JSON)
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(service="admission", subject=msg.subject)
        replied = False

        async def respond(reply: Reply) -> None:
            nonlocal replied
            replied = True
            if isinstance(reply, ev.CommandRejected) and not reply.errors:
                reply = ev.CommandRejected(code=reply.code, message=reply.message, errors=(reply.message,))
            if msg.reply:
                await msg.respond(codec.encode_reply(reply, json=as_json))

        try:
            command, sender = msg.subject.rsplit(".", 2)[-2:]
            deadline = admission.deadline_of(
                headers.get(admission.DEADLINE_HEADER), received, self.default_deadline_s
            )
            if isinstance(deadline, admission.Rejected):
                await respond(deadline.reply())
                return
            # Continue the client's trace: the event this writes carries it to the allocator.
            with consumer_span(f"admission.{command}", headers, attributes={"shoal.sender": sender}):
                await self.handle(
                    msg.data, command, as_json, sender=sender, deadline=deadline, respond=respond
                )
        except Exception as exc:  # never leave a client hanging
            log.exception("admission_failed")
            if not replied:
                with contextlib.suppress(Exception):
                    await respond(ev.CommandRejected(code="internal", message=f"admission failed: {exc}"))

    async def handle(
        self,
        data: bytes,
        command: str,
        as_json: bool = False,
        *,
        sender: str = ADMIN_TOKEN,
        deadline: float | None = None,
        respond: Callable[[Reply], Awaitable[None]] | None = None,
    ) -> Reply:
        """Decode, authorize (``sender``: the user the server authenticated, from the
        command subject; :func:`shoal.auth.authorize_command`), decide, publish; return
        the reply, after passing it to ``respond`` when given.

        ``deadline`` (Unix seconds; default ``default_deadline_s`` from now): no write
        starts after it. ``respond`` gets the reply as soon as it is known; the call
        returns once the job's and user's locks are released (the event folded)."""
        if deadline is None:
            deadline = time.time() + self.default_deadline_s
        checked = self._check(data, command, as_json, sender)
        if isinstance(checked, Reply):
            reply = checked
        else:
            cmd, key, keys = checked
            try:
                async with self.locks.hold(keys, deadline - time.time()):
                    reply, seq = await self._decide_and_publish(cmd, key, deadline, sender)
                    if respond is not None:
                        await respond(reply)
                        respond = None
                    if seq:
                        await self._wait_folded(seq)
            except TimeoutError:
                reply = self._late(deadline, "waited for earlier requests on the same job or user")
        if respond is not None:
            await respond(reply)
        return reply

    @staticmethod
    def _late(deadline: float, why: str) -> ev.CommandRejected:
        late = time.time() - deadline
        log.info("deadline_exceeded", late_s=round(late, 3), why=why)
        return ev.CommandRejected(
            code="deadline_exceeded",
            message=f"the request's deadline passed {late:.3f}s ago ({why}); nothing was written",
        )

    async def _wait_folded(self, seq: int) -> None:
        """Until this process's view has folded ``seq`` (the locks are held meanwhile)."""
        while True:
            try:
                await self.projection.wait_for(seq, timeout_s=10.0)
                return
            except TimeoutError:
                log.warning("view_behind", seq=seq, folded=self.projection.last_seq)

    def _check(
        self, data: bytes, command: str, as_json: bool, sender: str
    ) -> Reply | tuple[Any, str, list[str]]:
        """Decode and authorize: a rejection, or the command, the id it addresses (a
        new one for a submission without ``job_id``) and the keys of the locks that
        order it (:class:`KeyedLocks`)."""
        try:
            cmd = codec.decode_command(data, json=as_json)
        except codec.MessageTooLarge as exc:
            return ev.CommandRejected(code="too_large", message=str(exc))
        except codec.UnknownFields as exc:
            code = "invalid_spec" if exc.in_spec else "invalid_command"
            return ev.CommandRejected(code=code, message=str(exc), errors=exc.errors)
        except codec.MalformedMessage as exc:
            return ev.CommandRejected(code="invalid_command", message=str(exc), errors=(str(exc),))
        if cmd.name != command:
            return ev.CommandRejected(
                code="wrong_subject", message=f"a {cmd.name} command was sent to the {command} subject"
            )
        state = self.projection.state
        owner = None
        if isinstance(cmd, ev.CancelJob) and cmd.job_id in state.jobs:
            owner = state.jobs[cmd.job_id].spec.user
        refusal = authorize_command(cmd, sender, owner)
        if refusal is not None:
            log.info("command_refused", code=refusal[0], sender=sender, command=command)
            return ev.CommandRejected(code=refusal[0], message=refusal[1], errors=(refusal[1],))
        user: str | None
        if isinstance(cmd, ev.SubmitJob):
            key = cmd.job_id or new_ulid()
            keys = [f"job:{key}"]
            user = cmd.spec.user
        elif isinstance(cmd, ev.CancelJob):
            key, keys, user = cmd.job_id, [f"job:{cmd.job_id}"], owner
        elif isinstance(cmd, ev.SetTickets):
            return cmd, cmd.user, [f"tickets:{cmd.user}"]
        elif isinstance(cmd, SetUserLimits):
            # Under the user's submission lock too: a submission decided on the old
            # limits is written before the new ones are, never after.
            return cmd, cmd.user, [f"tickets:{cmd.user}", f"user:{cmd.user}"]
        else:
            return ev.CommandRejected(code="unsupported", message=f"admission does not handle {cmd.name}")
        if user is not None and any(admission.user_limits(state, user, self.limits)):
            keys.append(f"user:{user}")
        return cmd, key, keys

    async def _decide_and_publish(
        self, cmd: Any, key: str, deadline: float, sender: str
    ) -> tuple[Reply, int]:
        """Decide on the current view and append the event unless the deadline has
        passed; the reply and the stream sequence the view must fold (0: nothing written)."""
        state = self.projection.state
        now = self.clock.now()
        at = now
        if isinstance(cmd, ev.SubmitJob) and cmd.submitted_at is not None:
            if not self.accept_submitted_at:
                return ev.CommandRejected(
                    code="submitted_at_not_allowed",
                    message="submitted_at is only accepted by an installation that replays traces",
                ), 0
            if not 0 <= cmd.submitted_at <= now + 1e-3:  # also refuses NaN
                return ev.CommandRejected(
                    code="invalid_submitted_at",
                    message=f"submitted_at {cmd.submitted_at} is not in [0, now] (now {now:.3f})",
                ), 0
            at = cmd.submitted_at
        if isinstance(cmd, ev.SubmitJob):
            decision = admission.decide_submit(state, cmd, key, self.limits)
        elif isinstance(cmd, ev.CancelJob):
            # Again under the job's lock: the job may have entered the view since (its
            # submission still being folded when the request was checked).
            owner = state.jobs[cmd.job_id].spec.user if cmd.job_id in state.jobs else None
            refusal = authorize_command(cmd, sender, owner)
            if refusal is not None:
                return ev.CommandRejected(code=refusal[0], message=refusal[1], errors=(refusal[1],)), 0
            decision = admission.decide_cancel(state, cmd)
        elif isinstance(cmd, SetUserLimits):
            decision = admission.decide_set_user_limits(state, cmd)
        else:
            decision = admission.decide_set_tickets(state, cmd)
        if isinstance(decision, admission.Rejected):
            log.info("command_rejected", code=decision.code, message=decision.message)
            return decision.reply(), 0
        if decision.event is None:
            return ev.CommandAccepted(id=decision.id, duplicate=True), 0
        left = deadline - time.time()
        if left <= 0:  # the sender has stopped waiting: write nothing
            return self._late(deadline, "before the write"), 0
        env = codec.wrap(decision.event, at=at)
        try:
            if isinstance(decision.event, ev.JobSubmitted):
                result = await self.bus.publish_first(env, timeout_s=left)
            else:
                result = await self.bus.publish(env, timeout_s=left)
        except ConcurrencyConflict:
            # Another replica submitted this job id first: compare with what it wrote.
            return await self._already_submitted(cmd, decision.id), 0
        except AckTimeout as exc:
            log.warning("write_unconfirmed", id=decision.id, error=str(exc))
            return ev.CommandRejected(
                code="unconfirmed",
                message=f"no ack for the write of {decision.id} before the deadline: it may or may not "
                "be in the log; retry with the same job id",
            ), 0
        except PublishRejected as exc:
            return ev.CommandRejected(code="log_refused", message=str(exc)), 0
        log.info("command_accepted", id=decision.id, event_type=env.type, stream_seq=result.seq)
        return ev.CommandAccepted(id=decision.id, event_id=env.id, duplicate=result.duplicate), result.seq

    async def _already_submitted(self, cmd: ev.SubmitJob, job_id: str) -> Reply:
        """The answer to a submission whose job id is on the log already (written by
        another replica or an earlier attempt this view has not folded yet), read from
        the log itself rather than waiting for the view."""
        _, found = await self.bus.last_valid_on_subject(
            self.bus.names.subject(ev.JobSubmitted(job_id, cmd.spec))
        )
        existing = found[1].event if found is not None else None
        if not isinstance(existing, ev.JobSubmitted):
            return ev.CommandRejected(code="log_refused", message=f"a conflicting append on job {job_id!r}")
        if existing.spec != cmd.spec:
            message = f"job {job_id!r} already exists with a different spec"
            return ev.CommandRejected(code="job_exists", message=message, errors=(message,))
        return ev.CommandAccepted(id=job_id, duplicate=True)
