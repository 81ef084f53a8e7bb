#!/usr/bin/env bash
# Makes what a TLS + node-authenticated fedmeta federation needs, idempotently:
#   DIR/ca.key, DIR/ca.crt            a private CA (kept by the server operator; ca.crt goes to every node)
#   DIR/server.key, DIR/server.crt    the SuperLink's certificate, signed by the CA, with SANs for the compose
#                                     service names, localhost, 127.0.0.1, ::1 and every --san you give
#   DIR/superexec.secret              32 random bytes shared by the SuperLink and the ServerApp executor
#                                     (--superexec-auth-secret-file; with --isolation process only)
#   DIR/nodes/NAME.key, NAME.key.pub  one ECDSA P-384 key pair per participant node (OpenSSH format, as
#                                     flower-supernode --auth-supernode-private-key reads it)
#   DIR/node-keys.toml                the server's binding of participant ids to node keys,
#                                     [federation.node_keys] "ID" = "SHA256:...", for every key in
#                                     DIR/nodes (`fedmeta deploy run --node-keys DIR/node-keys.toml`)
# and prints the mapping. A node named participant-ID is bound to participant id ID; any other NAME to
# the id NAME. With --register ADDRESS it also registers the node keys with the SuperLink at ADDRESS
# (its Control API: run it on the server host; deploy/tls/register-nodes.sh).
#
# Usage:
#   deploy/tls/make-certs.sh [--out DIR] [--nodes N | --node NAME ...] [--san HOST_OR_IP ...] [--days D]
#                            [--owner UID[:GID]]   # owner of the private keys (containers run as 10001)
#                            [--group-read]        # and readable by GID too (mode 640): Flower's
#                                                  # images run as 49999 (--owner 10001:49999)
#                            [--register HOST:PORT]
#   deploy/tls/make-certs.sh --out DIR --no-ca --node NAME    # on a participant's machine: only its key pair
#
# Multi-machine: the server operator runs it with --san for the SuperLink's public name(s) and no nodes;
# each participant makes its own key pair on its own machine (--no-ca --node NAME) and sends only
# NAME.key.pub; the private key never leaves the participant. Existing files are kept; the server
# certificate is re-issued (by the same CA) when the requested SANs change. --force re-makes everything.
set -euo pipefail

out=certs
days=825
nodes=()
sans=()
force=0
make_ca=1
owner=""
group_read=0
register=""
n_nodes=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --nodes) n_nodes=$2; shift 2 ;;
    --node) nodes+=("$2"); shift 2 ;;
    --san) sans+=("$2"); shift 2 ;;
    --days) days=$2; shift 2 ;;
    --no-ca) make_ca=0; shift ;;
    --owner) owner=$2; shift 2 ;;
    --group-read) group_read=1; shift ;;
    --register) register=$2; shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "make-certs: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# Private keys: the owner's alone (600), or also their group's with --group-read (640), which
# needs the group named (--owner UID:GID); a run without the flag makes them 600 again.
key_mode=600
if [ "$group_read" = 1 ]; then
  case "$owner" in
    *:?*) key_mode=640 ;;
    *) echo "make-certs: --group-read needs --owner UID:GID (the group that may read the keys, e.g. 10001:49999)" >&2; exit 2 ;;
  esac
fi
if [ -n "$n_nodes" ]; then
  case "$n_nodes" in (*[!0-9]*|'') echo "make-certs: --nodes needs a number; got $n_nodes" >&2; exit 2 ;; esac
  for ((i = 0; i < n_nodes; i++)); do nodes+=("participant-$i"); done
fi
for tool in openssl ssh-keygen; do
  command -v "$tool" >/dev/null || { echo "make-certs: $tool not found (Debian: apt-get install openssl openssh-client)" >&2; exit 1; }
done
for name in "${nodes[@]}"; do
  case "$name" in (*[!A-Za-z0-9._-]*|'') echo "make-certs: node names are [A-Za-z0-9._-]+; got '$name'" >&2; exit 2 ;; esac
done

mkdir -p "$out"
umask 077
if [ "$force" = 1 ]; then
  rm -f "$out"/ca.key "$out"/ca.crt "$out"/ca.srl "$out"/server.key "$out"/server.crt "$out"/server.sans \
    "$out"/superexec.secret
  for name in "${nodes[@]}"; do rm -f "$out/nodes/$name.key" "$out/nodes/$name.key.pub"; done
fi

if [ "$make_ca" = 1 ]; then
  # --- CA ---------------------------------------------------------------------------------------
  if [ ! -s "$out/ca.key" ] || [ ! -s "$out/ca.crt" ]; then
    openssl ecparam -name prime256v1 -genkey -noout -out "$out/ca.key"
    openssl req -x509 -new -key "$out/ca.key" -sha256 -days "$days" -subj "/CN=fedmeta federation CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -out "$out/ca.crt" 2>/dev/null
    rm -f "$out/server.crt"   # a new CA invalidates the old server certificate
    echo "made CA: $out/ca.crt"
  fi

  # --- server certificate ------------------------------------------------------------------------
  # Compose service names first, then loopback, then what the operator asked for.
  alt="DNS:superlink,DNS:serverapp,DNS:localhost,IP:127.0.0.1,IP:::1"
  for s in "${sans[@]}"; do
    if [[ "$s" =~ ^[0-9.]+$ || "$s" == *:* ]]; then alt+=",IP:$s"; else alt+=",DNS:$s"; fi
  done
  if [ ! -s "$out/server.key" ] || [ ! -s "$out/server.crt" ] || [ "$(cat "$out/server.sans" 2>/dev/null)" != "$alt" ]; then
    [ -s "$out/server.key" ] || openssl ecparam -name prime256v1 -genkey -noout -out "$out/server.key"
    openssl req -new -key "$out/server.key" -subj "/CN=superlink" -out "$out/server.csr"
    printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
      "$alt" > "$out/server.ext"
    openssl x509 -req -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
      -days "$days" -sha256 -extfile "$out/server.ext" -out "$out/server.crt" 2>/dev/null
    rm -f "$out/server.csr" "$out/server.ext"
    printf '%s' "$alt" > "$out/server.sans"
    echo "made server certificate: $out/server.crt ($alt)"
  fi
  openssl verify -CAfile "$out/ca.crt" "$out/server.crt" >/dev/null
  chmod 644 "$out/ca.crt" "$out/server.crt"
  if [ ! -s "$out/superexec.secret" ]; then
    openssl rand -out "$out/superexec.secret" 32
    echo "made SuperExec secret: $out/superexec.secret"
  fi
  [ -z "$owner" ] || chown "$owner" "$out/server.key" "$out/superexec.secret"
  chmod "$key_mode" "$out/server.key" "$out/superexec.secret"
fi

# --- node key pairs ------------------------------------------------------------------------------
if [ ${#nodes[@]} -gt 0 ]; then
  mkdir -p "$out/nodes"
  chmod 755 "$out/nodes"   # the keys inside are $key_mode: 600, or 640 with --group-read
  for name in "${nodes[@]}"; do
    key="$out/nodes/$name.key"
    if [ ! -s "$key" ] || [ ! -s "$key.pub" ]; then
      rm -f "$key" "$key.pub"
      ssh-keygen -q -t ecdsa -b 384 -N "" -C "$name" -f "$key"
      echo "made node key pair: $key (+ .pub)"
    fi
    chmod 644 "$key.pub"
    [ -z "$owner" ] || chown "$owner" "$key"
    chmod "$key_mode" "$key"
  done
fi

# --- the participant id <-> key binding ---------------------------------------------------------
if [ "$make_ca" = 1 ] && compgen -G "$out/nodes/*.key.pub" >/dev/null; then
  {
    echo "# participant id = node public-key fingerprint (deploy/tls/make-certs.sh); give it to"
    echo "# \`fedmeta deploy run --node-keys\` or copy the table into the server's configuration."
    echo "[federation.node_keys]"
    for pub in "$out"/nodes/*.key.pub; do
      name=$(basename "$pub" .key.pub); id=${name#participant-}
      printf '"%s" = "%s"\n' "$id" "$(ssh-keygen -l -E sha256 -f "$pub" | awk '{print $2}')"
    done
  } > "$out/node-keys.toml.tmp"
  chmod 644 "$out/node-keys.toml.tmp"
  mv "$out/node-keys.toml.tmp" "$out/node-keys.toml"
  echo
  echo "federation.node_keys ($out/node-keys.toml: bind each participant id to its node's key):"
  sed -n 's/^"/  "/p' "$out/node-keys.toml"
fi
if [ ${#nodes[@]} -gt 0 ] && [ "$make_ca" = 0 ]; then
  echo
  echo "Send only the public key(s) to the federation's operator (the private key stays here):"
  for name in "${nodes[@]}"; do echo "  $out/nodes/$name.key.pub"; done
elif [ ${#nodes[@]} -gt 0 ] && [ -z "$register" ]; then
  echo
  echo "Register the keys with the SuperLink (on the server host, whose Control API it is):"
  echo "  fedmeta deploy register --superlink 127.0.0.1:8000 --root-certificates $out/ca.crt $out/nodes"
fi
if [ -n "$register" ]; then
  [ "$make_ca" = 1 ] || { echo "make-certs: --register needs the CA (not --no-ca)" >&2; exit 2; }
  bash "$(dirname "$0")/register-nodes.sh" --address "$register" --ca "$out/ca.crt" "$out"/nodes/*.key.pub
fi
