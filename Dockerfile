# tierd's images, from the repository root:
#   docker build -t tierd:local .                             # the daemon (default target)
#   docker build --target engine -t tierd-engine:local .      # + torch: the demo and reference engine
#
# The daemon image has no torch: it moves KV bytes through shared memory and never imports it.
# The engine image adds CPU torch (`tierd[engine]`) for `tierd demo`; real engines (vLLM,
# SGLang) bring their own torch and install tierd into their own image.
#
# Build arguments (the defaults use the public registries):
#   BASE_IMAGE  a Debian-like image with python3 (>= 3.11) and its venv module
#   PIP_ARGS    extra pip arguments for every install, e.g. "--no-index --find-links URL"
#   TORCH_ARGS  where torch comes from (engine image only)
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG PIP_ARGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# A C compiler for the native helpers (connector/native, built by pip below), in this stage
# only: the images copy the built venv, not the compiler.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/tierd
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY tierd ./tierd
COPY gpu ./gpu
COPY connector ./connector
RUN /opt/tierd/bin/pip install $PIP_ARGS .

FROM build AS build-engine
ARG PIP_ARGS=""
ARG TORCH_ARGS="--index-url https://download.pytorch.org/whl/cpu"
RUN /opt/tierd/bin/pip install $TORCH_ARGS "torch>=2.4,<3" \
    && /opt/tierd/bin/pip install $PIP_ARGS ".[engine]"

# What both images share: the user (uid/gid 10001), the folders the volumes mount, the defaults.
FROM ${BASE_IMAGE} AS runtime
RUN groupadd --gid 10001 tierd \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin tierd \
    && mkdir -p /run/tierd /var/lib/tierd/ssd \
    && chown tierd:tierd /run/tierd /var/lib/tierd/ssd \
    && chmod 0700 /var/lib/tierd/ssd
ENV PATH=/opt/tierd/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TIERD_SOCKET_PATH=/run/tierd/tierd.sock \
    TIERD_SSD_DIR=/var/lib/tierd/ssd \
    TIERD_ARENA_DIRECTORY=/dev/shm
WORKDIR /home/tierd
ENTRYPOINT ["tierd"]

FROM runtime AS engine
COPY --from=build-engine /opt/tierd /opt/tierd
USER tierd
CMD ["demo"]

FROM runtime AS daemon
COPY --from=build /opt/tierd /opt/tierd
USER tierd
# Prometheus metrics (when TIERD_METRICS_PORT is set to it).
EXPOSE 9400
# Healthy = the daemon answers the standard gRPC health check on its Unix socket.
HEALTHCHECK --interval=5s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import grpc, os, sys; from grpc_health.v1 import health_pb2 as p, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('unix://' + os.environ['TIERD_SOCKET_PATH'])); sys.exit(s.Check(p.HealthCheckRequest(), timeout=3).status != 1)"]
CMD ["serve"]
