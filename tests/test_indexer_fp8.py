"""indexer_logits on FP8 paged key caches against the plain-torch fp8_index reference: odd and
mixed live lengths, page boundaries, row groups, rows the schedule skips, and pools whose every
byte outside the live slots is NaN (codes 0xFF, scales NaN), so a wrong read shows.

Tolerance: the kernel and the reference multiply the same values (e4m3 codes, exact in fp32;
power-of-two scales, exact), so they differ only in the fp32 summation order of the 128-term
dots and the head sum. The test allows ``(128 + H + 8) * 2**-24`` times the sum of the absolute
terms (the first-order bound of any fp32 summation order), computed by the same reference on
the absolute values. On the GPU the FP8 MMA's accumulation is looser (Hopper's FP8 tensor cores
keep fewer accumulator bits than fp32), so the GPU tests allow ``2**-10`` of that sum.
"""


import pytest
import torch

from dataclasses import replace

from dsa_inputs import (POISON_SLOT, SENTINEL, launch_indexer, random_indexer_inputs,
                        random_tiny_indexer)
from compile_scripts import integer_rows, run_in_scripts
from dsaspec.bench.dsa_ops import TUNE_INDEXER_FP8
from dsaspec.ops.indexer import (INDEXER_BASELINE_CONFIG, INDEXER_CONFIG, INDEXER_FP8_CONFIG,
                                 INDEXER_FP8_GATHER_CONFIG, INDEXER_FP8_GROUP_CONFIG,
                                 INDEXER_FP8_WIDE_GROUP_CONFIG, INDEXER_WIDE_GROUP_CONFIG,
                                 default_indexer_config, default_indexer_programs, indexer_logits)
from dsaspec.ops.device import resident_registers
from dsaspec.ops.indexer_schedule import (PROGRAMS_PER_SM, SMS_WITHOUT_CUDA, indexer_programs,
                                          indexer_schedule)
from dsaspec.reference.fp8_gemm import act_quant
from dsaspec.reference.indexer import reference_indexer_logits_fp8

# The unmarked tests hold the interpreter's fp32 tolerance; the gpu-marked ones the tensor cores'.
pytestmark = pytest.mark.interpreter

PAGE, PAGE_BYTES = 64, 8448
EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193]
# The default reads a page per block (page-consistent tables only); the others gather each slot.
CONFIGS = {"paged": INDEXER_FP8_CONFIG, "gather": INDEXER_FP8_GATHER_CONFIG, "bf16_default": INDEXER_CONFIG,
           "baseline": INDEXER_BASELINE_CONFIG}
FORMS = ("paged", "gather")
# The default with each position's slot read on its own: on page-consistent tables the same logits
# bitwise (the same warps and stages; another warp count sums the heads in another order on the GPU).
DEFAULT_GATHERED = replace(INDEXER_FP8_CONFIG, page_blocks=False)


def fp8_inputs(seqlens, num_heads, width, num_pages, device, seed=0, rows_per_group=1,
               table=None):
    """Random indexer inputs over an FP8 pool of ``num_pages`` pages: the slots the live page-table
    prefixes name hold quantized random keys (magnitudes spread over 2**-6 .. 2**6, so the
    scales differ per token); every other byte of the pool is 0xFF (NaN codes, NaN scales). The
    queries' heads have spread magnitudes too, one head all zeros. ``table``: this int32
    ``[R, width]`` page table instead of random slots."""
    inputs = random_indexer_inputs(seqlens, num_heads, width, num_pages * PAGE, "cpu", seed=seed,
                                   rows_per_group=rows_per_group)
    if table is not None:
        inputs["page_table_1"] = table
    gen = torch.Generator().manual_seed(seed + 1)
    q = inputs["q"].float() * 2.0 ** torch.randint(-6, 7, (len(seqlens), num_heads, 1), generator=gen)
    q[:, 0] = 0.0
    table, lengths = inputs["page_table_1"], inputs["seqlens"]
    live = torch.arange(width)[None, :] < lengths.clamp_min(0)[:, None]
    slots = table[live].long().unique()
    keys = inputs["k_cache"][slots].float() * 2.0 ** torch.randint(-6, 7, (slots.numel(), 1),
                                                                    generator=gen)
    codes, scales = act_quant(keys, "ue8m0")
    pool = torch.full((num_pages, PAGE_BYTES), 0xFF, dtype=torch.uint8)
    pages, offsets = (slots // PAGE)[:, None], (slots % PAGE)[:, None]
    pool[pages, 128 * offsets + torch.arange(128)] = codes.view(torch.uint8)
    pool[pages, 8192 + 4 * offsets + torch.arange(4)] = scales.contiguous().view(torch.uint8)
    cpu = dict(inputs, q=q.to(torch.bfloat16), k_cache=pool)
    return {name: value.to(device) for name, value in cpu.items()}


def paged_table(seqlens, width, num_pages, seed, rows_per_group=1):
    """int32 ``[R, width]`` page-consistent table as the page allocator writes it: position ``t``
    of a group at ``64 * pages[t // 64] + t % 64`` for random (repeating) pages, the group's
    first row up to its longest member, the others to their own length; POISON_SLOT beyond."""
    gen = torch.Generator().manual_seed(seed + 2)
    table = torch.full((len(seqlens), width), POISON_SLOT, dtype=torch.int32)
    for first in range(0, len(seqlens), rows_per_group):
        members = [max(length, 0) for length in seqlens[first:first + rows_per_group]]
        pages = torch.randint(0, num_pages, (-(-width // PAGE),), generator=gen, dtype=torch.int32)
        slots = (pages[:, None] * PAGE + torch.arange(PAGE, dtype=torch.int32)).flatten()[:width]
        for offset, length in enumerate(members):
            table[first + offset, :max(members) if offset == 0 else length] = \
                slots[:max(members) if offset == 0 else length]
    return table


def form_inputs(form, seqlens, num_heads, width, num_pages, device, seed=0, rows_per_group=1):
    """``fp8_inputs`` with the table ``CONFIGS[form]`` reads: page-consistent for ``"paged"`` (the
    default config), random repeating slots otherwise."""
    table = paged_table(seqlens, width, num_pages, seed, rows_per_group) if CONFIGS[form].page_blocks else None
    return fp8_inputs(seqlens, num_heads, width, num_pages, device, seed=seed, rows_per_group=rows_per_group,
                      table=table)


def _reference(inputs):
    cpu = {name: value.cpu() for name, value in inputs.items()}
    expected = reference_indexer_logits_fp8(**cpu)
    absolute = cpu["k_cache"].clone()
    absolute[:, :8192] &= 0x7F       # |codes|; the NaN pattern 0xFF stays NaN (0x7F)
    bound = reference_indexer_logits_fp8(cpu["q"].abs(), cpu["weights"].abs(), absolute,
                                         cpu["page_table_1"], cpu["seqlens"])
    return expected, bound


def _assert_matches(out, inputs, skip_len=0, relative=None, reference=None):
    """Rows longer than skip_len: the reference (``reference``: computed before) within the
    tolerance (module docstring), -inf to the 64-token block edge, the sentinel beyond. Other
    rows: the sentinel everywhere."""
    num_heads = inputs["q"].shape[1]
    relative = (128 + num_heads + 8) * 2.0 ** -24 if relative is None else relative
    out = out.cpu()
    for row, (want, bound) in enumerate(zip(*(reference or _reference(inputs)))):
        length = want.numel()
        if length <= skip_len:
            assert torch.all(out[row] == SENTINEL), row
            continue
        edge = min(-(-length // 64) * 64, out.shape[1])
        got = out[row, :length].double()
        assert torch.isfinite(got).all(), row
        error = (got - want).abs()
        assert torch.all(error <= relative * bound + 1e-30), (row, float((error - relative * bound).max()))
        assert torch.all(out[row, length:edge] == float("-inf")), row
        assert torch.all(out[row, edge:] == SENTINEL), row


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("num_heads", [4, 32, 64])
@pytest.mark.parametrize("num_sms", [1, 3])
def test_edge_lengths(config, num_heads, num_sms, device):
    seqlens = EDGE_LENGTHS + [5, 0, 256]
    inputs = form_inputs(config, seqlens, num_heads, width=260, num_pages=9, device=device,
                         seed=num_heads + num_sms)
    out = launch_indexer(inputs, num_sms, out_width=320, config=CONFIGS[config])
    _assert_matches(out, inputs)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", range(3))
def test_mixed_lengths_repeated_slots(seed, form, device):
    """Random lengths over a pool of 3 pages: slots repeat, tokens of one page serve many rows."""
    gen = torch.Generator().manual_seed(seed)
    seqlens = torch.randint(0, 300, (7,), generator=gen).tolist()
    skip_len = [0, 100, 64][seed]
    inputs = form_inputs(form, seqlens, 8, width=333, num_pages=3, device=device, seed=seed)
    out = launch_indexer(inputs, num_sms=5, out_width=320, skip_len=skip_len, config=CONFIGS[form])
    _assert_matches(out, inputs, skip_len=skip_len)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("skip_len", [1, 64, 128])
def test_skipped_and_padded_rows(skip_len, form, device):
    """Graph-padding rows (live 1) and rows at or below skip_len are neither read nor written:
    their page tables hold out-of-range slots and their queries NaN."""
    seqlens = [1, skip_len, skip_len + 1, 130, 1, 200]
    inputs = form_inputs(form, seqlens, 8, width=210, num_pages=4, device=device, seed=skip_len)
    reference = _reference(inputs)
    for row, length in enumerate(seqlens):
        if length <= skip_len:
            inputs["page_table_1"][row] = 2**30
            inputs["q"][row] = float("nan")
    out = launch_indexer(inputs, num_sms=3, out_width=256, skip_len=skip_len, check_values=False,
                         config=CONFIGS[form])
    _assert_matches(out, inputs, skip_len=skip_len, reference=reference)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows_per_group,num_heads", [(2, 8), (4, 8), (3, 5)])
def test_row_groups(rows_per_group, num_heads, form, device):
    """Target-verify groups sharing a page table: each member exact to its own length."""
    lengths = [0, 1, 63, 64, 65, 127, 128, 129, 130, 2, 64, 200]
    seqlens = lengths[:len(lengths) // rows_per_group * rows_per_group]
    inputs = form_inputs(form, seqlens, num_heads, width=210, num_pages=5, device=device,
                         seed=rows_per_group, rows_per_group=rows_per_group)
    out = launch_indexer(inputs, 3, out_width=256, skip_len=64, rows_per_group=rows_per_group,
                         check_values=False, config=CONFIGS[form])
    _assert_matches(out, inputs, skip_len=64)


@pytest.mark.parametrize("form", FORMS)
def test_bad_key_poisons_only_its_token(form, device):
    """A live key quantized from an infinity has scale NaN (codes 0): its logit is NaN in every
    row that reads it, and no other logit is."""
    inputs = form_inputs(form, [70, 129], 4, width=140, num_pages=3, device=device, seed=7)
    slot = int(inputs["page_table_1"][1, 100])
    page, offset = divmod(slot, PAGE)
    pool = inputs["k_cache"]
    pool[page, 128 * offset:128 * offset + 128] = 0
    pool[page, 8192 + 4 * offset:8196 + 4 * offset] = torch.tensor([float("nan")]).view(torch.uint8).to(device)
    out = launch_indexer(inputs, 2, out_width=192, config=CONFIGS[form]).cpu()
    table = inputs["page_table_1"].cpu()
    for row, length in enumerate((70, 129)):
        bad = table[row, :length] == slot
        assert row == 0 or bad[100]
        assert torch.isnan(out[row, :length][bad]).all()
        assert torch.isfinite(out[row, :length][~bad]).all()


def test_bad_arguments(device):
    inputs = fp8_inputs([10, 20], 4, width=32, num_pages=1, device=device)
    schedule = torch.zeros(3, 2, dtype=torch.int32, device=device)
    indexer_schedule(inputs["seqlens"], 2, schedule)
    out = torch.zeros(2, 32, device=device)
    with pytest.raises(ValueError, match=r"k_cache: expected shape \('\*', 8448\), got \(1, 8192\)"):
        indexer_logits(**dict(inputs, k_cache=inputs["k_cache"][:, :8192]), schedule=schedule,
                       out=out, check_values=False)
    wide = torch.zeros(1, 2 * PAGE_BYTES, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=r"k_cache: expected contiguous FP8 pages \(row stride "
                                         r"8448\), got stride 16896"):
        indexer_logits(**dict(inputs, k_cache=wide[:, :PAGE_BYTES]), schedule=schedule, out=out)
    with pytest.raises(ValueError, match=r"k_cache: expected dtype torch.bfloat16 \(or an FP8 "
                                         r"paged cache, uint8 \[pages, 8448\]\), got torch.float32"):
        indexer_logits(**dict(inputs, k_cache=inputs["k_cache"].float()), schedule=schedule,
                       out=out)
    inputs["page_table_1"][1, 19] = PAGE
    with pytest.raises(ValueError, match=r"page_table_1: slot 64 at row 1, position 19 \(within "
                                         r"the live length\) is out of range for a k_cache of 64 "
                                         r"slots; expected 0 <= slot < 64"):
        indexer_logits(**inputs, schedule=schedule, out=out)


PAGE_LENGTHS = [1, 63, 64, 65, 127, 128, 129, 0, 200, 5]


@pytest.mark.parametrize("num_heads,num_sms", [(4, 1), (32, 3)])
def test_page_blocks_equal_the_gather_form(num_heads, num_sms, device):
    """On page-consistent tables the page-granular read gives the gather form's logits bitwise
    (odd lengths, partial last pages, pool bytes outside the live slots NaN)."""
    inputs = fp8_inputs(PAGE_LENGTHS, num_heads, width=210, num_pages=9, device=device,
                        seed=num_heads, table=paged_table(PAGE_LENGTHS, 210, 9, num_heads))
    gathered = launch_indexer(inputs, num_sms, out_width=256, config=DEFAULT_GATHERED)
    paged = launch_indexer(inputs, num_sms, out_width=256, config=INDEXER_FP8_CONFIG)
    assert torch.equal(paged, gathered)
    _assert_matches(paged, inputs)


def test_page_blocks_equal_the_gather_form_in_groups(device):
    """Target-verify groups of 4 (skip_len 64), mixed lengths, the eager checks on."""
    seqlens = [61, 62, 63, 64, 126, 127, 128, 129, 1, 2, 3, 4, 197, 198, 199, 200]
    inputs = fp8_inputs(seqlens, 8, width=210, num_pages=7, device=device, seed=3,
                        rows_per_group=4, table=paged_table(seqlens, 210, 7, 3, rows_per_group=4))
    runs = [launch_indexer(inputs, 3, out_width=256, skip_len=64, rows_per_group=4, config=config)
            for config in (DEFAULT_GATHERED, INDEXER_FP8_CONFIG)]
    assert torch.equal(runs[1], runs[0])
    _assert_matches(runs[1], inputs, skip_len=64)


def test_page_blocks_on_bf16_keys(device):
    inputs = random_indexer_inputs(PAGE_LENGTHS, 8, 210, 6 * PAGE, device, seed=4)
    inputs["page_table_1"] = paged_table(PAGE_LENGTHS, 210, 6, seed=4).to(device)
    gathered = launch_indexer(inputs, 2, out_width=256)
    paged = launch_indexer(inputs, 2, out_width=256, config=replace(INDEXER_CONFIG, page_blocks=True))
    assert torch.equal(paged, gathered)


@pytest.mark.parametrize("position,slot", [(70, None), (130, "next_page"), (0, "shifted"),
                                           (199, "other_page")])
def test_page_blocks_check_refuses_inconsistent_tables(position, slot, device):
    """check_values refuses a live entry off its block's page (a swapped slot, a page change
    inside a block, a block not starting at a page start, a partial last block), naming
    page_table_1; rows at or below skip_len are not checked."""
    seqlens = [200, 40]
    inputs = fp8_inputs(seqlens, 4, width=210, num_pages=9, device=device, seed=5,
                        table=paged_table(seqlens, 210, 9, 5))
    table = inputs["page_table_1"]
    if slot is None:
        table[0, position], table[0, position + 1] = table[0, position + 1].clone(), table[0, position].clone()
    elif slot == "next_page":
        table[0, position:192] = (table[0, position:192] + PAGE) % (9 * PAGE)
    elif slot == "shifted":
        table[0, :64] = table[0, :64] // PAGE * PAGE + torch.arange(1, 65, device=device) % PAGE
    else:
        table[0, position] = (table[0, position] + PAGE) % (9 * PAGE)
    expected = int(table[0, position - position % PAGE] // PAGE * PAGE + position % PAGE)
    with pytest.raises(ValueError, match=rf"page_table_1: slot {int(table[0, position])} at row 0, "
                                         rf"position {position} breaks the page-granular read "
                                         rf"\(config.page_blocks\): expected slot {expected}"):
        launch_indexer(inputs, 2, out_width=256, config=INDEXER_FP8_CONFIG)
    launch_indexer(inputs, 2, out_width=256, config=INDEXER_FP8_GATHER_CONFIG)  # the gather form reads it
    launch_indexer(inputs, 2, out_width=256, skip_len=200, config=INDEXER_FP8_CONFIG)


def test_page_allocator_tables_are_page_consistent(device):
    """The runtime's tables (RequestSlots: admissions, growth, a release and a re-admission over
    reused pages) pass the page_blocks check, and both forms agree bitwise on them."""
    from dsaspec.memory import PageAllocator, ReqToTokenPool, RequestSlots

    pool = ReqToTokenPool(max_reqs=4, context_len=300, num_draft_tokens=4)
    slots = RequestSlots(pool, PageAllocator(12 * PAGE))
    rows = [slots.admit(length) for length in (130, 1, 64)]
    slots.extend(rows[1], 100)
    slots.release(rows[0])
    rows[0] = slots.admit(200, reserve=5)
    slots.extend(rows[2], 250)
    seqlens = [205, 100, 250, 64]
    table = pool.req_to_token[rows + [rows[2]]]
    inputs = fp8_inputs(seqlens, 8, width=pool.width, num_pages=12, device=device, seed=6,
                        table=table)
    runs = [launch_indexer(inputs, 2, out_width=320, config=config)
            for config in (DEFAULT_GATHERED, INDEXER_FP8_CONFIG)]
    assert torch.equal(runs[1], runs[0])
    _assert_matches(runs[1], inputs)


def test_torch_ops_match_the_reference(device):
    """The runtime's torch ops quantize the query the same way (eager CPU runs on FP8 caches)."""
    from dsaspec.layers.attention import torch_ops

    seqlens = [0, 1, 64, 65, 129, 200]
    inputs = fp8_inputs(seqlens, 8, width=210, num_pages=4, device=device, seed=5)
    out = torch.full((len(seqlens), 200), SENTINEL, device=device)
    torch_ops.indexer_logits(**inputs, schedule=None, out=out)
    expected, bound = _reference(inputs)
    for row, (want, limit) in enumerate(zip(expected, bound)):
        error = (out[row, :want.numel()].cpu().double() - want).abs()
        assert torch.all(error <= (128 + 16) * 2.0 ** -24 * limit), row


def test_indexer_rotates_for_fp8_caches_only():
    """With an FP8 cache the Indexer returns the Hadamard-rotated query and quantizes the rotated
    key; with a bf16 cache neither is rotated. The head weights do not change."""
    from types import SimpleNamespace

    from dsaspec.layers.attention import torch_ops
    from dsaspec.layers.attention.dsa_ops import dsa_ops
    from dsaspec.layers.attention.mla import hadamard_matrix

    rows = 5
    config, indexer, x, q_latent, gen = random_tiny_indexer(torch.float32, seed=0, rows=rows)
    angles = torch.randn(rows, config.qk_rope_head_dim // 2, generator=gen)
    loc = torch.arange(rows) * 7 + 3
    step = SimpleNamespace(cos=angles.cos(), sin=angles.sin(), out_cache_loc=loc, ops=dsa_ops(False, False, False),
                           check_values=True)
    plain_cache = torch.zeros(2 * PAGE, 128)
    fp8_cache = torch.zeros(2, PAGE_BYTES, dtype=torch.uint8)
    q_plain, w_plain = indexer(x, q_latent, step, plain_cache)
    q_fp8, w_fp8 = indexer(x, q_latent, step, fp8_cache)
    h = hadamard_matrix(128, torch.device("cpu"))
    assert torch.allclose(h @ h, torch.eye(128), atol=1e-6)
    assert torch.equal(q_fp8, (q_plain.reshape(-1, 128) @ h).view(q_plain.shape))
    assert torch.equal(w_fp8, w_plain)
    expected = torch.zeros_like(fp8_cache)
    torch_ops.store_index_k(expected, loc, plain_cache[loc] @ h)
    assert torch.equal(fp8_cache, expected)


GPU_WIDTH = 65_600
GPU_TOLERANCE = 2.0 ** -10   # FP8 MMA accumulation (module docstring)


def _gpu_inputs(seqlens, form, rows_per_group=1, seed=1):
    return form_inputs(form, seqlens, 64, width=GPU_WIDTH, num_pages=1 << 12, device="cuda",
                       seed=seed, rows_per_group=rows_per_group)


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("num_rows, longest, skip_len",
                         [(1, 65_536, 0), (16, 2_049, 2048), (32, 65_536, 2048), (64, 8_192, 0)])
def test_gpu_production_sizes(config, num_rows, longest, skip_len):
    """64 heads, 2k .. 64k live tokens, a last row of exactly the top-k (skipped at 2048)."""
    gen = torch.Generator().manual_seed(num_rows)
    seqlens = torch.randint(2_048, longest + 1, (num_rows,), generator=gen)
    seqlens[0] = longest
    seqlens[-1] = 2048
    inputs = _gpu_inputs(seqlens.tolist(), config)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = launch_indexer(inputs, num_sms, out_width=GPU_WIDTH, skip_len=skip_len, config=CONFIGS[config])
    _assert_matches(out, inputs, skip_len=skip_len, relative=GPU_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows_per_group", [2, 4])
def test_gpu_row_groups(rows_per_group, form):
    gen = torch.Generator().manual_seed(rows_per_group)
    seqlens = []
    for live in torch.randint(2_000, 64_000, (8,), generator=gen).tolist() + [2048]:
        seqlens += [live + j for j in range(rows_per_group)]
    inputs = _gpu_inputs(seqlens, form, rows_per_group=rows_per_group, seed=2)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = launch_indexer(inputs, num_sms, out_width=GPU_WIDTH, skip_len=2048,
                         rows_per_group=rows_per_group, check_values=False, config=CONFIGS[form])
    _assert_matches(out, inputs, skip_len=2048, relative=GPU_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_group", [1, 4])
def test_gpu_page_blocks(rows_per_group):
    """The page-granular read on page-consistent tables, 2k .. 64k live: the gather form's logits
    bitwise, within the GPU tolerance of the reference."""
    gen = torch.Generator().manual_seed(10 + rows_per_group)
    seqlens = []
    for live in torch.randint(2_000, 65_000, (16,), generator=gen).tolist() + [2048]:
        seqlens += [live + j for j in range(rows_per_group)]
    table = paged_table(seqlens, GPU_WIDTH, 1 << 12, seed=4, rows_per_group=rows_per_group)
    inputs = fp8_inputs(seqlens, 64, width=GPU_WIDTH, num_pages=1 << 12, device="cuda", seed=4,
                        rows_per_group=rows_per_group, table=table)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    runs = [launch_indexer(inputs, num_sms, out_width=GPU_WIDTH, skip_len=2048,
                           rows_per_group=rows_per_group, config=config)
            for config in (DEFAULT_GATHERED, INDEXER_FP8_CONFIG)]
    assert torch.equal(runs[1], runs[0])
    _assert_matches(runs[1], inputs, skip_len=2048, relative=GPU_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [32, 64])
def test_gpu_default_row_groups(num_heads):
    """The op's default for verify groups of 4 (4 warps at GLM-5's 32 index heads, 8 at DeepSeek-V3.2's
    64), 2k .. 64k live, against the reference."""
    gen = torch.Generator().manual_seed(num_heads)
    seqlens = []
    for live in torch.randint(2_000, 64_000, (6,), generator=gen).tolist():
        seqlens += [live + j for j in range(4)]
    inputs = fp8_inputs(seqlens, num_heads, width=GPU_WIDTH, num_pages=1 << 12, device="cuda", seed=5,
                        rows_per_group=4, table=paged_table(seqlens, GPU_WIDTH, 1 << 12, 5, rows_per_group=4))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = launch_indexer(inputs, num_sms, out_width=GPU_WIDTH, skip_len=2048, rows_per_group=4)
    _assert_matches(out, inputs, skip_len=2048, relative=GPU_TOLERANCE)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_lengths():
    """One capture over the static metadata replays with new lengths (no host sync)."""
    num_rows, skip_len = 16, 2048
    inputs = _gpu_inputs([GPU_WIDTH - 64] * num_rows, "paged", seed=3)  # the default config
    seqlens = inputs["seqlens"]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    schedule = torch.zeros(num_sms + 1, 2, dtype=torch.int32, device="cuda")
    out = torch.zeros(num_rows, GPU_WIDTH, device="cuda")

    def step():
        indexer_schedule(seqlens, num_sms, schedule, skip_len=skip_len)
        indexer_logits(**inputs, schedule=schedule, out=out, skip_len=skip_len, check_values=False)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(0)
    for high in (3, 4_100, GPU_WIDTH - 64):
        seqlens.copy_(torch.randint(0, high, (num_rows,), generator=gen, dtype=torch.int32))
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(out, inputs, skip_len=skip_len, relative=GPU_TOLERANCE)


def test_tune_candidates_compile_for_sm90_without_spills():
    """Without a GPU: every FP8 candidate ``bench dsa-ops --tune`` times (``TUNE_INDEXER_FP8``)
    compiles for sm_90 at 64 index heads with e4m3 wgmmas, no register spills, within the shared
    memory of a block and within its register cap; the default's registers let the schedule's
    programs per SM all be resident (64 index heads take 185 uncapped: 2 of 3 resident).
    scripts/compile_fp8_dsa.py's compile, in a subprocess (it compiles instead of interpreting)."""
    out = run_in_scripts("compile_fp8_dsa",
                         "for config in c.TUNE_INDEXER_FP8:\n"
                         "    r = c.compile_indexer(True, config)\n"
                         "    print(r['regs'], r['spill'], r['shared'], c.SM90_SHARED,"
                         " sum(n for op, n in r['sass'].items() if 'E4M3' in op))")
    results = integer_rows(out)
    assert len(results) == len(TUNE_INDEXER_FP8), out
    for config, (regs, spilled, shared, limit, e4m3) in zip(TUNE_INDEXER_FP8, results):
        assert 0 < regs <= (config.max_registers or 255) and spilled == 0 and shared <= limit and e4m3 > 0, \
            (config, out)
    default_regs = results[TUNE_INDEXER_FP8.index(INDEXER_FP8_CONFIG)][0]
    assert default_regs * 32 * INDEXER_FP8_CONFIG.num_warps * PROGRAMS_PER_SM <= 65536, out


def test_default_configs():
    """Single rows take the register-capped config, groups the compiler's count, groups of 256 and more
    dot columns 8 warps; on bf16 keys wide groups run fewer programs an SM, narrower ones and single
    rows the bf16 default."""
    assert default_indexer_config(True, 1, 64) == INDEXER_FP8_CONFIG
    assert default_indexer_config(True, 4, 32) == INDEXER_FP8_GROUP_CONFIG      # 128 columns
    assert default_indexer_config(True, 3, 64) == INDEXER_FP8_WIDE_GROUP_CONFIG  # next_pow2(3) * 64
    assert default_indexer_config(True, 2, 64) == INDEXER_FP8_GROUP_CONFIG
    assert default_indexer_config(False, 4, 64) == INDEXER_WIDE_GROUP_CONFIG
    assert default_indexer_config(False, 4, 32) == INDEXER_CONFIG
    assert default_indexer_config(False, 1, 128) == INDEXER_CONFIG
    assert INDEXER_FP8_WIDE_GROUP_CONFIG.num_warps == 8 and INDEXER_FP8_GROUP_CONFIG.max_registers is None
    # the schedule follows the configuration: 132 SMs of an H200 off-GPU
    assert default_indexer_programs("cpu", True, 4, 32) == 2 * SMS_WITHOUT_CUDA
    assert default_indexer_programs("cpu", True, 4, 64) == SMS_WITHOUT_CUDA
    assert default_indexer_programs("cpu", False, 1, 64) == PROGRAMS_PER_SM * SMS_WITHOUT_CUDA
    with pytest.raises(ValueError, match="programs_per_sm"):
        indexer_programs("cpu", 0)


# (FP8 keys, rows per group, index heads): decode and verify groups of GLM-5 (32) and DeepSeek-V3.2 (64)
RESIDENCY_SHAPES = [(fp8, group, heads) for fp8 in (False, True) for group in (1, 4) for heads in (32, 64)]


def test_default_programs_per_sm_are_all_resident():
    """Without a GPU: each default configuration's ``programs_per_sm`` is the number of its programs
    an SM holds at once (registers in units of 8 a thread over the SM's 65,536; shared memory, 1 KiB
    reserved a block, over the SM's 228 KiB), at most PROGRAMS_PER_SM: more would run as a second
    wave, fewer would leave gathers unissued (the verify tunes, logs/idx_tune_verify_*_session19.md).
    scripts/compile_fp8_dsa.py's sm_90 compile, in a subprocess."""
    out = run_in_scripts("compile_fp8_dsa",
                         "from dsaspec.ops.indexer import default_indexer_config\n"
                         f"for fp8, group, heads in {RESIDENCY_SHAPES}:\n"
                         "    r = c.compile_indexer(fp8, default_indexer_config(fp8, group, heads), group, heads)\n"
                         "    print(r['regs'], r['spill'], r['shared'])")
    results = integer_rows(out)
    assert len(results) == len(RESIDENCY_SHAPES), out
    for (fp8, group, heads), (regs, spilled, shared) in zip(RESIDENCY_SHAPES, results):
        config = default_indexer_config(fp8, group, heads)
        by_registers = 65536 // (-(-regs // 8) * 8 * 32 * config.num_warps)
        by_shared = 233472 // (shared + 1024)
        resident = min(by_registers, by_shared, PROGRAMS_PER_SM)
        assert spilled == 0 and config.programs_per_sm == resident, (fp8, group, heads, regs, shared, config)


def test_resident_registers():
    assert resident_registers(3, 4) == 168    # 3 x 128 threads: 170.7, allocation unit 8
    assert resident_registers(2, 8) == 128
    assert resident_registers(1, 4) == 255    # a thread's most
    assert INDEXER_FP8_CONFIG.max_registers == resident_registers(PROGRAMS_PER_SM, INDEXER_FP8_CONFIG.num_warps)
