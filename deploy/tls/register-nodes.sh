#!/usr/bin/env bash
# Registers node public keys with a SuperLink started with --enable-supernode-auth, idempotently: a key
# that is already registered is reported, not an error. Run it where the SuperLink's Control API is
# reachable (on the server host: 127.0.0.1:8000; the Control API has no account authentication in
# open-source Flower 1.41, so never expose it beyond the operator's host).
#
#   deploy/tls/register-nodes.sh --address 127.0.0.1:8000 --ca certs/ca.crt certs/nodes/*.key.pub
#   deploy/tls/register-nodes.sh --connection NAME KEY.pub ...   # a [superlink.NAME] of $FLWR_HOME/config.toml
#
# Each key is registered under its file name (participant-3.key.pub -> --name participant-3) and the
# node id the SuperLink assigned is printed beside the key's fingerprint.
set -euo pipefail
address="" ca="" connection=""
keys=()
while [ $# -gt 0 ]; do
  case "$1" in
    --address) address=$2; shift 2 ;;
    --ca) ca=$2; shift 2 ;;
    --connection) connection=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) keys+=("$1"); shift ;;
  esac
done
[ ${#keys[@]} -gt 0 ] || { echo "register-nodes: no public key files given" >&2; exit 2; }
flwr=${FLWR:-$(command -v flwr || true)}
[ -n "$flwr" ] || { echo "register-nodes: flwr CLI not found (pip install flwr==1.41.0)" >&2; exit 1; }

if [ -z "$connection" ]; then
  [ -n "$address" ] && [ -n "$ca" ] || { echo "register-nodes: give --address and --ca, or --connection" >&2; exit 2; }
  home=$(mktemp -d); trap 'rm -rf "$home"' EXIT
  export FLWR_HOME=$home
  ca_abs=$(cd "$(dirname "$ca")" && pwd)/$(basename "$ca")
  printf '[superlink]\ndefault = "target"\n\n[superlink.target]\naddress = "%s"\nroot-certificates = "%s"\n' \
    "$address" "$ca_abs" > "$home/config.toml"
  connection=target
fi

status=0
for key in "${keys[@]}"; do
  name=$(basename "$key"); name=${name%.pub}; name=${name%.key}
  fp=$(ssh-keygen -l -E sha256 -f "$key" | awk '{print $2}')
  if out=$(timeout 60 "$flwr" supernode register "$key" "$connection" --name "$name" --format json 2>&1); then
    id=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1][sys.argv[1].index("{"):]); print(d.get("node-id", d))' "$out" 2>/dev/null || echo "?")
    printf 'registered %-20s %s node id %s\n' "$name" "$fp" "$id"
  elif grep -qi "already in use" <<<"$out"; then
    printf 'already    %-20s %s\n' "$name" "$fp"
  else
    printf 'FAILED     %-20s %s\n%s\n' "$name" "$fp" "$out" >&2
    status=1
  fi
done
exit $status
