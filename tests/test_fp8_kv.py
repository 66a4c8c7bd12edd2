"""The FP8 KV caches: the byte layouts of ``dsaspec.memory`` (FlashMLA's ``fp8_ds_mla``, 656 B a
slot; the paged FP8 indexer keys, 132 B a token in 64-token pages), the quantize-on-write and
dequantizing-gather kernels of ``dsaspec.ops.fp8_kv`` against ``dsaspec.reference.fp8_kv``
(bit-exact bytes, on CPU under the Triton interpreter as on a GPU), the runtime's torch writes and
reads against the kernels, edge values with their expected scales, and bad arguments."""

import pytest
import torch

from dsaspec.layers.attention import torch_ops
from dsaspec.memory import KVPool, resolve_kv_cache_dtype
from dsaspec.ops.kv_cache_layout import INDEX_FP8_PAGE_BYTES, MLA_FP8_BYTES, index_k_fp8_views, mla_fp8_views
from dsaspec.ops import fp8_kv
from dsaspec.reference import fp8_kv as ref

from conftest import DEVICE

SLOTS = 256


def poisoned_pool(layers: int = 1, seed: int = 0) -> KVPool:
    """An FP8 pool whose bytes are random (NaN scales included), so a write that touches a byte it
    should not shows up."""
    pool = KVPool(layers, SLOTS, kv_cache_dtype="fp8_e4m3", device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    for cache in (pool._mla, pool._index_k):
        cache.copy_(torch.randint(0, 256, cache.shape, generator=g, dtype=torch.uint8))
    return pool


def rows_like(n: int, width: int, dtype, seed: int) -> torch.Tensor:
    """Rows whose 128-groups span magnitudes 1e-3 .. 1e3 (different scales per group)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g)
    magnitude = 10.0 ** torch.randint(-3, 4, (n, -(-width // 128)), generator=g).float()
    return (x * magnitude.repeat_interleave(128, dim=1)[:, :width]).to(dtype).to(DEVICE)


def distinct_slots(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed))[:n].to(DEVICE)


# ---- layout ------------------------------------------------------------------------------------
def test_fp8_pool_sizes_and_byte_offsets():
    pool = KVPool(2, SLOTS, kv_cache_dtype="fp8_e4m3")
    assert MLA_FP8_BYTES == 656 and INDEX_FP8_PAGE_BYTES == 64 * 132
    assert pool.mla_cache[1].shape == (SLOTS, 656) and pool.mla_cache[1].dtype == torch.uint8
    assert pool.index_k_cache[1].shape == (SLOTS // 64, 8448) and pool.index_k_cache[1].dtype == torch.uint8
    assert pool.nbytes() == 2 * SLOTS * (656 + 132)
    cache = pool.mla_cache[1]
    latent, scale, rope = mla_fp8_views(cache)
    base = cache.data_ptr()
    assert (latent.data_ptr() - base, scale.data_ptr() - base, rope.data_ptr() - base) == (0, 512, 528)
    assert latent.shape == (SLOTS, 512) and scale.shape == (SLOTS, 4) and rope.shape == (SLOTS, 64)
    assert (latent.stride(0), scale.stride(0) * 4, rope.stride(0) * 2) == (656, 656, 656)
    keys, scales = index_k_fp8_views(pool.index_k_cache[1])
    base = pool.index_k_cache[1].data_ptr()
    assert keys.shape == (SLOTS // 64, 64, 128) and scales.shape == (SLOTS // 64, 64)
    assert scales.data_ptr() - base == 8192 and keys.stride() == (8448, 128, 1) and scales.stride(0) * 4 == 8448
    scale[3, 2] = 0.5                                      # slot 3, group 2: bytes 3 * 656 + 520 ..
    assert torch.equal(cache[3, 520:524], torch.tensor([0.5]).view(torch.uint8))
    scales[1, 5] = 2.0                                     # slot 69: page 1, bytes 8192 + 20 ..
    assert torch.equal(pool.index_k_cache[1][1, 8212:8216], torch.tensor([2.0]).view(torch.uint8))


def test_bf16_pool_is_unchanged_and_auto_is_bf16():
    pool = KVPool(2, 100, dtype=torch.float32)
    assert pool.kv_cache_dtype == "bf16" and pool.mla_cache[0].shape == (100, 576)
    assert pool.nbytes() == 2 * 100 * (576 + 128) * 4
    assert resolve_kv_cache_dtype("auto") == "bf16"
    assert KVPool(1, 64, kv_cache_dtype="auto").kv_cache_dtype == "bf16"


@pytest.mark.parametrize("kwargs, named", [
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(num_slots=100, kv_cache_dtype="fp8_e4m3"), "multiple of 64"),
    (dict(kv_cache_dim=512, kv_cache_dtype="fp8_e4m3"), "kv_cache_dim=576"),
])
def test_bad_pools_are_refused(kwargs, named):
    args = dict(num_layers=1, num_slots=128) | kwargs
    with pytest.raises(ValueError, match=named):
        KVPool(**args)


# ---- writes and reads against the reference ----------------------------------------------------
@pytest.mark.parametrize("n, dtype, seed", [(1, torch.bfloat16, 0), (5, torch.float32, 1), (17, torch.bfloat16, 2),
                                            (33, torch.float32, 3), (64, torch.bfloat16, 4)])
def test_store_and_gather_match_the_reference_bit_for_bit(n, dtype, seed):
    pool = poisoned_pool(seed=seed)
    mla, index = pool.mla_cache[0], pool.index_k_cache[0]
    mla_before, index_before = mla.cpu().clone(), index.cpu().clone()
    rows, keys = rows_like(n, 576, dtype, seed), rows_like(n, 128, dtype, seed + 100)
    loc = distinct_slots(n, seed)
    fp8_kv.store_mla(mla, loc, rows)
    fp8_kv.store_index_k(index, loc, keys)
    want_mla = ref.write_mla(mla_before, loc.cpu(), rows.cpu())
    want_index = ref.write_index_k(index_before, loc.cpu(), keys.cpu())
    assert torch.equal(mla.cpu(), want_mla)                # every byte: written slots and untouched ones
    assert torch.equal(index.cpu(), want_index)
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[loc.cpu()] = False
    assert torch.equal(mla.cpu()[others], mla_before[others])
    slots = torch.cat((loc, torch.tensor([-1], device=DEVICE))).reshape(-1, 1)
    got = fp8_kv.gather_mla(mla, loc)
    assert torch.equal(got.cpu(), ref.read_mla(want_mla, loc.cpu()))
    assert torch.equal(fp8_kv.gather_index_k(index, slots).cpu(), ref.read_index_k(want_index, slots.cpu()))
    assert torch.equal(fp8_kv.gather_mla(mla, slots, torch.bfloat16).cpu(),
                       ref.read_mla(want_mla, slots.cpu()).to(torch.bfloat16))
    # e4m3 keeps 3 mantissa bits: |error| <= half an ulp of the group's scaled values
    scale = ref.read_mla(want_mla, loc.cpu())[:, :512].abs().view(n, 4, 128).amax(-1, keepdim=True)
    err = (got.cpu()[:, :512] - rows.cpu()[:, :512].float()).abs().view(n, 4, 128)
    assert (err <= scale / 16 + 1e-6).all()
    assert torch.equal(got.cpu()[:, 512:], rows.cpu()[:, 512:].to(torch.bfloat16).float())


def test_edge_values_get_the_stated_scales():
    pool = KVPool(1, SLOTS, kv_cache_dtype="fp8_e4m3", device=DEVICE)
    row = torch.zeros(576)
    row[128:256] = torch.linspace(-448.0, 448.0, 128)     # amax 448: scale 1, codes exact
    row[256:384] = 1.0
    row[256] = 449.0                                       # amax just over 448: scale 2
    row[384] = float("nan")                                # NaN group: scale NaN, codes 0
    row[512] = float("inf")                                # the rope key: stored as is
    rows = torch.stack((row, row.clone()))
    rows[1, 384] = float("-inf")
    loc = torch.tensor([5, 70], device=DEVICE)
    fp8_kv.store_mla(pool.mla_cache[0], loc, rows.to(DEVICE))
    latent, scale, rope = mla_fp8_views(pool.mla_cache[0])
    s = scale[5].cpu()
    assert s[0] == 2.0 ** -22 and s[1] == 1.0 and s[2] == 2.0 and torch.isnan(s[3])
    assert torch.isnan(scale[70, 3].cpu())
    assert (latent[5, :128].view(torch.uint8) == 0).all() and (latent[5, 384:].view(torch.uint8) == 0).all()
    assert rope[5, 0] == float("inf")
    back = fp8_kv.gather_mla(pool.mla_cache[0], loc).cpu()
    assert (back[:, :128] == 0).all() and torch.isnan(back[:, 384:512]).all()
    assert torch.equal(back[0, 128:256], row[128:256].to(torch.float8_e4m3fn).float())
    keys = torch.zeros(3, 128)
    keys[1, 0] = 1e-30                                     # below the 1e-4 floor: scale 2**-22, code 0
    keys[2, 7] = float("nan")
    fp8_kv.store_index_k(pool.index_k_cache[0], torch.tensor([0, 63, 64], device=DEVICE), keys.to(DEVICE))
    codes, scales = index_k_fp8_views(pool.index_k_cache[0])
    assert scales[0, 0] == 2.0 ** -22 and scales[0, 63] == 2.0 ** -22 and torch.isnan(scales[1, 0].cpu())
    assert (codes[:2].view(torch.uint8) == 0).all()


@pytest.mark.parametrize("n, dtype", [(1, torch.float32), (19, torch.bfloat16)])
def test_runtime_torch_writes_and_reads_equal_the_kernels(n, dtype):
    kernel, torch_path = poisoned_pool(seed=7), poisoned_pool(seed=7)
    rows, keys, loc = rows_like(n, 576, dtype, 9), rows_like(n, 128, dtype, 10), distinct_slots(n, 11)
    fp8_kv.store_mla(kernel.mla_cache[0], loc, rows)
    fp8_kv.store_index_k(kernel.index_k_cache[0], loc, keys)
    torch_ops.store_mla(torch_path.mla_cache[0], loc, rows)
    torch_ops.store_index_k(torch_path.index_k_cache[0], loc, keys)
    assert torch.equal(kernel._mla, torch_path._mla) and torch.equal(kernel._index_k, torch_path._index_k)
    slots = loc.reshape(1, -1).long()
    assert torch.equal(torch_ops._mla_entries(kernel.mla_cache[0], slots), fp8_kv.gather_mla(kernel.mla_cache[0], slots))
    assert torch.equal(torch_ops._index_keys(kernel.index_k_cache[0], slots),
                       fp8_kv.gather_index_k(kernel.index_k_cache[0], slots))


def test_bf16_caches_are_copied():
    cache = torch.zeros(8, 576)
    rows = torch.randn(2, 576)
    fp8_kv.store_mla(cache, torch.tensor([1, 6]), rows)
    assert torch.equal(cache[[1, 6]], rows) and (cache[[0, 2, 3, 4, 5, 7]] == 0).all()


@pytest.mark.parametrize("call, named", [
    (lambda p: fp8_kv.store_mla(p.mla_cache[0], torch.tensor([SLOTS]), torch.zeros(1, 576)), "loc"),
    (lambda p: fp8_kv.store_mla(p.mla_cache[0], torch.tensor([-1]), torch.zeros(1, 576)), "loc"),
    (lambda p: fp8_kv.store_mla(p.mla_cache[0], torch.tensor([0, 1]), torch.zeros(1, 576)), "loc"),
    (lambda p: fp8_kv.store_mla(p.mla_cache[0], torch.tensor([0]), torch.zeros(1, 512)), "rows"),
    (lambda p: fp8_kv.store_index_k(p.index_k_cache[0], torch.tensor([0]), torch.zeros(1, 128, dtype=torch.float16)), "keys"),
    (lambda p: fp8_kv.store_index_k(p.index_k_cache[0], torch.tensor([0.0]), torch.zeros(1, 128)), "loc"),
    (lambda p: fp8_kv.gather_mla(p.mla_cache[0], torch.tensor([-2])), "slots"),
    (lambda p: fp8_kv.gather_index_k(p.index_k_cache[0], torch.tensor([SLOTS])), "slots"),
    (lambda p: fp8_kv.gather_mla(p.index_k_cache[0], torch.tensor([0])), "mla cache"),
    (lambda p: fp8_kv.gather_index_k(p.index_k_cache[0], torch.tensor([0]), torch.float16), "out_dtype"),
])
def test_bad_arguments_name_what_is_wrong(call, named):
    with pytest.raises(ValueError, match=named):
        call(KVPool(1, SLOTS, kv_cache_dtype="fp8_e4m3"))
