#!/usr/bin/env bash
# Installs dsaspec and what its tests need into the current Python, then returns.
# Without torch, it installs the CPU build of torch 2.13.0 (kernels then run under the Triton
# interpreter, which needs numpy < 2.4); a machine with CUDA torch keeps its own torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
if ! python3 -c "import torch" >/dev/null 2>&1; then
    python3 -m pip install -q --disable-pip-version-check torch==2.13.0
fi
python3 -m pip install -q --disable-pip-version-check -e ".[test,plot]"
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    python3 -m pip install -q --disable-pip-version-check "triton==3.6.0" "numpy<2.4"
fi
