# The Engram daemon on the CPU build of torch (GPU hosts: start from an NVIDIA CUDA image instead).
FROM python:3.11-slim
WORKDIR /opt/engram
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY engram ./engram
COPY kernels ./kernels
COPY cli ./cli
RUN pip install --no-cache-dir . \
 && useradd --system --uid 10001 --home-dir /opt/engram engram \
 && mkdir -p /data && chown engram /data
ENV ENGRAM_SERVER__HOST=0.0.0.0 \
    ENGRAM_SERVER__PORT=50051 \
    ENGRAM_SERVER__DATA_PORT=50052 \
    ENGRAM_SERVER__METRICS_PORT=9400 \
    ENGRAM_SERVER__METRICS_HOST=0.0.0.0 \
    ENGRAM_LOGGING__JSON=true
EXPOSE 50051 50052 9400
VOLUME ["/data"]
USER engram
# The standard gRPC health check (no token needed): exit 0 while the daemon serves, 2 when it does not answer.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s CMD ["engram", "ping", "--address", "127.0.0.1:50051"]
CMD ["engram", "serve"]
