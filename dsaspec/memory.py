"""KV memory of the runtime: the ``req_to_token`` table, a page allocator for KV slots, and the
per-layer caches indexed by slot id.

Layout:
- ``ReqToTokenPool.req_to_token``: int32 ``[max_reqs + 1, W]``, ``W = context_len + 4 + N``;
  entry ``[r, j]`` is the KV slot of logical position ``j`` of request row ``r``. The last row is a
  dummy row (all ``SINK_SLOT``) that CUDA-graph padding rows point to.
- ``PageAllocator``: slots are handed out one 64-token page at a time, so ``slot % 64 ==
  position % 64`` and ``slot // 64`` at page starts is the real page table. Page 0 is never handed
  out: slot 0 (``SINK_SLOT``) absorbs the cache writes of padded rows.
- ``KVPool``: per layer an MLA cache and an indexer key cache, in one of two dtypes
  (``kv_cache_dtype``). ``"bf16"``: ``[num_slots, 576]`` (latent 512 | rope key 64) and
  ``[num_slots, 128]`` in the model's dtype. ``"fp8_e4m3"``: uint8 pools in the byte layouts of
  FlashMLA's ``fp8_ds_mla`` and DeepGEMM's paged indexer cache (page 64), so a pool can be handed
  to those kernels unchanged:

      MLA, per slot (656 B):       [512 e4m3 latent | 4 fp32 scales | 64 bf16 rope key]
                                    bytes 0..511      512..527        528..655
      indexer keys, per page (64 x 132 B = 8448 B):
                                   [64 x 128 e4m3 keys | 64 fp32 scales]
                                    bytes 0..8191        8192..8447

  Scale ``g`` of a slot covers latent values ``128 g .. 128 g + 127``; every scale is a power of
  two (a ue8m0 value stored as fp32); value = code * scale. :func:`mla_fp8_views` and
  :func:`index_k_fp8_views` give typed views of these bytes. The target model and the MTP layer
  each own a KVPool (their own layers) over the same slot ids.
- ``RequestSlots``: admission, growth and release of a request's row and pages. Every failure is
  checked before any state changes, so a refused request never corrupts the table.

Every size argument of the constructors must be an int >= 1 (else a ``TypeError`` /
``ValueError`` naming it).
"""

from __future__ import annotations

import torch

from dsaspec.ops.checks import check_count
from dsaspec.ops.kv_cache_layout import (PAGE_SIZE, MLA_LATENT_DIM, MLA_ROPE_DIM, INDEX_HEAD_DIM,
                                         MLA_FP8_BYTES, INDEX_FP8_PAGE_BYTES)

SINK_SLOT = 0

KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")

class PoolExhaustedError(RuntimeError):
    """No free request row or not enough free KV pages for an admission or a growth."""


class ContextLengthError(ValueError):
    """A prompt (or a growth) longer than the configured context."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ReqToTokenPool:
    """The ``req_to_token`` table and its free request rows.

    Parameters
    ----------
    max_reqs : int
        Request rows (the dummy row is extra, at index ``max_reqs``).
    context_len : int
        Longest sequence (prompt + generated) a request may reach.
    num_draft_tokens : int
        ``N`` of speculative decoding (1 without speculation); ``W = context_len + 4 + N``.
    """

    DTYPE = torch.int32

    def __init__(self, max_reqs: int, context_len: int, num_draft_tokens: int = 1,
                 device: torch.device | str = "cpu"):
        for name, value in (("max_reqs", max_reqs), ("context_len", context_len),
                            ("num_draft_tokens", num_draft_tokens)):
            check_count(f"ReqToTokenPool {name}", value)
        self.max_reqs = max_reqs
        self.context_len = context_len
        self.num_draft_tokens = num_draft_tokens
        self.width = self.width_for(context_len, num_draft_tokens)
        self.dummy_row = max_reqs
        self.req_to_token = torch.full((max_reqs + 1, self.width), SINK_SLOT, dtype=self.DTYPE,
                                       device=device)
        self._free_rows = list(range(max_reqs - 1, -1, -1))  # pop() hands out row 0 first

    @staticmethod
    def width_for(context_len: int, num_draft_tokens: int = 1) -> int:
        """Table width W of a configured context: ``context_len + 4 + N``."""
        return context_len + 4 + num_draft_tokens

    @classmethod
    def table_nbytes(cls, max_reqs: int, context_len: int, num_draft_tokens: int = 1) -> int:
        """Bytes of the ``req_to_token`` table of a pool with these arguments, without building one."""
        return (max_reqs + 1) * cls.width_for(context_len, num_draft_tokens) * cls.DTYPE.itemsize

    @property
    def num_free(self) -> int:
        """Free request rows."""
        return len(self._free_rows)

    def alloc(self) -> int:
        """Take a free request row. Raises ``PoolExhaustedError`` when all are taken."""
        if not self._free_rows:
            raise PoolExhaustedError(f"ReqToTokenPool: all {self.max_reqs} request rows are in use")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        """Return a row; its table entries are reset to the sink slot."""
        if not 0 <= row < self.max_reqs or row in self._free_rows:
            raise ValueError(f"ReqToTokenPool.free: row {row} is not an allocated request row")
        self.req_to_token[row].fill_(SINK_SLOT)
        self._free_rows.append(row)


class PageAllocator:
    """Hands out KV slots a page (``page_size`` consecutive slots) at a time; page 0 is reserved.

    Parameters
    ----------
    num_slots : int
        Slots in the KV pools; a multiple of ``page_size``, at least two pages.
    """

    def __init__(self, num_slots: int, page_size: int = PAGE_SIZE):
        check_count("PageAllocator page_size", page_size)
        check_count("PageAllocator num_slots", num_slots)
        if num_slots % page_size or num_slots < 2 * page_size:
            raise ValueError(f"PageAllocator: num_slots must be a multiple of page_size={page_size} "
                             f"and at least 2 pages (page 0 is the sink), got {num_slots}")
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self._free = list(range(self.num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._is_free = [False] + [True] * (self.num_pages - 1)

    @property
    def num_free_pages(self) -> int:
        """Pages not handed out."""
        return len(self._free)

    def alloc(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages (all or none). Raises ``PoolExhaustedError`` if too few are free."""
        if num_pages > len(self._free):
            raise PoolExhaustedError(
                f"KV pool full: need {num_pages} page(s) of {self.page_size} slots, "
                f"{len(self._free)} free of {self.num_pages - 1}")
        pages = [self._free.pop() for _ in range(num_pages)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages. Raises ``ValueError`` on the sink page, an unknown or a double-freed page."""
        for page in pages:
            if not 0 < page < self.num_pages or self._is_free[page]:
                raise ValueError(f"PageAllocator.free: page {page} is not an allocated page")
        for page in pages:
            self._is_free[page] = True
            self._free.append(page)


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """``"bf16"`` or ``"fp8_e4m3"`` for one of :data:`KV_CACHE_DTYPES`. ``"auto"`` is ``"bf16"``:
    the Triton sparse MLA reads only unquantized caches so far, and an FP8 cache is a
    precision trade the user asks for. Raises ``ValueError`` for any other value."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return "bf16" if kv_cache_dtype == "auto" else kv_cache_dtype


class KVPool:
    """Per-layer MLA and indexer-key caches over ``num_slots`` slot ids (module docstring for
    the layouts).

    Attributes
    ----------
    kv_cache_dtype : str
        ``"bf16"`` (the caches in ``dtype``, the model's) or ``"fp8_e4m3"`` (uint8 byte layouts).
    mla_cache : list of Tensor
        Per layer, ``[num_slots, kv_cache_dim]`` (``dtype``): normed latent | roped key; FP8:
        uint8 ``[num_slots, 656]``.
    index_k_cache : list of Tensor
        Per layer, ``[num_slots, index_head_dim]`` (``dtype``): the indexer's roped, normed key;
        FP8: uint8 ``[num_slots / 64, 8448]`` (one row a page).
    """

    def __init__(self, num_layers: int, num_slots: int, kv_cache_dim: int = 576,
                 index_head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", *, kv_cache_dtype: str = "bf16"):
        for name, value in (("num_layers", num_layers), ("num_slots", num_slots),
                            ("kv_cache_dim", kv_cache_dim), ("index_head_dim", index_head_dim)):
            check_count(f"KVPool {name}", value)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype)
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.dtype = dtype
        if self.kv_cache_dtype == "fp8_e4m3":
            if (kv_cache_dim, index_head_dim) != (MLA_LATENT_DIM + MLA_ROPE_DIM, INDEX_HEAD_DIM):
                raise ValueError(f"KVPool: the fp8_e4m3 layouts need kv_cache_dim={MLA_LATENT_DIM + MLA_ROPE_DIM} "
                                 f"and index_head_dim={INDEX_HEAD_DIM}, got {kv_cache_dim}, {index_head_dim}")
            if num_slots % PAGE_SIZE:
                raise ValueError(f"KVPool: an fp8_e4m3 pool needs num_slots a multiple of {PAGE_SIZE} "
                                 f"(its indexer cache is paged), got {num_slots}")
            self._mla = torch.zeros(num_layers, num_slots, MLA_FP8_BYTES, dtype=torch.uint8, device=device)
            self._index_k = torch.zeros(num_layers, num_slots // PAGE_SIZE, INDEX_FP8_PAGE_BYTES,
                                        dtype=torch.uint8, device=device)
        else:
            self._mla = torch.zeros(num_layers, num_slots, kv_cache_dim, dtype=dtype, device=device)
            self._index_k = torch.zeros(num_layers, num_slots, index_head_dim, dtype=dtype, device=device)
        self.mla_cache = [self._mla[i] for i in range(num_layers)]
        self.index_k_cache = [self._index_k[i] for i in range(num_layers)]

    @classmethod
    def for_model(cls, config, num_slots: int, *, mtp: bool = False, dtype=torch.bfloat16,
                  device="cpu", kv_cache_dtype: str = "bf16") -> "KVPool":
        """The target pool (``num_hidden_layers`` layers) or, with ``mtp``, the MTP layer's pool."""
        layers = config.num_nextn_predict_layers if mtp else config.num_hidden_layers
        if layers < 1:
            raise ValueError("KVPool.for_model: the config has no MTP layer")
        return cls(layers, num_slots, config.kv_cache_dim, config.index_head_dim, dtype, device,
                   kv_cache_dtype=kv_cache_dtype)

    def nbytes(self) -> int:
        """Bytes held by the caches."""
        return self._mla.nbytes + self._index_k.nbytes


class RequestSlots:
    """A request's row in ``req_to_token`` and the pages behind its positions.

    ``admit`` takes a row and pages for the first tokens; ``extend`` grows a request to cover more
    positions (whole pages); ``release`` returns both. Failures raise before any state changes.
    """

    def __init__(self, req_pool: ReqToTokenPool, allocator: PageAllocator):
        self.req_pool = req_pool
        self.allocator = allocator
        self._pages: dict[int, list[int]] = {}

    def allocated_len(self, row: int) -> int:
        """Positions of ``row`` that have a slot in ``req_to_token`` (capped at the table width)."""
        return min(len(self._pages[row]) * self.allocator.page_size, self.req_pool.width)

    def admit(self, prompt_len: int, reserve: int = 0) -> int:
        """Take a row with slots for ``prompt_len + reserve`` positions; returns the row.

        Raises ``ContextLengthError`` if ``prompt_len`` exceeds ``context_len``,
        ``PoolExhaustedError`` if no row or too few pages are free, ``TypeError`` / ``ValueError``
        unless ``prompt_len >= 1`` and ``reserve >= 0`` are ints."""
        check_count("admit prompt_len", prompt_len)
        check_count("admit reserve", reserve, minimum=0)
        if prompt_len > self.req_pool.context_len:
            raise ContextLengthError(f"prompt of {prompt_len} tokens exceeds context_len="
                                     f"{self.req_pool.context_len}")
        needed = _cdiv(min(prompt_len + reserve, self.req_pool.width), self.allocator.page_size)
        if needed > self.allocator.num_free_pages:
            raise PoolExhaustedError(f"KV pool full: a prompt of {prompt_len} tokens needs {needed} "
                                     f"page(s), {self.allocator.num_free_pages} free")
        row = self.req_pool.alloc()
        self._pages[row] = []
        self._grow(row, needed)
        return row

    def extend(self, row: int, new_len: int) -> None:
        """Make positions ``[0, new_len)`` of ``row`` have slots (whole pages).

        Raises ``ContextLengthError`` past the table width and ``PoolExhaustedError`` if too few
        pages are free."""
        if row not in self._pages:
            raise ValueError(f"extend: row {row} is not an admitted request")
        if new_len > self.req_pool.width:
            raise ContextLengthError(f"extend: {new_len} positions exceed the req_to_token width "
                                     f"{self.req_pool.width} (context_len={self.req_pool.context_len})")
        more = _cdiv(new_len, self.allocator.page_size) - len(self._pages[row])
        if more > 0:
            self._grow(row, more)

    def release(self, row: int) -> None:
        """Free the row's pages and the row."""
        if row not in self._pages:
            raise ValueError(f"release: row {row} is not an admitted request")
        self.allocator.free(self._pages.pop(row))
        self.req_pool.free(row)

    def _grow(self, row: int, num_pages: int) -> None:
        page_size = self.allocator.page_size
        start = len(self._pages[row]) * page_size
        pages = self.allocator.alloc(num_pages)
        self._pages[row].extend(pages)
        slots = (torch.tensor(pages, dtype=torch.int32)[:, None] * page_size
                 + torch.arange(page_size, dtype=torch.int32)).flatten()
        end = min(start + slots.numel(), self.req_pool.width)
        table = self.req_pool.req_to_token
        table[row, start:end] = slots[: end - start].to(table.device)
