"""The MQTT front door: devices submit jobs over MQTT and get the outcome back.

NATS's MQTT listener maps MQTT topic ``a/b/c`` to NATS subject ``a.b.c``, so this
bridge is a plain NATS subscriber; it needs no MQTT library.

Consumes: ``<prefix>.mqtt.submit.<user>`` — MQTT topic ``<prefix>/mqtt/submit/<user>``
(a dotted prefix becomes slashes), QoS 0 or 1. The payload is a JSON object with
the :class:`~shoal.events.JobSpec` fields, optionally ``job_id`` (a client-chosen
id: it makes the submission idempotent) and ``user`` (which must then equal the
topic's). Queue group ``admission-mqtt``, so bridge replicas share the load.

Decides: nothing itself. It turns the payload into the same ``cmd.submit_job``
request any NATS client sends (JSON, ``Content-Type: application/json``) and asks
admission on ``<prefix>.cmd.submit_job.<user>``: one path, one set of rules. The
topic's user is the device's: with authentication on, the server lets an MQTT
user publish only on its own submit topic and read only its own result topic
(:mod:`shoal.auth`).

Publishes: the outcome as JSON on ``<prefix>.mqtt.result.<user>`` — MQTT topic
``<prefix>/mqtt/result/<user>``: admission's reply (``type`` ``reply.accepted`` with
``id`` and ``duplicate``, or ``reply.rejected`` with ``code``, ``message`` and
``errors``) plus ``job_id`` (the accepted id, or the one the device sent) and
``user``. A payload that never reaches admission gets a rejection from the bridge
(``invalid_json``, ``invalid_spec``, ``user_mismatch``, ``too_large``) or, when no
admission service answers, ``unavailable``.

Size: a payload over :data:`~shoal.events.MAX_MESSAGE_BYTES` (256 KiB) is answered
``too_large``. One over the NATS server's ``max_payload`` (1 MiB for the embedded
server) never reaches the bridge: the server closes the device's MQTT connection
(NATS does this for any oversized MQTT PUBLISH), so there is nobody to answer.

Delivery: results are published once, to subscribers connected at that moment (the
device subscribes to its result topic before it publishes). A device that sees no
result re-publishes with the same ``job_id``; admission answers a repeat with
``duplicate: true`` and writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from shoal.admission import DEADLINE_HEADER
from shoal.bus import Names
from shoal.events import MAX_MESSAGE_BYTES

log = structlog.get_logger("shoal.admission.mqtt")

JSON = "application/json"
QUEUE = "admission-mqtt"


def mqtt_topic(subject: str) -> str:
    """The MQTT topic of a NATS subject (``shoal.mqtt.result.alice`` -> ``shoal/mqtt/result/alice``)."""
    return subject.replace(".", "/")


class MqttSubjects:
    """The bridge's subjects for one prefix."""

    def __init__(self, prefix: str = "shoal") -> None:
        self.names = Names(prefix)
        self.submit_wildcard = f"{prefix}.mqtt.submit.*"

    def submit(self, user: str) -> str:
        return f"{self.names.prefix}.mqtt.submit.{user}"

    def result(self, user: str) -> str:
        return f"{self.names.prefix}.mqtt.result.{user}"


def _rejected(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "reply.rejected", "code": code, "message": message, "errors": [message], **extra}


class MqttBridge:
    """Subscribes to MQTT submissions on the NATS side and answers on the result topic.

    Args:
        nc: a connected NATS client (admission's own connection will do).
        prefix: the installation's subject prefix.
        timeout_s: how long to wait for admission's answer.
    """

    def __init__(self, nc: NatsClient, prefix: str = "shoal", *, timeout_s: float = 10.0) -> None:
        self.nc = nc
        self.subjects = MqttSubjects(prefix)
        self.timeout_s = timeout_s
        self._sub: Any = None
        self.handled = 0

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subjects.submit_wildcard, queue=QUEUE, cb=self._on_submit)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.drain()

    async def _on_submit(self, msg: Msg) -> None:
        user = msg.subject.rsplit(".", 1)[-1]
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(service="admission-mqtt", user=user)
        try:
            result = await self.handle(user, msg.data)
        except Exception as exc:  # never leave a device without an answer
            log.exception("mqtt_submit_failed")
            result = _rejected("internal", f"the MQTT bridge failed: {exc}", user=user)
        self.handled += 1
        log.info(
            "mqtt_submit", outcome=result.get("type"), code=result.get("code"), job_id=result.get("job_id")
        )
        await self.nc.publish(self.subjects.result(user), json.dumps(result).encode())

    async def handle(self, user: str, data: bytes) -> dict[str, Any]:
        """Turn one MQTT submission into an admission request; return the result to publish."""
        if len(data) > MAX_MESSAGE_BYTES:
            return _rejected(
                "too_large",
                f"payload of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit",
                user=user,
                job_id=None,  # every reply names both; no job id could be read
            )
        try:
            payload = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            return _rejected("invalid_json", f"payload is not JSON: {exc}", user=user, job_id=None)
        except RecursionError:
            return _rejected("invalid_json", "payload is not JSON: nested too deeply", user=user, job_id=None)
        if not isinstance(payload, dict):
            return _rejected(
                "invalid_json",
                f"payload must be a JSON object of job spec fields, not {type(payload).__name__}",
                user=user,
                job_id=None,
            )
        job_id = payload.pop("job_id", None)
        extra = {"user": user, "job_id": job_id}
        if "user" in payload and payload["user"] != user:
            return _rejected(
                "user_mismatch",
                f"payload user {payload['user']!r} does not match the topic's user {user!r}",
                **extra,
            )
        from shoal.client import CommandError, spec_to_wire

        try:
            spec = spec_to_wire({**payload, "user": user})
        except CommandError as exc:
            return {**_rejected(exc.code, exc.message), "errors": list(exc.errors), **extra}
        body: dict[str, Any] = {"type": "cmd.submit_job", "spec": spec}
        if job_id is not None:
            body["job_id"] = job_id
        subject = self.subjects.names.cmd("submit_job", user)
        try:
            # Admission starts no write after the bridge stops waiting (it answers `unavailable`).
            deadline = f"{time.time() + self.timeout_s:.3f}"
            reply = await self.nc.request(
                subject,
                json.dumps(body).encode(),
                timeout=self.timeout_s,
                headers={"Content-Type": JSON, DEADLINE_HEADER: deadline},
            )
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
            return _rejected(
                "unavailable",
                f"no admission service answered on {subject}; retry with the same job_id",
                **extra,
            )
        answer = json.loads(reply.data)
        if answer.get("type") == "reply.accepted":
            extra["job_id"] = answer.get("id")
        elif not answer.get("errors"):
            answer["errors"] = [answer.get("message", "")]  # each problem listed, as the SDK does
        return {**answer, **extra}
