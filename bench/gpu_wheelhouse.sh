#!/usr/bin/env bash
# Wheels that bench/gpu_check.sh needs on a GPU machine that reaches no package registry and has
# torch (and numpy, safetensors, tokenizers, msgpack, xxhash, jinja2, pytest, ...) but not the rest
# of our dependencies: pure-Python or cp312 manylinux x86-64 wheels, torch excluded, under 64 MiB.
#
#   bench/gpu_wheelhouse.sh [DIR]     (default .whl; add the folder to .git/info/exclude)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl}
mkdir -p "$out"
# Pinned to what the CPU suite passes with; transformers is the reference the GPU checks compare to.
pins=(
    transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    kernels==0.19.1 tomlkit==0.15.3 typer==0.29.2 shellingham==1.5.4
    gguf==0.19.0 nats-py==2.16.0 pytest-asyncio==1.5.0
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$out" "${pins[@]}"
du -sh "$out"
