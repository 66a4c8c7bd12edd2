"""The DSA model's step path (paged caches, indexer -> top-k -> sparse MQA) against the masked-dense
reference forward, the MTP layer, verify rows, padded rows, the Triton ops, and bad inputs.

fp32 models (plain-torch ops) must match the fp32 reference to ~1e-5, top-k selections included.
bf16 models are compared with the reference only where no selection can flip (top-k >= length):
at bf16 a top-k boundary tie flips with rounding, and that is a property of DSA, not a bug.
"""

import itertools

import pytest
import torch

from dsaspec.reference.model import reference_forward, reference_mtp_forward
from dsaspec.configs.model_config import get_config
from dsaspec.configs.quantization import Fp8Quantization
from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.memory import (PAGE_SIZE, SINK_SLOT, KVPool, PageAllocator, ReqToTokenPool,
                                    RequestSlots)
from dsaspec.layers.attention.dsa_ops import dsa_ops
from dsaspec.layers.attention.inputs import AttentionInputs, build_extend_inputs
from dsaspec.layers.fp8_linear import ActQuant
from dsaspec.models.dsa_model import DSAModel

CONTEXT = 192
NUM_SLOTS = 10 * PAGE_SIZE


class Session:
    """One model, its memory and a request: prefill, decode, verify and MTP steps on table rows."""

    def __init__(self, model: DSAModel, device="cpu"):
        self.model, self.config = model, model.config
        dtype = model.lm_head.weight.dtype
        self.pool = ReqToTokenPool(3, CONTEXT, num_draft_tokens=4, device=device)
        self.slots = RequestSlots(self.pool, PageAllocator(NUM_SLOTS))
        self.kv = KVPool.for_model(self.config, NUM_SLOTS, dtype=dtype, device=device)
        self.kv_mtp = KVPool.for_model(self.config, NUM_SLOTS, mtp=True, dtype=dtype, device=device)
        self.device = device

    @property
    def table(self):
        return self.pool.req_to_token

    def step(self, row, ids, start, *, seqlens=None, mtp_hidden=None, seed_slots=None):
        """Rows for positions ``start + [0, len(ids))`` of ``row``; returns (output hidden, attn).
        ``seed_slots``: an MTP step seeded with these slots (its indexer skipped)."""
        ids = torch.as_tensor(ids, device=self.device)
        self.slots.extend(row, start + ids.numel())
        positions, loc, attn = build_extend_inputs(self.table, [row], [start], [ids.numel()])
        if seqlens is not None:
            attn.seqlens = torch.as_tensor(seqlens, dtype=torch.int32, device=self.device)
        attn.topk_slots = torch.empty(ids.numel(), self.config.index_topk, dtype=torch.int32,
                                      device=self.device)
        with torch.no_grad():
            if mtp_hidden is None:
                return self.model(ids, positions, loc, self.kv, attn), attn
            return self.model.forward_mtp(ids, mtp_hidden, positions, loc, self.kv_mtp, attn,
                                          seed_slots=seed_slots), attn

    @classmethod
    def prefill_prompt(cls, model: DSAModel, ids, chunk_size: int):
        """A new session's prefill of ``ids`` in chunks of ``chunk_size`` rows: the prompt's hidden."""
        session = cls(model)
        return model.prefill(ids, session.table, session.slots.admit(ids.numel()), session.kv,
                             chunk_size=chunk_size)

    def positions_of(self, row, slots):
        """Logical positions of ``row`` for selected slots (``-1`` entries dropped), ascending."""
        lookup = {int(s): p for p, s in enumerate(self.table[row].tolist())}
        return sorted(lookup[int(s)] for s in slots.tolist() if s >= 0)


def _model(dtype=torch.float32, seed=0, preset="tiny", **overrides):
    return DSAModel(get_config(preset, **overrides), dtype=dtype).init_weights(seed)


def _tokens(n, vocab, seed=1):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


YARN = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("overrides", [
    {"indexer_rope_interleave": True},
    {"indexer_rope_interleave": False},
    {"indexer_rope_interleave": False, "rope_scaling": YARN},
], ids=["glm-interleaved", "ds-half-split", "ds-yarn"])
def test_prefill_and_greedy_decode_match_reference_with_sparse_selection(overrides):
    _decode_against_reference(_model(**overrides))


def test_moe_layers_match_reference():
    """tiny-moe (layer 1 and the MTP layer MoE: 8 experts in 4 groups, 2 groups, 3 experts per token,
    a shared expert, a non-zero correction bias): prefill and greedy decode against the reference's
    per-token routing."""
    model = _model(preset="tiny-moe")
    assert type(model.model.layers[1].mlp).__name__ == "MoE" and type(model.model.layers[0].mlp).__name__ == "MLP"
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0
    _decode_against_reference(model)


def test_index_share_layers_match_reference():
    """Shared-indexer layers (full, shared, full, shared), prefill and greedy decode against the
    reference: layer 1 attends to layer 0's selection and layer 3 to layer 2's, which differs from
    layer 0's on the sparse rows (so attending to the wrong full layer's would show)."""
    model = _model(num_hidden_layers=4, indexer_types=("full", "shared", "full", "shared"))
    assert [layer.self_attn.indexer is None for layer in model.model.layers[:4]] == [False, True, False, True]
    selected = _decode_against_reference(model).selected
    assert torch.equal(selected[1], selected[0]) and torch.equal(selected[3], selected[2])
    assert not torch.equal(selected[2][64:], selected[0][64:])


def _decode_against_reference(model):
    """Prefill 90 tokens (chunks of 37) and decode 10 greedily; the logits, tokens and the last
    layer's selection of each decode row (actually sparse) must be the reference's. Returns the
    reference's output over the sequence."""
    k = model.config.index_topk
    session = Session(model)
    prompt = _tokens(90, model.config.vocab_size)                      # 90 > K = 64: sparse
    row = session.slots.admit(prompt.numel())
    hidden = model.prefill(prompt, session.table, row, session.kv, chunk_size=37)
    logits = [model.logits(hidden)]
    tokens = prompt.tolist() + [int(logits[0][-1].argmax())]
    selections = []
    for _ in range(10):
        hidden, attn = session.step(row, [tokens[-1]], len(tokens) - 1)
        logits.append(model.logits(hidden))
        selections.append(session.positions_of(row, attn.topk_slots[0]))
        tokens.append(int(logits[-1][0].argmax()))

    reference = reference_forward(model, torch.tensor(tokens[:-1]))
    torch.testing.assert_close(torch.cat(logits), reference.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.tensor(tokens[90:]), reference.logits[89:].argmax(-1))
    last_layer = reference.selected[-1]
    for i, selected in enumerate(selections):
        position = 90 + i
        expected = last_layer[position].nonzero().flatten().tolist()
        assert len(selected) == k < position + 1                   # actually sparse
        assert selected == expected
    return reference


def test_verify_rows_and_padding_rows():
    """A 4-row verify step (rows see L+1..L+4 keys) plus a graph-padding row on the dummy table
    row (sink slot, length 1) and an empty row (length 0) gives the reference logits."""
    model = _model(seed=3)
    session = Session(model)
    sequence = _tokens(80, model.config.vocab_size, seed=4)
    row = session.slots.admit(76)
    session.step(row, sequence[:76], 0)
    session.slots.extend(row, 80)
    table = session.table
    positions = torch.arange(76, 80)
    dummy = session.pool.dummy_row
    rows = [row] * 4 + [dummy, dummy]
    ids = torch.cat([sequence[76:], torch.zeros(2, dtype=torch.long)])
    attn = AttentionInputs(page_table_1=table[rows], seqlens=torch.tensor([77, 78, 79, 80, 1, 0], dtype=torch.int32))
    loc = torch.cat([table[row, positions].long(), torch.full((2,), SINK_SLOT)])
    with torch.no_grad():
        hidden = model(ids, torch.cat([positions, torch.zeros(2, dtype=torch.long)]), loc, session.kv, attn)
    assert torch.isfinite(hidden).all()
    reference = reference_forward(model, sequence)
    torch.testing.assert_close(model.logits(hidden[:4]), reference.logits[76:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["decode", "target_verify"])
def test_step_over_backend_metadata_buffers(mode):
    """The engine's path: AttentionInputs over MetadataBuffers (seqlens_expanded, page_table_1)
    and a schedule, two requests at once; decode: seq_lens include the new token; verify: N=4
    rows per request at L..L+3 with seq_lens = L."""
    from dsaspec.forward_mode import Mode
    from dsaspec.reference.dsa_metadata import reference_metadata
    from dsaspec.reference.indexer_schedule import reference_indexer_schedule

    model = _model(seed=13)
    session = Session(model)
    new = 1 if mode == "decode" else 4
    sequences = [_tokens(length + new, model.config.vocab_size, seed=length) for length in (75, 30)]
    rows = [session.slots.admit(len(seq)) for seq in sequences]
    for row, seq in zip(rows, sequences):
        session.step(row, seq[:-new], 0)
    lengths = torch.tensor([len(seq) - new for seq in sequences], dtype=torch.int32)
    seq_lens = lengths + 1 if mode == "decode" else lengths
    metadata = reference_metadata(Mode(mode), session.table, torch.tensor(rows), seq_lens,
                                  index_topk=model.config.index_topk, page_size=PAGE_SIZE,
                                  num_draft_tokens=new)
    schedule = reference_indexer_schedule(metadata.seqlens_expanded, 8)
    attn = AttentionInputs.from_metadata(metadata, schedule, model.config.index_topk)
    positions = torch.cat([torch.arange(int(n), int(n) + new) for n in lengths])
    loc = torch.cat([session.table[row, int(n):int(n) + new].long() for row, n in zip(rows, lengths)])
    ids = torch.cat([seq[-new:] for seq in sequences])
    with torch.no_grad():
        logits = model.logits(model(ids, positions, loc, session.kv, attn))
    for i, seq in enumerate(sequences):
        expected = reference_forward(model, seq).logits[-new:]
        torch.testing.assert_close(logits[i * new:(i + 1) * new], expected, atol=1e-4, rtol=1e-4)
    assert attn.topk_slots.shape == (len(rows) * new, model.config.index_topk)
    assert (attn.topk_slots[: new] >= 0).sum(-1).eq(64).all()        # the long request is sparse


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_mtp_layer_matches_reference(preset):
    """Draft extend over the prompt (row p: token p+1, target hidden p), then one MTP decode row
    (tiny-moe: the MTP layer's FFN is MoE)."""
    model = _model(seed=5, preset=preset)
    assert hasattr(model.mtp_layer.mlp, "experts") == (preset == "tiny-moe")
    session = Session(model)
    prompt = _tokens(70, model.config.vocab_size, seed=6)
    row = session.slots.admit(71)
    target_hidden, _ = session.step(row, prompt, 0)
    bonus = int(model.logits(target_hidden[-1:]).argmax())
    next_ids = torch.cat([prompt[1:], torch.tensor([bonus])])
    draft_hidden = model.prefill_mtp(next_ids, target_hidden, session.table, row, session.kv_mtp, chunk_size=32)
    draft_token = int(model.logits(draft_hidden[-1:]).argmax())
    step_hidden, _ = session.step(row, [draft_token], 70, mtp_hidden=draft_hidden[-1:])

    reference = reference_mtp_forward(model, torch.cat([next_ids, torch.tensor([draft_token])]),
                                      torch.cat([target_hidden, draft_hidden[-1:]]))
    outputs = torch.cat([draft_hidden, step_hidden])
    torch.testing.assert_close(outputs, reference.hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.logits(outputs), reference.logits, atol=1e-4, rtol=1e-4)


def test_bf16_model_matches_reference_where_no_selection_can_flip():
    model = _model(dtype=torch.bfloat16, seed=7, index_topk=128)      # dense at these lengths
    session = Session(model)
    prompt = _tokens(40, model.config.vocab_size, seed=8)
    row = session.slots.admit(40)
    logits = [model.logits(session.step(row, prompt, 0)[0])]
    tokens = prompt.tolist() + [int(logits[0][-1].argmax())]
    for _ in range(8):
        logits.append(model.logits(session.step(row, [tokens[-1]], len(tokens) - 1)[0]))
        tokens.append(int(logits[-1][0].argmax()))
    reference = reference_forward(model, torch.tensor(tokens[:-1]))
    torch.testing.assert_close(torch.cat(logits), reference.logits, atol=0.1, rtol=0.05)
    # where the reference's top-2 margin exceeds twice the error, the argmax cannot differ
    error = (torch.cat(logits)[39:] - reference.logits[39:]).abs().max()
    top2 = reference.logits[39:].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * error
    assert clear.sum() >= 4, (error, top2)
    assert torch.equal(torch.tensor(tokens[40:])[clear], reference.logits[39:].argmax(-1)[clear])


def test_triton_ops_match_torch_ops_on_a_short_sequence():
    """The same bf16 step through the Triton kernels (interpreter on CPU) and the torch references."""
    model = _model(dtype=torch.bfloat16, seed=9)
    prompt = _tokens(12, model.config.vocab_size, seed=10)
    results = []
    for use_triton in (False, True):
        model.use_triton = use_triton
        session = Session(model)
        row = session.slots.admit(13)
        logits = model.logits(session.step(row, prompt, 0)[0])
        decode = model.logits(session.step(row, [int(logits[-1].argmax())], 12)[0])
        results.append((torch.cat([logits, decode]), session.kv))
    model.use_triton = False
    (torch_logits, torch_kv), (triton_logits, triton_kv) = results
    torch.testing.assert_close(triton_logits, torch_logits, atol=0.1, rtol=0.05)
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(triton_kv.mla_cache[layer].float(), torch_kv.mla_cache[layer].float(),
                                   atol=0.07, rtol=0.02)


def test_attention_workspace_parts():
    """The Triton model's per-row-count workspaces: the top-k chunks (topk_num_chunks with 8
    SMs off-GPU) in every mode, the sparse-MLA split not in the row-invariant mode; the torch
    ops get none."""
    from dsaspec.ops.topk import TOPK_WORKSPACE_WORDS, topk_num_chunks

    assert _model().attention_workspace(2) is None
    model = DSAModel(get_config("tiny"), use_triton=True)
    workspace = model.attention_workspace(2)
    assert workspace.topk.shape == (2, topk_num_chunks(2, 8), TOPK_WORKSPACE_WORDS)
    assert workspace.sparse_mla is not None
    assert model.attention_workspace(1000).topk is None
    row_invariant = DSAModel(get_config("tiny"), use_triton=True, row_invariant=True)
    workspace = row_invariant.attention_workspace(3)
    assert workspace.topk.shape == (3, topk_num_chunks(3, 8), TOPK_WORKSPACE_WORDS)
    assert workspace.sparse_mla is None


@pytest.mark.parametrize("option, single_launch", [(None, None), (True, None), (False, False)])
def test_topk_single_launch_option(monkeypatch, option, single_launch):
    """The model's ``topk_single_launch`` option (default on) decides the workspace's single_launch,
    which reaches every top-k call of a forward (None: one launch where it fits; off: five); the
    environment switch, set to the other value, changes nothing."""
    monkeypatch.setenv("DSASPEC_TOPK_SINGLE_LAUNCH", "1" if option is False else "0")
    options = None if option is None else RuntimeOptions(topk_single_launch=option)
    model = DSAModel(get_config("tiny"), use_triton=True, options=options).init_weights(0)
    workspace = model.attention_workspace(3)
    assert workspace.topk_single_launch is single_launch
    ops = dsa_ops(True, model.sparse_mla_gluon, model.sparse_mla_slot_major)
    calls = []
    real = ops.topk_slots
    monkeypatch.setattr(ops, "topk_slots",
                        lambda *a, **kw: calls.append(kw.get("single_launch", "unset")) or real(*a, **kw))
    session = Session(model)
    row = session.slots.admit(4)
    ids = torch.as_tensor(_tokens(3, model.config.vocab_size, seed=1))
    session.slots.extend(row, 3)
    positions, loc, attn = build_extend_inputs(session.table, [row], [0], [3])
    attn.workspace = workspace
    with torch.no_grad():
        model(ids, positions, loc, session.kv, attn)
    assert calls == [single_launch] * model.config.num_hidden_layers


@pytest.mark.parametrize("option", [None, True, False])
def test_sparse_mla_gluon_option(monkeypatch, option):
    """The model's ``sparse_mla_gluon`` option (default on). Off, every sparse MLA call of a forward
    passes the Triton kernel's default configuration for its rows; on, the call leaves the choice to
    sparse_mla_decode (no config: the Gluon kernel where it runs). The environment switch, set to the
    other value, changes nothing."""
    import dsaspec.ops.sparse_mla as sparse_mla_module

    monkeypatch.setenv("DSASPEC_SPARSE_MLA_GLUON", "1" if option is False else "0")
    options = None if option is None else RuntimeOptions(sparse_mla_gluon=option)
    model = DSAModel(get_config("tiny"), use_triton=True, options=options).init_weights(0)
    assert model.options == (RuntimeOptions() if options is None else options)
    calls = []
    real = sparse_mla_module.sparse_mla_decode
    monkeypatch.setattr(sparse_mla_module, "sparse_mla_decode",
                        lambda *a, **kw: calls.append(kw.get("config", "unset")) or real(*a, **kw))
    dsa_ops.cache_clear()  # the ops namespace binds the recorder when the forward builds it
    session = Session(model)
    row = session.slots.admit(4)
    ids = torch.as_tensor(_tokens(3, model.config.vocab_size, seed=1))
    session.slots.extend(row, 3)
    positions, loc, attn = build_extend_inputs(session.table, [row], [0], [3])
    with torch.no_grad():
        model(ids, positions, loc, session.kv, attn)
    dsa_ops.cache_clear()
    expected = ("unset" if option is not False else
                sparse_mla_module.sparse_mla_config(3, model.num_local_heads, split=False))
    assert calls == [expected] * model.config.num_hidden_layers


@pytest.mark.parametrize("gluon", [True, False])
@pytest.mark.parametrize("slot_major", [True, False])
def test_sparse_mla_slot_major_option(monkeypatch, gluon, slot_major):
    """The model's ``sparse_mla_slot_major`` option (default on) reaches every choice of a sparse MLA
    configuration a forward over the tiny model makes (each call's and the attention workspace's
    sizing), with or without ``sparse_mla_gluon``; the rule itself is test_sparse_mla's."""
    import dsaspec.ops.sparse_mla as sparse_mla_module

    assert RuntimeOptions().sparse_mla_slot_major is True
    options = RuntimeOptions(sparse_mla_slot_major=slot_major, sparse_mla_gluon=gluon)
    model = DSAModel(get_config("tiny"), use_triton=True, options=options).init_weights(0)
    passed = []
    real = sparse_mla_module.sparse_mla_config
    monkeypatch.setattr(sparse_mla_module, "sparse_mla_config",
                        lambda *a, **kw: passed.append(kw.get("slot_major", True)) or real(*a, **kw))
    dsa_ops.cache_clear()
    session = Session(model)
    row = session.slots.admit(4)
    ids = torch.as_tensor(_tokens(3, model.config.vocab_size, seed=1))
    session.slots.extend(row, 3)
    positions, loc, attn = build_extend_inputs(session.table, [row], [0], [3])
    attn.workspace = model.attention_workspace(3)
    with torch.no_grad():
        model(ids, positions, loc, session.kv, attn)
    dsa_ops.cache_clear()
    assert len(passed) == 1 + model.config.num_hidden_layers  # the workspace, then one call a layer
    assert passed == [slot_major] * len(passed)


def test_cache_entries_hold_normed_latent_and_roped_key():
    """The MLA cache entry of a row is [kv_a_layernorm(latent) | rope(k_rope)]; position 0's RoPE
    is the identity, so its rope part equals the raw projection."""
    model = _model(seed=11)
    session = Session(model)
    ids = _tokens(3, model.config.vocab_size, seed=12)
    row = session.slots.admit(3)
    session.step(row, ids, 0)
    attn = model.model.layers[0].self_attn
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    latent, k_rope = attn.kv_a_proj_with_mqa(x).split([512, 64], dim=-1)
    entry = session.kv.mla_cache[0][session.table[row, 0].long()]
    torch.testing.assert_close(entry[:512], attn.kv_a_layernorm(latent)[0])
    torch.testing.assert_close(entry[512:], k_rope[0])
    assert not torch.allclose(session.kv.mla_cache[0][session.table[row, 1].long()][512:], k_rope[1])


def test_init_is_seeded():
    a, b, c = _model(seed=1), _model(seed=1), _model(seed=2)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name


def test_parameter_names_are_the_hf_names():
    model = DSAModel(get_config("tiny"))
    names = set(model.state_dict())
    layer, mtp = "model.layers.0.", f"model.layers.{model.config.num_hidden_layers}."
    for suffix in ("input_layernorm.weight", "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                   "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                   "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
                   "self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight",
                   "self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias",
                   "self_attn.indexer.weights_proj.weight", "post_attention_layernorm.weight",
                   "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        assert layer + suffix in names and mtp + suffix in names, suffix
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert mtp + suffix in names
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert model.state_dict()[mtp + "eh_proj.weight"].shape == (256, 512)


def test_bad_inputs_are_named():
    model = _model()
    session = Session(model)
    row = session.slots.admit(4)
    positions, loc, attn = build_extend_inputs(session.table, [row], [0], [4])
    ids = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"positions must have shape \[4\]"):
        model(ids, positions[:3], loc, session.kv, attn)
    with pytest.raises(ValueError, match="out_cache_loc must be int64"):
        model(ids, positions, loc.int(), session.kv, attn)
    with pytest.raises(ValueError, match=r"attn.seqlens must be int32"):
        model(ids, positions, loc, session.kv, AttentionInputs(attn.page_table_1, attn.seqlens.long()))
    with pytest.raises(ValueError, match="KV pool has 1 layer"):
        model(ids, positions, loc, session.kv_mtp, attn)
    with pytest.raises(ValueError, match=r"hidden must be \[4, 256\]"):
        model.forward_mtp(ids, torch.zeros(4, 128), positions, loc, session.kv_mtp, attn)
    with pytest.raises(ValueError, match="KV pool dtype"):
        model(ids, positions, loc, KVPool.for_model(model.config, NUM_SLOTS), attn)
    with pytest.raises(ValueError, match="no MTP layer"):
        _model(num_nextn_predict_layers=0).mtp_layer


# ---------------------------------------------------------------------------------------------
# GPU: `python -m pytest -m gpu tests/test_model.py`


def _teacher_forced(model, tokens, prompt_len, device):
    """Logits of every position after the prompt (prefill, then one decode step per token) and
    the last layer's selected positions of each decode step."""
    session = Session(model, device=device)
    row = session.slots.admit(prompt_len)
    logits = [model.logits(session.step(row, tokens[:prompt_len], 0)[0])[-1:]]
    selections = []
    for position in range(prompt_len, len(tokens)):
        hidden, attn = session.step(row, tokens[position:position + 1], position)
        logits.append(model.logits(hidden))
        selections.append(set(session.positions_of(row, attn.topk_slots[0])))
    return torch.cat(logits), selections


@pytest.mark.gpu
@pytest.mark.parametrize("index_topk", [256, 64], ids=["dense", "sparse"])
def test_gpu_triton_path_matches_torch_path(index_topk):
    """bf16 on the GPU, same tokens through the Triton kernels and the torch references. Dense:
    logits close and the argmax equal wherever the margin exceeds twice the error. Sparse: the
    selections agree (a top-k boundary tie may flip with accumulation order, nothing more)."""
    model = DSAModel(get_config("tiny", index_topk=index_topk), device="cuda").init_weights(0)
    tokens = _tokens(124, model.config.vocab_size).tolist()
    runs = []
    for use_triton in (False, True):
        model.use_triton = use_triton
        runs.append(_teacher_forced(model, tokens, 100, "cuda"))
    (torch_logits, torch_selected), (triton_logits, triton_selected) = runs
    overlap = [len(a & b) / len(a | b) for a, b in zip(torch_selected, triton_selected)]
    if index_topk >= len(tokens):
        torch.testing.assert_close(triton_logits, torch_logits, atol=0.1, rtol=0.05)
        error = (triton_logits - torch_logits).abs().max()
        top2 = torch_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * error
        assert clear.sum() >= 5
        assert torch.equal(triton_logits.argmax(-1)[clear], torch_logits.argmax(-1)[clear])
        assert min(overlap) == 1.0
    else:
        assert all(len(s) == index_topk for s in triton_selected)
        assert sum(overlap) / len(overlap) > 0.95 and min(overlap) > 0.8


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "bench", "tiny-moe"])
def test_gpu_decode_step_replays_in_a_cuda_graph(preset):
    """A decode step (Triton ops, check_values=False, static inputs) captured in a CUDA graph replays to
    the eager result, for new tokens and lengths written into the same buffers."""
    config = get_config(preset)
    model = DSAModel(config, device="cuda", use_triton=True).init_weights(0)
    session = Session(model, device="cuda")
    batch = 2
    rows = [session.slots.admit(150), session.slots.admit(40)]
    for row, length in zip(rows, (150, 40)):
        session.step(row, _tokens(length, config.vocab_size, seed=row).cuda(), 0)
    from dsaspec.ops.indexer_schedule import indexer_programs
    sms = indexer_programs("cuda")
    width = session.pool.width
    static = dict(
        ids=torch.zeros(batch, dtype=torch.long, device="cuda"),
        positions=torch.zeros(batch, dtype=torch.long, device="cuda"),
        loc=torch.zeros(batch, dtype=torch.long, device="cuda"),
        attn=AttentionInputs(page_table_1=torch.zeros(batch, width, dtype=torch.int32, device="cuda"),
                             seqlens=torch.ones(batch, dtype=torch.int32, device="cuda"),
                             schedule=torch.zeros(sms + 1, 2, dtype=torch.int32, device="cuda"),
                             index_logits=torch.empty(batch, width, device="cuda"),
                             topk_slots=torch.empty(batch, config.index_topk, dtype=torch.int32, device="cuda")))
    from dsaspec.ops.indexer_schedule import indexer_schedule

    def fill(lengths, tokens):
        for b, (row, length) in enumerate(zip(rows, lengths)):
            session.slots.extend(row, length + 1)
            static["ids"][b] = tokens[b]
            static["positions"][b] = length
            static["loc"][b] = session.table[row, length]
            static["attn"].page_table_1[b] = session.table[row]
            static["attn"].seqlens[b] = length + 1
        indexer_schedule(static["attn"].seqlens, sms, out=static["attn"].schedule)

    def run():
        return model(static["ids"], static["positions"], static["loc"], session.kv, static["attn"], check_values=False)

    fill((150, 40), (3, 4))
    with torch.no_grad():
        run()                                          # warm up (Triton compiles)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        replays = []
        for lengths, tokens in (((150, 40), (3, 4)), ((151, 41), (5, 6))):
            fill(lengths, tokens)
            graph.replay()
            replays.append(out.clone())
            torch.testing.assert_close(replays[-1], run(), atol=2e-2, rtol=2e-2)
        assert not torch.allclose(replays[0], replays[1])


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["glm5-fp8-tp8-rank", "deepseek-v32-fp8-tp8-rank"])
def test_gpu_norm_quant_decode_step_is_the_act_quant_step_at_rank_shapes(preset, monkeypatch):
    """A TP 8 rank's shapes (FP8 weights, GLM-5: fp32 activation scales, DeepSeek-V3.2: ue8m0; 2
    layers, the second MoE): a decode step of 2 rows whose norms write the codes of the attention's
    GEMMs, the dense FFN's gate/up and the fused MoE's gate/up equals the step whose GEMMs quantize
    (act_quant launches at these widths), output and caches bitwise, eagerly and replayed from a
    CUDA graph per path (twice, new tokens and lengths written into the same buffers)."""
    from dsaspec.layers.moe import MoE
    from dsaspec.ops.indexer_schedule import indexer_programs, indexer_schedule

    config = get_config(preset, num_hidden_layers=2, first_k_dense_replace=1)
    model = DSAModel(config, device="cuda", use_triton=True).init_weights(0)
    attns = [layer.self_attn for layer in model.model.layers]       # the MTP layer's last
    dense, moe = (layer.mlp for layer in model.model.layers[:config.num_hidden_layers])
    quants = [(attn.input_quant, attn.latent_quant) for attn in attns]
    fmt = config.quantization.scale_fmt
    assert all(q == (ActQuant(fmt), ActQuant(fmt)) for q in quants)
    assert isinstance(moe, MoE) and dense.input_quant == moe.input_quant == ActQuant(fmt)

    def quantize(on):
        for attn, q in zip(attns, quants):
            attn.input_quant, attn.latent_quant = q if on else (None, None)
        dense.input_quant = ActQuant(fmt) if on else None
        if on:
            monkeypatch.undo()
        else:
            monkeypatch.setattr(MoE, "input_quant", property(lambda self: None))

    session = Session(model, device="cuda")
    rows = [session.slots.admit(150), session.slots.admit(40)]
    for row, length in zip(rows, (150, 40)):
        session.step(row, _tokens(length, config.vocab_size, seed=row).cuda(), 0)
    sms = indexer_programs("cuda")
    width = session.pool.width
    ids, positions, loc = (torch.zeros(2, dtype=torch.long, device="cuda") for _ in range(3))
    attn = AttentionInputs(page_table_1=torch.zeros(2, width, dtype=torch.int32, device="cuda"),
                           seqlens=torch.ones(2, dtype=torch.int32, device="cuda"),
                           schedule=torch.zeros(sms + 1, 2, dtype=torch.int32, device="cuda"),
                           index_logits=torch.empty(2, width, device="cuda"),
                           topk_slots=torch.empty(2, config.index_topk, dtype=torch.int32, device="cuda"))

    def fill(lengths, tokens):
        for b, (row, length) in enumerate(zip(rows, lengths)):
            session.slots.extend(row, length + 1)
            ids[b], positions[b] = tokens[b], length
            loc[b] = session.table[row, length]
            attn.page_table_1[b] = session.table[row]
            attn.seqlens[b] = length + 1
        indexer_schedule(attn.seqlens, sms, out=attn.schedule)

    def run():
        return model(ids, positions, loc, session.kv, attn, check_values=False)

    def state(out):
        return [out.clone(), attn.topk_slots.clone(), *(c.clone() for c in session.kv.mla_cache),
                *(c.clone() for c in session.kv.index_k_cache)]

    def assert_bitwise(got, want, what):
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), what

    fill((150, 40), (3, 4))
    graphs = {}
    with torch.no_grad():
        for on in (True, False):
            quantize(on)
            eager = state(run())                       # also the warm-up: Triton compiles here
            if on:
                fused_eager = eager
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run()
            graphs[on] = graph, out
        assert_bitwise(fused_eager, eager, "eager: the norm-quant step differs from the act_quant step")
        for lengths, tokens in (((150, 40), (3, 4)), ((151, 41), (5, 6))):
            fill(lengths, tokens)
            replays = {}
            for on, (graph, out) in graphs.items():
                graph.replay()
                replays[on] = state(out)
            assert_bitwise(replays[True], replays[False], f"replay {lengths}: the two paths differ")
            quantize(True)
            torch.testing.assert_close(replays[True][0], run(), atol=2e-2, rtol=2e-2)


def test_fused_moe_option_routes_the_experts_to_the_fused_kernel():
    """``RuntimeOptions.fused_moe`` (the default) sends the routed experts of a model that runs the
    Triton ops, outside the row-invariant mode, to ``dsaspec.ops.fused_moe``; its result equals the
    torch expert path's (fp32; the kernel under the interpreter on CPU)."""
    from dsaspec.configs.runtime_options import RuntimeOptions
    from dsaspec.layers.moe import RoutedExperts

    def experts(model):
        return [m for m in model.modules() if isinstance(m, RoutedExperts)]

    config = get_config("tiny-moe")
    fused = DSAModel(config, device="cpu", dtype=torch.float32, use_triton=True).init_weights(3)
    assert experts(fused) and all(m.use_fused for m in experts(fused))
    for model in (DSAModel(config, device="cpu", dtype=torch.float32, use_triton=True,
                           options=RuntimeOptions(fused_moe=False)),
                  DSAModel(config, device="cpu", dtype=torch.float32, use_triton=True, row_invariant=True,
                           options=RuntimeOptions(fused_moe=True)),
                  DSAModel(config, device="cpu", dtype=torch.float32, options=RuntimeOptions(fused_moe=True))):
        assert not any(m.use_fused for m in experts(model))
    layer = experts(fused)[0]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, config.hidden_size, generator=generator)
    ids = torch.stack([torch.randperm(config.n_routed_experts, generator=generator)[:config.num_experts_per_tok]
                       for _ in range(5)]).to(torch.int32)
    weights = torch.rand(5, config.num_experts_per_tok, generator=generator)
    layer.use_fused = False
    want = layer(x, ids, weights)
    layer.use_fused = True
    torch.testing.assert_close(layer(x, ids, weights), want, rtol=1e-5, atol=1e-5)


def test_fp8_fast_accum_reaches_every_fp8_linear_and_is_refused_with_row_invariant():
    """``options.fp8_fast_accum`` sets ``fast_accum`` on every Fp8Linear of an FP8 model (the
    attention's fused GEMMs, o_proj, the dense MLPs'); off by default; a ValueError naming it with
    the row-invariant mode."""
    from dsaspec.configs.runtime_options import RuntimeOptions
    from dsaspec.layers.fp8_linear import Fp8Linear

    config = get_config("tiny", num_hidden_layers=1, quantization=Fp8Quantization())
    for fast_accum in (True, False):
        model = DSAModel(config, device="meta", options=RuntimeOptions(fp8_fast_accum=fast_accum))
        layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        assert len(layers) >= 4 and all(m.fast_accum is fast_accum for m in layers)
    assert not any(m.fast_accum for m in DSAModel(config, device="meta").modules() if isinstance(m, Fp8Linear))
    with pytest.raises(ValueError, match="options.fp8_fast_accum: the row-invariant mode"):
        DSAModel(config, device="meta", row_invariant=True, options=RuntimeOptions(fp8_fast_accum=True))


# one layer, narrow: quick with the row-invariant kernels under the interpreter
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=64, q_lora_rank=32, num_attention_heads=2,
             index_n_heads=2, num_hidden_layers=2, index_topk=8)


def _unfused(model: DSAModel) -> DSAModel:
    for module in model.modules():
        if hasattr(module, "fused_input"):
            module.fused_input = module.fused_latent = None
        if hasattr(module, "gate_up"):
            module.gate_up = None
    return model


def _fused_latent_calls(model: DSAModel) -> list[int]:
    """Counts the calls of every ``fused_latent`` GEMM of ``model`` (one shared list, by layer; the
    MTP layer last)."""
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        if layer.self_attn.fused_latent is not None:
            layer.self_attn.fused_latent.register_forward_hook(
                lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _fused_against_unfused(config, dtype, row_invariant=False, use_triton=False):
    """Prefill 12 tokens, decode one, an MTP extend over the prompt and one MTP step seeded with
    the extend's last top-k, on the fused model (the default) and on the same weights unfused:
    both runs' outputs and caches, and the fused run's ``fused_latent`` calls after each step."""
    outs, calls = [], []
    for fused in (True, False):
        model = DSAModel(config, dtype=dtype, row_invariant=row_invariant, use_triton=use_triton).init_weights(8)
        model = model if fused else _unfused(model)
        counts, seen = _fused_latent_calls(model), []
        session = Session(model)
        ids = _tokens(12, model.config.vocab_size, seed=9)
        row = session.slots.admit(14)
        hidden, _ = session.step(row, ids, 0)
        seen.append(list(counts))
        step, _ = session.step(row, [5], 12)
        seen.append(list(counts))
        mtp, attn = session.step(row, ids[1:], 0, mtp_hidden=hidden[:-1])
        seen.append(list(counts))
        seeded, _ = session.step(row, [7], 11, mtp_hidden=mtp[-1:], seed_slots=attn.topk_slots[-1:].clone())
        seen.append(list(counts))
        outs.append([hidden, step, mtp, seeded, *session.kv.mla_cache, *session.kv.index_k_cache,
                     *session.kv_mtp.mla_cache, *session.kv_mtp.index_k_cache])
        calls.append(seen)
    return outs, calls[0]


@pytest.mark.parametrize("row_invariant", [False, True])
def test_fused_projections_decode_what_the_separate_ones_do(row_invariant):
    """The model with its shared-input projections fused (the default: the layer input's and the
    q latent's) against the same weights run projection by projection: prefill, decode, MTP and
    seeded MTP outputs and every cache entry bitwise equal (fp32 CPU, row-invariant kernels or
    torch: at K <= 64 the row-invariant GEMM splits no K whatever the width, so an output's sum runs
    in the same order fused or not; torch's CPU GEMM, measured, does the same at these sizes). The fused
    q-latent GEMM runs once per layer and forward where the indexer runs, and not in the seeded
    MTP step (``q_b_proj`` alone: ``wq_b`` unread)."""
    outs, calls = _fused_against_unfused(get_config("tiny", **SMALL), torch.float32, row_invariant)
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    assert calls == [[1, 1, 0], [2, 2, 0], [2, 2, 1], [2, 2, 1]]


@pytest.mark.parametrize("quantization", [None, Fp8Quantization()], ids=["bf16", "fp8"])
def test_fused_latent_with_the_triton_ops_decodes_what_the_separate_ones_do(quantization):
    """bf16 and FP8 weights (tiny: K 128 and 256), the Triton ops (under the interpreter on CPU):
    the indexer's query reaches ``indexer_epilogues`` as a column view of the fused output;
    outputs and caches bitwise the unfused model's (the Triton FP8 GEMM and the interpreter's
    bf16 dot compute an output column from its own weight rows, K in the same order: at tiny's
    widths the FP8 GEMM's K groups (``k_group``) are one block fused and unfused alike; at
    production widths G follows each GEMM's N, and a part run alone may differ in the last bits)."""
    config = get_config("tiny", num_hidden_layers=1, quantization=quantization)
    outs, calls = _fused_against_unfused(config, torch.bfloat16, use_triton=True)
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    assert calls == [[1, 0], [2, 0], [2, 1], [2, 1]]


# SMALL with the FP8 layers' input widths multiples of 128, one layer
FP8_SMALL = dict(hidden_size=256, intermediate_size=128, q_lora_rank=128, num_hidden_layers=1)


class _Launches:
    """Counts the launches of a Triton kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def _layer_with_and_without_norm_quant(row_invariant, monkeypatch):
    """Decoder layer 0 of a one-layer FP8 model (ue8m0 activation scales, bf16, Triton ops) over 3
    prompt rows and their residual, with its norms writing the attention GEMMs' codes (the default)
    and without (those GEMMs' act_quant launches quantize): per run its outputs, the caches and
    top-k slots it wrote, and the act_quant launches."""
    from dsaspec.ops import fp8_gemm

    launches = _Launches(fp8_gemm._act_quant_kernel)
    monkeypatch.setattr(fp8_gemm, "_act_quant_kernel", launches)
    config = get_config("tiny", **(SMALL | FP8_SMALL), quantization=Fp8Quantization(scale_fmt="ue8m0"))
    model = DSAModel(config, dtype=torch.bfloat16, use_triton=True, row_invariant=row_invariant).init_weights(21)
    layer = model.model.layers[0]
    attn = layer.self_attn
    quants = attn.input_quant, attn.latent_quant, layer.mlp.input_quant
    assert quants == (ActQuant("ue8m0"),) * 3
    gen = torch.Generator().manual_seed(22)
    x, residual = (torch.randn(3, config.hidden_size, generator=gen).bfloat16() for _ in range(2))
    runs = []
    for quantize in (True, False):
        attn.input_quant, attn.latent_quant, layer.mlp.input_quant = quants if quantize else (None, None, None)
        runs.append(_prompt_through_layer(model, 0, x, residual, launches))
    return runs


def _prompt_through_layer(model, index, x, residual, launches):
    """Decoder layer ``index`` of ``model`` over the prompt rows ``x`` of a new request (and their
    ``residual``): its outputs, the top-k slots and the layer's caches it wrote, and the launches
    ``launches`` counted in it."""
    tokens = x.shape[0]
    session = Session(model)
    row = session.slots.admit(tokens)
    session.slots.extend(row, tokens)
    positions, loc, inputs = build_extend_inputs(session.table, [row], [0], [tokens])
    inputs.topk_slots = torch.empty(tokens, model.config.index_topk, dtype=torch.int32)
    launches.count = 0
    with torch.no_grad():
        out = model.model.layers[index](x, model._state(positions, loc, inputs, True), session.kv.mla_cache[index],
                                        session.kv.index_k_cache[index], residual)
    return [*out, inputs.topk_slots, session.kv.mla_cache[index], session.kv.index_k_cache[index]], launches.count


@pytest.mark.interpreter
@pytest.mark.parametrize("row_invariant", [False, True], ids=["default", "row_invariant"])
def test_norms_quantizing_for_the_fp8_gemms_are_bitwise_the_act_quant_path(row_invariant, monkeypatch):
    """The input norm (residual add + RMSNorm) writes the codes of ``fused_input`` (q_a / wk / kv_a)
    and ``q_a_layernorm`` those of ``fused_latent`` (q_b / wq_b): a layer's forward runs 2
    act_quant launches fewer, and the post-attention norm those of the dense FFN's ``gate_up``: one
    more (2 left: ``o_proj`` and ``down_proj``); its outputs, the new residual, the selection and
    the caches bitwise the same."""
    (fused, fused_launches), (unfused, unfused_launches) = _layer_with_and_without_norm_quant(
        row_invariant, monkeypatch)
    assert (unfused_launches, fused_launches) == (5, 2)
    for got, want in zip(fused, unfused):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.interpreter
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_post_attention_norm_writes_the_fused_moe_codes(scale_fmt, monkeypatch):
    """An FP8 MoE layer on the fused path with its shared expert stacked (``mlp.input_quant``): the
    post-attention norm writes the codes that the fused MoE's gate/up reads, one act_quant launch
    fewer; the layer's output, residual, selection and caches bitwise those of the MoE quantizing its
    input."""
    from dsaspec.layers.moe import MoE
    from dsaspec.ops import fp8_gemm

    launches = _Launches(fp8_gemm._act_quant_kernel)
    monkeypatch.setattr(fp8_gemm, "_act_quant_kernel", launches)
    config = get_config("tiny-moe", num_hidden_layers=2, quantization=Fp8Quantization(scale_fmt=scale_fmt))
    model = DSAModel(config, dtype=torch.bfloat16, use_triton=True,
                     options=RuntimeOptions(fused_moe=True)).init_weights(23)
    layer = model.model.layers[1]
    assert isinstance(layer.mlp, MoE) and layer.mlp.experts.stacked is not None
    assert layer.mlp.input_quant == ActQuant(scale_fmt)
    gen = torch.Generator().manual_seed(24)
    x, residual = (torch.randn(5, config.hidden_size, generator=gen).bfloat16() for _ in range(2))
    fused, fused_launches = _prompt_through_layer(model, 1, x, residual, launches)
    monkeypatch.setattr(MoE, "input_quant", property(lambda self: None))
    unfused, unfused_launches = _prompt_through_layer(model, 1, x, residual, launches)
    assert unfused_launches == fused_launches + 1
    for got, want in zip(fused, unfused):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("row_invariant", [False, True])
def test_residual_adds_fused_into_the_norms_are_the_unfused_layer(row_invariant):
    """``forward``'s layers hand the un-added FFN output and its residual to the next norm (one
    add + RMSNorm kernel in row-invariant mode); bitwise the plain ``x + attn(norm(x))``,
    ``x + mlp(norm(x))`` layers and the final norm."""
    model = DSAModel(get_config("tiny", **SMALL), dtype=torch.float32, row_invariant=row_invariant).init_weights(13)
    session = Session(model)
    ids = _tokens(11, model.config.vocab_size, seed=14)
    row = session.slots.admit(11)
    got, attn = session.step(row, ids, 0)
    positions, loc, attn = build_extend_inputs(session.table, [row], [0], [ids.numel()])
    attn.topk_slots = torch.empty(ids.numel(), model.config.index_topk, dtype=torch.int32)
    step = model._state(positions, loc, attn, True)
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        for i in range(model.config.num_hidden_layers):
            layer = model.model.layers[i]
            x = x + layer.self_attn(layer.input_layernorm(x), step, session.kv.mla_cache[i], session.kv.index_k_cache[i])
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        want = model.model.norm(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("scaling", [None, {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                            "mscale": 1.0, "mscale_all_dim": 0.0}])
def test_rotary_tables(scaling):
    """Rotary's cos/sin: the fp64 angles ``float64(position) * inv_freq``, their cos/sin times the
    YaRN factor (left out when 1), rounded to fp32 once; positions up to 2**20."""
    from dsaspec.layers.rotary import Rotary, rope_inv_freq

    config = get_config("tiny").replace(rope_scaling=scaling)
    inv_freq, factor = rope_inv_freq(config)
    assert (factor == 1.0) == (scaling is None)
    positions = torch.tensor([0, 1, 7, 4095, 65537, 2 ** 20 - 1])
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = Rotary(config)(positions)
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, (angles.cos() * factor).float())
    assert torch.equal(sin, (angles.sin() * factor).float())


@pytest.mark.parametrize("row_invariant", [False, True], ids=["torch", "row_invariant"])
def test_o_proj_reads_the_value_product_where_it_was_written(row_invariant):
    """The W_UV product is written through the [H, R, v] view of a [R, H, v] tensor, so o_proj's
    input is that tensor's [R, H * v] view (its storage, no reshape copy) and no aten clone runs
    in the attention forward; the decode's logits are unchanged against the reference."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Clones(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    model = DSAModel(get_config("tiny"), dtype=torch.float32, row_invariant=row_invariant).init_weights(0)
    attention = model.model.layers[0].self_attn
    seen = []
    attention.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    counted = Clones()
    attention.register_forward_pre_hook(lambda module, args: [counted.__enter__()] and None)
    attention.register_forward_hook(lambda module, args, out: [counted.__exit__(None, None, None)] and None)
    session = Session(model)
    prompt = _tokens(20, model.config.vocab_size)
    row = session.slots.admit(prompt.numel())
    model.prefill(prompt, session.table, row, session.kv, chunk_size=20)
    hidden, _ = session.step(row, [3], 20)
    o = seen[-1]
    heads, v = attention.num_heads, model.config.v_head_dim
    assert o.shape == (1, heads * v) and o.is_contiguous() and o._base is not None
    assert o._base.shape == (1, heads, v) and o.data_ptr() == o._base.data_ptr()
    assert counted.count["clone"] == 0, counted.count
    want = reference_forward(model, torch.cat((prompt, torch.tensor([3])))).logits[-1]
    torch.testing.assert_close(model.logits(hidden)[0], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("row_invariant", [False, True])
def test_prefill_groups_the_indexer_rows_of_a_chunk(monkeypatch, row_invariant):
    """Prefill chunks give the indexer groups of 4 consecutive positions (chunks of 32 rows; the
    last chunk of 6 rows and the row-invariant mode keep single rows), and the grouped logits
    (another head-sum order) select what single rows select: the prompt's hidden states agree with
    an ungrouped prefill to fp32 rounding. Triton ops under the interpreter; 96 of the 102 rows
    are longer than the top-k of 64."""
    import dsaspec.models.dsa_model as dsa_model

    model = DSAModel(get_config("tiny"), use_triton=True, row_invariant=row_invariant).init_weights(5)
    ops = dsa_ops(True, model.sparse_mla_gluon, model.sparse_mla_slot_major)
    groups = []
    real = ops.indexer_logits
    monkeypatch.setattr(ops, "indexer_logits", lambda q, *a, **kw: groups.append(
        (q.shape[0], kw["rows_per_group"])) or real(q, *a, **kw))
    ids = _tokens(102, model.config.vocab_size, seed=4)

    grouped = Session.prefill_prompt(model, ids, 32)
    expected_group = 1 if row_invariant else 4
    assert groups == [(rows, expected_group if rows % 4 == 0 else 1)
                      for rows in (32, 32, 32, 6) for _ in range(model.config.num_hidden_layers)]
    monkeypatch.setattr(dsa_model, "PREFILL_INDEX_GROUP", 1)
    groups.clear()
    single = Session.prefill_prompt(model, ids, 32)
    assert {g for _, g in groups} == {1}
    torch.testing.assert_close(grouped, single, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("row_invariant", [False, True])
def test_prefill_chunks_of_many_rows_take_the_head_weights_from_a_gemm(monkeypatch, row_invariant):
    """From PREFILL_MIN_ROWS rows (lowered to 32 here) the indexer's epilogue launch gets
    no layer input and the head weights come from torch's fp32 GEMM, except in the row-invariant
    mode; the prompt's hidden states agree with the epilogue's head weights to fp32 rounding.
    Triton ops under the interpreter; chunks of 32, 32 and 6 rows."""
    import dsaspec.layers.attention.mla as mla

    model = DSAModel(get_config("tiny"), use_triton=True, row_invariant=row_invariant).init_weights(6)
    ops = dsa_ops(True, model.sparse_mla_gluon, model.sparse_mla_slot_major)
    inputs = []
    real = ops.indexer_epilogues
    monkeypatch.setattr(ops, "indexer_epilogues", lambda *a, **kw: inputs.append(
        (a[0].shape[0], a[11] is not None)) or real(*a, **kw))
    ids = _tokens(70, model.config.vocab_size, seed=7)

    launch = Session.prefill_prompt(model, ids, 32)
    monkeypatch.setattr(mla, "PREFILL_MIN_ROWS", 32)
    inputs.clear()
    gemm = Session.prefill_prompt(model, ids, 32)
    layers = model.config.num_hidden_layers
    assert inputs == [(rows, row_invariant or rows < 32) for rows in (32, 32, 6) for _ in range(layers)]
    torch.testing.assert_close(gemm, launch, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_prefill_head_weights_are_fp32_sums_of_exact_products(monkeypatch):
    """On CUDA a default-mode prefill chunk's head weights (bf16 rows and weight) come from
    cuBLAS's bf16 GEMM with fp32 output, not the fp32 GEMM on copies: at GLM-5's width and 4,096
    rows, within the bound of an fp32 sum of exact products (and the scale's one rounding) of the
    float64 result, and within fp32 rounding of the fp32 GEMM they replace."""
    from dsaspec.layers.attention.mla import Indexer

    config = get_config("e2e")
    indexer = Indexer(config, torch.device("cuda"), torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        indexer.weights_proj.weight.copy_(torch.randn(indexer.weights_proj.weight.shape, device="cuda",
                                                      generator=gen) / config.hidden_size ** 0.5)
    x = torch.randn(4096, config.hidden_size, device="cuda", generator=gen).bfloat16()
    fp32 = indexer._head_weights(x)
    monkeypatch.setattr(Indexer, "_head_weights", lambda *a: pytest.fail("the fp32 GEMM ran"))
    got = indexer._prefill_head_weights(x)
    w = indexer.weights_proj.weight
    # u doubled for the sums: tensor cores need not round their fp32 additions to nearest
    k, u = config.hidden_size, 2.0 ** -23
    scale = config.index_weight_scale
    exact = (x.double() @ w.double().T) * scale
    bound = (k * u / (1 - k * u) + u) * (x.double().abs() @ w.double().abs().T) * abs(scale)
    assert got.dtype == torch.float32 and got.shape == (4096, config.index_n_heads)
    assert bool(((got.double() - exact).abs() <= bound).all())
    torch.testing.assert_close(got, fp32, rtol=1e-5, atol=1e-6)


def test_only_the_first_layer_runs_the_value_checks(monkeypatch):
    """check_values reaches the first layer's ops alone (the later layers would repeat its host
    syncs on the same slots and tables), and a slot outside the pool is still refused there
    (Triton ops under the interpreter)."""
    model = DSAModel(get_config("tiny", num_hidden_layers=3), use_triton=True).init_weights(0)
    ops = dsa_ops(True, model.sparse_mla_gluon, model.sparse_mla_slot_major)
    checks = []
    real = ops.store_mla_normed
    monkeypatch.setattr(ops, "store_mla_normed", lambda *a, **kw: checks.append(kw["check_values"]) or real(*a, **kw))
    session = Session(model)
    ids = _tokens(12, model.config.vocab_size)
    row = session.slots.admit(ids.numel())
    positions, loc, attn = build_extend_inputs(session.table, [row], [0], [ids.numel()])
    model(ids, positions, loc, session.kv, attn)
    assert checks == [True, False, False]
    checks.clear()
    model(ids, positions, loc, session.kv, attn, check_values=False)
    assert checks == [False, False, False]
    bad = loc.clone()
    bad[-1] = session.kv.mla_cache[0].shape[0]
    with pytest.raises(ValueError, match="loc"):
        model(ids, positions, bad, session.kv, attn)


def test_extend_inputs_page_table_of_one_request_is_its_row_without_a_copy():
    """One request: page_table_1 is its table row repeated with stride 0 (no [R, W] copy); several:
    each row's request's row. Both cut to the longest live length."""
    pool = ReqToTokenPool(3, CONTEXT, device="cpu")
    pool.req_to_token.copy_(torch.randint(0, 1000, pool.req_to_token.shape, dtype=torch.int32))
    _, _, one = build_extend_inputs(pool.req_to_token, [1], [10], [5])
    assert one.page_table_1.stride(0) == 0 and one.page_table_1.shape == (5, 15)
    assert torch.equal(one.page_table_1, pool.req_to_token[1, :15].expand(5, -1))
    _, _, two = build_extend_inputs(pool.req_to_token, [2, 0], [3, 20], [2, 4])
    assert two.page_table_1.shape == (6, 24)
    assert torch.equal(two.page_table_1, pool.req_to_token[[2, 2, 0, 0, 0, 0], :24])
    assert torch.equal(two.seqlens, torch.tensor([4, 5, 21, 22, 23, 24], dtype=torch.int32))


@pytest.mark.parametrize("prefix", [0, 1, 63, 64, 65, 1000, 16384, 131072, 1 << 20])
@pytest.mark.parametrize("chunk_size", [1, 512, 4096, 1 << 20])
def test_prefill_chunk_rows_keep_the_logits_within_their_budget(prefix, chunk_size):
    """A chunk's fp32 logits [rows, prefix + rows] fit PREFILL_LOGITS_BYTES; a chunk the budget cuts
    is a multiple of the index group and the largest such; never more rows than asked or left."""
    from dsaspec.models.dsa_model import PREFILL_INDEX_GROUP, PREFILL_LOGITS_BYTES

    def logits_bytes(rows):
        return 4 * rows * (prefix + rows)

    for remaining in (1, 3, 5000, 1 << 21):
        rows = DSAModel.prefill_chunk_rows(prefix, remaining, chunk_size)
        assert 1 <= rows <= min(chunk_size, remaining)
        assert logits_bytes(rows) <= PREFILL_LOGITS_BYTES
        if rows < min(chunk_size, remaining):
            assert rows % PREFILL_INDEX_GROUP == 0
            assert logits_bytes(rows + PREFILL_INDEX_GROUP) > PREFILL_LOGITS_BYTES


def test_prefill_of_a_long_prefix_takes_fewer_rows_a_chunk(monkeypatch):
    """With a logits budget of 4 * 2000 bytes, chunks of 64 asked for get 44 rows at prefix 0 (44 x
    44 <= 2000), then fewer as the prefix grows; the prompt's hidden states equal one unbounded
    prefill's to fp32 rounding."""
    import dsaspec.models.dsa_model as dsa_model

    model = _model(seed=6)
    ids = _tokens(100, model.config.vocab_size, seed=7)
    extends = []
    real = dsa_model.build_extend_inputs
    monkeypatch.setattr(dsa_model, "build_extend_inputs", lambda table, rows, prefixes, lens: extends.append(
        tuple(lens)) or real(table, rows, prefixes, lens))

    whole = Session.prefill_prompt(model, ids, 64)
    assert extends == [(64,), (36,)]
    extends.clear()
    monkeypatch.setattr(dsa_model, "PREFILL_LOGITS_BYTES", 4 * 2000)
    bounded = Session.prefill_prompt(model, ids, 64)
    assert extends[0] == (44,) and sum(n for (n,) in extends) == 100
    starts = itertools.accumulate([0] + [n for (n,) in extends])
    assert all(n * (start + n) <= 2000 for (n,), start in zip(extends, starts))
    torch.testing.assert_close(bounded, whole, atol=1e-5, rtol=1e-5)


def test_an_eager_forward_writes_the_indexer_schedule_once(monkeypatch):
    """A forward without a schedule in its inputs (prefill chunks) writes the indexer schedule at
    its first layer and hands that one to every layer's indexer: one schedule launch a chunk, not
    one a layer, each equal to what the layer would have written itself. Triton ops under the
    interpreter; chunks of 32, 32 and 6 rows over 3 layers."""
    from dsaspec.ops.indexer import default_indexer_programs
    from dsaspec.ops.indexer_schedule import indexer_schedule
    from dsaspec.ops.kv_cache_layout import is_fp8_cache

    model = DSAModel(get_config("tiny", num_hidden_layers=3), use_triton=True).init_weights(8)
    ops = dsa_ops(True, model.sparse_mla_gluon, model.sparse_mla_slot_major)
    written, read = [], []
    real_schedule, real_logits = ops.indexer_schedule, ops.indexer_logits

    def schedule(*a, **kw):
        written.append(real_schedule(*a, **kw))
        return written[-1]

    def logits(q, weights, cache, table, seqlens, sched, *a, **kw):
        programs = default_indexer_programs(q.device, is_fp8_cache(cache), kw["rows_per_group"], q.shape[1])
        own = indexer_schedule(seqlens, programs, torch.empty(programs + 1, 2, dtype=torch.int32),
                               skip_len=kw["skip_len"], rows_per_group=kw["rows_per_group"])
        assert torch.equal(sched, own)
        read.append(sched)
        return real_logits(q, weights, cache, table, seqlens, sched, *a, **kw)

    monkeypatch.setattr(ops, "indexer_schedule", schedule)
    monkeypatch.setattr(ops, "indexer_logits", logits)
    Session.prefill_prompt(model, _tokens(70, model.config.vocab_size, seed=9), 32)
    assert len(written) == 3
    assert [s.data_ptr() for s in read] == [s.data_ptr() for s in written for _ in range(3)]
