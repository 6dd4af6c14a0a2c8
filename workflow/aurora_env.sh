#!/bin/bash -l
# Optimus's Python environment on Aurora, as ALCF's Python page documents it: the pinned
# frameworks module (torch 2.10.0a0 with xpu + xccl, Triton for XPU), a venv on top of it with
# --system-site-packages, and our package installed without replacing the module's torch or
# triton. Run once from the checkout on a login node; the site's worker_init
# (workflow/config/aurora.yaml) loads the same module and activates the same venv.
#
#   bash workflow/aurora_env.sh [VENV]          VENV defaults to .venv in the checkout
#   OPTIMUS_FRAMEWORKS=frameworks/2025.3.1      the module (pin it: a new one is a new torch)
set -euo pipefail
FRAMEWORKS=${OPTIMUS_FRAMEWORKS:-frameworks/2025.3.1}
VENV=${1:-.venv}
cd "$(dirname "$0")/.."

type module >/dev/null 2>&1 || source /etc/profile
if ! module is-avail "$FRAMEWORKS"; then
    echo "aurora_env.sh: module $FRAMEWORKS is not available here (ALCF's PyTorch page names the current one);" \
         "set OPTIMUS_FRAMEWORKS and the site's worker_init (workflow/config/aurora.yaml) to it" >&2
    exit 1
fi
module load "$FRAMEWORKS"
python3 -m venv --system-site-packages "$VENV"
source "$VENV/bin/activate"

stack() {  # what must not change: the module's torch and triton, and where they come from
    python - <<'PY'
import importlib.util
for name in ("torch", "triton"):
    spec = importlib.util.find_spec(name)
    if spec is None:
        print(f"{name}: none")
        continue
    module = __import__(name)
    print(f"{name} {getattr(module, '__version__', '?')} from {spec.origin}")
PY
}
before=$(stack)
echo "$before"
python -m workflow.requirements --without torch triton --extras aurora > "$VENV/optimus-requirements.txt"
pip install -r "$VENV/optimus-requirements.txt"
pip install --no-deps -e .
after=$(stack)
if [ "$before" != "$after" ]; then
    echo "aurora_env.sh: the install changed torch or triton (it must not):" >&2
    echo "before: $before" >&2
    echo "after:  $after" >&2
    exit 1
fi
python -c "import torch, workflow; print('optimus on torch', torch.__version__, '| xccl:', torch.distributed.is_xccl_available() if hasattr(torch.distributed, 'is_xccl_available') else 'n/a')"
echo "done: $VENV on $FRAMEWORKS (the site's worker_init activates it on the compute nodes)"
