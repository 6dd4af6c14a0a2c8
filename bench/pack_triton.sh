#!/usr/bin/env bash
# Another Triton for the GPU machine, small enough to carry (bench/NOTES.md, twenty-fifth session).
#
#   bench/pack_triton.sh 3.7.1            # here, on the CPU: writes .triton/triton-3.7.1-py3.12.tar.xz
#   # on the GPU machine (carry .triton):
#   mkdir -p /tmp/t && tar -xJf .triton/triton-3.7.1-py3.12.tar.xz -C /tmp/t
#   PYTHONPATH=/tmp/t TRITON_PTXAS_PATH=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas) python3 ...
#
# Why: a Triton wheel is 400-700 MB unpacked, and a device call carries 64 MiB. What a kernel
# benchmark needs of it is the compiler's Python, libtriton.so without its symbol tables, the CUDA
# headers its launcher is built against and libdevice: 183 MB, 38 MB as xz for 3.7.1. Left out:
# ptxas and the other CUDA tools (the machine's own CUDA has them: TRITON_PTXAS_PATH), proton and
# cupti (profiling), FileCheck and the plugins. It replaces the machine's Triton only for the
# processes given that PYTHONPATH; torch.compile in those processes expects the Triton its torch
# was built with, so use it for processes that launch Triton kernels themselves (bench/kernels.py).
set -euo pipefail
version=${1:?usage: bench/pack_triton.sh VERSION   (a triton release on the package index, e.g. 3.7.1)}
python_version=${PYTHON_VERSION:-3.12}  # the GPU machine's Python
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 "triton==$version" -d "$work/wheel"
python3 -m zipfile -e "$work"/wheel/triton-*.whl "$work/site"
t=$work/site/triton
rm -rf "$t/backends/nvidia/bin" "$t/backends/nvidia/lib/cupti" "$t/_C/libproton.so" "$t/FileCheck" \
  "$t/instrumentation" "$t/plugins"
strip --strip-unneeded "$t/_C/libtriton.so"
mkdir -p .triton
grep -qx '/.triton/' .git/info/exclude 2>/dev/null || echo /.triton/ >>.git/info/exclude
tar -C "$work/site" -cf - triton | xz -T0 -6 >".triton/triton-$version-py$python_version.tar.xz"
ls -l ".triton/triton-$version-py$python_version.tar.xz"
