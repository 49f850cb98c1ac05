"""Bad submissions against an installation started as a user starts it (`shoal up`),
sent as a client in another language would send them (plain NATS, JSON): each gets its
specific code and message back, and nothing reaches the log. The same cases run
against a hand-built admission service in tests/clients/test_bad_specs.py; here the
shipped command wires admission, its settings and the cluster it judges against."""

from __future__ import annotations

import json
from typing import Any

import nats
import pytest

from tests.clients.test_bad_specs import BAD_SPECS, GOOD
from tests.services.test_liveness import shoal_up

pytestmark = pytest.mark.integration

# Cases whose expectation depends on the hand-built fixture (its registered users, its
# one 4-GPU V100 node) or that need a payload past the server's limit.
FIXTURE_ONLY = {"unknown_user", "beyond_nats_limit", "unknown_gpu_type", "too_big_for_cluster"}
# Over JSON, NaN and Infinity are not numbers (RFC 8259; Python's json writes them
# anyway): admission refuses the whole payload as malformed JSON, same code.
NOT_JSON = {"nan_convergence_target", "infinite_convergence_target"}


def json_fragment(case: str, fragment: str) -> str:
    return "JSON is malformed" if case in NOT_JSON else fragment


async def test_every_bad_submission_is_refused_specifically_through_shoal_up(tmp_path: Any) -> None:
    async with shoal_up(tmp_path, nodes=2) as up:
        nc = await nats.connect(up.url, nkeys_seed=str(up.creds / "admin.nk"))
        js = nc.jetstream()
        headers = {"Content-Type": "application/json"}

        async def jobs_in_log() -> int:
            info = await js.stream_info("SHOAL_EVENTS", subjects_filter="shoal.job.>")
            return sum((info.state.subjects or {}).values())

        async def submit(spec: dict[str, Any], job_id: str) -> dict[str, Any]:
            body = {"type": "cmd.submit_job", "job_id": job_id, "spec": spec}
            msg = await nc.request(
                "shoal.cmd.submit_job.@admin", json.dumps(body).encode(), timeout=10, headers=headers
            )
            return dict(json.loads(msg.data))

        try:
            before = await jobs_in_log()
            cases = [c for c in BAD_SPECS if c[0] not in FIXTURE_ONLY]
            cases += [
                ("too_big_for_cluster", {"min_gpus": 8, "max_gpus": 8, "requested_gpus": 8}, "invalid_spec",
                 "exceeds the cluster's 4 GPUs"),
                ("unknown_gpu_type", {"gpu_type": "H100"}, "invalid_spec", "unknown gpu_type 'H100'"),
            ]  # fmt: skip
            for case, override, code, fragment in cases:
                spec = {k: v for k, v in {**GOOD, **override}.items() if v is not None}
                reply = await submit(spec, f"bad-{case.replace('_', '-')}")
                assert reply["type"] == "reply.rejected", (case, reply)
                assert reply["code"] == code, (case, reply)
                text = " ".join([reply["message"], *reply.get("errors", [])])
                assert json_fragment(case, fragment) in text, (case, reply)
            assert await jobs_in_log() == before, "a refused submission reached the log"
            good = await submit(GOOD, "good-one")  # and the installation still takes a good one
            assert good["type"] == "reply.accepted", good
        finally:
            await nc.close()


async def test_every_bad_mqtt_submission_is_refused_specifically_through_shoal_up(tmp_path: Any) -> None:
    """The same cases from an MQTT device (aiomqtt) of a user added with `shoal creds add
    ... --mqtt-password`, through `shoal up --mqtt`'s listener and admission's bridge, as
    tests/clients/test_mqtt.py runs them against a hand-built bridge: each gets its code
    on the device's result topic, and nothing reaches the log."""
    import asyncio
    import os
    import socket
    import subprocess

    import aiomqtt
    from shoal.commands.run import CLI_ARGV

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env["SHOAL_STATE_DIR"] = str(tmp_path / "state")
    subprocess.run(
        [*CLI_ARGV, "creds", "add", "user", "alice", "--mqtt-password", "alice-pw"],
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def submit(device: aiomqtt.Client, payload: bytes) -> dict[str, Any]:
        await device.publish("shoal/mqtt/submit/alice", payload, qos=1)
        async with asyncio.timeout(30):
            async for message in device.messages:
                assert isinstance(message.payload, bytes)
                return dict(json.loads(message.payload))
        raise AssertionError("no result")

    async with shoal_up(tmp_path, nodes=2, SHOAL_MQTT_PORT=str(port)) as up:
        nc = await nats.connect(up.url, nkeys_seed=str(up.creds / "admin.nk"))
        js = nc.jetstream()

        async def jobs_in_log() -> int:
            info = await js.stream_info("SHOAL_EVENTS", subjects_filter="shoal.job.>")
            return sum((info.state.subjects or {}).values())

        # Over MQTT the topic names the user: a spec naming another (a bad name among
        # them) is refused for that first.
        mismatch = ("user_mismatch", "does not match the topic's user 'alice'")
        cases = [
            (c, {**GOOD, **o}, *(mismatch if "user" in o else (code, json_fragment(c, f))))
            for c, o, code, f in BAD_SPECS
            if c not in FIXTURE_ONLY
        ]
        raw = [
            ("garbage", b"{not json", "invalid_json", "payload is not JSON"),
            ("not_utf8", b'{"user": "alice", "name": "\xff"}', "invalid_json", "payload is not JSON"),
            ("not_object", b"[1, 2]", "invalid_json", "must be a JSON object"),
            ("other_user", json.dumps({**GOOD, "user": "bob"}).encode(), "user_mismatch", "'alice'"),
        ]
        try:
            before = await jobs_in_log()
            async with aiomqtt.Client(
                "127.0.0.1", port, username="alice", password="alice-pw", identifier="alice-dev", timeout=10
            ) as device:
                await device.subscribe("shoal/mqtt/result/alice", qos=1)
                for case, spec, code, fragment in cases:
                    body = json.dumps({k: v for k, v in spec.items() if v is not None}).encode()
                    raw.append((case, body, code, fragment))
                for case, payload, code, fragment in raw:
                    reply = await submit(device, payload)
                    assert reply["type"] == "reply.rejected", (case, reply)
                    assert reply["code"] == code, (case, reply)
                    text = " ".join([reply["message"], *reply.get("errors", [])])
                    assert fragment in text, (case, reply)
                assert await jobs_in_log() == before, "a refused submission reached the log"
                good = await submit(device, json.dumps(GOOD).encode())
                assert good["type"] == "reply.accepted", good
        finally:
            await nc.close()
