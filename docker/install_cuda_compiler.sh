#!/usr/bin/env bash
# Lay out a CUDA 13.0 compiler from NVIDIA's PyPI wheels, as on the project's dev machines:
#
#   docker/install_cuda_compiler.sh [PREFIX] [BINDIR]     # defaults: /usr/local/cuda-13.0 /usr/local/bin
#
# gives PREFIX/{bin,include,lib,lib64,nvvm,targets/x86_64-linux/{include,lib}} and BINDIR/nvcc.
# Only the compiler is installed: torch's own nvidia-* wheels carry the CUDA runtime libraries, and
# the NVIDIA Container Toolkit brings the driver at run time. The versions are those of the CUDA
# runtime that torch 2.14.1 pins in requirements/lock.txt (nvidia-cuda-runtime==13.0.96).
#
# Why BINDIR/nvcc is a wrapper script and not a symlink: scripts/build_horovod.sh links the folder
# of `command -v nvcc` into a toolkit folder it assembles, and nvcc looks for cicc and its crt/
# headers relative to the folder it was started from. A symlinked nvcc would look inside that
# assembled folder (no nvvm/, no crt/) and fail; a wrapper execs the real nvcc from PREFIX/bin.
set -euo pipefail

PY=${PYTHON:-python3}
prefix=${1:-/usr/local/cuda-13.0}
bindir=${2:-/usr/local/bin}
wheels=(
  nvidia-cuda-nvcc==13.0.88       # nvcc, ptxas, fatbinary, nvlink, cudafe++
  nvidia-cuda-crt==13.0.88        # crt/ headers nvcc includes
  nvidia-nvvm==13.0.88            # cicc and libdevice
  nvidia-cuda-cccl==13.0.85       # thrust / cub / libcu++ headers
  nvidia-cuda-runtime==13.0.96    # cuda_runtime.h, libcudart (same version as torch's)
  nvidia-cuda-culibos==13.0.85    # libculibos.a, linked by the static cudart
  nvidia-cuda-cupti==13.0.85
  nvidia-cuda-cuxxfilt==13.0.85
  nvidia-cuda-profiler-api==13.0.85
  nvidia-nvtx==13.0.85
)

die() { echo "install_cuda_compiler: ERROR: $*" >&2; exit 1; }
[ "$(uname -m)" = x86_64 ] || die "only x86_64 is laid out here (targets/x86_64-linux); got $(uname -m)"
"$PY" -m pip --version >/dev/null 2>&1 || die "no pip for $PY (set PYTHON=...)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuda-wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip install -q --no-deps --no-compile --target "$tmp/site" "${wheels[@]}" \
  || die "could not install ${wheels[*]} from the package index"
src="$tmp/site/nvidia/cu13"
[ -x "$src/bin/nvcc" ] || die "the nvidia-cuda-nvcc wheel did not provide nvidia/cu13/bin/nvcc"

mkdir -p "$prefix" "$bindir"
cp -a "$src/." "$prefix/"
ln -sfn lib "$prefix/lib64"
for lib in "$prefix"/lib/lib*.so.*; do   # the unversioned names that linkers look for
  dev=${lib%.so.*}.so
  [ -e "$dev" ] || ln -s "$(basename "$lib")" "$dev"
done
mkdir -p "$prefix/targets/x86_64-linux"
ln -sfn ../../include "$prefix/targets/x86_64-linux/include"
ln -sfn ../../lib "$prefix/targets/x86_64-linux/lib"
printf '#!/bin/sh\nexec %s/bin/nvcc "$@"\n' "$prefix" >"$bindir/nvcc"
chmod 0755 "$bindir/nvcc"
"$bindir/nvcc" --version | tail -2
