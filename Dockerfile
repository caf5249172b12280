# The Engram daemon on the CPU build of torch (GPU hosts: start from an NVIDIA CUDA image instead).
FROM python:3.11-slim
WORKDIR /opt/engram
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY engram ./engram
COPY kernels ./kernels
COPY cli ./cli
RUN pip install --no-cache-dir .
ENV ENGRAM_SERVER__HOST=0.0.0.0 \
    ENGRAM_SERVER__PORT=50051 \
    ENGRAM_SERVER__METRICS_PORT=9400 \
    ENGRAM_SERVER__METRICS_HOST=0.0.0.0 \
    ENGRAM_LOGGING__JSON=true
EXPOSE 50051 9400
VOLUME ["/data"]
CMD ["engram", "serve"]
