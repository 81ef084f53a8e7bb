#!/usr/bin/env bash
# The compose federation end to end, by the documented commands only (docs/deploy.md), through
# podman's Docker-compatible API where there is no Docker Engine. The `slow` test
# tests/deploy/test_compose_podman.py runs it.
#
#   scripts/compose-smoke.sh [--engine auto|docker|podman] [--tls] [--flower-images] [--no-build]
#                            [--no-setup] [--images-from-podman] [--quick] [--keep-up]
#
#   1. the engine: --engine docker needs a Docker Engine that answers (DOCKER_HOST, else the
#      default socket); where python:3.11-slim-bookworm cannot be pulled and FEDMETA_BASE_IMAGE is
#      unset, the local base image of docs/deploy.md (debootstrap | docker import). --engine
#      podman: scripts/podman-setup.sh all; eval "$(scripts/podman-setup.sh env)". auto (default):
#      a Docker Engine if one answers, else podman. --no-setup: podman is set up already (the
#      compose tests' session fixture ran `podman-setup.sh all` once), only `env` is read.
#      --images-from-podman (Docker Engine; implies --no-build): fedmeta's images as podman built
#      them (scripts/compose-build.sh podman), copied with `podman save | docker load` where this
#      engine lacks them or holds another build, instead of built again in this engine.
#   2. docker compose up -d --build (--wait for health; timed); a participant reads a PNG drawing
#   3. docker compose exec serverapp fedmeta deploy run --set rounds=4        -> 4 rounds
#      flwr run . compose (a connection to 127.0.0.1:8000; without --tls)     -> 3 rounds
#      docker compose exec serverapp fedmeta deploy run                       -> budget_exhausted:
#      the second run composes in the same ledger (its participants take part only as far as
#      their data's budget is left); a third, of 1 round over the spent data, runs with nobody
#      taking part (exit status 0, charged to nobody). Every run sets privacy.epsilon_budget=2.5
#      (FEDMETA_SMOKE_BUDGET; a ledger keeps its first budget, so all runs give the same) rather
#      than federation.toml's 4.0: the run to budget_exhausted takes about 9 rounds, not 34.
#   4. the exporter reads the ledger: one spend per round of the three runs that ran
#   5. docker compose down -v (also on failure, checked: the script fails if the project's
#      containers are not gone; --keep-up leaves the federation running)
#   --quick: step 3 is one run of 2 rounds (no `flwr run .`, no run to budget_exhausted), and step
#   4 checks its 2 spends: the other engines and overlays, whose runs compose in the ledger as
#   the plain one's do (the deploy suite runs the whole sequence once, on podman's plain files).
#
# --tls: the TLS overlay (deploy/tls/make-certs.sh into a temporary directory first).
# --flower-images: the overlay deploy/compose/flower-images.yml (the SuperLink and the SuperNodes on
# Flower's flwr/superlink and flwr/supernode images, fedmeta's worker beside each SuperNode); where
# docker.io/flwr/superlink:1.41.0 cannot be pulled and FEDMETA_FLWR_SUPERLINK_IMAGE is unset, the
# stand-ins of deploy/images/flower-standin.Dockerfile, by the commands of docs/deploy.md, and it
# says so. Step 2 then also checks that those containers run as Flower's user without fedmeta.
# Both: the four files of docs/deploy.md (keys made with --owner 10001:49999 --group-read).
# Project name fedmeta-smoke (COMPOSE_PROJECT_NAME; FEDMETA_SMOKE_PROJECT names another), so that
# `down -v` never touches a federation of yours under the default name; the published ports are
# FEDMETA_SUPERLINK_PORT and FEDMETA_EXPORTER_PORT (8000, 9464), so that two runs of this script
# can share a machine with other names and ports. Offline torch: FEDMETA_WHEELHOUSE=.whl with the CPU wheel in
# .whl/ (the script links /opt/wheels' torch wheel there when it exists and no wheelhouse is set);
# no torch index reachable: FEDMETA_TORCH_INDEX_URL= (empty). Prints "compose-smoke: ok" at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
build=(--build) tls=0 keep=0 engine=auto flower=0 setup=1 from_podman=0 quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=(--no-build) ;;
    --no-setup) setup=0 ;;
    --images-from-podman) from_podman=1 build=(--no-build) ;;
    --tls) tls=1 ;;
    --quick) quick=1 ;;
    --flower-images) flower=1 ;;
    --keep-up) keep=1 ;;
    --engine) [ $# -ge 2 ] || { echo "compose-smoke: --engine needs a value: auto, docker or podman" >&2; exit 2; }
              engine=$2; shift ;;
    *) echo "compose-smoke: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
case "$engine" in auto|docker|podman) ;; *) echo "compose-smoke: --engine is auto, docker or podman (got '$engine')" >&2; exit 2 ;; esac
export COMPOSE_PROJECT_NAME=${FEDMETA_SMOKE_PROJECT:-fedmeta-smoke}
link_port=${FEDMETA_SUPERLINK_PORT:-8000} exporter_port=${FEDMETA_EXPORTER_PORT:-9464}
work=$(mktemp -d /tmp/fedmeta-compose-smoke.XXXXXX)
secs() { echo $(( $(date +%s) - $1 )); }

# 1. The engine: Docker Engine if one answers (or --engine docker), else podman as
#    scripts/podman-setup.sh sets it up.
answers() { timeout 20 docker info >/dev/null 2>&1; }
if [ "$engine" = auto ]; then
  if [ -n "${DOCKER_HOST:-}" ] || answers; then engine=docker; else engine=podman; fi
fi
if [ "$engine" = podman ]; then
  t0=$(date +%s)
  # `all` ends with a compose project of its own (up, wait, down): once per machine, not per run.
  if [ "$setup" = 1 ]; then bash scripts/podman-setup.sh all; fi
  eval "$(bash scripts/podman-setup.sh env)"
  echo "compose-smoke: podman set up in $(secs "$t0") s"
else
  # podman with the store of scripts/podman-setup.sh (its `env` would also set DOCKER_HOST).
  pm() { ( eval "$(bash scripts/podman-setup.sh env)"; podman "$@" ); }
  answers || { echo "compose-smoke: no Docker Engine answers on ${DOCKER_HOST:-the default socket}; start it, or use --engine podman" >&2; exit 1; }
  echo "compose-smoke: Docker Engine $(docker version --format '{{.Server.Version}}') on ${DOCKER_HOST:-the default socket}"
  # No image registry: the local base image, by the commands of docs/deploy.md ("A local base image").
  # The local base is also made where FEDMETA_BASE_IMAGE names it but this engine lacks it (the
  # podman environment of `podman-setup.sh env` exports its name; an engine pulls localhost/ names
  # from port 80, where no registry is): copied from podman's store where that holds it.
  base=python:3.11-slim-bookworm local_base=localhost/fedmeta-base:bookworm
  if [ "${FEDMETA_BASE_IMAGE:-}" = "$local_base" ] || { [ -z "${FEDMETA_BASE_IMAGE:-}" ] \
     && ! docker image inspect "$base" >/dev/null 2>&1 \
     && ! timeout 120 docker pull -q "$base" >/dev/null 2>&1; }; then
    export FEDMETA_BASE_IMAGE=$local_base
    if ! docker image inspect "$FEDMETA_BASE_IMAGE" >/dev/null 2>&1 \
       && command -v podman >/dev/null && pm image exists "$FEDMETA_BASE_IMAGE" 2>/dev/null; then
      t0=$(date +%s)
      pm save "$FEDMETA_BASE_IMAGE" | docker load >/dev/null
      echo "compose-smoke: local base $FEDMETA_BASE_IMAGE copied from podman's store in $(secs "$t0") s"
    fi
    if ! docker image inspect "$FEDMETA_BASE_IMAGE" >/dev/null 2>&1; then
      t0=$(date +%s)
      command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q debootstrap >/dev/null
      mirror=$(bash scripts/podman-setup.sh mirror)
      timeout 1800 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/rootfs" "$mirror" >/dev/null
      rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/* "$work"/rootfs/usr/share/doc "$work"/rootfs/usr/share/man "$work"/rootfs/usr/share/locale
      tar -C "$work/rootfs" -c . | docker import - "$FEDMETA_BASE_IMAGE" >/dev/null
      rm -rf "$work/rootfs"
      echo "compose-smoke: $base not reachable; local base $FEDMETA_BASE_IMAGE made in $(secs "$t0") s"
    fi
  fi
  # --images-from-podman: the images of this test run's one build (podman's), not a second build
  # in this engine. The same image id is the same build: nothing to copy.
  if [ "$from_podman" = 1 ]; then
    t0=$(date +%s) copy=()
    for img in fedmeta-server:dev fedmeta-participant:dev; do
      want=$(pm image inspect -f '{{.Id}}' "$img" 2>/dev/null) \
        || { echo "compose-smoke: podman holds no $img (scripts/compose-build.sh podman builds it)" >&2; exit 1; }
      have=$(docker image inspect -f '{{.Id}}' "$img" 2>/dev/null || true)
      [ "${have#sha256:}" = "$want" ] || copy+=("$img")
    done
    if [ ${#copy[@]} -gt 0 ]; then
      pm save -m "${copy[@]}" | docker load >/dev/null   # as podman names them: localhost/NAME
      for img in "${copy[@]}"; do docker tag "localhost/$img" "$img"; done
      echo "compose-smoke: ${copy[*]} copied from podman's store in $(secs "$t0") s (not built in this engine)"
    else
      echo "compose-smoke: fedmeta-server:dev, fedmeta-participant:dev: this engine holds podman's build"
    fi
  fi
fi
if docker compose version >/dev/null 2>&1; then compose=(docker compose)
else compose=("$(bash scripts/podman-setup.sh compose-bin)"); fi
files=()
if [ "$tls" = 1 ]; then
  export FEDMETA_CERTS=$work/certs
  if [ "$flower" = 1 ]; then
    bash deploy/tls/make-certs.sh --out "$FEDMETA_CERTS" --nodes 3 --owner 10001:49999 --group-read >/dev/null
    files=(-f docker-compose.yml -f deploy/compose/tls.yml -f deploy/compose/flower-images.yml
           -f deploy/compose/flower-images-tls.yml)
  else
    bash deploy/tls/make-certs.sh --out "$FEDMETA_CERTS" --nodes 3 --owner 10001 >/dev/null
    files=(-f docker-compose.yml -f deploy/compose/tls.yml)
  fi
elif [ "$flower" = 1 ]; then
  files=(-f docker-compose.yml -f deploy/compose/flower-images.yml)
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
# Flower's images, or where no registry has them the stand-ins (docs/deploy.md, "Flower's
# published images"), built with the same base, package index and CA bundle as fedmeta's.
if [ "$flower" = 1 ]; then
  cli=docker; command -v docker >/dev/null || cli=podman   # podman-setup allows no Docker CLI
  # The overlay's defaults (deploy/compose/flower-images.yml).
  published_link=docker.io/flwr/superlink:1.41.0 published_node=docker.io/flwr/supernode:1.41.0
  if [ -n "${FEDMETA_FLWR_SUPERLINK_IMAGE:-}${FEDMETA_FLWR_SUPERNODE_IMAGE:-}" ]; then
    echo "compose-smoke: Flower's images as given: ${FEDMETA_FLWR_SUPERLINK_IMAGE:-$published_link}, ${FEDMETA_FLWR_SUPERNODE_IMAGE:-$published_node}"
  elif timeout 180 "$cli" pull -q "$published_link" >/dev/null 2>&1 \
     && timeout 180 "$cli" pull -q "$published_node" >/dev/null 2>&1; then
    echo "compose-smoke: Flower's published images $published_link, $published_node"
  else
    t0=$(date +%s)
    for role in superlink supernode; do
      timeout 1800 "$cli" build -q -f deploy/images/flower-standin.Dockerfile --target "$role" \
        --build-arg BASE_IMAGE="${FEDMETA_BASE_IMAGE:-python:3.11-slim-bookworm}" \
        --build-arg PACKAGE_INDEX_URL="${FEDMETA_PACKAGE_INDEX_URL:-}" \
        --build-arg CA_CERTS="${FEDMETA_CA_CERTS:-deploy/images/ca-certs}" \
        -t "localhost/flwr-standin/$role:1.41.0" . >/dev/null
    done
    export FEDMETA_FLWR_SUPERLINK_IMAGE=localhost/flwr-standin/superlink:1.41.0 \
      FEDMETA_FLWR_SUPERNODE_IMAGE=localhost/flwr-standin/supernode:1.41.0
    echo "compose-smoke: $published_link not reachable; stand-ins built from deploy/images/flower-standin.Dockerfile in $(secs "$t0") s (not Flower's images)"
  fi
fi
# One image build at a time: both images share their layers (the second build reuses them).
export COMPOSE_PARALLEL_LIMIT=${COMPOSE_PARALLEL_LIMIT:-1}
# What an interrupted earlier run of this project left (its containers restart with the engine,
# its ledger volume holds a spent budget): gone first. Only this script's own project name.
timeout 300 "${compose[@]}" "${files[@]}" down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
for port in "$link_port" "$exporter_port"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "compose-smoke: 127.0.0.1:$port is in use; the compose file publishes it" >&2; exit 1
  fi
done

# 5. Down, checked: a `down` that fails (or leaves a container) is tried once more, then makes the
#    script fail, saying what is left; unchecked, one once left a project's SuperLink running.
cleanup() {
  local status=$? left=""
  if [ "$keep" = 0 ]; then
    for _ in 1 2; do
      if timeout 300 "${compose[@]}" "${files[@]}" down -v --remove-orphans -t 5 > "$work/down.log" 2>&1; then
        left=$(timeout 120 "${compose[@]}" "${files[@]}" ps -a -q 2>&1) && [ -z "$left" ] && break
      else
        left="(down exited non-zero)"
      fi
    done
    if [ -n "$left" ]; then
      echo "compose-smoke: down left project $COMPOSE_PROJECT_NAME behind: $left $(tail -c 1500 "$work/down.log")" >&2
      [ "$status" != 0 ] || status=1
    fi
  fi
  rm -rf "$work"
  exit "$status"
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
# 2b. The participant image reads the official Omniglot zips and image folders: a PNG drawing
#     through fedmeta's own reader (Pillow, which once arrived only with matplotlib).
png_check='import io; from PIL import Image; from fedmeta.metalearning.omniglot import decode_png
buf = io.BytesIO(); Image.new("L", (105, 105), 255).save(buf, format="PNG")
assert decode_png(buf.getvalue(), "check.png").shape == (105, 105)'
timeout 120 "${compose[@]}" "${files[@]}" exec -T participant-0 python -c "$png_check" \
  || { echo "compose-smoke: the participant image cannot read a PNG drawing" >&2; exit 1; }
echo "compose-smoke: the participant image reads PNG drawings"
# 2c. With Flower's images: the SuperLink and a SuperNode run as Flower's user, without fedmeta.
if [ "$flower" = 1 ]; then
  for svc in superlink supernode-0; do
    uid=$(timeout 120 "${compose[@]}" "${files[@]}" exec -T "$svc" python -c 'import os; print(os.getuid())')
    if timeout 120 "${compose[@]}" "${files[@]}" exec -T "$svc" python -c 'import fedmeta' >/dev/null 2>&1; then
      echo "compose-smoke: $svc has fedmeta installed: not a Flower image" >&2; exit 1
    fi
    [ "$uid" = 49999 ] || { echo "compose-smoke: $svc runs as uid $uid, expected Flower's 49999" >&2; exit 1; }
  done
  echo "compose-smoke: superlink and supernode-0 run ${FEDMETA_FLWR_SUPERLINK_IMAGE:-$published_link} / ${FEDMETA_FLWR_SUPERNODE_IMAGE:-$published_node} as uid 49999, without fedmeta"
fi

budget=${FEDMETA_SMOKE_BUDGET:-2.5}
run() { timeout 1800 "${compose[@]}" "${files[@]}" exec -T serverapp fedmeta deploy run --poll 1 \
          --set "privacy.epsilon_budget=$budget" "$@"; }

# 3. A first run of 4 rounds, `flwr run .` (3b), then the documented command to budget_exhausted:
#    each run composes in the same ledger (its participants take part only as far as their data's
#    budget is left), and a last one of 1 round runs over the spent data (exit status 0).
t0=$(date +%s) planned=4
[ "$quick" = 0 ] || planned=2
out=$(run --set "rounds=$planned") || { echo "$out"; echo "compose-smoke: first run failed" >&2; exit 1; }
echo "$out"; echo "compose-smoke: first run ($planned rounds) $(secs "$t0") s"
first=$(sed -n 's/.*rounds completed \([0-9]*\),.*/\1/p' <<<"$out" | head -1)
[ "${first:-0}" = "$planned" ] || { echo "compose-smoke: first run completed ${first:-no} rounds, expected $planned" >&2; exit 1; }

# 3b. The same federation through Flower's own CLI from this checkout, as docs/deploy.md shows:
#     `flwr run .` with a connection to the published Control API. It exits 0 even when the run
#     fails, so the run's status and its summary are checked, and it spends from the same ledger.
flwr_rounds=0 second=0 third=0
if [ "$tls" = 0 ] && [ "$quick" = 0 ]; then
  flwr_cli=${FEDMETA_FLWR:-$(command -v flwr || true)}
  [ -n "$flwr_cli" ] || { echo "compose-smoke: no flwr CLI (activate fedmeta's environment or set FEDMETA_FLWR)" >&2; exit 1; }
  mkdir -p "$work/flwr-home"
  printf '[superlink]\ndefault = "compose"\n\n[superlink.compose]\naddress = "127.0.0.1:%s"\ninsecure = true\n' \
    "$link_port" > "$work/flwr-home/config.toml"
  fl() { FLWR_HOME=$work/flwr-home FLWR_TELEMETRY_ENABLED=0 timeout 300 "$flwr_cli" "$@"; }
  # A field of the JSON that `flwr ... --format json` prints (lines may come before it): KEY ...
  json_field() {
    python3 -c 'import json, sys
t = sys.stdin.read(); v = json.loads(t[t.index("{"):])
for k in sys.argv[1:]: v = v[int(k)] if k.isdigit() else v[k]
print(v)' "$@"
  }
  t0=$(date +%s)
  flwr_rounds=3 flwr_out=/runs/flwr-run-dot-$(date -u +%Y%m%dT%H%M%SZ)
  submitted=$(fl run . compose --format json --run-config \
    "config-file='/etc/fedmeta/federation.toml' num-server-rounds=$flwr_rounds out='$flwr_out' set='privacy.epsilon_budget=$budget'" 2>&1) || true
  run_id=$(json_field run-id <<<"$submitted") \
    || { echo "$submitted"; echo "compose-smoke: flwr run . was not accepted" >&2; exit 1; }
  status=""
  # Every 5 s: each `flwr ls` is a new Python process that imports Flower (about a CPU second).
  for _ in $(seq 360); do
    status=$(fl ls compose --run-id "$run_id" --format json | json_field runs 0 status 2>/dev/null || true)
    case "$status" in finished*) break ;; esac
    sleep 5
  done
  echo "compose-smoke: flwr run . (run $run_id): $status in $(secs "$t0") s"
  [ "$status" = finished:completed ] || { fl log "$run_id" compose --show 2>&1 | tail -30; exit 1; }
  done_rounds=$(timeout 120 "${compose[@]}" "${files[@]}" exec -T serverapp python -c \
    'import json,sys; print(json.load(open(sys.argv[1]))["rounds_completed"])' "$flwr_out/summary.json") || true
  [ "$done_rounds" = "$flwr_rounds" ] || { echo "compose-smoke: flwr run . completed ${done_rounds:-no} rounds, expected $flwr_rounds" >&2; exit 1; }
fi

if [ "$quick" = 0 ]; then
  t0=$(date +%s)
  again=$(run) || { echo "$again"; echo "compose-smoke: second run failed" >&2; exit 1; }
  echo "$again"; echo "compose-smoke: second run $(secs "$t0") s"
  grep -q "stopped: budget_exhausted" <<<"$again"
  second=$(sed -n 's/.*rounds completed \([0-9]*\),.*/\1/p' <<<"$again" | head -1)
  [ "${second:-0}" -ge 1 ]
  set +e; third_out=$(run --set rounds=1); status=$?; set -e
  echo "$third_out"
  [ "$status" = 0 ] || { echo "compose-smoke: third run exited $status, expected 0 (spent data takes no part)" >&2; exit 1; }
  third=$(sed -n 's/.*rounds completed \([0-9]*\),.*/\1/p' <<<"$third_out" | head -1)
  [ "${third:-0}" = 1 ] || { echo "compose-smoke: third run completed ${third:-no} rounds, expected 1" >&2; exit 1; }
fi

# 4. The ledger as the exporter sees it.
metrics=$(timeout 120 "${compose[@]}" "${files[@]}" exec -T exporter python -c '
import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=60).read().decode())')
spends=$(awk '/^fedmeta_ledger_spends_total/ {print $2}' <<<"$metrics" | head -1)
echo "compose-smoke: exporter: ${spends:-no} spends; runs: ${first} + ${flwr_rounds} + ${second} + ${third} rounds; $(grep '^fedmeta_ledger_readable' <<<"$metrics")"
python3 -c "import sys; assert float(sys.argv[1]) == sum(map(int, sys.argv[2:])), sys.argv" "${spends:-0}" "$first" "$flwr_rounds" "${second:-0}" "${third:-0}"
timeout 120 "${compose[@]}" "${files[@]}" exec -T serverapp ls /runs
echo "compose-smoke: ok"
