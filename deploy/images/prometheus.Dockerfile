# Prometheus from Debian's package, for the `dashboards` profile where no image registry is
# reachable (build from the repository root; scripts/podman-setup.sh dashboards does this):
#
#   docker build -f deploy/images/prometheus.Dockerfile \
#       --build-arg BASE_IMAGE=${FEDMETA_BASE_IMAGE:-python:3.11-slim-bookworm} \
#       -t localhost/fedmeta-prometheus:2.42 .
#   export FEDMETA_PROMETHEUS_IMAGE=localhost/fedmeta-prometheus:2.42
#
# This is NOT the official prom/prometheus image (Prometheus 2.53 built by its authors). It is
# Debian 12's `prometheus` package (2.42, with Debian's classic web UI: /graph opens
# /classic/graph) on the same Debian base as fedmeta's images, built to what docker-compose.yml's
# `prometheus` service relies on: the binary as the entrypoint (the service passes
# --config.file=/etc/prometheus/prometheus.yml and --storage.tsdb.path=/prometheus), a non-root
# user owning /prometheus, port 9090. Its apt needs a Debian mirror: the base image's own sources
# (scripts/podman-setup.sh base debootstraps from the mirror apt uses on the host), through
# HTTP(S)_PROXY where set (passed to builds by the engine).
#
# Build arguments: BASE_IMAGE (a Debian 12 image whose apt sources reach a mirror).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
USER root
# No service starts inside a build (Debian's convention: policy-rc.d exit 101); removed after.
RUN set -eu; printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; \
    export DEBIAN_FRONTEND=noninteractive; \
    apt-get update -q; \
    apt-get install -y -q --no-install-recommends prometheus; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /usr/sbin/policy-rc.d; \
    install -d -o prometheus -g prometheus /prometheus; \
    prometheus --version
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
