# tierd: the node daemon (`tierd serve`), the CLI (`tierd route`, `tierd stats`) and the demo.
#   docker build -t tierd:local .
# CPU torch from the PyTorch CPU index (the daemon never needs CUDA: KV bytes move through
# shared memory; engines bring their own GPU stack). Copies only what the package needs, so a
# local .venv or build tree never enters the image.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<3"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY tierd ./tierd
COPY gpu ./gpu
COPY connector ./connector
RUN pip install . \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin tierd \
    && mkdir -p /run/tierd /var/lib/tierd/ssd \
    && chown tierd:tierd /run/tierd /var/lib/tierd/ssd

# Defaults for a container: socket and SSD in the volumes compose and Helm mount; arena in /dev/shm.
ENV TIERD_SOCKET_PATH=/run/tierd/tierd.sock \
    TIERD_SSD_DIR=/var/lib/tierd/ssd \
    TIERD_ARENA_DIRECTORY=/dev/shm

USER tierd
WORKDIR /home/tierd
# Prometheus metrics (when TIERD_METRICS_PORT is set to it).
EXPOSE 9400

# Healthy = the daemon answers the standard gRPC health check on its Unix socket.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import grpc, os, sys; from grpc_health.v1 import health_pb2 as p, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('unix://' + os.environ['TIERD_SOCKET_PATH'])); sys.exit(s.Check(p.HealthCheckRequest(), timeout=3).status != 1)"]

ENTRYPOINT ["tierd"]
CMD ["serve"]
