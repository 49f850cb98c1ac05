"""One typed settings struct for every shoal process, read from ``SHOAL_*`` variables and flags.

Precedence, lowest first: the defaults below, then the environment
(``SHOAL_<FIELD>``, e.g. ``SHOAL_TIME_SCALE=500``), then explicit overrides (the
command-line flags). ``nats_url`` also honours the plain ``NATS_URL`` that NATS
tooling uses; when both are set ``NATS_URL`` wins, the same order the client
commands use to find the server, so services and clients never disagree.

Parsing rules, chosen to match what an operator of a production scheduler expects:

* every value is validated on load; a bad one (``SHOAL_TIME_SCALE=abc``) raises
  :class:`SettingsError` naming the variable (or flag) and what was expected, and no
  settings object is produced at all (nothing is half-applied);
* booleans accept ``1/0, true/false, yes/no, on/off`` (any case);
* an empty variable means "unset" for optional fields (``SHOAL_MQTT_PORT=``) and is
  an error for required ones;
* ``SHOAL_POLICY_PARAMS`` is a JSON object of keyword arguments for the policy;
* an unknown ``SHOAL_*`` variable is ignored by :meth:`Settings.load` but reported by
  :func:`unknown_variables` (with the closest known name), which ``shoal run``/``up``/
  ``demo`` and :func:`shoal.runtime.run_service` print as a warning: a typo must not
  pass silently, yet other shoal tools own variables of their own (``SHOAL_TRAIN_*``
  of the training workers, ``SHOAL_USER`` of the client), and a service must not
  refuse to start because a shell exports one. Unknown *overrides* (flags) are
  programming errors and raise.

Loading reads nothing but the mapping it is given: no file, no network. Modules deep
in the code never read the environment; they get a :class:`Settings`.
"""

from __future__ import annotations

import difflib
import json
import os
import socket
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

ENV_PREFIX = "SHOAL_"

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LogFormat = Literal["auto", "json", "pretty"]
SidecarMode = Literal["emulated", "real"]
TrainDevice = Literal["cpu", "cuda"]
PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Port = Annotated[int, Meta(ge=-1, le=65535)]
Token = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,128}$(?!\n)")]
Prefix = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$(?!\n)")]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A setting has a value that cannot be used; the message names its source."""


def default_state_dir() -> str:
    """The per-user state directory (e.g. ``~/.local/state/shoal`` on Linux)."""
    import platformdirs

    return platformdirs.user_state_dir("shoal", appauthor=False)


def default_node_id() -> str:
    """A node id derived from the host name (a valid id token: no dots)."""
    host = socket.gethostname().split(".")[0] or "node"
    token = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)
    return token[:128] or "node"


class Settings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a shoal process can be configured with.

    Build it with :meth:`load`, not the constructor, so the environment is honoured
    and values are validated.
    """

    nats_url: str | None = None
    """NATS server URL, or a comma-separated seed list of a cluster's servers. Unset: the
    embedded server that `shoal up` runs for ``state_dir``."""
    replicas: Annotated[int, Meta(ge=1, le=5)] | None = None
    """Replicas of every stream, KV bucket and object store shoal creates. Unset: 3 when
    the server reports a cluster of three or more servers, else 1. An existing stream,
    bucket or object store is never scaled down; the admin's start raises one with fewer."""
    sync_interval: Annotated[str, Meta(pattern=r"^(always|[0-9]+(ms|s|m|h))$")] | None = None
    """`shoal up`'s embedded server: how often JetStream fsyncs its store (e.g. ``10s``), or
    ``always`` (before every ack). Unset: nats-server's default, every 2 minutes."""
    nats_creds: str | None = None
    """nkey seed file this process authenticates with (``NATS_CREDS`` also sets it; see
    :mod:`shoal.auth`). Unset: the file of this process's identity in ``<state_dir>/creds``
    when `shoal up` runs there, else no credentials."""
    tls_ca: str | None = None
    """PEM file of the CA that signed the NATS server's certificate: connect over TLS and
    verify the server (``NATS_CA`` also sets it). Unset: plain TCP unless the URL is
    ``tls://`` (then the system's CAs)."""
    tls_cert: str | None = None
    """`shoal up`'s embedded server: its TLS certificate (PEM); with ``tls_key`` every
    client must use TLS."""
    tls_key: str | None = None
    """`shoal up`'s embedded server: the TLS certificate's private key (PEM)."""
    sidecar_creds: str | None = None
    """A node daemon's: the seed file its sidecars authenticate with (role ``sidecar``)."""
    sidecar_tokens: bool = False
    """A node daemon's and its sidecars': the sidecars never get ``sidecar_creds``; the
    daemon signs with it a token per sidecar naming its job, and the server's auth
    callout (:mod:`shoal.callout`) makes each sidecar an identity of that job only.
    `shoal up` sets it for its node daemons when ``auth_callout`` is on."""
    auth_callout: bool = True
    """`shoal up`'s embedded server: judge sidecars by the auth callout (starts ``shoal run
    authorizer``, and the node daemons with ``sidecar_tokens``): each sidecar is an
    identity of its own job only (``docs/security.md``). Off: every sidecar of a node
    shares the static ``sidecar-<node>`` identity, allowed any job's reports."""
    sidecar_revoke_after_s: PositiveFloat = 30.0
    """The authorizer's: how long a sidecar may stay connected after its job left its node
    (moved, preempted, finished) before its connection is ended (:mod:`shoal.callout`)."""
    prefix: Prefix = "shoal"
    """Subject/stream prefix of one installation (several can share a NATS server)."""
    state_dir: str = ""
    """Where `shoal up` keeps its JetStream store and its ``nats.json``; default: per-user state dir."""
    log_level: LogLevel = "info"
    """Least severe log line written (structured, on stderr)."""
    log_format: LogFormat = "auto"
    """``auto``: pretty on a terminal, JSON lines otherwise."""
    policy: str = "afs-p"
    """Allocation policy name (see ``shoal.policies.registry``)."""
    policy_params: dict[str, Any] = {}
    """Keyword arguments of the policy's constructor (``SHOAL_POLICY_PARAMS`` is JSON)."""
    time_scale: PositiveFloat = 1.0
    """Virtual seconds per wall second (emulation)."""
    clock_origin: float | None = None
    """Shared origin of the scaled clock; every process of one emulated installation needs the same."""
    node_id: Token | None = None
    """This node daemon's id; default: the host name."""
    fake_gpus: NonNegInt = 0
    """Emulated GPUs on this node; 0 discovers real GPUs through NVML."""
    gpu_type: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,32}$")] = "V100"
    """Generation of the emulated GPUs."""
    sidecar_mode: SidecarMode = "emulated"
    """What the node daemon's sidecars run: ``emulated`` trainers advancing at the modelled
    throughput, or ``real`` ``shoal.train`` workers started from the job's entrypoint."""
    train_device: TrainDevice | None = None
    """Device of real workers; default ``cuda`` on NVML GPUs, ``cpu`` on fake ones (one CPU
    worker slot per fake GPU)."""
    sidecar_host: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:-]{1,253}$")] = "127.0.0.1"
    """Address of this node that real sidecars bind their control server and rendezvous
    store to and advertise to the job's workers on other nodes; the default only reaches
    workers on the same machine."""
    sidecar_spares: NonNegInt = 1
    """Sidecars each node daemon keeps started ahead of need, so that a job placed on
    its node starts without a process start (0 turns them off)."""
    heartbeat_s: PositiveFloat = 1.0
    """Wall seconds between a node daemon's heartbeats (it never sends them faster). The
    beats stream stores at most eight of a node's heartbeats a second (the per-node rate
    limit, ``shoal.bus.BEATS_PER_NODE``): under about 0.2 s some are refused, and the
    node's newest stored heartbeat can be up to a second older than its last one."""
    lease_ttl_s: PositiveFloat = 3.0
    """Leader lease TTL (wall seconds) of the leader-elected services (allocator, placer,
    profiler, trader) and of a real-mode job's leading sidecar: a standby takes over
    about this long after the leader stops renewing. One value per installation: the
    leases share one bucket whose TTL this is, and a process given another is refused."""
    node_timeout_s: PositiveFloat = 10.0
    """Wall seconds by which the newest heartbeat of any node (read at once with every
    node's) may pass a node's newest heartbeat before the leading allocator declares the
    node lost (:func:`shoal.cluster.lost_nodes`). Judged by the heartbeats' own stamps, so
    an allocator that lags declares nobody for that; and when every node's heartbeats
    stop at once (one node, or a cut between the nodes and the servers), nobody is
    declared lost, as there is no live node to move work to."""
    snapshot_every: Annotated[int, Meta(ge=1)] = 10_000
    """The leading allocator writes the cluster-state snapshot that every service starts from
    (and the leading profiler its own, :mod:`shoal.profiling.snapshot`) after this many
    folded events (see :mod:`shoal.projection`)..."""
    snapshot_interval_s: PositiveFloat = 60.0
    """... or after this many wall seconds when any event was folded since the last one."""
    mqtt_port: Port | None = None
    """Enable the embedded server's MQTT listener on this port (-1: any free port)."""
    catalog: str | None = "afs"
    """Throughput-model catalog (``shoal.models.get_catalog``); empty: none."""
    costs: str = "coddl"
    """Reconfiguration cost model of emulated trainers (``shoal.sim.costs``)."""
    placer: str = "min-migration"
    """The placer's algorithm for jobs without a policy's node choice: ``min-migration``
    (keep GPUs where possible) or ``consolidated`` (fewest servers)."""
    network_packing: bool = True
    """Regulate an elastic policy's shares to server sizes (AFS appendix E); rigid
    policies' shares are never regulated."""
    report_every_s: PositiveFloat = 0.25
    """Wall seconds from a job's start or change of shape to its trainer sidecar's first
    progress report; each later interval doubles, up to ``report_max_every_s``
    (:mod:`shoal.reporting`)."""
    report_max_every_s: PositiveFloat = 30.0
    """The largest interval between a running job's progress reports, wall seconds (each
    is an event in the log, kept for ever); at or below ``report_every_s``: a fixed
    interval of ``report_every_s``, as before this setting. One report more comes when
    the profiler's measurement window (``profiler_min_interval_s``) of a new shape ends."""
    profiler_min_interval_s: PositiveFloat = 30.0
    """The profiler's least virtual seconds between two models of one job
    (:mod:`shoal.profiling.ratelimit`); so also how long a job runs on each GPU count
    AFS §4.5 measures it at."""
    connect_wait_s: NonNegFloat = 0.0
    """How long a service waits at start for NATS and its JetStream to answer (a cluster
    still electing its meta leader, a server not yet resolvable), retrying with back-off,
    before it exits with status 2. 0: the first failure is final, which is what someone
    at a terminal wants; the compose stack and the Kubernetes manifests set 120 so that
    services started next to a forming cluster wait for it instead of crash-looping."""
    drain_timeout_s: PositiveFloat = 10.0
    """How long a service may take to drain in-flight work after SIGTERM."""
    restart_budget: NonNegInt = 5
    """`shoal up`'s supervisor: restarts a crashed process may have within ``restart_window_s``;
    one more crash in that window and it is given up (loudly: stderr, log, ``up.json``)."""
    restart_window_s: PositiveFloat = 60.0
    """The window of ``restart_budget``, wall seconds."""
    compact_every_s: NonNegFloat = 3600.0
    """`shoal up`: run `shoal compact` (as the admin, in a child process) this often, wall
    seconds, first one period after start: the progress reports that no fold of the log
    needs are removed. 0: never (run `shoal compact` yourself)."""
    compact_after_s: NonNegFloat = 604800.0
    """`shoal up`'s compaction: only reports made at least this long (seconds of the log's
    clock) before the log's newest event go (`shoal compact --older-than`); newer ones
    stay, so `shoal explain` and `shoal replay --until` see them one by one. Default a
    week."""
    entrypoints: tuple[tuple[str, ...], ...] = ()
    """Admission's: argv prefixes real-mode jobs may run (``SHOAL_ENTRYPOINTS`` is JSON,
    e.g. ``[["python", "/opt/jobs/train.py"]]``); empty: no job may name an entrypoint."""
    job_env: tuple[str, ...] = ()
    """Admission's: ``spec.env`` names a job may set besides ``SHOAL_TRAIN_*`` (JSON list)."""
    max_active_jobs_per_user: NonNegInt = 0
    """Admission's: the most pending + running jobs of a user without limits of its own
    (``shoal limits``); 0: no limit."""
    max_gpus_per_user: NonNegInt = 0
    """Admission's: the most GPUs (sum of ``min_gpus``) the active jobs of a user without
    limits of its own may ask for; 0: no limit."""
    registered_users_only: bool = False
    """Admission's: refuse submissions (``unknown_user``) from a user the admin has not
    registered with ``shoal limits`` (a ``UserRegistered`` on the log; ``--max-jobs 0``
    registers a user without a limit)."""
    trace_jsonl: str | None = None
    """Append every finished span as one JSON line to this file."""
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    """Serve ``/healthz``, ``/readyz`` and ``/metrics`` of a service on this port (0: any
    free port; unset: none; see :mod:`shoal.probes`). `shoal up` gives each child its
    own: consecutive ports from this one, or free ports when it is unset or 0."""
    metrics_host: str = "127.0.0.1"
    """Address the probe endpoints listen on. They are read-only; listening beyond this
    machine (e.g. a Kubernetes pod IP) is the operator's choice (docs/security.md)."""

    # -- loading ---------------------------------------------------------------------

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``env`` (default ``os.environ``) and explicit overrides.

        Args:
            env: the environment to read ``SHOAL_*`` (and ``NATS_URL``) from.
            **overrides: field values from flags; ``None`` means "not given".

        Returns:
            Validated settings.

        Raises:
            SettingsError: an unknown override, or a value that does not parse or is
                out of range; the message names the variable or flag.
        """
        env = os.environ if env is None else env
        hints = _field_types()
        values: dict[str, Any] = {}
        for key, text in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name not in hints:
                continue  # see unknown_variables()
            values[name] = _parse_text(key, text, hints[name], name)
        if env.get("NATS_URL", "").strip():
            # NATS tooling's own variable wins, as in the CLI's server lookup (commands/_connect).
            values["nats_url"] = env["NATS_URL"].strip()
        if env.get("NATS_CREDS", "").strip():
            values["nats_creds"] = env["NATS_CREDS"].strip()
        if env.get("NATS_CA", "").strip():
            values["tls_ca"] = env["NATS_CA"].strip()
        for name, value in overrides.items():
            if value is None:
                continue
            if name not in hints:
                raise SettingsError(_unknown(name, list(hints)))
            flag = "--" + name.replace("_", "-")
            values[name] = _convert(flag, value, hints[name])
        if not values.get("state_dir"):
            values["state_dir"] = default_state_dir()
        try:
            return msgspec.convert(values, cls)
        except msgspec.ValidationError as exc:  # pragma: no cover - each field was checked above
            raise SettingsError(str(exc)) from None

    def to_env(self) -> dict[str, str]:
        """The ``SHOAL_*`` variables that reproduce these settings in a child process."""
        out: dict[str, str] = {}
        for name, value in msgspec.structs.asdict(self).items():
            key = ENV_PREFIX + name.upper()
            if value is None:
                continue
            if isinstance(value, bool):
                out[key] = "true" if value else "false"
            elif isinstance(value, dict | tuple | list):
                out[key] = json.dumps(value, sort_keys=True)
            elif isinstance(value, float):
                out[key] = repr(value)
            else:
                out[key] = str(value)
        return out

    def resolved_node_id(self) -> str:
        return self.node_id or default_node_id()


#: ``SHOAL_*`` names owned by other shoal tools, never reported as unknown.
FOREIGN_PREFIXES: tuple[str, ...] = ("SHOAL_TRAIN_",)
FOREIGN_NAMES: frozenset[str] = frozenset(
    {
        "SHOAL_USER",  # the client's default user
        # The job-scoped token a node daemon hands the trainer sidecar it starts
        # (shoal_services.trainer_sidecar.SIDECAR_TOKEN), read before settings are:
        "SHOAL_SIDECAR_TOKEN",
        # The compose stack's own variables (deploy/compose/compose.yaml substitutes them;
        # an operator exports them in the shell that also starts shoal):
        "SHOAL_BASE_IMAGE",
        "SHOAL_IMAGE",
        "SHOAL_PROMETHEUS_IMAGE",
        "SHOAL_NATS_PORT",
        "SHOAL_GRAFANA_PORT",
        "SHOAL_JAEGER_PORT",
        "SHOAL_OTLP_ENDPOINT",
        "SHOAL_PROMETHEUS_PORT",
        "SHOAL_JOBS_DIR",
        "SHOAL_REAL_FAKE_GPUS",
        "SHOAL_REAL_GPU_TYPE",
        "SHOAL_USERS",
    }
)
"""``SHOAL_*`` variables other tools own: not reported as unknown settings."""


def unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """One message per ``SHOAL_*`` variable of ``env`` that no setting reads (sorted),
    e.g. ``"SHOAL_TIME_SCLAE (did you mean SHOAL_TIME_SCALE?)"``."""
    env = os.environ if env is None else env
    known = [ENV_PREFIX + n.upper() for n in _field_types()]
    out = []
    for key in sorted(env):
        if not key.startswith(ENV_PREFIX) or key in known or key in FOREIGN_NAMES:
            continue
        if key.startswith(FOREIGN_PREFIXES):
            continue
        out.append(_unknown(key, known).removeprefix("unknown setting "))
    return out


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(Settings, include_extras=True)
    return {f.name: hints[f.name] for f in msgspec.structs.fields(Settings)}


def _unknown(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown setting {name}{hint}"


def _is_optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)


def _base(tp: Any) -> Any:
    if typing.get_origin(tp) is Annotated:
        return typing.get_args(tp)[0]
    return tp


def _parse_text(source: str, text: str, tp: Any, name: str) -> Any:
    text = text.strip()
    if text == "":
        if _is_optional(tp):
            return None
        raise SettingsError(f"{source} is empty; expected {_describe(tp)}")
    base = _base(tp)
    if base is bool:
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise SettingsError(f"{source}={text!r}: expected a boolean (true/false, 1/0, yes/no, on/off)")
    if typing.get_origin(base) in (dict, tuple, list):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            kind = "a JSON object" if typing.get_origin(base) is dict else "a JSON list"
            raise SettingsError(f"{source}={text!r}: expected {kind} ({exc})") from None
        return _convert(source, parsed, tp)
    return _convert(source, text, tp, shown=text)


def _convert(source: str, value: Any, tp: Any, shown: Any = None) -> Any:
    try:
        return msgspec.convert(value, tp, strict=False)
    except msgspec.ValidationError as exc:
        shown = value if shown is None else shown
        raise SettingsError(f"{source}={shown!r}: {_reason(exc, tp)}") from None


def _reason(exc: msgspec.ValidationError, tp: Any) -> str:
    base = _base(tp)
    if typing.get_origin(base) is Literal:
        return "expected one of " + ", ".join(str(a) for a in typing.get_args(base))
    msg = str(exc)
    if "got `str`" in msg:
        return f"expected {_describe(tp)}"
    return msg[0].lower() + msg[1:] if msg else f"expected {_describe(tp)}"


def _describe(tp: Any) -> str:
    base = _base(tp)
    args = [a for a in typing.get_args(base) if a is not type(None)]
    if typing.get_origin(base) is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if args and _is_optional(base):
        return _describe(args[0])
    return _NAMES.get(base, getattr(base, "__name__", str(base)))


_NAMES: dict[Any, str] = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}
