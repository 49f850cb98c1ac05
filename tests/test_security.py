"""Issue 20's attacks against an installation started as a user starts it (``shoal up``
with ``--mqtt``, identities added with ``shoal creds add``): every one is refused, and
the legitimate path keeps working. The same audit writes ``benchmarks/reports/security.md``
(``python benchmarks/security.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import aiomqtt
import pytest
from shoal import events as ev
from shoal.audit import (
    Target,
    _create_capturing_stream,
    _delete_consumer,
    _durable_consumer,
    _forge,
    _forge_beat,
    local_installation,
    run_audit,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    # A short revocation grace (30 s by default) so that the attack "sidecar stays
    # connected after its job ended" does not hold the default run up.
    with local_installation(str(tmp_path_factory.mktemp("sec") / "state"), revoke_after_s=2.0) as t:
        yield t


def test_every_attack_is_refused_and_the_legitimate_path_works(target: Target) -> None:
    outcomes, (legit_ok, legit_how) = asyncio.run(run_audit(target))
    accepted = [(o.attack, o.how) for o in outcomes if not o.refused]
    assert not accepted, accepted
    assert len(outcomes) >= 20
    assert legit_ok, legit_how


def test_the_audit_sees_an_accepted_forgery(target: Target) -> None:
    """The audit judges by the log, so it can fail: the admin may append a heartbeat."""
    refused, how = asyncio.run(_forge(target, target.admin, ev.NodeHeartbeat(node_id="node0", seq=10**6)))
    assert not refused, how
    # The same for the beats stream: the admin may store a heartbeat of any node there.
    refused, how = asyncio.run(_forge_beat(target, target.admin, "other-node"))
    assert not refused, how
    # And the JetStream API attacks: the admin may create a stream, keep a durable
    # consumer and delete another's consumer (each undone by the audit afterwards).
    for attack in (_create_capturing_stream, _durable_consumer, _delete_consumer):
        refused, how = asyncio.run(attack(target, target.admin))
        assert not refused, (attack.__name__, how)


def test_credentials_are_private(target: Target) -> None:
    creds = Path(target.admin).parent
    assert stat.S_IMODE(creds.stat().st_mode) == 0o700
    for path in creds.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_mqtt_device_submits_as_itself(target: Target) -> None:
    """`shoal up --mqtt` runs admission's MQTT bridge; a device authenticated as mallory
    submits on its own topic and gets the outcome on its result topic."""

    async def device() -> dict[str, object]:
        async with aiomqtt.Client(
            "127.0.0.1",
            target.mqtt_port or 0,
            username=target.mqtt_user,
            password=target.mqtt_password,
            protocol=aiomqtt.ProtocolVersion.V311,
        ) as mq:
            await mq.subscribe(f"shoal/mqtt/result/{target.mqtt_user}", qos=1)
            spec = {"model": "resnet50", "max_gpus": 1, "total_iterations": 10, "job_id": "mqtt-own"}
            await mq.publish(f"shoal/mqtt/submit/{target.mqtt_user}", json.dumps(spec), qos=1)
            async with asyncio.timeout(30):
                async for message in mq.messages:
                    assert isinstance(message.payload, bytes)
                    return json.loads(message.payload)  # type: ignore[no-any-return]
        raise AssertionError("no result")

    assert target.mqtt_port, "shoal up --mqtt printed no MQTT port"
    result = asyncio.run(device())
    assert result["type"] == "reply.accepted", result
    assert result["job_id"] == "mqtt-own"


def test_an_outsider_cannot_use_the_cli(target: Target, tmp_path: Path) -> None:
    """Without credentials the CLI gets a clear refusal, not a traceback."""
    import subprocess

    from shoal.commands.run import CLI_ARGV

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env["SHOAL_STATE_DIR"] = str(tmp_path / "elsewhere")
    done = subprocess.run(
        [*CLI_ARGV, "jobs", "--nats-url", target.url], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done
    assert "requires credentials" in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # the message alone, no log line


@pytest.mark.skipif(not shutil.which("mosquitto_pub"), reason="mosquitto clients not installed")
def test_mosquitto_pub_job_runs_to_completion(target: Target) -> None:
    """Debian's mosquitto_pub, authenticated as mallory, submits to `shoal up --mqtt`; the
    job is admitted through the bridge of `shoal run admission` and runs to completion."""
    import subprocess

    from shoal.client import Client

    spec = {"model": "resnet50", "max_gpus": 1, "total_iterations": 20, "job_id": "mosq-run"}
    subprocess.run(
        [
            "mosquitto_pub",
            *("-h", "127.0.0.1", "-p", str(target.mqtt_port), "-V", "mqttv311", "-q", "1"),
            *("-u", target.mqtt_user, "-P", target.mqtt_password),
            *("-t", f"shoal/mqtt/submit/{target.mqtt_user}", "-m", json.dumps(spec)),
        ],
        check=True,
        timeout=30,
    )

    async def follow() -> list[str]:
        async with await Client.connect(target.url, target.prefix, creds=target.admin) as client:
            seen: list[str] = []
            async for env in client.job_events("mosq-run"):
                seen.append(env.type)
            return seen

    seen = asyncio.run(asyncio.wait_for(follow(), 90))
    assert seen[0] == "job.submitted" and seen[-1] == "job.completed", seen


def test_sidecars_hold_no_seed(target: Target) -> None:
    """Under the auth callout the node daemons give their sidecars (spares included) a
    token per job, never a seed file: no sidecar process of this installation has one
    in its environment."""
    state = str(Path(target.admin).parent.parent).encode()

    def sidecar_envs() -> dict[str, dict[bytes, bytes]]:
        out = {}
        for proc in Path("/proc").iterdir():
            try:
                if b"trainer_sidecar" not in (proc / "cmdline").read_bytes():
                    continue
                environ = (proc / "environ").read_bytes()
            except OSError:  # not a process, or gone
                continue
            env = dict(item.split(b"=", 1) for item in environ.split(b"\0") if b"=" in item)
            if env.get(b"SHOAL_STATE_DIR") == state:
                out[proc.name] = env
        return out

    deadline = time.monotonic() + 30
    while not (envs := sidecar_envs()) and time.monotonic() < deadline:
        time.sleep(0.2)  # the daemons start their spares once they run
    assert envs, "no sidecar of this installation found (each daemon keeps a spare)"
    for pid, env in envs.items():
        held = {b"NATS_CREDS", b"SHOAL_NATS_CREDS", b"SHOAL_SIDECAR_CREDS"} & env.keys()
        assert not held, (pid, held)
        assert env.get(b"SHOAL_SIDECAR_TOKENS") == b"true", pid
