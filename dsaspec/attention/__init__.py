"""DSA attention backend: per-bucket graph metadata buffers, capture / replay per mode, kernel
selection, and the multi-step MTP draft-decode backend."""

from dsaspec.attention.dsa_backend import DSAAttnBackend, select_kernel
from dsaspec.attention.multi_step import DSAMultiStepDraftBackend, steps_running_indexer

__all__ = ["DSAAttnBackend", "DSAMultiStepDraftBackend", "select_kernel", "steps_running_indexer"]
