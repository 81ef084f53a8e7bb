#!/usr/bin/env bash
# The compose federation end to end through podman (phase-1 smoke test; phase 2 turns it into a `slow`
# test): builds the images from the local Debian base, brings up the federation profile with the TLS
# overlay, registers the node keys, runs a short private federation of the prototype app
# (deploy/prototype/app) and checks its outcome and the ledger in the named volume, then tears
# everything down. Needs root, scripts/podman-setup.sh (install, base, service) and .venv.
#
#   scripts/compose-smoke.sh [ROUNDS]         (default 10; about 6 minutes here, images cached)
#
# Offline torch: put the CPU wheel in .whl/ (and, behind a TLS-inspecting proxy, its CA bundle as
# .whl/ca-bundle.crt). Every wait has a timeout; `down -v` runs on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-10}
work=$(mktemp -d /tmp/fedmeta-compose-smoke.XXXXXX)
netns=${FEDMETA_PODMAN_NETNS:-fedmeta-podman}
eval "$(scripts/podman-setup.sh env)"
export FEDMETA_CERTS=$work/certs FEDMETA_PULL_POLICY=never FLWR_HOME=$work/home
compose=(.venv/bin/docker-compose -f docker-compose.yml -f deploy/compose/tls.yml --profile federation)
in_ns() { nsenter --net="/run/netns/$netns" -- "$@"; }

build_args=(--build-arg BASE_IMAGE="${FEDMETA_BASE_IMAGE:-localhost/fedmeta-base:bookworm}")
if [ -d .whl ]; then build_args+=(--build-arg WHEELHOUSE=.whl --build-arg TORCH_INDEX_URL=); fi
for target in server participant; do
  timeout 2400 podman build --network=host -q -f deploy/images/Dockerfile --target "$target" \
    "${build_args[@]}" -t "localhost/fedmeta-$target:dev" . >/dev/null
done

cleanup() { timeout 300 "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT

bash deploy/tls/make-certs.sh --out "$work/certs" --nodes 3 --owner 10001 >/dev/null
mkdir -p "$FLWR_HOME"
printf '[superlink]\ndefault = "c"\n\n[superlink.c]\naddress = "127.0.0.1:8000"\nroot-certificates = "%s"\n' \
  "$work/certs/ca.crt" > "$FLWR_HOME/config.toml"
timeout 300 "${compose[@]}" up -d --no-build superlink serverapp participant-0 participant-1 participant-2

flwr=.venv/bin/flwr
for _ in $(seq 120); do in_ns timeout 60 "$flwr" ls c >/dev/null 2>&1 && break; sleep 2; done
in_ns env PATH="$PWD/.venv/bin:$PATH" bash deploy/tls/register-nodes.sh --connection c "$work"/certs/nodes/*.key.pub
online=0
for _ in $(seq 120); do
  online=$(in_ns timeout 60 "$flwr" supernode list c --format json 2>/dev/null \
    | python3 -c 'import json,sys; print(sum(n["status"] == "online" for n in json.load(sys.stdin)["nodes"]))' || echo 0)
  [ "$online" = 3 ] && break
  sleep 2
done
[ "$online" = 3 ] || { echo "compose-smoke: $online of 3 participants online" >&2; exit 1; }

set_="rounds=$rounds;federation.participants=3;sampling.participants_per_round=3;sampling.task_rate=0.2"
set_+=";dataset.tasks_per_participant=20;training.eval_every=1000000;privacy.report_every=1000000"
set_+=";dataset.test_tasks=8;dataset.validation_tasks=8;dataset.probe_tasks=0;output.plots=false"
set_+=";output.progress=false;federation.round_timeout_s=60;federation.register_timeout_s=60"
set_+=";privacy.ledger_path=/ledger/ledger.sqlite"
in_ns .venv/bin/python scripts/flwr-run-wait.py deploy/prototype/app c --timeout 1200 \
  --run-config "set=\"$set_\" out=\"/runs/smoke\" reply-poll-s=0.1"
podman exec fedmeta-serverapp-1 python -c "
import json, sqlite3
s = json.load(open('/runs/smoke/summary.json'))
n = sqlite3.connect('/ledger/ledger.sqlite').execute('select count(*) from sqlite_master').fetchone()[0]
print('rounds', s['rounds_completed'], 'stopped', s['stopped_reason'], 'epsilon', round(s['epsilon_spent'], 3), 'ledger tables', n)
assert s['rounds_completed'] >= 1 and n > 0
"
echo "compose-smoke: ok"
