#!/usr/bin/env bash
# The compose federation end to end, by the documented commands only (docs/deploy.md), through
# podman's Docker-compatible API where there is no Docker Engine. The `slow` test
# tests/deploy/test_compose_podman.py runs it.
#
#   scripts/compose-smoke.sh [--tls] [--no-build] [--keep-up]
#
#   1. no Docker Engine answering: scripts/podman-setup.sh all; eval "$(scripts/podman-setup.sh env)"
#   2. docker compose up -d --build (--wait for health; timed)
#   3. docker compose exec serverapp fedmeta deploy run --set rounds=4        -> 4 rounds
#      docker compose exec serverapp fedmeta deploy run                       -> budget_exhausted:
#      the second run composes in the same ledger (it spends only what the first left); a third
#      finds nothing left (exit status 3)
#   4. the exporter reads the ledger: one spend per round of the two runs
#   5. docker compose down -v (also on failure; --keep-up leaves the federation running)
#
# --tls: the TLS overlay (deploy/tls/make-certs.sh into a temporary directory first).
# Project name fedmeta-smoke (COMPOSE_PROJECT_NAME), so that `down -v` never touches a federation
# of yours under the default name. Offline torch: FEDMETA_WHEELHOUSE=.whl with the CPU wheel in
# .whl/ (the script links /opt/wheels' torch wheel there when it exists and no wheelhouse is set);
# no torch index reachable: FEDMETA_TORCH_INDEX_URL= (empty). Prints "compose-smoke: ok" at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
build=(--build) tls=0 keep=0
for a in "$@"; do
  case "$a" in
    --no-build) build=(--no-build) ;;
    --tls) tls=1 ;;
    --keep-up) keep=1 ;;
    *) echo "compose-smoke: unknown argument $a" >&2; exit 2 ;;
  esac
done
export COMPOSE_PROJECT_NAME=fedmeta-smoke
work=$(mktemp -d /tmp/fedmeta-compose-smoke.XXXXXX)
secs() { echo $(( $(date +%s) - $1 )); }

# 1. The engine: Docker Engine if one answers, else podman as scripts/podman-setup.sh sets it up.
if [ -z "${DOCKER_HOST:-}" ] && ! timeout 20 docker info >/dev/null 2>&1; then
  t0=$(date +%s)
  bash scripts/podman-setup.sh all
  eval "$(bash scripts/podman-setup.sh env)"
  echo "compose-smoke: podman set up in $(secs "$t0") s"
fi
if docker compose version >/dev/null 2>&1; then compose=(docker compose)
else compose=("$(bash scripts/podman-setup.sh compose-bin)"); fi
files=()
if [ "$tls" = 1 ]; then
  export FEDMETA_CERTS=$work/certs
  bash deploy/tls/make-certs.sh --out "$FEDMETA_CERTS" --nodes 3 --owner 10001 >/dev/null
  files=(-f docker-compose.yml -f deploy/compose/tls.yml)
fi
dc() { "${compose[@]}" "${files[@]}" "$@"; }

# Offline torch: the machine's own CPU wheel, linked into the build context.
if [ -z "${FEDMETA_WHEELHOUSE:-}" ] && ls /opt/wheels/torch-*+cpu-*.whl >/dev/null 2>&1; then
  mkdir -p .whl && ln -f /opt/wheels/torch-*+cpu-*.whl .whl/ 2>/dev/null || cp -n /opt/wheels/torch-*+cpu-*.whl .whl/
  export FEDMETA_WHEELHOUSE=.whl
  timeout 5 curl -sfI https://download.pytorch.org/whl/cpu/ >/dev/null 2>&1 || export FEDMETA_TORCH_INDEX_URL=
fi
# A mirror or TLS-inspecting proxy with its own CA: the bundle pip uses on this machine, copied into
# the build context (FEDMETA_CA_CERTS; .ca/ is ignored by git).
if [ -z "${FEDMETA_CA_CERTS:-}" ]; then
  cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    mkdir -p .ca && cp "$cert" .ca/pip-cert.crt && export FEDMETA_CA_CERTS=.ca
  fi
fi
# One image build at a time: both images share their layers (the second build reuses them).
export COMPOSE_PARALLEL_LIMIT=${COMPOSE_PARALLEL_LIMIT:-1}
for port in 8000 9464; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "compose-smoke: 127.0.0.1:$port is in use; the compose file publishes it" >&2; exit 1
  fi
done

cleanup() {
  [ "$keep" = 1 ] || timeout 300 "${compose[@]}" "${files[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 2. Up, built here.
t0=$(date +%s)
if [ "${build[0]}" = --build ]; then
  nice -n 10 timeout 3600 "${compose[@]}" "${files[@]}" build
  echo "compose-smoke: images built in $(secs "$t0") s"
  for img in fedmeta-server:dev fedmeta-participant:dev; do
    echo "compose-smoke: image $img $(docker image inspect -f '{{.Size}}' "$img" 2>/dev/null || podman image inspect -f '{{.Size}}' "$img") bytes"
  done
fi
t0=$(date +%s)
timeout 900 "${compose[@]}" "${files[@]}" up -d --wait --wait-timeout 840
echo "compose-smoke: federation up and healthy in $(secs "$t0") s"

run() { timeout 1800 "${compose[@]}" "${files[@]}" exec -T serverapp fedmeta deploy run --poll 1 "$@"; }

# 3. A first run of 4 rounds, then the documented command to budget_exhausted: the second run
#    composes in the same ledger (it spends only what the first left), and a third finds nothing
#    left (exit status 3).
t0=$(date +%s)
out=$(run --set rounds=4) || { echo "$out"; echo "compose-smoke: first run failed" >&2; exit 1; }
echo "$out"; echo "compose-smoke: first run (4 rounds) $(secs "$t0") s"
first=$(sed -n 's/.*rounds completed \([0-9]*\),.*/\1/p' <<<"$out" | head -1)
[ "${first:-0}" = 4 ] || { echo "compose-smoke: first run completed ${first:-no} rounds, expected 4" >&2; exit 1; }

t0=$(date +%s)
again=$(run) || { echo "$again"; echo "compose-smoke: second run failed" >&2; exit 1; }
echo "$again"; echo "compose-smoke: second run $(secs "$t0") s"
grep -q "stopped: budget_exhausted" <<<"$again"
second=$(sed -n 's/.*rounds completed \([0-9]*\),.*/\1/p' <<<"$again" | head -1)
[ "${second:-0}" -ge 1 ]
set +e; third=$(run); status=$?; set -e
echo "$third"
[ "$status" = 3 ] || { echo "compose-smoke: third run exited $status, expected 3 (budget spent)" >&2; exit 1; }

# 4. The ledger as the exporter sees it.
metrics=$(timeout 120 "${compose[@]}" "${files[@]}" exec -T exporter python -c '
import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=60).read().decode())')
spends=$(awk '/^fedmeta_ledger_spends_total/ {print $2}' <<<"$metrics" | head -1)
echo "compose-smoke: exporter: ${spends:-no} spends; runs: ${first} + ${second} rounds; $(grep '^fedmeta_ledger_readable' <<<"$metrics")"
python3 -c "import sys; assert float(sys.argv[1]) == int(sys.argv[2]) + int(sys.argv[3]), sys.argv" "${spends:-0}" "$first" "${second:-0}"
timeout 120 "${compose[@]}" "${files[@]}" exec -T serverapp ls /runs
echo "compose-smoke: ok"
