"""MQTT devices submit jobs through the embedded server's MQTT listener and get the
outcome on their result topic: with aiomqtt, and with Debian's mosquitto_pub /
mosquitto_sub as separate processes. A real nats-server with MQTT on, a real
admission service with its MQTT bridge."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiomqtt
import msgspec
import pytest
from shoal import admission
from shoal import events as ev
from shoal import state as st
from shoal.auth import CredentialStore
from shoal.bus import Bus
from shoal.nats_server import EmbeddedNats
from shoal.projection import Projection
from shoal_services.admission.service import AdmissionService

pytestmark = pytest.mark.integration

_prefixes = itertools.count(1)


#: MQTT devices authenticate with a user name and password (MQTT has no nkeys): the
#: server admits these, each allowed only its own submit and result topics.
PASSWORDS = {"alice": "alice-secret", "mallory": "mallory-secret"}


@pytest.fixture(scope="module")
def mqtt_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    creds = CredentialStore(tmp_path_factory.mktemp("mqtt-creds"))
    creds.ensure("admin")
    for user, password in PASSWORDS.items():
        creds.ensure("client", user, mqtt_password=password)
    with EmbeddedNats(
        store_dir=tmp_path_factory.mktemp("mqtt-js"), mqtt_port=-1, creds_dir=creds.directory, prefix="*"
    ) as server:
        server.admin_creds = str(creds.path("admin"))  # type: ignore[attr-defined]
        assert server.mqtt_listen_port, "the MQTT listener did not come up"
        yield server


class Installation:
    def __init__(self, bus: Bus, service: AdmissionService, port: int) -> None:
        self.bus = bus
        self.service = service
        self.port = port
        self.topic_prefix = bus.names.prefix.replace(".", "/")

    def submit_topic(self, user: str) -> str:
        return f"{self.topic_prefix}/mqtt/submit/{user}"

    def result_topic(self, user: str) -> str:
        return f"{self.topic_prefix}/mqtt/result/{user}"

    async def submitted(self) -> list[ev.JobSubmitted]:
        return [e.event async for _, e in self.bus.replay() if isinstance(e.event, ev.JobSubmitted)]

    async def fingerprint(self) -> tuple[int, str]:
        return await self.bus.last_seq(), st.digest(self.service.projection.state)


@pytest.fixture
async def inst(mqtt_server: EmbeddedNats) -> AsyncIterator[Installation]:
    bus = await Bus.connect(
        mqtt_server.url,
        prefix=f"mq{next(_prefixes)}",
        creds=mqtt_server.admin_creds,  # type: ignore[attr-defined]
    )
    await bus.publish_many(
        [
            ev.NodeRegistered(
                node_id="n0", gpus=tuple(ev.GpuInfo(index=i, gpu_type="A100") for i in range(8))
            ),
            ev.UserRegistered(user="alice"),
        ]
    )
    projection = Projection(bus)
    await projection.start()
    await projection.wait_ready()
    service = AdmissionService(bus, projection, admission.Limits(enforce_users=True), mqtt_bridge=True)
    await service.start()
    assert mqtt_server.mqtt_listen_port is not None
    try:
        yield Installation(bus, service, mqtt_server.mqtt_listen_port)
    finally:
        await service.stop()
        await projection.stop()
        await bus.close()


SPEC = {"model": "resnet50", "min_gpus": 1, "max_gpus": 4, "requested_gpus": 2, "total_iterations": 500}


async def mqtt_roundtrip(inst: Installation, user: str, payload: bytes, *, qos: int = 1) -> dict[str, Any]:
    """Subscribe to the user's result topic, publish one submission, return the result."""
    async with aiomqtt.Client(
        "127.0.0.1",
        inst.port,
        protocol=aiomqtt.ProtocolVersion.V311,
        username=user,
        password=PASSWORDS[user],
    ) as mq:
        await mq.subscribe(inst.result_topic(user), qos=qos)  # returns after the SUBACK
        await mq.publish(inst.submit_topic(user), payload, qos=qos)
        async with asyncio.timeout(30):
            async for message in mq.messages:
                assert str(message.topic) == inst.result_topic(user)
                assert isinstance(message.payload, bytes)
                return json.loads(message.payload)  # type: ignore[no-any-return]
    raise AssertionError("no result")


@pytest.mark.parametrize("qos", [0, 1])
async def test_aiomqtt_device_submits_and_gets_the_outcome(inst: Installation, qos: int) -> None:
    result = await mqtt_roundtrip(
        inst, "alice", json.dumps({**SPEC, "job_id": f"dev-{qos}"}).encode(), qos=qos
    )
    assert result["type"] == "reply.accepted"
    assert (result["job_id"], result["user"], result["duplicate"]) == (f"dev-{qos}", "alice", False)
    [submitted] = await inst.submitted()
    assert submitted.job_id == f"dev-{qos}"
    assert submitted.spec == msgspec.convert({"user": "alice", **SPEC}, ev.JobSpec)
    # The same job_id again is answered as a duplicate and adds nothing.
    before = await inst.fingerprint()
    again = await mqtt_roundtrip(
        inst, "alice", json.dumps({**SPEC, "job_id": f"dev-{qos}"}).encode(), qos=qos
    )
    assert again["type"] == "reply.accepted" and again["duplicate"] is True
    assert await inst.fingerprint() == before


@pytest.mark.parametrize(
    ("user", "payload", "code", "fragment"),
    [
        ("alice", b"{not json", "invalid_json", "payload is not JSON"),
        ("alice", b"[1, 2]", "invalid_json", "must be a JSON object of job spec fields, not list"),
        ("alice", json.dumps({**SPEC, "min_gpus": 0}).encode(), "invalid_command", "`$.spec.min_gpus`"),
        (
            "alice",
            json.dumps({**SPEC, "min_gpus": 4, "max_gpus": 2}).encode(),
            "invalid_spec",
            "min_gpus (4) is greater than max_gpus (2)",
        ),
        ("alice", json.dumps({**SPEC, "gpu_type": "K80"}).encode(), "invalid_spec", "unknown gpu_type 'K80'"),
        (
            "alice",
            json.dumps({**SPEC, "max_gpus": "four"}).encode(),
            "invalid_command",
            "Expected `int`, got `str`",
        ),
        ("alice", json.dumps({**SPEC, "maxgpus": 4}).encode(), "invalid_spec", "unknown field 'maxgpus'"),
        (
            "alice",
            json.dumps({**SPEC, "user": "bob"}).encode(),
            "user_mismatch",
            "does not match the topic's user 'alice'",
        ),
        (
            "alice",
            json.dumps({**SPEC, "name": "x" * 300_000}).encode(),
            "too_large",
            "exceeds the 262144-byte limit",
        ),
        ("mallory", json.dumps(SPEC).encode(), "unknown_user", "user 'mallory' is not registered"),
    ],
    ids=[
        "garbage",
        "not_object",
        "zero_gpus",
        "min_above_max",
        "unknown_type",
        "non_numeric",
        "typo",
        "user_mismatch",
        "oversized",
        "unknown_user",
    ],
)
async def test_bad_mqtt_payload_gets_a_rejection_on_the_result_topic(
    inst: Installation, user: str, payload: bytes, code: str, fragment: str
) -> None:
    before = await inst.fingerprint()
    result = await mqtt_roundtrip(inst, user, payload)
    assert result["type"] == "reply.rejected"
    assert result["code"] == code
    assert fragment in result["message"]
    assert result["errors"] and result["user"] == user
    assert "job_id" in result  # every reply names the job id (null when none could be read)
    assert await inst.fingerprint() == before, "a rejected submission writes nothing"


@pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("mosquitto_sub", "mosquitto_pub", "stdbuf")),
    reason="mosquitto clients (and stdbuf) not installed",
)
async def test_mosquitto_clients(inst: Installation, tmp_path: Path) -> None:
    async def device(user: str, payload: str) -> dict[str, Any]:
        sub = await asyncio.create_subprocess_exec(
            # Line-buffered, so the SUBACK line reaches us while mosquitto_sub waits.
            "stdbuf",
            "-oL",
            "mosquitto_sub",
            "-h",
            "127.0.0.1",
            "-p",
            str(inst.port),
            "-V",
            "mqttv311",
            "-u",
            user,
            "-P",
            PASSWORDS[user],
            "-q",
            "1",
            "-t",
            inst.result_topic(user),
            "-C",
            "1",
            "-W",
            "60",
            "-d",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert sub.stdout is not None
        # -d prints the protocol exchange: publish only once the subscription is acknowledged.
        async with asyncio.timeout(30):
            while b"SUBACK" not in (line := await sub.stdout.readline()):
                assert line, "mosquitto_sub exited before subscribing"
        pub = await asyncio.create_subprocess_exec(
            "mosquitto_pub",
            "-h",
            "127.0.0.1",
            "-p",
            str(inst.port),
            "-V",
            "mqttv311",
            "-u",
            user,
            "-P",
            PASSWORDS[user],
            "-q",
            "1",
            "-t",
            inst.submit_topic(user),
            "-m",
            payload,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, pub_err = await asyncio.wait_for(pub.communicate(), 30)
        assert pub.returncode == 0, pub_err.decode()
        rest, sub_err = await asyncio.wait_for(sub.communicate(), 60)
        assert sub.returncode == 0, sub_err.decode()
        [result_line] = [ln for ln in rest.decode().splitlines() if ln.startswith("{")]
        return json.loads(result_line)  # type: ignore[no-any-return]

    ok = await device("alice", json.dumps({**SPEC, "job_id": "mosq-1"}))
    assert ok["type"] == "reply.accepted" and ok["job_id"] == "mosq-1"
    assert [s.job_id for s in await inst.submitted()] == ["mosq-1"]
    before = await inst.fingerprint()
    bad = await device("alice", json.dumps({**SPEC, "min_gpus": 8, "max_gpus": 2}))
    assert bad["type"] == "reply.rejected" and bad["code"] == "invalid_spec"
    assert "min_gpus (8) is greater than max_gpus (2)" in bad["message"]
    assert await inst.fingerprint() == before
