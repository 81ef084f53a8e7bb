# Sourced by deploy/images/Dockerfile before each pip install (POSIX sh): the package index and the CA
# bundle from the build arguments. Nothing here stays in the images (the build stage is discarded).
if [ -n "${PACKAGE_INDEX_URL:-}" ]; then
  export PIP_INDEX_URL="$PACKAGE_INDEX_URL"
fi
if ls /tmp/ca-certs/*.crt >/dev/null 2>&1; then
  # The base image's roots (when it has any) plus the given certificates.
  cat /etc/ssl/certs/ca-certificates.crt /tmp/ca-certs/*.crt > /tmp/pip-ca.pem 2>/dev/null \
    || cat /tmp/ca-certs/*.crt > /tmp/pip-ca.pem
  export PIP_CERT=/tmp/pip-ca.pem
fi
