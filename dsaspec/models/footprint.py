"""What a model and its KV pools take on one GPU before they are built: the bytes the engine
allocates up front, and the bytes a device has free.
"""

from __future__ import annotations

import torch

from dsaspec.memory import KVPool, ReqToTokenPool


class _Layout:
    """Rank 0 of a TP group of ``size`` on the meta device: enough to build a model's shapes."""

    def __init__(self, size: int):
        self.rank, self.size, self.device = 0, size, torch.device("meta")


def required_bytes(config, dtype: torch.dtype, *, max_batch: int, context_len: int, num_slots: int,
                   mtp: bool = False, tp: int = 1, kv_cache_dtype: str = "auto") -> dict:
    """Bytes the engine allocates up front on one GPU: ``weights`` (every parameter of a rank's
    shard at TP ``tp``, in ``dtype``), ``kv`` (the MLA and indexer-key caches over ``num_slots``,
    with ``mtp`` the MTP layer's too, in ``kv_cache_dtype``; replicated over TP), ``table`` (req_to_token) and their
    ``total``. Activations and workspaces come on top."""
    from dsaspec.models.dsa_model import DSAModel  # imports triton: not before the command picked the interpreter

    meta = torch.device("meta")
    model = DSAModel(config, dtype=dtype, tp_group=_Layout(tp)) if tp > 1 else DSAModel(config, device=meta, dtype=dtype)
    weights = sum(p.nbytes for p in model.parameters())
    pools = dict(dtype=dtype, device=meta, kv_cache_dtype=kv_cache_dtype)
    kv = KVPool.for_model(config, num_slots, **pools).nbytes()
    if mtp:
        kv += KVPool.for_model(config, num_slots, mtp=True, **pools).nbytes()
    table = ReqToTokenPool.table_nbytes(max_batch, context_len)   # a pool would build a host list of every row
    return {"weights": weights, "kv": kv, "table": table, "total": weights + kv + table}


def available_bytes(device: torch.device) -> tuple[int, str] | None:
    """(bytes free for a new model, where that number comes from) on ``device``; None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"{device} has"
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024, "this machine has"
    except (OSError, KeyError, ValueError):
        return None
