#!/usr/bin/env bash
# One participant: a SuperNode (--isolation process) and fedmeta's warm worker beside it, sharing the
# container's loopback (the SuperNode's Runtime API never leaves the container). If either process
# ends, the other is stopped and the container exits with the first one's status, so the restart
# policy restarts both.
#
# Environment (all but the first two have defaults):
#   FEDMETA_SUPERLINK         host:port of the SuperLink's Fleet API               (required)
#   FEDMETA_PARTICIPANT_ID    this node's participant id                           (required)
#   FEDMETA_TLS_CA            the federation CA file; unset = --insecure, which needs FEDMETA_INSECURE=1
#   FEDMETA_NODE_KEY          this node's private authentication key (OpenSSH ECDSA) for node auth
#   FEDMETA_DATA_DIR          this participant's own data                          (/data)
#   FEDMETA_RUNTIME_PORT      the SuperNode's local Runtime API port               (9094)
#   FEDMETA_FAST_POLL         1 (default): poll the SuperLink every FEDMETA_SUPERNODE_POLL_S while a run
#                             is active (deploy/prototype/fast_supernode.py); 0: Flower's 3 s
# Extra arguments are passed to the SuperNode.
set -euo pipefail
: "${FEDMETA_SUPERLINK:?set FEDMETA_SUPERLINK (host:port of the SuperLink)}"
: "${FEDMETA_PARTICIPANT_ID:?set FEDMETA_PARTICIPANT_ID}"
port=${FEDMETA_RUNTIME_PORT:-9094}
data=${FEDMETA_DATA_DIR:-/data}

tls=()
if [ -n "${FEDMETA_TLS_CA:-}" ]; then
  tls=(--root-certificates "$FEDMETA_TLS_CA")
  [ -n "${FEDMETA_NODE_KEY:-}" ] && tls+=(--auth-supernode-private-key "$FEDMETA_NODE_KEY")
elif [ "${FEDMETA_INSECURE:-0}" = 1 ]; then
  tls=(--insecure)
  echo "fedmeta-participant: WARNING: no TLS to the SuperLink (FEDMETA_INSECURE=1); local testing only" >&2
else
  echo "fedmeta-participant: set FEDMETA_TLS_CA (and FEDMETA_NODE_KEY), or FEDMETA_INSECURE=1 for a local test" >&2
  exit 2
fi

if [ "${FEDMETA_FAST_POLL:-1}" = 1 ]; then
  node=(python /opt/fedmeta-participant/fast_supernode.py)
else
  node=(flower-supernode)
fi
"${node[@]}" --superlink "$FEDMETA_SUPERLINK" "${tls[@]}" --isolation process \
  --host 127.0.0.1 --port "$port" \
  --node-config "participant-id=\"$FEDMETA_PARTICIPANT_ID\" data-dir=\"$data\"" "$@" &
node_pid=$!
python /opt/fedmeta-participant/warm_worker.py --runtime-api-address "127.0.0.1:$port" --insecure \
  --alive-file "${FEDMETA_WORKER_ALIVE:-/tmp/fedmeta-worker.alive}" &
worker_pid=$!

stop() { kill -TERM "$node_pid" "$worker_pid" 2>/dev/null || true; }
trap 'stop' TERM INT
set +e
wait -n "$node_pid" "$worker_pid"
status=$?
stop
wait "$node_pid" "$worker_pid" 2>/dev/null
exit "$status"
