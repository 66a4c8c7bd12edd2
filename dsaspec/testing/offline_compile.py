"""Compile Triton and Gluon kernels for sm_90 on any machine, GPU or not: a kernel's launch is
intercepted and compiled offline as Triton's JIT would specialize it, with the wheel's ptxas.

Call :func:`compile_only_environment` before anything imports triton (the interpreter choice is
read when a kernel is defined), then wrap the real host launch in :func:`compile_instead_of_launch`.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
import time
from pathlib import Path

# ptxas log fields recorded per compile
PTXAS = {
    "regs": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
}


def compile_only_environment() -> Path:
    """Set ``TRITON_INTERPRET=0`` (compile, never interpret) and a fresh empty ``TRITON_CACHE_DIR``
    (every compile cold); returns that folder. Raises RuntimeError once triton is imported, when
    the interpreter setting could no longer take effect."""
    if "triton" in sys.modules:
        raise RuntimeError("compile_only_environment() must run before triton is imported")
    os.environ["TRITON_INTERPRET"] = "0"
    return fresh_cache_dir()


def fresh_cache_dir() -> Path:
    """Point ``TRITON_CACHE_DIR`` at a new empty folder (the next compiles are cold); returns it."""
    folder = Path(tempfile.mkdtemp(prefix="dsaspec-compile-"))
    os.environ["TRITON_CACHE_DIR"] = str(folder)
    return folder


def sm90_target():
    """Triton's ``GPUTarget`` of compute capability 9.0 (H100 / H200), warp size 32."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def compile_instead_of_launch(kernel, record: dict, keep_compiled: bool = False):
    """While active, a launch of ``kernel`` (a Triton or a Gluon kernel) compiles it for
    :func:`sm90_target` (as the JIT would specialize these arguments) instead of running it, and
    writes into ``record``: ``compile_s``, the :data:`PTXAS` fields (None unless
    ``triton.knobs.nvidia.dump_ptxas_log`` is set), ``ptx_lines``, ``grid`` (its first dimension)
    and, with ``keep_compiled``, the compiled kernel under ``"compiled"``."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import create_function_from_signature

    target = sm90_target()
    backend = make_backend(target)
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)

    def run(*args, grid, warmup, **kwargs):
        kwargs.update(debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization,
                                                                  options)
        log = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
        record["compile_s"] = time.perf_counter() - start
        for key, pattern in PTXAS.items():
            found = pattern.findall(log.getvalue())
            record[key] = int(found[-1]) if found else None
        record["ptx_lines"] = compiled.asm["ptx"].count("\n")
        record["grid"] = grid[0]
        if keep_compiled:
            record["compiled"] = compiled

    kernel.run = run
    try:
        yield
    finally:
        del kernel.run


# a PTX instruction that reads or writes global memory (loads, stores, atomics, reductions, async
# copies, prefetches), with or without a predicate
_GLOBAL_ACCESS = re.compile(r"^\s*(@!?%\w+\s+)?(ld|st|atom|red|cp|prefetch)\.\S*global")


def chain_entry(ptx: str) -> tuple[int, int, int, int]:
    """Where a chained kernel (:func:`dsaspec.ops.device.enter_chain`) waits, from its PTX: the line
    of its first ``griddepcontrol.wait`` (-1 where it has none), how many
    ``griddepcontrol.launch_dependents`` it has, how many global memory accesses come before that
    wait (:func:`accesses_before_wait`) and how many of those are 16-byte loads."""
    lines = ptx.splitlines()
    early = accesses_before_wait(ptx)
    return (_first_wait(lines), sum("griddepcontrol.launch_dependents" in line for line in lines), len(early),
            sum("ld.global.v4.b32" in access for access in early))


def accesses_before_wait(ptx: str) -> list[str]:
    """The global memory accesses (loads, stores, atomics, reductions, async copies, prefetches)
    before a chained kernel's first ``griddepcontrol.wait`` (all of them where it has none),
    stripped: loads a kernel may issue there only from memory no kernel before it writes (its
    weights)."""
    lines = ptx.splitlines()
    wait = _first_wait(lines)
    return [line.strip() for line in (lines[:wait] if wait >= 0 else lines) if _GLOBAL_ACCESS.match(line)]


def _first_wait(lines: list[str]) -> int:
    # the index of the first griddepcontrol.wait line, -1 where there is none
    return next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), -1)
