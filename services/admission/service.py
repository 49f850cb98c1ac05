"""admission: the front door for commands.

Consumes: request/reply commands on ``<prefix>.cmd.submit_job.<sender>``,
``cmd.cancel_job.<sender>`` and ``cmd.set_tickets.<sender>`` (queue group
``admission``, so replicas share the load). ``<sender>`` is the user the command is
sent as; the server lets each client identity publish only with its own user there
(:mod:`shoal.auth`), so admission reads the authenticated user from the subject and
refuses a command that user may not send (``user_mismatch``, ``not_owner``,
``forbidden``) before deciding anything.
A request is msgpack, or JSON when the request carries the header
``Content-Type: application/json`` (and then the reply is JSON too).

Decides: :mod:`shoal.admission` (pure) against the folded cluster state.

Publishes: ``JobSubmitted`` / ``JobCancelled`` / ``TicketsSet``, then replies
``CommandAccepted`` (with the job id) or ``CommandRejected`` (with a code and one
message per problem). A rejected command publishes nothing.

Idempotency: ``JobSubmitted`` is appended with ``Nats-Expected-Last-Subject-Sequence: 0``
on ``<prefix>.job.<id>.submitted`` (:meth:`shoal.bus.Bus.publish_first`: after the
newest message there when none there decodes), so however many admission replicas
race, one submission per job id reaches the log; the loser answers as a duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog
from nats.aio.msg import Msg
from shoal import admission, codec
from shoal import events as ev
from shoal.auth import ADMIN_TOKEN, authorize_command, command_subject
from shoal.bus import Bus, ConcurrencyConflict, Header, PublishRejected
from shoal.clock import Clock, WallClock
from shoal.ids import new_ulid
from shoal.projection import Projection

log = structlog.get_logger("shoal.admission")

JSON = "application/json"
COMMANDS = ("submit_job", "cancel_job", "set_tickets")


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
        self._lock = asyncio.Lock()

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

    async def _on_request(self, msg: Msg) -> None:
        as_json = (msg.headers or {}).get(Header.CONTENT_TYPE.value, "").startswith(JSON)
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(service="admission", subject=msg.subject)
        try:
            command, sender = msg.subject.rsplit(".", 2)[-2:]
            reply = await self.handle(msg.data, command, as_json, sender=sender)
        except Exception as exc:  # never leave a client hanging
            log.exception("admission_failed")
            reply = ev.CommandRejected(code="internal", message=f"admission failed: {exc}")
        if isinstance(reply, ev.CommandRejected) and not reply.errors:
            reply = ev.CommandRejected(code=reply.code, message=reply.message, errors=(reply.message,))
        if msg.reply:
            await msg.respond(codec.encode_reply(reply, json=as_json))

    async def handle(
        self, data: bytes, command: str, as_json: bool = False, *, sender: str = ADMIN_TOKEN
    ) -> ev.CommandAccepted | ev.CommandRejected:
        """Decode, authorize (``sender``: the user the server authenticated, from the
        command subject; :func:`shoal.auth.authorize_command`), decide, publish; return
        the reply."""
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
        owner = None
        if isinstance(cmd, ev.CancelJob) and cmd.job_id in self.projection.state.jobs:
            owner = self.projection.state.jobs[cmd.job_id].spec.user
        refusal = authorize_command(cmd, sender, owner)
        if refusal is not None:
            log.info("command_refused", code=refusal[0], sender=sender, command=command)
            return ev.CommandRejected(code=refusal[0], message=refusal[1], errors=(refusal[1],))
        # One decision at a time per process, so a decision always sees the previous one's event.
        async with self._lock:
            return await self._decide_and_publish(cmd)

    async def _decide_and_publish(self, cmd: Any) -> ev.CommandAccepted | ev.CommandRejected:
        state = self.projection.state
        now = self.clock.now()
        at = now
        if isinstance(cmd, ev.SubmitJob) and cmd.submitted_at is not None:
            if not self.accept_submitted_at:
                return ev.CommandRejected(
                    code="submitted_at_not_allowed",
                    message="submitted_at is only accepted by an installation that replays traces",
                )
            if not 0 <= cmd.submitted_at <= now + 1e-3:  # also refuses NaN
                return ev.CommandRejected(
                    code="invalid_submitted_at",
                    message=f"submitted_at {cmd.submitted_at} is not in [0, now] (now {now:.3f})",
                )
            at = cmd.submitted_at
        if isinstance(cmd, ev.SubmitJob):
            job_id = cmd.job_id or new_ulid()
            decision = admission.decide_submit(state, cmd, job_id, self.limits)
        elif isinstance(cmd, ev.CancelJob):
            decision = admission.decide_cancel(state, cmd)
        elif isinstance(cmd, ev.SetTickets):
            decision = admission.decide_set_tickets(state, cmd)
        else:
            return ev.CommandRejected(code="unsupported", message=f"admission does not handle {cmd.name}")
        if isinstance(decision, admission.Rejected):
            log.info("command_rejected", code=decision.code, message=decision.message)
            return decision.reply()
        if decision.event is None:
            return ev.CommandAccepted(id=decision.id, duplicate=True)
        env = codec.wrap(decision.event, at=at)
        try:
            if isinstance(decision.event, ev.JobSubmitted):
                result = await self.bus.publish_first(env)
            else:
                result = await self.bus.publish(env)
        except ConcurrencyConflict:
            # Another replica submitted this job id first: decide again on the caught-up state.
            await self.projection.wait_for(await self.bus.last_seq())
            again = admission.decide_submit(self.projection.state, cmd, decision.id, self.limits)
            if isinstance(again, admission.Rejected):
                return again.reply()
            return ev.CommandAccepted(id=decision.id, duplicate=True)
        except PublishRejected as exc:
            return ev.CommandRejected(code="log_refused", message=str(exc))
        await self.projection.wait_for(result.seq)
        log.info("command_accepted", id=decision.id, event_type=env.type, stream_seq=result.seq)
        return ev.CommandAccepted(id=decision.id, event_id=env.id, duplicate=result.duplicate)
