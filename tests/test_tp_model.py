"""Tensor parallelism of the DSA model and the runtime (docs/runtime.md, "Tensor parallel").

CPU: TP 2 and TP 4 emulated in one process (tests/fake_tp.py: one thread per rank, run in lockstep,
the all-reduce a sum and the all-gather a stack): each rank's shards against slices of the TP 1
weights written out by hand, the sharded forward against the TP 1 forward, the Engine at TP 2
(speculative = plain, = TP 1, the argmax-exchange option), sharded loading from one checkpoint,
and the command-line errors. fp32 with the runtime's torch ops.

Tolerance: a row-parallel GEMM sums its K dimension as TP partial sums plus one all-reduce instead
of one sum, so results differ from TP 1 in rounding only: fp32 hidden states and logits of the tiny
model agree to 1e-4 (measured: at most 3e-6 on logits up to 5), and greedy tokens must agree
wherever the TP 1 top-2 margin exceeds twice that.

multigpu (two GPUs, bf16, CUDA graphs):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 -m pytest tests/test_tp_model.py -q -m multigpu -p no:cacheprovider
"""

import os

import pytest
import torch

from dsaspec.distributed.tp_group import SYMM_MEM
from dsaspec.configs.model_config import get_config
from dsaspec.engine.engine import Engine
from dsaspec.models.loader import load_weights, save_checkpoint
from dsaspec.memory import KVPool, PageAllocator, ReqToTokenPool, RequestSlots
from dsaspec.layers.attention.inputs import build_extend_inputs
from dsaspec.configs.runtime_options import RuntimeOptions
from dsaspec.models.dsa_model import DSAModel
from dsaspec.speculative.spec_worker import SpecConfig
from dsaspec.layers.logits_processor import GREEDY_TOPK1, LogitsProcessor
from fake_tp import fake_groups, run_ranks
from test_spec_engine import predictable

TOL = 1e-4


def _tp_models(config, tp, seed=0, dtype=torch.float32, **kwargs):
    groups = fake_groups(tp)
    return groups, [DSAModel(config, dtype=dtype, tp_group=g, **kwargs).init_weights(seed) for g in groups]


# ---------------------------------------------------------------------------------------------
# shards


def _expected_shard(name: str, full: torch.Tensor, config, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of a TP 1 tensor, written out per parameter kind (not with the model's Shard)."""
    heads = config.num_attention_heads // tp
    mine = slice(rank * heads, (rank + 1) * heads)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        rows = -(-config.vocab_size // (64 * tp)) * 64             # padded vocab / TP
        out = torch.zeros(rows, full.shape[1], dtype=full.dtype)
        part = full[rank * rows:(rank + 1) * rows]
        out[:part.shape[0]] = part
        return out
    if name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
        return full.view(config.num_attention_heads, -1, full.shape[1])[mine].reshape(-1, full.shape[1])
    if name.endswith("o_proj.weight"):
        return full.view(full.shape[0], config.num_attention_heads, -1)[:, mine].reshape(full.shape[0], -1)
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return full.chunk(tp, dim=0)[rank]
    if name.endswith("down_proj.weight"):
        return full.chunk(tp, dim=1)[rank]
    if name.endswith("experts.w13"):           # [E, gate I | up I, hidden]: each half split
        gate, up = full.chunk(2, dim=1)
        return torch.cat((gate.chunk(tp, dim=1)[rank], up.chunk(tp, dim=1)[rank]), dim=1)
    if name.endswith("experts.w2"):            # [E, hidden, I]
        return full.chunk(tp, dim=2)[rank]
    return full                                # the router and its correction bias replicated


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_hold_their_shards_of_the_tp1_weights(tp, preset):
    config = get_config(preset)
    full = DSAModel(config, dtype=torch.float32).init_weights(0)
    _, ranks = _tp_models(config, tp)
    expected_shapes = full.checkpoint_shapes()
    if preset == "tiny":
        assert expected_shapes == {name: tuple(p.shape) for name, p in full.state_dict().items()}
    sharded = set()
    for rank, model in enumerate(ranks):
        assert model.checkpoint_shapes() == expected_shapes
        assert model.num_local_heads == config.num_attention_heads // tp
        for name, param in model.state_dict().items():
            want = _expected_shard(name, full.state_dict()[name], config, rank, tp)
            assert torch.equal(param, want), name
            if param.shape != full.state_dict()[name].shape:
                sharded.add(name.split(".")[-2])
        assert model.model.embed_tokens.shard == model.lm_head.shard      # one vocab layout
    assert sharded == {"embed_tokens", "lm_head", "q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"} | ({"experts"} if config.is_moe else set())


def test_tp_size_must_divide_heads_and_ffn():
    with pytest.raises(ValueError, match=r"tensor parallel size 3 must divide ModelConfig.num_attention_heads \(4\)"):
        DSAModel(get_config("tiny"), tp_group=fake_groups(3)[0])
    with pytest.raises(ValueError, match=r"must divide ModelConfig.intermediate_size \(510\)"):
        DSAModel(get_config("tiny", intermediate_size=510), tp_group=fake_groups(4)[0])
    with pytest.raises(ValueError, match=r"must divide ModelConfig.moe_intermediate_size \(126\)"):
        DSAModel(get_config("tiny-moe", moe_intermediate_size=126), tp_group=fake_groups(4)[0])
    with pytest.raises(ValueError, match="differs from the TP group's device"):
        DSAModel(get_config("tiny"), device="meta", tp_group=fake_groups(2)[0])


# ---------------------------------------------------------------------------------------------
# forward


class _Request:
    """One request's memory for one model (every rank holds the same replicated caches)."""

    def __init__(self, model, length: int):
        self.model = model
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        slots = 64 * (2 + length // 64)
        self.pool = ReqToTokenPool(1, length, device=device)
        self.slots = RequestSlots(self.pool, PageAllocator(slots))
        self.kv = KVPool.for_model(model.config, slots, dtype=dtype, device=device)
        self.kv_mtp = KVPool.for_model(model.config, slots, mtp=True, dtype=dtype, device=device)
        self.row = self.slots.admit(length)

    @torch.no_grad()
    def run(self, ids: list[int], decode: list[int], chunk: int = 40) -> dict:
        """Prefill ``ids`` (chunks of ``chunk`` rows), then decode ``decode`` one token at a time and run
        the MTP layer over the prompt: hidden states, logits and the selected slots."""
        model, table = self.model, self.pool.req_to_token
        device = table.device
        ids = torch.tensor(ids, device=device)
        hidden = model.prefill(ids, table, self.row, self.kv, chunk_size=chunk)
        out = {"prefill": hidden, "logits": [model.logits(hidden)], "selected": []}
        for i, token in enumerate(decode):
            position = ids.numel() + i
            positions, loc, attn = build_extend_inputs(table, [self.row], [position], [1])
            attn.topk_slots = torch.empty(1, model.config.index_topk, dtype=torch.int32, device=device)
            step = model(torch.tensor([token], device=device), positions, loc, self.kv, attn)
            out["logits"].append(model.logits(step))
            out["selected"].append(attn.topk_slots.clone())
        mtp = model.prefill_mtp(torch.cat((ids[1:], ids[:1])), hidden, table, self.row, self.kv_mtp, chunk_size=chunk)
        out["mtp_logits"] = model.logits(mtp)
        return out


@pytest.mark.parametrize("tp,preset", [(2, "tiny"), (4, "tiny"), (2, "tiny-moe")])
def test_sharded_forward_matches_tp1(tp, preset):
    """Prefill (sparse rows: 90 > top-k 64), decode steps and the MTP layer at TP ``tp`` against TP 1:
    every rank computes the same bits; TP 1 within TOL; greedy tokens equal where the margin allows.
    tiny-moe: every expert (routed and shared) split by its intermediate features, the router
    replicated, one all-reduce per MoE layer."""
    config = get_config(preset)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, config.vocab_size, (90,), generator=generator).tolist()
    decode = torch.randint(0, config.vocab_size, (3,), generator=generator).tolist()
    length = len(ids) + len(decode)
    reference = _Request(DSAModel(config, dtype=torch.float32).init_weights(0), length).run(ids, decode)
    groups, ranks = _tp_models(config, tp)
    requests = {g.rank: _Request(m, length) for g, m in zip(groups, ranks)}
    outs = run_ranks(groups, lambda g: requests[g.rank].run(ids, decode))
    for out in outs[1:]:
        for key in ("prefill", "mtp_logits"):
            assert torch.equal(out[key], outs[0][key]), key
        assert all(torch.equal(a, b) for a, b in zip(out["logits"] + out["selected"],
                                                     outs[0]["logits"] + outs[0]["selected"]))
    got = outs[0]
    torch.testing.assert_close(got["prefill"], reference["prefill"], atol=TOL, rtol=TOL)
    for a, b in zip(got["logits"] + [got["mtp_logits"]], reference["logits"] + [reference["mtp_logits"]]):
        assert a.shape == b.shape == (a.shape[0], config.vocab_size)
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)
        top2 = b.topk(2, dim=-1).values
        decided = top2[:, 0] - top2[:, 1] > 2 * TOL
        assert decided.float().mean() > 0.9
        assert torch.equal(a.argmax(-1)[decided], b.argmax(-1)[decided])
    for a, b in zip(got["selected"], reference["selected"]):
        assert torch.equal(a.sort().values, b.sort().values)


# ---------------------------------------------------------------------------------------------
# loading


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_each_rank_loads_its_slices_of_one_checkpoint(tmp_path, monkeypatch, preset):
    config = get_config(preset)
    save_checkpoint(DSAModel(config, dtype=torch.float32).init_weights(3), tmp_path, max_shard_bytes=1 << 20)
    groups, expected = _tp_models(config, 2, seed=3)
    from dsaspec.models import loader

    whole_reads = []
    safe_open = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, name):
            whole_reads.append(name)
            return self.inner.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    for group, want in zip(groups, expected):
        model = DSAModel(config, dtype=torch.float32, tp_group=group).init_weights(9)
        load_weights(model, tmp_path)
        for name, param in model.state_dict().items():
            assert torch.equal(param, want.state_dict()[name]), name
        assert whole_reads and not set(whole_reads) & set(model.shards())
        assert not any(".experts." in name for name in whole_reads)           # experts: slices only
        whole_reads.clear()


def test_sharded_loading_names_the_unsharded_shape_and_saving_needs_tp1(tmp_path):
    config = get_config("tiny")
    save_checkpoint(DSAModel(config, dtype=torch.float32).init_weights(0), tmp_path)
    _, (model, _) = _tp_models(get_config("tiny", intermediate_size=256), 2)
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight has shape \(512, 256\), the model expects \(256, 256\)"):
        load_weights(model, tmp_path)
    with pytest.raises(ValueError, match="save_checkpoint writes a TP 1 model; this one is rank 0 of TP 2"):
        save_checkpoint(model, tmp_path / "again")


# ---------------------------------------------------------------------------------------------
# the Engine at TP 2

PROMPTS = [[7, 3, 900, 12, 5], list(range(100, 170))]          # 70 > top-k 64: sparse rows
MAX_NEW = [7, 6]


def watch_draft_paths(monkeypatch, groups) -> dict:
    """Per rank: the draft forwards of every LogitsProcessor by the path they took (``exchange``: no
    logits left the rank; ``gather``), and the transports of the all-reduces of symmetric buffers (the
    exchange's) over ``groups``. Installed before a worker is built: with CUDA graphs the Python runs
    at warm-up and capture, so what is counted is what the graphs hold (and the eager prefill's)."""
    seen = {g.rank: {"exchange": 0, "gather": 0, "verify_exchange": 0, "symmetric_all_reduce": []} for g in groups}
    forward = LogitsProcessor.forward
    target_tokens = LogitsProcessor.target_tokens

    def watched_target_tokens(self, hidden_states):
        seen[self.group.rank]["verify_exchange"] += self.uses_verify_argmax_exchange()
        return target_tokens(self, hidden_states)

    def watched_forward(self, hidden_states, sampling=None, **kwargs):
        out = forward(self, hidden_states, sampling, **kwargs)
        if sampling is not None:
            seen[self.group.rank]["gather" if out.next_token_logits is not None else "exchange"] += 1
        return out

    def watch(group):
        all_reduce = group.all_reduce

        def watched_all_reduce(tensor, out=None):
            if group.is_symmetric(tensor):
                seen[group.rank]["symmetric_all_reduce"].append(group.all_reduce_transport(tensor.numel() * 4))
            return all_reduce(tensor, out)

        monkeypatch.setattr(group, "all_reduce", watched_all_reduce)

    monkeypatch.setattr(LogitsProcessor, "forward", watched_forward)
    monkeypatch.setattr(LogitsProcessor, "target_tokens", watched_target_tokens)
    for group in groups:
        watch(group)
    return seen


def check_draft_paths(seen: dict, exchange: bool) -> None:
    """Every draft forward took the exchange (``exchange``) or the gather path, and each exchange
    (drafts, and the verify tokens' when that switch is on) all-reduced its symmetric buffer over
    symmetric memory."""
    path = "exchange" if exchange else "gather"
    assert seen[path] > 0 and seen["exchange"] + seen["gather"] == seen[path], seen
    assert seen["symmetric_all_reduce"] == [SYMM_MEM] * (seen["exchange"] + seen["verify_exchange"])


def _engine_run(model, spec=None, options=None):
    engine = Engine(model, context_len=96, max_batch=2, bucket_sizes=(1, 2), progress=False, speculative=spec,
                    options=options)
    results = engine.generate(PROMPTS, MAX_NEW)
    return {"tokens": [r.token_ids for r in results], "accept": engine.stats.accept_lens,
            "exchange": None if spec is None else engine.worker.processor.uses_draft_argmax_exchange(GREEDY_TOPK1)}


@pytest.fixture(scope="module")
def guessing_tp1():
    return predictable(DSAModel(get_config("tiny"), dtype=torch.float32).init_weights(1), 0.5)


def test_tp2_engine_speculative_equals_plain_and_tp1(guessing_tp1, monkeypatch):
    """Plain and speculative decoding at TP 2 (vocab-parallel head, draft tokens by the argmax
    exchange, then by the logits gather with draft_argmax_exchange off) commit the TP 1 plain tokens;
    the two settings accept identically."""
    groups, ranks = _tp_models(get_config("tiny"), 2, seed=1)
    ranks = [predictable(m, 0.5) for m in ranks]
    expected = _engine_run(guessing_tp1)["tokens"]
    plain = run_ranks(groups, lambda g: _engine_run(ranks[g.rank]))
    assert plain[0]["tokens"] == plain[1]["tokens"] == expected
    runs = {}
    for exchange in (True, False):
        options = RuntimeOptions(draft_argmax_exchange=exchange)
        with monkeypatch.context() as patch:
            seen = watch_draft_paths(patch, groups)
            runs[exchange] = run_ranks(groups, lambda g: _engine_run(ranks[g.rank], SpecConfig(num_steps=3),
                                                                     options))
        for rank, out in enumerate(runs[exchange]):
            assert out["tokens"] == expected
            assert out["exchange"] == exchange
            check_draft_paths(seen[rank], exchange=exchange)
    assert runs[True][0]["accept"] == runs[False][0]["accept"] == runs[True][1]["accept"]
    assert max(runs[True][0]["accept"]) > 1


# ---------------------------------------------------------------------------------------------
# command line


@pytest.mark.parametrize("argv", [["generate", "--tp", "2"], ["bench", "e2e", "--tp", "2"]])
def test_tp_needs_as_many_gpus(capsys, argv):
    from dsaspec.commands import cli

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two GPUs")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsaspec: error: --tp 2: TP 2 needs 2 GPUs (one process per GPU)")


def test_tp_under_torchrun_needs_a_matching_world(capsys, monkeypatch):
    from dsaspec.commands import cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["generate", "--no-progress"]) == 2
    assert "--tp 1 under torchrun with WORLD_SIZE=2" in capsys.readouterr().err


def test_tp_generate_relaunches_itself_under_torchrun(monkeypatch, tmp_path):
    """With the GPUs (faked), ``generate --tp 2`` checks its options, then runs itself as two
    torchrun processes with the same options, in the caller's directory, this checkout importable."""
    import subprocess

    from dsaspec.commands import cli
    from dsaspec.distributed import launch

    calls = []
    monkeypatch.setattr(launch, "visible_gpus", lambda: 2)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kwargs: calls.append((cmd, kwargs))
                        or subprocess.CompletedProcess(cmd, 3))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["generate", "--tp", "2", "--prompt-lens", "5,9", "--no-progress"]) == 3
    (cmd, kwargs), = calls
    assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "dsaspec"]
    assert cmd[7] == "generate" and cmd[cmd.index("--tp") + 1] == "2" and cmd[cmd.index("--prompt-lens") + 1] == "5,9"
    assert kwargs.get("cwd") is None and str(launch.REPO_ROOT) in kwargs["env"]["PYTHONPATH"]
    assert cli.main(["generate", "--tp", "2", "--speculative-num-steps", "2"]) == 2     # checked before launching
    assert len(calls) == 1


def test_rank_status_reaches_the_launcher_without_failing_torchrun(monkeypatch):
    """A rank that finishes with status 1 (a missed target) exits 0, so torchrun succeeds and
    prints no ChildFailedError; the launcher still returns 1. A failed torchrun passes through."""
    import subprocess

    from dsaspec.distributed import launch

    rank_exits = []

    def fake_torchrun(cmd, env, **_):
        monkeypatch.setenv(launch.STATUS_DIR_ENV, env[launch.STATUS_DIR_ENV])
        monkeypatch.setenv("WORLD_SIZE", "2")
        for rank, status in enumerate((0, 1)):
            monkeypatch.setenv("RANK", str(rank))
            rank_exits.append(launch.worker_exit_status(status))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_torchrun)
    assert launch.torchrun(["bench", "draft-step"], 2) == 1
    assert rank_exits == [0, 0]
    monkeypatch.setattr(subprocess, "run", lambda cmd, **_: subprocess.CompletedProcess(cmd, 7))
    assert launch.torchrun(["bench", "draft-step"], 2) == 7
    monkeypatch.delenv(launch.STATUS_DIR_ENV)
    assert launch.worker_exit_status(1) == 1  # not started by the launcher: unchanged


@pytest.mark.parametrize("module, argv", [
    ("dsaspec.commands.generate", ["--tp", "2", "--prompt-lens", "5,70", "--row-invariant", "--device", "cuda",
                                      "--speculative-algorithm", "nextn", "--eos-token-id", "3"]),
    ("dsaspec.bench.e2e", ["--tp", "2", "--presets", "bench", "--accept", "2.5,real", "--contexts", "4096",
                           "--num-steps", "4,5"]),
])
def test_relaunch_command_line_parses_back(module, argv):
    """What a command re-launches itself with under torchrun parses to the same options."""
    import importlib

    from dsaspec.cli_parsing import Parser
    from dsaspec.distributed.launch import command_line

    add_arguments = importlib.import_module(module).add_arguments
    parser = Parser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    assert vars(parser.parse_args(command_line(add_arguments, args))) == vars(args)


# ---------------------------------------------------------------------------------------------
# two GPUs, under torchrun (see the module docstring)


@pytest.fixture(scope="module")
def group():
    from dsaspec.distributed.tp_group import init_tp_group

    group = init_tp_group()
    assert group.size == 2 and group.transport == SYMM_MEM, "symmetric-memory all-reduce unavailable"
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    return group


def _same_on_ranks(group, tensor) -> bool:
    gathered = torch.empty(group.size, *tensor.shape, dtype=tensor.dtype, device=tensor.device)
    group.all_gather(tensor.contiguous(), gathered)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def _gpu_prompts(preset, count, seed=21):
    config = get_config(preset)
    k = config.index_topk
    lengths = [(k + 37, 9, 3 * k // 2, 64, 130)[i % 5] for i in range(count)]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _gpu_engine(model, spec=None, *, batch, max_new, prompts, context_len=1 << 20, options=None):
    slots = 64 * (2 + batch * -(-(max(map(len, prompts)) + max_new + 8) // 64))
    return Engine(model, speculative=spec, context_len=context_len, max_batch=batch, num_slots=slots, progress=False,
                  bucket_sizes=(1, 2, 4, 8, 16, 32), options=options)


def _gpu_model(preset, group, *, row_invariant, branch_scale=None, seed=0):
    model = DSAModel(get_config(preset), use_triton=True, row_invariant=row_invariant, tp_group=group)
    model.init_weights(seed)
    return model if branch_scale is None else predictable(model, branch_scale)


@pytest.mark.multigpu
@pytest.mark.parametrize("preset, batch, max_new", [("tiny", 16, 128), ("bench", 8, 64)])
def test_tp2_speculative_equals_plain_row_invariant(group, preset, batch, max_new):
    """bf16, CUDA graphs, 1M context configured, row-invariant GEMMs (a sum of two bf16 partials is
    correctly rounded whatever the transport, so TP 2 keeps row invariance): speculative = plain."""
    model = _gpu_model(preset, group, row_invariant=True, branch_scale={"tiny": 0.5, "bench": 0.2}[preset])
    prompts = _gpu_prompts(preset, batch)
    limits = [max_new - 3 * (i % 4) for i in range(batch)]
    plain = _gpu_engine(model, batch=batch, max_new=max_new, prompts=prompts)
    spec = _gpu_engine(model, SpecConfig(num_steps=3), batch=batch, max_new=max_new, prompts=prompts)
    assert spec.use_cuda_graph and spec.worker.processor.uses_draft_argmax_exchange(GREEDY_TOPK1)
    want = [r.token_ids for r in plain.generate(prompts, limits)]
    got = [r.token_ids for r in spec.generate(prompts, limits)]
    mismatched = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not mismatched, f"rank {group.rank}: requests {mismatched} differ"
    assert 1.2 < spec.stats.mean_accept_len < 4
    assert _same_on_ranks(group, torch.tensor(sum(got, []), device=group.device))


@pytest.mark.multigpu
def test_tp2_logits_close_to_tp1(group):
    """The bench preset (GLM-5 shapes, 2 layers) in bf16: TP 2 against TP 1 (the whole model on each
    rank's GPU), prefill and one decode step. Rounding is all that differs (TP 1 rounds a GEMM's
    whole K sum to bf16 once; TP 2 rounds each rank's partial, then the all-reduced sum), so on a
    dense prompt (300 < top-k: every row attends to every position) the logits (|logit| < 8, bf16
    ulp 1/32 there) agree within 0.125 (4 ulps; measured on CPU: 0.047) and greedy tokens agree
    wherever the TP 1 top-2 margin exceeds 0.25. On a sparse prompt (top-k + 37) a rounding
    difference can flip an indexer top-k boundary, which moves that row's logits further (a
    property of DSA, not of TP): only the mean difference is bounded; both prompts' flips are printed."""
    tol = 0.125
    tp1 = DSAModel(get_config("bench"), device=group.device, use_triton=True).init_weights(0)
    tp2 = _gpu_model("bench", group, row_invariant=False)
    k = get_config("bench").index_topk
    generator = torch.Generator().manual_seed(23)
    for name, length in (("dense", 300), ("sparse", k + 37)):
        ids = torch.randint(0, tp1.config.vocab_size, (length,), generator=generator).tolist()
        want, got = (_Request(model, length + 1).run(ids, [17], chunk=512) for model in (tp1, tp2))
        a, b = torch.cat(got["logits"]), torch.cat(want["logits"])
        assert _same_on_ranks(group, a)
        diff = (a - b).abs()
        top2 = b.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        flips = a.argmax(-1) != b.argmax(-1)
        print(f"rank {group.rank} {name} prompt ({length}): |TP2 - TP1| max {diff.max():.4f}, mean {diff.mean():.5f}; "
              f"{int(flips.sum())} of {flips.numel()} greedy tokens differ, at TP 1 margins "
              f"{[round(m, 4) for m in margin[flips].tolist()[:8]]}")
        assert diff.mean() < 0.02
        if name == "dense":
            assert diff.max() < tol
            assert not bool((flips & (margin > 2 * tol)).any())


@pytest.mark.multigpu
def test_tp2_exchange_option_paths_tokens_and_acceptance(group, monkeypatch):
    """Exchange on vs off at TP 2 (default numerics, graphs): identical tokens and accept lengths; the
    draft steps take the exchange (its all-reduce on symmetric memory) or the gather path."""
    model = _gpu_model("bench", group, row_invariant=False, branch_scale=0.2, seed=2)
    prompts = _gpu_prompts("bench", 6, seed=22)
    outputs = {}
    for exchange in (True, False):
        with monkeypatch.context() as patch:
            seen = watch_draft_paths(patch, [group])[group.rank]
            engine = _gpu_engine(model, SpecConfig(num_steps=3), batch=6, max_new=48, prompts=prompts,
                                 options=RuntimeOptions(draft_argmax_exchange=exchange))
            outputs[exchange] = ([r.token_ids for r in engine.generate(prompts, 48)], engine.stats.accept_lens)
        processor = engine.worker.processor
        assert processor.uses_draft_argmax_exchange(GREEDY_TOPK1) == exchange
        assert processor.lm_head is model.lm_head and processor.lm_head.num_shards == 2
        if exchange:
            assert group.all_reduce_transport(processor.exchange_nbytes) == SYMM_MEM
        else:
            assert processor.draft_argmax_exchange_declined(GREEDY_TOPK1) == \
                "draft_argmax_exchange=False (the processor's option)"
        check_draft_paths(seen, exchange=exchange)
        del engine, processor
    assert outputs[True] == outputs[False]
    assert sum(outputs[True][1]) / len(outputs[True][1]) > 1.2


@pytest.mark.multigpu
def test_tp2_loads_its_slices(group, tmp_path_factory):
    """Rank 0 writes a TP 1 checkpoint; every rank loads its slices of it: the same weights as the
    sharded init of the same seed."""
    import torch.distributed as dist

    path = [str(tmp_path_factory.mktemp("ckpt")) if group.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if group.rank == 0:
        save_checkpoint(DSAModel(get_config("tiny"), device=group.device).init_weights(4), path[0],
                        max_shard_bytes=1 << 20)
    group.barrier()
    loaded = load_weights(DSAModel(get_config("tiny"), tp_group=group), path[0])
    expected = DSAModel(get_config("tiny"), tp_group=group).init_weights(4)
    for name, param in loaded.state_dict().items():
        assert torch.equal(param, expected.state_dict()[name]), name
