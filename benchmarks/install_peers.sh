#!/usr/bin/env bash
# Install the peer allocators that the page benchmark compares against into a
# virtual environment of their own, never the project's CI venv:
#
#   bash benchmarks/install_peers.sh /work/venv-peers
#   /work/venv-peers/bin/python -m benchmarks                       # from the repo root
#   /work/venv-peers/bin/python -m benchmarks --only pages --no-md  # the pages alone
#
# * torch 2.13.0 first, so nothing later pulls a CUDA build of torch.
# * SGLang 0.5.23 without its dependency tree (CUDA kernels, a serving
#   stack), then the packages its allocator module needs at import time;
#   PagedTokenToKVPoolAllocator then runs on CPU.
# * vLLM 0.33.0: only the wheel's own source. The wheel is downloaded without
#   dependencies and unpacked into VENV/vllm-src, a .pth file puts that folder
#   on sys.path, and `vllm.v1.core.block_pool` imports from it unchanged
#   (nothing in vLLM is stubbed). The last pip line installs what that import
#   chain needs, pinned where vLLM 0.33.0's metadata pins it.
# * numpy and uvloop for the harness (tqdm, above, serves the demo); asyncpool
#   itself is used from the checkout (run from the repo root), not installed.
# * Pinned: what runs in a timed call or decides the loop the figures are
#   taken on: torch, SGLang, vLLM, numpy and uvloop (the versions of the
#   README's machine line). Left unpinned: the packages the two peers only
#   import (orjson ... aiohttp, triton included: on CPU no Triton kernel
#   runs; regex ... partial-json-parser), none of which the timed calls
#   reach; the report's machine line records torch's and uvloop's versions
#   and each peer row's label its peer's.
#
# docs/benchmarks.md lists these same commands (benchmarks/report.py holds
# them; tests/test_benchmarks_smoke.py checks each one is in this script).
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 VENV" >&2
  exit 2
fi
VENV=$1
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT

python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install torch==2.13.0
"$VENV/bin/python" -m pip install numpy==2.4.6 uvloop==0.23.0
"$VENV/bin/python" -m pip install --no-deps sglang==0.5.23
"$VENV/bin/python" -m pip install orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp
"$VENV/bin/python" -m pip download --no-deps vllm==0.33.0 -d "$WHEELS"
rm -rf "$VENV/vllm-src"
"$VENV/bin/python" -m zipfile -e "$WHEELS"/vllm-0.33.0-*.whl "$VENV/vllm-src"
"$VENV/bin/python" -c 'import os, sys, sysconfig; open(os.path.join(sysconfig.get_paths()["purelib"], "vllm_src.pth"), "w").write(os.path.abspath(sys.argv[1]) + "\n")' "$VENV/vllm-src"
"$VENV/bin/python" -m pip install regex cbor2 cachetools cloudpickle py-cpuinfo prometheus-client openai openai-harmony partial-json-parser transformers==5.19.0 tokenizers==0.23.2 xgrammar==0.2.8 "fastapi>=0.133.0,<0.137.0" "llguidance>=1.7.0,<1.8.0" apache-tvm-ffi==0.1.11

"$VENV/bin/python" -c 'from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator; from vllm.v1.core.block_pool import BlockPool; print("peers import: OK")'
