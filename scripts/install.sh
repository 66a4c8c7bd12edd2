#!/usr/bin/env bash
# Installs dsaspec (editable) with its test, plot, parity (transformers) and serve (HTTP server) extras, then returns.
# Where: the active virtual environment when python3 runs inside one; else the project's .venv, created here with
# --system-site-packages so that a machine's own torch (a CUDA build, say) is used, not replaced.
# Without torch it installs torch==2.13.0 (the CPU build where that is what pip finds); without
# CUDA it adds the `cpu` extra (triton==3.6.0, numpy<2.4: what the Triton interpreter is tested
# with). It never upgrades pip. `bash scripts/run CMD` runs CMD in the same environment.
set -euo pipefail
cd "$(dirname "$0")/.."
if python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    python=python3
else
    python=.venv/bin/python3
    if ! "$python" -m pip --version >/dev/null 2>&1; then
        if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
            echo "scripts/install.sh: $(command -v python3) cannot create a virtual environment (no ensurepip):" \
                 "install the python3-venv package (Debian/Ubuntu: apt install python3-venv)," \
                 "or run this inside an active virtual environment" >&2
            exit 1
        fi
        if ! log=$(python3 -m venv --system-site-packages .venv 2>&1); then
            echo "scripts/install.sh: python3 -m venv .venv failed: $(printf '%s' "$log" | tail -n 1)" >&2
            exit 1
        fi
    fi
fi
install() { "$python" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$python" -c "import torch" >/dev/null 2>&1; then
    install torch==2.13.0
fi
if "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    install -e ".[test,plot,parity,serve]"
else
    install -e ".[test,plot,cpu,parity,serve]"
fi
if [ "$python" != python3 ]; then
    echo "dsaspec is installed in $PWD/.venv: bash scripts/run CMD (or source .venv/bin/activate)"
fi
