"""The embedded nats-server: free port, JetStream, MQTT listener, clean stop, no orphans."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shoal.nats_server import EmbeddedNats, NatsServerError, find_nats_server

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _wait_dead(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_binary_is_found() -> None:
    assert Path(find_nats_server()).name == "nats-server"


def test_two_servers_get_different_free_ports_and_stop_cleanly(tmp_path: Path) -> None:
    with EmbeddedNats(store_dir=tmp_path / "a") as a, EmbeddedNats(store_dir=tmp_path / "b") as b:
        assert a.client_port != b.client_port
        for srv in (a, b):
            with socket.create_connection(("127.0.0.1", srv.client_port), timeout=2) as s:
                assert s.recv(4096).startswith(b"INFO ")
        pid = a.proc.pid  # type: ignore[union-attr]
    assert _wait_dead(pid)
    assert (tmp_path / "a").is_dir(), "a caller-owned store is kept"


def test_mqtt_listener_can_be_switched_on() -> None:
    with EmbeddedNats(mqtt_port=-1) as srv:
        assert srv.mqtt_listen_port
        with socket.create_connection(("127.0.0.1", srv.mqtt_listen_port), timeout=2):
            pass


def test_a_crashed_parent_leaves_no_orphan_server(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from shoal.nats_server import EmbeddedNats\n"
        f"srv = EmbeddedNats(store_dir={str(tmp_path)!r}).start()\n"
        "print(srv.proc.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert _alive(child_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    assert _wait_dead(child_pid), "nats-server outlived its killed parent"


def test_a_bad_config_is_a_clear_error() -> None:
    with pytest.raises(NatsServerError, match=r"exited|did not start"):
        EmbeddedNats(max_payload=-5, server_name='bad"name').start(timeout_s=5)
