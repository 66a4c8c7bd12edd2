#!/usr/bin/env bash
# Builds the folder a GPU machine without a package index needs for `dsaspec serve` under SGLang's
# client (docs/serving.md, "Measuring with SGLang's client"): cp312 wheels of what the lent H200
# image lacks, and SGLang 0.5.23's Python files under DIR/sgl (SGLANG_CLIENT=DIR/sgl there).
#   bash scripts/client_wheels.sh [DIR]      (default .whl; carry it, then on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile DIR/*.whl)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
if [ $# -gt 1 ]; then echo "client_wheels.sh: expected at most one argument, the folder (default .whl)" >&2; exit 2; fi
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$dir" \
    starlette==1.10.0 uvicorn==0.54.0 msgspec==0.23.0 orjson==3.13.0 pybase64==1.5.1 pyzmq==27.3.0 \
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pydantic==2.14.4 pydantic-core==2.50.5 \
    typing-inspection==0.4.5 annotated-types==0.8.0 typing_extensions==4.16.0 ipython==8.12.3 \
    traitlets==5.15.0 stack_data==0.6.3 executing==2.2.1 asttokens==3.0.1 pure_eval==0.2.3 \
    pexpect==4.8.0 ptyprocess==0.7.0 pickleshare==0.7.5 backcall==0.2.0 decorator==5.2.1 \
    prompt_toolkit==3.0.52 wcwidth==0.7.0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps sglang==0.5.23 -d "$work"
# the client is Python only: leave out the compiled extensions and the parts it never imports
python3 - "$work"/sglang-*.whl "$dir/sgl" <<'PY'
import sys, zipfile
wheel, target = sys.argv[1], sys.argv[2]
skip = ("sglang/multimodal_gen/", "sglang/test/", "sglang/kernels/")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py") and not n.startswith(skip)
             or ".dist-info/" in n]  # the metadata too: importlib.metadata finds the version there
    z.extractall(target, names)
print(f"{len(names)} files of {wheel.rsplit('/', 1)[-1]} in {target}")
PY
du -sh "$dir"
