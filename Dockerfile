# Parley worker image: one GPU, `parley serve` (see docs/deployment.md).
#   docker build -t parley .
#   docker run --gpus 1 -p 8998:8998 -v parley-cache:/cache parley --model kyutai/moshiko-pytorch-bf16
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/parley/bin:$PATH \
    PARLEY_CACHE=/cache/parley \
    HF_HOME=/cache/huggingface

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/parley

WORKDIR /opt/parley/src
COPY pyproject.toml README.md ./
COPY models ./models
COPY engine ./engine
COPY realtime ./realtime
COPY web ./web
# README's install command, with the CUDA build of torch in place of the CPU one.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 \
    && pip install -e .

RUN useradd --uid 10001 --user-group --create-home parley \
    && mkdir -p /cache \
    && chown parley:parley /cache
USER 10001:10001
# Hugging Face downloads and the demo model: keep them across container restarts.
VOLUME ["/cache"]
EXPOSE 8998

# Liveness only (never load-dependent); a full worker stays healthy. Model load and CUDA graph
# capture happen before the port opens, hence the long start period.
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8998/livez', timeout=2)"]

# SIGTERM drains (--drain-timeout, default 30 s): give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["parley", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8998", "--device", "cuda"]
