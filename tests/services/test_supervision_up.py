"""`shoal up` notices (issue 21), with real processes started as a user starts them:

1. its nats-server killed with SIGKILL is restarted on the same store and port, and a
   job submitted afterwards completes, without restarting `shoal up`;
2. a service killed more often than the old lifetime budget (5) is still restarted:
   the restart budget is per time window (a short one here);
3. a budget exhausted is loud: on `shoal up`'s stderr, in its log and in ``up.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.services.test_liveness import Up, run_job, shoal_up, wait_until
from tests.services.test_up import alive, descendants

pytestmark = pytest.mark.integration


READERS = 12
"""An upper bound on the log readers of one `shoal up` (services, node daemons, the
supervisor's own): each may lose its consumer once when the server dies."""


def up_info(tmp_path: Path) -> dict[str, Any]:
    return dict(json.loads((tmp_path / "state" / "up.json").read_text()))


def admission_pid(up: Up) -> int | None:
    with contextlib.suppress(AssertionError):
        return up.pid_of("run", "admission")
    return None


async def test_killed_nats_server_is_restarted_and_scheduling_resumes(tmp_path: Path) -> None:
    async with shoal_up(tmp_path) as up:
        old = int(up_info(tmp_path)["server_pid"])
        assert old in descendants(up.proc.pid)
        os.kill(old, signal.SIGKILL)

        def restarted() -> bool:
            with contextlib.suppress(OSError, ValueError):
                pid = int(up_info(tmp_path)["server_pid"])
                return pid != old and alive(pid)
            return False

        await wait_until(restarted, 30, "a new nats-server in up.json")
        assert up_info(tmp_path)["url"] == up.url  # same port: clients reconnect
        assert await run_job(up, "after-server-kill", gpus=2, timeout_s=90)
        assert up.proc.poll() is None
    err = (tmp_path / "up.err").read_text()
    assert "NATS server restarted" in err, err[-2000:]
    assert "nats_server_died" in err
    # Readers that lost their consumer say so once per episode, not once per retry (the
    # failure this replaced logged millions of lines within minutes).
    lines = err.splitlines()
    lost = [line for line in lines if "replay_consumer_lost" in line]
    assert len(lost) <= READERS, lost
    assert len(lines) < 2_000, f"{len(lines)} lines on up's stderr"


async def test_service_is_restarted_beyond_the_old_lifetime_budget(tmp_path: Path) -> None:
    window_s = 1.0
    async with shoal_up(
        tmp_path, nodes=0, SHOAL_RESTART_BUDGET="2", SHOAL_RESTART_WINDOW_S=repr(window_s)
    ) as up:
        killed_at = 0.0
        pid = admission_pid(up)
        for _ in range(7):
            assert pid is not None
            # At most one restart within the window at each death: never over the budget.
            await asyncio.sleep(max(0.0, killed_at + window_s - time.monotonic()))
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            await wait_until(
                lambda previous=pid: admission_pid(up) not in (None, previous), 30, "admission restarted"
            )
            pid = admission_pid(up)
        assert up_info(tmp_path)["gave_up"] == []
    assert "gave up" not in (tmp_path / "up.err").read_text()


def child_metric(base: str, name: str, child: str) -> float:
    """One per-child sample of `shoal up`'s own /metrics."""
    from tests.services.test_probes_up import get, samples

    status, text = get(base + "/metrics")
    assert status == 200, text
    return next(v for labels, v in samples(text)[name] if labels.get("child") == child)


async def test_exhausted_budget_is_loud(tmp_path: Path) -> None:
    """...and `shoal up`'s own probes say it: /readyz turns 503 naming the child, and
    /metrics counts its restarts and marks it given up."""
    from tests.services.test_probes_up import get, wait_status

    async with shoal_up(tmp_path, nodes=0, SHOAL_RESTART_BUDGET="1", SHOAL_RESTART_WINDOW_S="600") as up:
        own = up_info(tmp_path)["probes"]
        assert get(own + "/healthz") == (200, "ok\n")
        assert await asyncio.to_thread(wait_status, own + "/readyz", 200, 30) == "ready\n"
        assert child_metric(own, "shoal_up_child_running", "admission") == 1
        assert child_metric(own, "shoal_up_child_restarts_total", "admission") == 0
        first = admission_pid(up)
        assert first is not None
        os.kill(first, signal.SIGKILL)  # the one restart of the budget
        await wait_until(lambda: admission_pid(up) not in (None, first), 30, "admission restarted")
        second = admission_pid(up)
        assert second is not None
        assert up_info(tmp_path)["gave_up"] == []
        os.kill(second, signal.SIGKILL)  # over the budget
        await wait_until(lambda: up_info(tmp_path)["gave_up"] == ["admission"], 30, "gave_up in up.json")
        assert admission_pid(up) is None
        status, body = get(own + "/readyz")
        assert status == 503 and "admission: given up" in body, (status, body)
        assert child_metric(own, "shoal_up_child_given_up", "admission") == 1
        assert child_metric(own, "shoal_up_child_running", "admission") == 0
        assert child_metric(own, "shoal_up_child_restarts_total", "admission") == 1
        assert child_metric(own, "shoal_up_child_given_up", "allocator") == 0
        assert up.proc.poll() is None
        err = (tmp_path / "up.err").read_text()
        assert "shoal up: gave up restarting admission" in err, err[-2000:]
        assert "child_gave_up" in err
        # Every CLI command on this installation says so too.
        import subprocess

        from shoal.commands.run import CLI_ARGV

        env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
        env["SHOAL_STATE_DIR"] = str(tmp_path / "state")
        nodes = subprocess.run([*CLI_ARGV, "nodes"], env=env, capture_output=True, text=True, timeout=60)
        assert nodes.returncode == 0, nodes.stderr
        assert "shoal up gave up restarting admission" in nodes.stderr, nodes.stderr


async def test_an_identity_added_with_shoal_creds_is_admitted_without_restarting_nats(tmp_path: Path) -> None:
    """`shoal creds add user bob --mqtt-password ...` against a running `shoal up` (auth
    callout on, the default; MQTT on): the server keeps its pid, the admin's connection
    never drops, and bob connects at once, and so does his MQTT device, both admitted
    by the shipped authorizer. Then carol, whose device login the server has listed
    since it started, gets a new password the same way: the server checks the new one
    at once (the old one is refused), still without a restart."""
    import socket
    import subprocess

    import aiomqtt
    from shoal.bus import Bus
    from shoal.commands.run import CLI_ARGV

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mqtt_port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env["SHOAL_STATE_DIR"] = str(tmp_path / "state")

    def creds_add(user: str, password: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*CLI_ARGV, "creds", "add", "user", user, "--mqtt-password", password],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done

    async def mqtt_login(user: str, password: str, client_id: str) -> None:
        async with aiomqtt.Client(
            "127.0.0.1", mqtt_port, username=user, password=password, identifier=client_id, timeout=5
        ) as device:
            await device.publish(f"shoal/mqtt/submit/{user}", b"{}", qos=1)

    creds_add("carol", "carol-old-pw")  # before the server starts: listed in its configuration
    async with shoal_up(tmp_path, nodes=0, SHOAL_MQTT_PORT=str(mqtt_port)) as up:
        pid = int(up_info(tmp_path)["server_pid"])
        admin = await Bus.connect(up.url, "shoal", declare=False, **up.admin())
        try:
            await mqtt_login("carol", "carol-old-pw", "carol-0")
            added = creds_add("bob", "bob-device-pw")
            bob = None
            deadline = time.monotonic() + 20
            while bob is None:  # `shoal up` acts on the SIGHUP a moment later
                try:
                    bob = await Bus.connect(up.url, "shoal", creds=added.stdout.split()[0], declare=False)
                except Exception:
                    assert time.monotonic() < deadline, "bob was never admitted"
                    await asyncio.sleep(0.2)
            assert bob.identity == "user-bob"
            await bob.close()
            await mqtt_login("bob", "bob-device-pw", "bob-1")
            with pytest.raises(aiomqtt.MqttError):
                await mqtt_login("bob", "guess", "bob-2")
            assert int(up_info(tmp_path)["server_pid"]) == pid
            assert admin.nc.is_connected and admin.nc.stats["reconnects"] == 0
            # carol's new password, with bob's addition pending in the running configuration.
            creds_add("carol", "carol-new-pw")
            deadline = time.monotonic() + 20
            while True:  # `shoal up` reloads on the SIGHUP a moment later
                try:
                    await mqtt_login("carol", "carol-new-pw", "carol-1")
                    break
                except aiomqtt.MqttError:
                    assert time.monotonic() < deadline, "carol's new password was never accepted"
                    await asyncio.sleep(0.2)
            with pytest.raises(aiomqtt.MqttError):
                await mqtt_login("carol", "carol-old-pw", "carol-2")
            assert int(up_info(tmp_path)["server_pid"]) == pid
            assert admin.nc.is_connected and admin.nc.stats["reconnects"] == 0
        finally:
            await admin.close()
