"""Test setup: without a GPU, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before anything imports triton, so it is decided here, first
(``flags.select_triton_interpreter``, which also refuses triton / numpy versions the interpreter
fails with, in one line).

The interpreter's ``tl.dot`` is numpy's matmul, so the row-invariance tests need numpy's BLAS to
give a tile's row the same bits wherever it sits in the tile. OpenBLAS's Haswell / Zen sgemm
kernels do not (AMD EPYC, OpenBLAS 0.3.30: a row moved within a 16-row tile changes its last
bits); its Sandybridge kernels do. ``OPENBLAS_CORETYPE`` is read when numpy loads, so it is pinned
here, before torch (which imports numpy), over any value the environment gives (this project's CPU
machines export ``OPENBLAS_CORETYPE=Haswell``).
"""

import os

os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest  # noqa: E402
import torch  # noqa: E402

from dsaspec import flags  # noqa: E402
from dsaspec.errors import UserError  # noqa: E402


def pytest_configure(config):
    # Runs before collection imports any test module (and so triton).
    try:
        flags.select_triton_interpreter(torch.cuda.is_available())
    except UserError as err:
        raise pytest.UsageError(f"dsaspec: error: {err}") from None
    if not torch.cuda.is_available():
        # Small CPU ops are dozens of times faster single-threaded on the 2-core CI machines.
        torch.set_num_threads(1)


HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs >= 2 CUDA devices under torchrun (WORLD_SIZE >= 2)")
    skip_interpreter = pytest.mark.skip(reason="calibrated for the Triton interpreter; the gpu-marked tests run here")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and (not HAS_CUDA or world < 2):
            item.add_marker(skip_multi)
        # A module marked ``interpreter`` as a whole keeps its gpu-marked tests on a CUDA host.
        if "interpreter" in item.keywords and "gpu" not in item.keywords and HAS_CUDA:
            item.add_marker(skip_interpreter)


@pytest.fixture
def device():
    return DEVICE
