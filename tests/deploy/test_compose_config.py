"""The compose stack's configuration, checked offline (default run, a few seconds): the
files of the services the container test cannot start (Grafana's dashboard and
provisioning, the OpenTelemetry collector), Prometheus's configuration with promtool, the
NATS servers' configuration that ``shoal nats-config`` writes (with nats-server's own
``-t`` check, and the auth callout for per-job sidecar identities), and that nothing in
compose.yaml runs without credentials."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from shoal.commands.run import CLI_ARGV
from shoal.nats_config import server_config
from shoal.nats_server import find_nats_server

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text()))


def shoal_services() -> dict[str, dict[str, Any]]:
    """The services that run `shoal run <service>`."""
    return {
        name: svc for name, svc in compose()["services"].items() if (svc.get("command") or [None])[0] == "run"
    }


def exported_metric_names() -> set[str]:
    """Every metric name shoal's code declares (prometheus_client adds _total, _bucket, ...)."""
    names: set[str] = set()
    for path in [ROOT / "libs/shoal/probes.py", ROOT / "services/allocator/service.py"]:
        names |= set(re.findall(r'"(shoal_[a-z_]+)"', path.read_text()))
    from shoal import state as st
    from shoal.health import state_gauges

    names |= {"shoal_" + g.name for g in state_gauges(st.ClusterState())}
    return names


def test_grafana_dashboard_loads_and_uses_exported_metrics() -> None:
    dashboard = json.loads((COMPOSE_DIR / "grafana/dashboards/shoal.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    datasources = yaml.safe_load(
        (COMPOSE_DIR / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    [source] = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((COMPOSE_DIR / "grafana/provisioning/dashboards/shoal.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    known = exported_metric_names()
    ids = set()
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for wanted in (
        "shares per job",
        "queue length",
        "cluster efficiency",
        "blocking index",
        "reconfiguration",
        "decision latency",
    ):
        assert wanted in titles, (wanted, titles)
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["type"] and set(panel["gridPos"]) == {"x", "y", "w", "h"}
        ids.add(panel["id"])
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"]
            for metric in re.findall(r"shoal_[a-z_]+", target["expr"]):
                queried.add(metric)
                base = re.sub(r"_(bucket|total|count|sum)$", "", metric)
                assert metric in known or base in known, f"{panel['title']}: {metric} is not exported"
    assert len(ids) == len(dashboard["panels"]), "panel ids must be unique"
    # AFS §2.2's QL, CE and BI, as the services export them.
    assert {"shoal_queue_length", "shoal_cluster_efficiency", "shoal_blocking_index"} <= queried


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    out = subprocess.run(
        # The full check (the files the config names, its rule files) and the lint of
        # the scrape configs, not --syntax-only.
        [promtool, "check", "config", "--lint=all", "--lint-fatal", str(COMPOSE_DIR / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_scrapes_every_shoal_service() -> None:
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    targets = {
        t.split(":")[0]
        for job in config["scrape_configs"]
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    }
    assert set(shoal_services()) <= targets, set(shoal_services()) - targets


def test_otel_collector_config_has_a_traces_pipeline_to_jaeger() -> None:
    config = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    pipeline = config["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        for name in pipeline[kind]:
            assert name in config[kind], f"{kind}: {name} is used but not defined"
    assert pipeline["receivers"] == ["otlp"] and "http" in config["receivers"]["otlp"]["protocols"]
    assert config["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    # The services export to the collector's OTLP/HTTP port by default.
    env = compose()["x-shoal"]["environment"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith("-http://otel-collector:4318}")


def test_every_shoal_container_authenticates_and_ports_stay_local() -> None:
    services = shoal_services()
    assert {"admission", "profiler", "placer", "trader", "allocator-1", "allocator-2", "authorizer"} <= set(
        services
    )
    for name, svc in services.items():
        creds = svc["environment"]["SHOAL_NATS_CREDS"]
        assert creds.startswith("/var/lib/shoal/creds/"), name
        # Its own seeds only: one volume that nats-config --split fills for this container.
        mounts = [v for v in svc["volumes"] if v.split(":")[1] == "/var/lib/shoal/creds"]
        identity = creds.removeprefix("/var/lib/shoal/creds/").removesuffix(".nk")
        group = identity if svc["command"][1] != "node-daemon" else identity.removeprefix("node-")
        assert mounts == [f"creds-{group}:/var/lib/shoal/creds:ro"], (name, svc["volumes"])
        if svc["command"][1] == "node-daemon":
            # The sidecar seed signs per-job tokens; the sidecars never get it.
            assert svc["environment"]["SHOAL_SIDECAR_CREDS"] == f"/var/lib/shoal/creds/sidecar-{group}.nk"
            assert svc["environment"]["SHOAL_SIDECAR_TOKENS"] == "true", name
        # nats-config writes that container's directory into that volume.
        writer = compose()["services"]["nats-config"]
        assert "--split" in writer["command"]
        assert f"creds-{group}:/var/lib/shoal/creds.d/{identity}" in writer["volumes"], name
    for name, svc in compose()["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond this host"
        # Only the one-shot that writes them sees the operator's (admin and users') seeds,
        # and every service's.
        if name != "nats-config":
            assert not any(v.startswith(("operator-creds:", "creds:")) for v in svc.get("volumes", [])), name


def test_nats_config_writes_valid_server_configs_and_keeps_seeds(tmp_path: Path) -> None:
    out = tmp_path / "cfg"
    argv = [*CLI_ARGV, "nats-config", str(out), "--nodes", "n1", "--users", "alice", "--mqtt", "--split"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    first = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert first.returncode == 0, first.stderr
    seeds = {p.name: p.read_bytes() for p in out.glob("*/*.nk")}
    assert set(seeds) == {
        "admission.nk",
        "allocator.nk",
        "placer.nk",
        "profiler.nk",
        "trader.nk",
        "node-n1.nk",
        "sidecar-n1.nk",
        "authorizer.nk",
        "revoker.nk",
        "callout-issuer.nk",
        "admin.nk",
        "user-alice.nk",
    }
    assert (out / "operator/admin.nk").exists() and not (out / "creds/admin.nk").exists()
    # --split: each container's own seeds in a directory of its own, the same bytes.
    split = {p.relative_to(out / "creds.d").as_posix(): p.read_bytes() for p in out.glob("creds.d/*/*.nk")}
    assert set(split) == {
        "admission/admission.nk",
        "allocator/allocator.nk",
        "placer/placer.nk",
        "profiler/profiler.nk",
        "trader/trader.nk",
        "node-n1/node-n1.nk",
        "node-n1/sidecar-n1.nk",
        "authorizer/authorizer.nk",
        "authorizer/revoker.nk",
        "authorizer/callout-issuer.nk",
    }
    assert all(seeds[name.split("/")[1]] == data for name, data in split.items())
    # The authorizer's directory: the sidecar keys that verify tokens, public keys only.
    from shoal.auth import CredentialStore

    services = CredentialStore(out / "creds")
    authorizer = CredentialStore(out / "creds.d/authorizer")
    assert authorizer.sidecar_keys() == services.sidecar_keys() and "n1" in authorizer.sidecar_keys()
    assert sorted(p.name for p in (out / "creds.d/authorizer").iterdir()) == [
        "authorizer.nk",
        "callout-issuer.nk",
        "identities.json",
        "revoker.nk",
    ]
    for path in out.rglob("*"):
        assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
    again = subprocess.run([*argv, "--users", "bob"], capture_output=True, text=True, timeout=60, env=env)
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_bytes() for p in out.glob("*/*.nk") if p.name in seeds} == seeds
    conf = out / "server/nats-2.conf"
    text = conf.read_text()
    password = (out / "server/route.password").read_text().strip()
    assert f"route:{password}@nats-1:6222" in text and f'password: "{password}"' in text
    bob = next(i for i in CredentialStore(out / "operator").identities() if i.subject == "bob")
    assert bob.public_key in text
    # The authorizer's manifest: every identity (bob too, with his MQTT password's hash),
    # so the callout admits one the running servers do not list yet; public keys only.
    everyone = [*services.identities(), *CredentialStore(out / "operator").identities()]
    assert authorizer.identities() == sorted(everyone, key=lambda i: i.name)
    assert bob in authorizer.identities() and bob.mqtt_password_hash
    manifest = (out / "creds.d/authorizer/identities.json").read_bytes()
    assert not any(seed.strip() in manifest for seed in seeds.values())
    check = subprocess.run(
        [find_nats_server(), "-c", str(conf), "-t"], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # Per-job sidecar identities: the callout block names the issuer the authorizer signs
    # with, every static identity bypasses it, and the node's sidecar key is no user.
    block = authorization(text)
    issuer = services.issuer_public_key()
    assert issuer and block["auth_callout"]["issuer"] == issuer
    users = {u.get("nkey") or u["user"] for u in block["users"]}
    # The revoker is the system account's user (not the log's account); it bypasses too.
    revoker = next(i.public_key for i in services.identities() if i.role == "revoker")
    assert set(block["auth_callout"]["auth_users"]) == users | {revoker}
    static = {i.public_key for i in [*services.identities(), *CredentialStore(out / "operator").identities()]}
    sidecar = services.sidecar_keys()["n1"]
    assert users == (static - {sidecar, revoker}) | {"alice", "bob"} and sidecar not in text
    authorizer_key = next(i.public_key for i in services.identities() if i.role == "authorizer")
    assert authorizer_key in users


def authorization(config: str) -> dict[str, Any]:
    """The ``authorization`` block of a server configuration nats-config wrote (JSON)."""
    return dict(json.loads(config.split("\nauthorization: ", 1)[1]))


def test_nats_config_without_the_callout_keeps_static_sidecars(tmp_path: Path) -> None:
    """--no-callout: no callout block; the node's sidecar key is a user of the cluster."""
    out = tmp_path / "cfg"
    argv = [*CLI_ARGV, "nats-config", str(out), "--nodes", "n1", "--split", "--no-callout"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    from shoal.auth import CredentialStore

    block = authorization((out / "server/nats-1.conf").read_text())
    assert "auth_callout" not in block
    assert CredentialStore(out / "creds").sidecar_keys()["n1"] in {u.get("nkey") for u in block["users"]}
    assert not (out / "creds.d/authorizer").exists() and not (out / "creds/callout-issuer.nk").exists()


def test_server_config_refuses_what_would_break_its_syntax() -> None:
    with pytest.raises(ValueError, match="not one of"):
        server_config("x", servers=["a"], identities=[], route_password="p")
    with pytest.raises(ValueError, match="route password"):
        server_config("a", servers=["a"], identities=[], route_password='p"')
    with pytest.raises(ValueError, match="server or cluster name"):
        server_config("a b", servers=["a b"], identities=[], route_password="p")
    assert sys.version_info >= (3, 11)


def _ca_and_server_cert(directory: Path, host: str) -> None:
    """``ca.pem`` and ``<host>.pem``/``<host>-key.pem``, signed by it, for ``host``."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def cert(subject: str, key: Any, issuer: str, signer: Any, *, ca: bool) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    pem = serialization.Encoding.PEM
    (directory / "ca.pem").write_bytes(
        cert("shoal-ca", ca_key, "shoal-ca", ca_key, ca=True).public_bytes(pem)
    )
    (directory / f"{host}.pem").write_bytes(cert(host, key, "shoal-ca", ca_key, ca=False).public_bytes(pem))
    (directory / f"{host}-key.pem").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


async def test_nats_config_keeps_tls_and_sync_interval_when_run_again(tmp_path: Path) -> None:
    """The bare-metal guide's TLS and fsync settings are options of `shoal nats-config`,
    not hand edits that the next run (adding a user) would overwrite. The configuration it
    writes starts a server that speaks only TLS to clients, with the CA's certificates."""
    import socket
    import ssl

    import nats
    import nats.errors

    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    _ca_and_server_cert(tls_dir, "localhost")
    out = tmp_path / "cfg"
    argv = [
        *CLI_ARGV, "nats-config", str(out), "--servers", "localhost", "--users", "alice",
        "--store-dir", str(tmp_path / "js"), "--sync-interval", "1s",
        "--tls-cert", str(tls_dir / "{server}.pem"), "--tls-key", str(tls_dir / "{server}-key.pem"),
        "--tls-ca", str(tls_dir / "ca.pem"),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    for users in ("alice", "alice,bob"):  # the second run adds bob and keeps the rest
        done = subprocess.run([*argv, "--users", users], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
    conf = out / "server/localhost.conf"
    text = conf.read_text()
    assert 'sync_interval: "1s"' in text
    assert f'cert_file: "{tls_dir / "localhost.pem"}"' in text and f'ca_file: "{tls_dir / "ca.pem"}"' in text
    check = subprocess.run(
        [find_nats_server(), "-c", str(conf), "-t"], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr

    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    port = free()
    server = subprocess.Popen(
        [find_nats_server(), "-c", str(conf), "-p", str(port), "-m", str(free()),
         "--cluster", f"nats://127.0.0.1:{free()}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        ctx = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
        admin = str(out / "operator/admin.nk")
        nc = None
        for _ in range(100):
            try:
                nc = await nats.connect(
                    f"tls://localhost:{port}",
                    tls=ctx,
                    nkeys_seed=admin,
                    allow_reconnect=False,
                    connect_timeout=2,
                )
                break
            except Exception:
                await asyncio.sleep(0.1)
        assert nc is not None, "no TLS connection to the server nats-config configured"
        await nc.close()
        with pytest.raises(Exception):  # noqa: B017 - without the CA: refused (the server wants TLS)
            await nats.connect(
                f"nats://localhost:{port}", nkeys_seed=admin, allow_reconnect=False, connect_timeout=2
            )
    finally:
        server.terminate()
        server.wait(10)


def test_every_nats_server_has_an_exporter_prometheus_scrapes() -> None:
    """The NATS servers' own metrics: a prometheus-nats-exporter in each server's network
    namespace (its monitoring port listens on that namespace's 127.0.0.1 only) reads it,
    without per-connection detail, and Prometheus's job "nats" scrapes each of them."""
    services = compose()["services"]
    servers = sorted(n for n in services if re.fullmatch(r"nats-\d", n))
    exporters = {n: s for n, s in services.items() if n.startswith("nats-exporter-")}
    assert len(servers) == 3 and sorted(s["network_mode"] for s in exporters.values()) == [
        f"service:{n}" for n in servers
    ]
    for name, svc in exporters.items():
        assert svc["command"][-1] == "http://127.0.0.1:8222", name
        assert "-connz" not in svc["command"] and "-jsz=streams" in svc["command"], name
        assert svc["image"].startswith("natsio/prometheus-nats-exporter:"), name
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "nats"]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"{n}:7777" for n in servers]


def test_the_default_base_image_is_pinned_by_digest_everywhere() -> None:
    """The Dockerfile's default ``BASE``, build.sh's and every build in compose.yaml name the
    same official slim Python image by digest (a tag alone would build on whatever the tag
    points at that day), and the deployment guide quotes that digest."""
    (dockerfile,) = re.findall(r"^ARG BASE=(\S+)$", (COMPOSE_DIR / "Dockerfile").read_text(), re.M)
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", dockerfile), dockerfile
    (script,) = re.findall(r'^BASE="\$\{BASE:-(\S+)\}"', (COMPOSE_DIR / "build.sh").read_text(), re.M)
    builds = [
        svc["build"]["args"]["BASE"]
        for svc in compose()["services"].values()
        if isinstance(svc.get("build"), dict) and "BASE" in svc["build"].get("args", {})
    ]
    assert script == dockerfile
    assert builds and set(builds) == {f"${{SHOAL_BASE_IMAGE:-{dockerfile}}}"}
    assert dockerfile in (ROOT / "docs" / "deploy.md").read_text()
