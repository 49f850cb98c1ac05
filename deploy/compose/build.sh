#!/usr/bin/env bash
# Build shoal's images with podman without reaching an index from inside the build: the
# host's pip fills deploy/wheels and deploy/wheels-train (pip's own cache makes a rebuild fast), then
# deploy/compose/Dockerfile installs from there with --no-index.
#
#   deploy/compose/build.sh                        # the shoal image
#   deploy/compose/build.sh shoal prometheus       # several targets
#   deploy/compose/build.sh shoal-train            # with torch
#   BASE=localhost/shoal-base:bookworm deploy/compose/build.sh   # the base CI makes (.ci/run)
#
# Images are tagged localhost/<target>:$TAG (TAG defaults to 0.1.0, the compose file's).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
BASE="${BASE:-python:3.11-slim-bookworm@sha256:fe556eaffd0d96abd8685b83bb8a69addd0dc730fa193669a7df0d49ddcfac02}"  # as the Dockerfile's
TAG="${TAG:-0.1.0}"
[ "$#" -gt 0 ] || set -- shoal
wheels() {  # wheels() DIR EXTRAS: every dependency's wheel (and setuptools/wheel, to build
    # shoal itself) in DIR, made again only when pyproject.toml's dependencies change.
    local dir="$1" extras="$2" stamp
    stamp="$("$PYTHON" -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(p["dependencies"], {k: p["optional-dependencies"][k] for k in sys.argv[1].split(",")})' "$extras" \
        | sha256sum | cut -c1-16)"
    if [ "$(cat "$dir/.stamp" 2>/dev/null)" != "$stamp" ]; then
        "$PYTHON" -m pip wheel -q --wheel-dir "$dir" ".[$extras]" "setuptools>=68" wheel
        rm -f "$dir"/shoal-*.whl
        echo "$stamp" > "$dir/.stamp"
    fi
}
for target in "$@"; do
    case "$target" in
        shoal) wheels deploy/wheels nvml,otlp ;;
        # A wheelhouse of its own, so that torch does not change the shoal image's layers.
        shoal-train) wheels deploy/wheels nvml,otlp && wheels deploy/wheels-train train ;;
        prometheus) ;;
        *) echo "unknown target $target (shoal, shoal-train, prometheus)" >&2; exit 2 ;;
    esac
done
for target in "$@"; do
    podman --runtime runc build --format docker --build-arg "BASE=$BASE" --build-arg PIP_ARGS=--no-index \
        -f deploy/compose/Dockerfile --target "$target" -t "localhost/$target:$TAG" .
done
