"""Check shoal's Kubernetes manifests offline: render, validate, scan.

    python deploy/k8s/check.py [--tools DIR] [--versions 1.30.0,1.33.0] [--no-scan]

For every variant (the ``dev`` overlay, the ``prod`` overlay, ``prod`` with the
``monitoring`` component, and the cluster-wide ``admission`` policies) it

1. renders the manifests with ``kubectl kustomize`` on a copy of ``deploy/k8s`` whose
   dev Secrets it has just made with ``shoal creds k8s`` (no seed is ever committed);
2. validates every object with ``kubernetes-validate --strict`` for each Kubernetes
   version (the ServiceMonitor has no schema there: kubernetes-validate warns and
   skips it);
3. scans the rendered objects (``dev`` and ``prod-monitoring``, which holds all of
   ``prod``) with ``checkov --framework kubernetes`` in one run and wants zero failed
   checks (a skipped check carries its reason next to its ``checkov.io/skip``
   annotation in the manifests).

The tools are looked up in ``--tools`` (a virtualenv's ``bin``, as ``.ci/run`` makes
it with ``pip install '.[k8s]'``), then on ``PATH``. Exit status 0 when everything
passed, 1 when something failed, 2 when a tool is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSIONS = ("1.30.0", "1.33.0")
"""Kubernetes versions the manifests must validate against (kubernetes-validate's schemas)."""
DEV_NODES = ("kind-control-plane", "kind-worker")
"""Node names the dev Secrets are made for when checking (any names render the same)."""


class MissingTool(RuntimeError):
    pass


def tool(name: str, tools: str | None = None) -> str:
    """The path of executable ``name``: in ``tools`` if given and there, else on PATH."""
    if tools:
        candidate = Path(tools) / name
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise MissingTool(f"{name} not found (in {tools or '-'} nor on PATH); pip install '.[k8s]'")
    return found


def prepare(workdir: Path) -> Path:
    """A copy of deploy/k8s in ``workdir`` with the dev overlay's Secrets made by
    ``shoal creds k8s`` and a ``prod-monitoring`` variant; returns the copy."""
    root = workdir / "k8s"
    shutil.copytree(HERE, root, ignore=shutil.ignore_patterns("secrets", "__pycache__", "*.py"))
    argv = [sys.executable, "-c", "import sys; from shoal.cli import main; sys.exit(main())"]
    argv += ["creds", "k8s", str(root / "overlays" / "dev" / "secrets"), "--user", "alice"]
    for node in DEV_NODES:
        argv += ["--node", node]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    mon = root / "overlays" / "prod-monitoring"
    mon.mkdir()
    (mon / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: shoal\n"
        "resources:\n  - ../prod\ncomponents:\n  - ../../components/monitoring\n"
    )
    return root


def render(kubectl: str, root: Path, variant: str, out: Path) -> Path:
    """``kubectl kustomize`` of overlay ``variant`` (or of ``root/<variant>`` when it is
    not an overlay, as :data:`CLUSTER_WIDE`) into ``out/<variant>.yaml``."""
    src = root / "overlays" / variant
    if not src.exists():
        src = root / variant
    text = subprocess.run([kubectl, "kustomize", str(src)], check=True, capture_output=True, text=True).stdout
    path = out / f"{variant}.yaml"
    path.write_text(text)
    return path


VARIANTS = ("dev", "prod", "prod-monitoring")
CLUSTER_WIDE = "admission"
"""Cluster-scoped objects applied apart from the overlays (``deploy/k8s/admission``)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--tools", default=os.environ.get("K8S_TOOLS_DIR"), help="directory of the tools")
    p.add_argument("--versions", default=",".join(VERSIONS), help="Kubernetes versions, comma-separated")
    p.add_argument("--no-scan", action="store_true", help="skip the checkov scan")
    args = p.parse_args(argv)
    try:
        kubectl = tool("kubectl", args.tools)
        validate = tool("kubernetes-validate", args.tools)
        checkov = None if args.no_scan else tool("checkov", args.tools)
    except MissingTool as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="shoal-k8s-") as tmp:
        root = prepare(Path(tmp))
        out = Path(tmp) / "rendered"
        out.mkdir()
        files = []
        for variant in (*VARIANTS, CLUSTER_WIDE):
            try:
                files.append(render(kubectl, root, variant, out))
                print(f"rendered {variant}")
            except subprocess.CalledProcessError as exc:
                print(f"FAIL kubectl kustomize {variant}:\n{exc.stderr}")
                failed.append(f"render {variant}")
        names = " ".join(f.name for f in files)
        for version in args.versions.split(","):
            r = subprocess.run([validate, "--strict", "-k", version, "--quiet", *map(str, files)])
            print(
                f"{'ok' if r.returncode == 0 else 'FAIL'} kubernetes-validate --strict -k {version} {names}"
            )
            if r.returncode != 0:
                failed.append(f"kubernetes-validate {version}")
        if checkov is not None:
            # prod-monitoring holds every object of prod: scanning prod too would add nothing.
            scan = out / "scan"
            scan.mkdir()
            for f in files:
                if f.stem != "prod":
                    shutil.copy(f, scan / f.name)
            cmd = [
                checkov,
                "-d",
                str(scan),
                "--framework",
                "kubernetes",
                "--quiet",
                "--compact",
                "--skip-download",
            ]
            r = subprocess.run(cmd)
            print(
                f"{'ok' if r.returncode == 0 else 'FAIL'} checkov {' '.join(sorted(p.name for p in scan.iterdir()))}"
            )
            if r.returncode != 0:
                failed.append("checkov")
    if failed:
        print("FAILED: " + ", ".join(failed))
        return 1
    print("k8s manifests: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
