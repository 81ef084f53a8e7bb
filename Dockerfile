# fedmeta (CPU): the image behind docker-compose.yml's exporter and simulate services.
# Not built in this repository's CI (no Docker daemon here); `docker compose config` validates the compose file.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0
WORKDIR /app
# CPU torch first, so pip does not pull a multi-GB CUDA build as a dependency.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.2"
COPY pyproject.toml README.md ./
COPY fedmeta ./fedmeta
COPY accounting ./accounting
COPY server ./server
COPY client ./client
COPY metalearning ./metalearning
COPY configs ./configs
RUN pip install .
RUN useradd --create-home --uid 1000 fedmeta && mkdir -p /data && chown fedmeta /data
USER fedmeta
VOLUME /data
ENTRYPOINT ["fedmeta"]
CMD ["--help"]
