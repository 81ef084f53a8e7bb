#!/usr/bin/env bash
# fedmeta's two images, built once with the engine's own `build` (not `docker compose build`, which
# over podman's Docker API builds once per service: 7 builds, docs/deploy.md), so that every
# compose test of one test run starts from them (tests/deploy/test_compose_podman.py, a session
# fixture) and compose itself runs with --no-build:
#
#   scripts/compose-build.sh [docker|podman] [--force]
#
# The build arguments come from the FEDMETA_* variables of docs/deploy.md ("Offline and mirrored
# builds"), as docker-compose.yml's x-build reads them; as scripts/compose-smoke.sh does, the
# machine's CPU torch wheel (/opt/wheels) is linked into the build context where no wheelhouse is
# given, and pip's CA bundle (PIP_CERT) copied where no CA directory is given. An image built from
# the same sources (a digest of every file the Dockerfile copies, kept as the image's label
# fedmeta.sources) is kept; one built from other sources is built again (--force: always; the
# layer cache still applies). Prints one line per image.
set -euo pipefail
cd "$(dirname "$0")/.."
cli=${1:-docker} force=0
[ "${2:-}" = --force ] && force=1
case "$cli" in docker|podman) ;; *) echo "compose-build: the engine is docker or podman (got '$cli')" >&2; exit 2 ;; esac
if [ "$cli" = podman ]; then eval "$(bash scripts/podman-setup.sh env)"; fi

if [ -z "${FEDMETA_WHEELHOUSE:-}" ] && ls /opt/wheels/torch-*+cpu-*.whl >/dev/null 2>&1; then
  mkdir -p .whl && { ln -f /opt/wheels/torch-*+cpu-*.whl .whl/ 2>/dev/null || cp -n /opt/wheels/torch-*+cpu-*.whl .whl/; }
  export FEDMETA_WHEELHOUSE=.whl
  timeout 5 curl -sfI https://download.pytorch.org/whl/cpu/ >/dev/null 2>&1 || export FEDMETA_TORCH_INDEX_URL=
fi
if [ -z "${FEDMETA_CA_CERTS:-}" ]; then
  cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    mkdir -p .ca && cp "$cert" .ca/pip-cert.crt && export FEDMETA_CA_CERTS=.ca
  fi
fi

# What the image is built from (deploy/images/Dockerfile's COPY lines), compiled files left out.
sources=$(find pyproject.toml README.md configs deploy/images deploy/fedmeta deploy/tls deploy/proxy \
            core/fedmeta cli/fedmeta accounting/fedmeta server/fedmeta client/fedmeta \
            metalearning/fedmeta simulation/fedmeta -type f ! -name '*.pyc' -print0 2>/dev/null \
          | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
built_from() { "$cli" image inspect --format '{{ index .Config.Labels "fedmeta.sources" }}' "$1" 2>/dev/null || true; }
for target in server participant; do   # the second reuses every layer of the first
  tag=fedmeta-$target:dev
  if [ "$force" = 0 ] && [ "$(built_from "$tag")" = "$sources" ]; then
    echo "compose-build: $tag exists, built from these sources ($sources)"; continue
  fi
  t0=$(date +%s)
  nice -n 10 timeout 3600 "$cli" build -q -f deploy/images/Dockerfile --target "$target" \
    --build-arg BASE_IMAGE="${FEDMETA_BASE_IMAGE:-python:3.11-slim-bookworm}" \
    --build-arg TORCH_VARIANT="${FEDMETA_TORCH_VARIANT:-cpu}" \
    --build-arg TORCH_INDEX_URL="${FEDMETA_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}" \
    --build-arg PACKAGE_INDEX_URL="${FEDMETA_PACKAGE_INDEX_URL:-}" \
    --build-arg WHEELHOUSE="${FEDMETA_WHEELHOUSE:-deploy/images/wheelhouse}" \
    --build-arg CA_CERTS="${FEDMETA_CA_CERTS:-deploy/images/ca-certs}" \
    --build-arg STRIP_LIBRARIES="${FEDMETA_STRIP_LIBRARIES:-auto}" \
    --label "fedmeta.sources=$sources" -t "$tag" . >/dev/null
  echo "compose-build: $tag built in $(( $(date +%s) - t0 )) s ($("$cli" image inspect --format '{{.Size}}' "$tag") bytes)"
done
