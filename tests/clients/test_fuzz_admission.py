"""Fuzzing the decoders and admission's three entry paths (NATS JSON, msgpack, MQTT
bridge) with hypothesis, against a real nats-server and a real admission service:
arbitrary bytes and arbitrary JSON-ish commands never crash it, always get a reply
whose code docs/clients.md lists, and a rejected input writes nothing to the log.

The service runs on its own event loop in a thread, so hypothesis drives plain
synchronous tests. Example counts are kept small (the whole module runs in well
under a minute)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from shoal import admission, codec
from shoal import events as ev
from shoal.bus import Bus
from shoal.nats_server import EmbeddedNats
from shoal.projection import Projection
from shoal_services.admission.mqtt import MqttBridge
from shoal_services.admission.service import AdmissionService

pytestmark = pytest.mark.integration

T = TypeVar("T")

DOCUMENTED = {
    "invalid_command",
    "invalid_spec",
    "unknown_user",
    "limit_exceeded",
    "job_exists",
    "too_large",
    "unknown_job",
    "wrong_subject",
    "submitted_at_not_allowed",
    "invalid_submitted_at",
    "invalid_json",
    "user_mismatch",
}
"""Codes bad input may get (docs/clients.md). ``internal``, ``log_refused`` and
``unavailable`` are documented too but mean a failure of shoal, not of the input."""

FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

json_leaf = (
    hs.none()
    | hs.booleans()
    | hs.integers(min_value=-(2**70), max_value=2**70)
    | hs.floats(allow_nan=False)
    | hs.text(max_size=20)
)
json_value = hs.recursive(
    json_leaf,
    lambda inner: hs.lists(inner, max_size=4) | hs.dictionaries(hs.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
spec_field = hs.sampled_from([*ev.JobSpec.__struct_fields__, "max_gpu", "type", ""])
spec_like = hs.dictionaries(spec_field, json_value, max_size=6).map(lambda d: {"user": "alice", **d})
command_like = hs.one_of(
    hs.builds(
        lambda s, j: {"type": "cmd.submit_job", "spec": s, **j},
        spec_like,
        hs.dictionaries(hs.sampled_from(["job_id", "submitted_at", "extra"]), json_value, max_size=2),
    ),
    hs.builds(lambda j, r: {"type": "cmd.cancel_job", "job_id": j, "reason": r}, json_value, json_value),
    hs.builds(lambda u, t: {"type": "cmd.set_tickets", "user": u, "tickets": t}, json_value, json_value),
    hs.dictionaries(hs.text(max_size=10), json_value, max_size=4),
)


class Loop:
    """An event loop in a thread running a bus, a projection and admission with its MQTT bridge."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = url

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def start(self) -> None:
        self.bus = await Bus.connect(self.url, prefix="fuzz", creds=os.environ["NATS_CREDS"])
        await self.bus.publish_many(
            [
                ev.NodeRegistered(
                    node_id="n0", gpus=tuple(ev.GpuInfo(index=i, gpu_type="V100") for i in range(4))
                ),
                ev.UserRegistered(user="alice"),
            ]
        )
        self.projection = Projection(self.bus)
        await self.projection.start()
        await self.projection.wait_ready()
        self.service = AdmissionService(self.bus, self.projection, admission.Limits(enforce_users=True))
        await self.service.start()
        self.bridge = MqttBridge(self.bus.nc, "fuzz", timeout_s=5)

    async def stop(self) -> None:
        await self.service.stop()
        await self.projection.stop()
        await self.bus.close()

    async def request(self, name: str, data: bytes, as_json: bool) -> tuple[dict[str, Any], int, int]:
        before = await self.bus.last_seq()
        headers = {"Content-Type": "application/json"} if as_json else None
        msg = await self.bus.nc.request(self.bus.names.cmd(name), data, timeout=10, headers=headers)
        reply = json.loads(msg.data) if as_json else msgspec.msgpack.decode(msg.data)
        return reply, before, await self.bus.last_seq()

    async def mqtt(self, data: bytes) -> tuple[dict[str, Any], int, int]:
        before = await self.bus.last_seq()
        result = await self.bridge.handle("alice", data)
        return result, before, await self.bus.last_seq()


@pytest.fixture(scope="module")
def fuzz_loop(nats_server: EmbeddedNats) -> Iterator[Loop]:
    loop = Loop(nats_server.url)
    loop.run(loop.start())
    try:
        yield loop
    finally:
        loop.run(loop.stop())
        loop.loop.call_soon_threadsafe(loop.loop.stop)
        loop.thread.join(10)


def encodings(body: Any) -> list[tuple[bytes, bool]]:
    """``body`` as JSON, and as msgpack when msgpack can carry it (no int beyond 64 bits)."""
    out = [(json.dumps(body).encode(), True)]
    try:
        out.append((msgspec.msgpack.encode(body), False))
    except OverflowError:
        pass
    return out


def check(reply: dict[str, Any], before: int, after: int) -> None:
    assert reply["type"] in ("reply.accepted", "reply.rejected"), reply
    if reply["type"] == "reply.rejected":
        assert reply["code"] in DOCUMENTED, reply
        assert reply["errors"], reply
        assert after == before, f"a rejected input wrote to the log: {reply}"


@FUZZ
@given(hs.binary(max_size=2000))
def test_decoders_never_crash_on_bytes(data: bytes) -> None:
    for decode in (codec.decode, codec.decode_json, codec.decode_reply):
        try:
            decode(data)
        except codec.DecodeFailure:
            pass
    for as_json in (False, True):
        try:
            codec.decode_command(data, json=as_json)
        except codec.DecodeFailure:
            pass


@FUZZ
@given(command_like)
def test_decode_command_never_crashes_on_commands(body: dict[str, Any]) -> None:
    for data, as_json in encodings(body):
        try:
            cmd = codec.decode_command(data, json=as_json)
        except codec.DecodeFailure:
            continue
        assert isinstance(cmd, ev.SubmitJob | ev.CancelJob | ev.SetTickets | ev.Reconfigure)


@FUZZ
@given(hs.binary(max_size=2000), hs.sampled_from(["submit_job", "cancel_job", "set_tickets"]), hs.booleans())
def test_admission_answers_arbitrary_bytes(fuzz_loop: Loop, data: bytes, name: str, as_json: bool) -> None:
    check(*fuzz_loop.run(fuzz_loop.request(name, data, as_json)))


@FUZZ
@given(command_like)
def test_admission_answers_arbitrary_commands(fuzz_loop: Loop, body: dict[str, Any]) -> None:
    name = str(body.get("type", "cmd.submit_job")).removeprefix("cmd.")
    name = name if name in ("submit_job", "cancel_job", "set_tickets") else "submit_job"
    for data, as_json in encodings(body):
        check(*fuzz_loop.run(fuzz_loop.request(name, data, as_json)))


@FUZZ
@given(hs.one_of(hs.binary(max_size=2000), spec_like.map(lambda d: json.dumps(d).encode())))
def test_mqtt_bridge_answers_arbitrary_payloads(fuzz_loop: Loop, data: bytes) -> None:
    result, before, after = fuzz_loop.run(fuzz_loop.mqtt(data))
    check(result, before, after)
    assert result["user"] == "alice"
