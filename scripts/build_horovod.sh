#!/usr/bin/env bash
# Build Horovod against the torch installed in a Python environment, cache the wheel, install it.
#
#   scripts/build_horovod.sh [PYTHON]          # PYTHON defaults to .venv/bin/python
#
# Horovod's last release (0.28.1, 2023) predates current PyTorch. Three things make it build:
#   1. torch's headers need C++17 (torch 2.1-2.13) or C++20 (>= 2.14), but Horovod's CMake pins
#      C++14: where torch/all.h asks for more, a CXX wrapper (scripts/cxx20) rewrites
#      -std=c++14 / gnu++14 to the standard torch asks for (HVA_CXX_STD) and execs g++.
#   2. A CUDA build of torch makes Horovod look for a CUDA toolkit. We assemble one from what
#      the torch wheel ships (nvidia/cu13 headers and libraries) plus the machine's nvcc.
#   3. pip's cmake 4 rejects gloo's cmake_minimum_required; the system cmake (3.13 <= v < 4) is used.
#
# The wheel is cached outside the work tree, keyed by Horovod version, torch version, Python tag
# and GPU operations, so the 6-12 minute build runs once per machine:
#   ${HOROVOD_WHEEL_CACHE:-~/.cache/horovod-airflow/wheels}/<key>/horovod-*.whl
#
# Environment knobs:
#   HOROVOD_VERSION          default 0.28.1
#   HOROVOD_GPU_OPERATIONS   unset (CPU/Gloo; CUDA tensors are staged through host memory) or NCCL
#   HOROVOD_BUILD_CUDA_CC_LIST  default 90 (Hopper); e.g. "80,90"
#   HOROVOD_FORCE_REBUILD=1  ignore the cache
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
PY=${1:-$root/.venv/bin/python}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-}

die() { echo "build_horovod: ERROR: $*" >&2; exit 1; }
log() { echo "build_horovod: $*" >&2; }

[ -x "$PY" ] || die "no Python at $PY (run scripts/setup.sh first, or pass the interpreter)"

# --- preflight: name the missing piece before a 10-minute build fails on it -----------------
command -v g++ >/dev/null || die "no C++ compiler: install g++ (Debian: apt-get install g++)"
CMAKE=${HOROVOD_CMAKE:-}
if [ -z "$CMAKE" ]; then
  for c in /usr/bin/cmake /usr/local/bin/cmake "$(command -v cmake || true)"; do
    [ -n "$c" ] && [ -x "$c" ] || continue
    v=$("$c" --version | head -1 | awk '{print $3}')
    major=${v%%.*}; rest=${v#*.}; minor=${rest%%.*}
    if [ "$major" = 3 ] && [ "$minor" -ge 13 ]; then CMAKE=$c; break; fi
  done
fi
[ -n "$CMAKE" ] || die "no cmake 3.13-3.x found (cmake 4 rejects gloo's CMakeLists): apt-get install cmake, or set HOROVOD_CMAKE"

read -r torch_ver torch_cuda torch_inc site <<<"$("$PY" - <<'EOF'
import os, site, sys
try:
    import torch
    from torch.utils import cpp_extension
except Exception as e:  # noqa: BLE001
    print("MISSING", "-", "-", "-"); sys.exit(0)
inc = cpp_extension.include_paths()[0]
print(torch.__version__, torch.version.cuda or "cpu", inc, os.path.dirname(os.path.dirname(torch.__file__)))
EOF
)"
[ "$torch_ver" != MISSING ] || die "torch does not import in $PY: install the pinned torch first"
[ -f "$torch_inc/torch/extension.h" ] || die "torch headers not found under $torch_inc (torch/extension.h)"
py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')

key="horovod-${HOROVOD_VERSION}-torch-${torch_ver//+/_}-${py_tag}-${GPU_OPS:-gloo}"
cache=${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/horovod-airflow/wheels}/$key

install_wheel() {
  # --no-deps: horovod's runtime requirements are pinned in requirements/lock.txt.
  "$PY" -m pip install -q --no-deps --force-reinstall "$1"
}

installed=$("$PY" -c 'import importlib.metadata as m; print(m.version("horovod"))' 2>/dev/null || true)
if [ -z "${HOROVOD_FORCE_REBUILD:-}" ] && ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
  whl=$(ls "$cache"/horovod-*.whl | head -1)
  if [ "$installed" = "$HOROVOD_VERSION" ] && [ -f "$(dirname "$PY")/../.horovod-key" ] \
     && [ "$(cat "$(dirname "$PY")/../.horovod-key")" = "$key" ]; then
    log "horovod $HOROVOD_VERSION already installed from $whl"
  else
    log "installing cached wheel $whl"
    install_wheel "$whl"
    echo "$key" >"$(dirname "$PY")/../.horovod-key"
  fi
  exit 0
fi

log "building $key (takes 6-12 minutes on 2 cores; cached afterwards in $cache)"
work=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The C++ standard torch's headers require (torch/all.h: "#if __cplusplus < 202002L #error C++20
# or later ..."); Horovod's CMake gives C++14, so a torch that needs more gets the wrapper.
all_h="$torch_inc/torch/csrc/api/include/torch/all.h"
need=$(grep -o '__cplusplus < 20[0-9]*L' "$all_h" 2>/dev/null | head -1 | grep -o '20[0-9]*' || true)
if [ -n "$need" ] && [ "$need" -gt 201402 ]; then
  export HVA_CXX_STD="gnu++${need:2:2}" CXX="$here/cxx20"
  log "torch $torch_ver's headers need C++${need:2:2}, Horovod pins C++14: CXX=scripts/cxx20 (-std=$HVA_CXX_STD)"
else
  log "torch $torch_ver's headers need no more than C++14: the plain compiler"
fi
export CC=${CC:-gcc}
export HOROVOD_CMAKE=$CMAKE
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
if [ -z "${HOROVOD_WITH_MPI:-}" ]; then export HOROVOD_WITHOUT_MPI=1; fi
export MAKEFLAGS="-j$(nproc)"

if [ "$torch_cuda" != cpu ]; then
  # Assemble a CUDA toolkit folder from the torch wheel's nvidia packages + the machine's nvcc.
  nvcc=$(command -v nvcc || true)
  [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
  [ -n "$nvcc" ] || die "torch $torch_ver is a CUDA build, so Horovod needs nvcc: install the CUDA compiler (nvcc) or use a CPU torch"
  nvcc_bin=$(dirname "$(readlink -f "$nvcc")")
  major=${torch_cuda%%.*}
  nv="$site/nvidia/cu$major"
  [ -d "$nv/include" ] || die "CUDA headers not found at $nv/include (expected from the nvidia-*-cu$major wheels torch installs)"
  tk="$work/cuda"
  mkdir -p "$tk/bin" "$tk/lib64"
  for f in "$nvcc_bin"/*; do ln -s "$f" "$tk/bin/"; done
  ln -s "$nv/include" "$tk/include"
  for f in "$nv/lib"/*; do ln -s "$f" "$tk/lib64/"; done
  ln -sf "$nv/lib/libcudart.so.$major" "$tk/lib64/libcudart.so"
  export CUDA_HOME=$tk CUDAToolkit_ROOT=$tk HOROVOD_CUDA_HOME=$tk
  export CUDAHOSTCXX=${CUDAHOSTCXX:-/usr/bin/g++}
  export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-90}
  if [ "$GPU_OPS" = NCCL ]; then
    [ -d "$site/nvidia/nccl" ] || die "HOROVOD_GPU_OPERATIONS=NCCL but no NCCL at $site/nvidia/nccl"
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$site/nvidia/nccl"
    ls "$site/nvidia/nccl/lib/libnccl.so" >/dev/null 2>&1 \
      || ln -sf "$(ls "$site"/nvidia/nccl/lib/libnccl.so.* | head -1)" "$site/nvidia/nccl/lib/libnccl.so"
  fi
fi

src=${HOROVOD_SDIST:-}
if [ -z "$src" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work/sdist" \
    || die "could not download the horovod==$HOROVOD_VERSION source archive from the package index"
  src=$(ls "$work"/sdist/horovod-*.tar.gz)
fi

start=$(date +%s)
if ! "$PY" -m pip wheel --no-build-isolation --no-deps -w "$work/wheel" "$src" >"$work/build.log" 2>&1; then
  tail -40 "$work/build.log" >&2
  grep -qi "No CMAKE_CXX_COMPILER\|g++: not found" "$work/build.log" && die "the C++ compiler failed to start"
  grep -qi "CMake Error" "$work/build.log" && die "cmake failed (see the log above; cmake: $CMAKE)"
  grep -qi "torch/extension.h\|ATen" "$work/build.log" && die "compiling against the torch headers failed (torch $torch_ver, headers $torch_inc)"
  die "pip wheel failed (see the log above)"
fi
log "built in $(( $(date +%s) - start ))s"
mkdir -p "$cache"
cp "$work"/wheel/horovod-*.whl "$cache/"
install_wheel "$(ls "$cache"/horovod-*.whl | head -1)"
echo "$key" >"$(dirname "$PY")/../.horovod-key"
