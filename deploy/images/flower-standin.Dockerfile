# Stand-ins for Flower's published flwr/superlink and flwr/supernode images, for a machine that
# cannot reach Docker Hub (build from the repository root):
#
#   docker build -f deploy/images/flower-standin.Dockerfile --target superlink \
#       -t localhost/flwr-standin/superlink:1.41.0 .
#   docker build -f deploy/images/flower-standin.Dockerfile --target supernode \
#       -t localhost/flwr-standin/supernode:1.41.0 .
#   export FEDMETA_FLWR_SUPERLINK_IMAGE=localhost/flwr-standin/superlink:1.41.0 \
#          FEDMETA_FLWR_SUPERNODE_IMAGE=localhost/flwr-standin/supernode:1.41.0
#
# These are NOT Flower's images. They are built to the same contract as those images (Flower's
# framework/docker/base Dockerfiles), which is what deploy/compose/flower-images.yml relies on:
#   * Flower (flwr==FLWR_VERSION and nothing else: no fedmeta, no torch) in a virtual environment
#     at /python/venv, first on PATH;
#   * the user `app`, uid 49999, home and working directory /app;
#   * PYTHONUNBUFFERED=1, PYTHONDONTWRITEBYTECODE=1, UTF-8 locale variables;
#   * entrypoint flower-superlink or flower-supernode.
# They differ in the operating system underneath: BASE_IMAGE, Debian's Python 3.11 by default,
# where Flower's use Ubuntu with a Python built by pyenv. With a registry, use Flower's own
# (the overlay's default).
#
# Build arguments: BASE_IMAGE (any Debian/Ubuntu image with Python 3.11 and its venv module, as for
# deploy/images/Dockerfile), FLWR_VERSION (1.41.0), PACKAGE_INDEX_URL and CA_CERTS (as for
# deploy/images/Dockerfile). Flower's dependencies are pinned by deploy/images/constraints.txt.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# Flower is installed in a build stage and its environment copied whole, as Flower's own base
# images do, so the CA bundle and pip's settings of the build are in no layer of the images.
FROM ${BASE_IMAGE} AS build
ARG FLWR_VERSION=1.41.0
ARG PACKAGE_INDEX_URL=
ARG CA_CERTS=deploy/images/ca-certs
USER root
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COPY ${CA_CERTS}/ /tmp/ca-certs/
COPY deploy/images/constraints.txt /tmp/constraints.txt
COPY deploy/images/pip-env.sh /tmp/pip-env.sh
RUN set -eu; . /tmp/pip-env.sh; \
    python3 -m venv /python/venv; \
    /python/venv/bin/pip install -c /tmp/constraints.txt "flwr==${FLWR_VERSION}"; \
    /python/venv/bin/flower-superlink --version

FROM ${BASE_IMAGE} AS base
USER root
RUN useradd --uid 49999 --user-group --home-dir /app --no-create-home --shell /bin/sh app \
    && mkdir -p /app && chown app:app /app
COPY --from=build --chown=app:app /python/venv /python/venv
ENV PATH=/python/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONIOENCODING=UTF-8 LANG=C.UTF-8 LC_ALL=C.UTF-8
WORKDIR /app
USER app
ENV HOME=/app

FROM base AS superlink
ENTRYPOINT ["flower-superlink"]

FROM base AS supernode
ENTRYPOINT ["flower-supernode"]
