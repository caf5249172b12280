# The Engram daemon on the CPU build of torch (GPU hosts: start from an NVIDIA CUDA image instead).
FROM python:3.11-slim
WORKDIR /opt/engram
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml setup.py README.md ./
COPY engram ./engram
COPY kernels ./kernels
COPY cli ./cli
# The C codecs (engram/codec/_cpu*.c) are compiled at install, and so are the store's hot modules (mypyc,
# ENGRAM_COMPILE=1: setup.py, engram/compiled.py): a compiler for that step only.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && ENGRAM_COMPILE=1 pip install --no-cache-dir . \
 && (cd / && python -c "from engram.codec import _cpu; from engram import compiled; \
assert set(compiled.status().values()) == {'compiled'}, compiled.status()") \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
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
