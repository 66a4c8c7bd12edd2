"""Run SGLang's serving benchmark client (``sglang.benchmark.serving``) without SGLang's engine.

The client imports ``sglang.srt.disaggregation.utils`` for one constant used only with
``--pd-separated``; that module pulls in SGLang's whole runtime (its configs, layers, kernels).
This stands in a module holding that constant, refuses ``--pd-separated``, and runs the client
with the remaining arguments. Exit 2 with one line when the client is not installed.
"""

import importlib.util
import runpy
import sys
import types

if importlib.util.find_spec("sglang") is None:
    print("sglang_client.py: SGLang's client is not importable: install it as docs/serving.md says "
          "(pip install --target DIR sglang==0.5.23 --no-deps + its wheels) and put DIR on PYTHONPATH",
          file=sys.stderr)
    sys.exit(2)
if "--pd-separated" in sys.argv:
    print("sglang_client.py: --pd-separated is not supported against dsaspec serve", file=sys.stderr)
    sys.exit(2)
stand_in = types.ModuleType("sglang.srt.disaggregation.utils")
stand_in.FAKE_BOOTSTRAP_HOST = None
sys.modules[stand_in.__name__] = stand_in
runpy.run_module("sglang.benchmark.serving", run_name="__main__", alter_sys=True)
