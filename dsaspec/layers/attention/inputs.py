"""What the sparse attention of one step reads (:class:`AttentionInputs`), the Triton ops'
workspaces (:class:`AttentionWorkspace`) and the indexer scratch (:class:`AttentionScratch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionInputs:
    """What the sparse attention of one step reads (all layers share it).

    Attributes
    ----------
    page_table_1 : Tensor
        int32 ``[R, W]``: row ``r``'s logical position -> KV slot.
    seqlens : Tensor
        int32 ``[R]``: row ``r`` attends to positions ``[0, seqlens[r])`` (``seqlens_expanded``).
    schedule : Tensor or None
        int32 ``[indexer_programs(device) + 1, 2]`` indexer schedule of ``seqlens``; None: computed in the step
        (eager only).
    index_logits : Tensor or None
        fp32 ``[R, W_out]`` scratch for the indexer logits (``W_out >= max seqlens``); None:
        allocated ``[R, W]`` in the step.
    topk_slots : Tensor or None
        int32 ``[R, index_topk]``; after the step it holds the *last* layer's selected slots
        (-1 fills). None: allocated in the step.
    rows_per_group : int
        The indexer's row groups (the schedule's): N for grouped target-verify rows, else 1.
    workspace : AttentionWorkspace or None
        The Triton ops' workspaces for these rows (``DSAModel.attention_workspace``), or None:
        none (one top-k program and one sparse-MLA pass per row).
    """

    page_table_1: torch.Tensor
    seqlens: torch.Tensor
    schedule: torch.Tensor | None = None
    index_logits: torch.Tensor | None = None
    topk_slots: torch.Tensor | None = None
    rows_per_group: int = 1
    workspace: "AttentionWorkspace | None" = None

    @property
    def rows(self) -> int:
        return self.seqlens.shape[0]

    @classmethod
    def from_metadata(cls, metadata, schedule: torch.Tensor, index_topk: int,
                      logits_width: int | None = None, scratch: "AttentionScratch | None" = None, *,
                      rows_per_group: int = 1,
                      workspace: "AttentionWorkspace | None" = None) -> "AttentionInputs":
        """Inputs over a DSA backend's static buffers of one (batch, mode): ``metadata`` (a
        ``MetadataBuffers``: its ``page_table_1`` and ``seqlens_expanded``), its indexer
        ``schedule`` and that schedule's ``rows_per_group``. The scratch (``index_logits`` fp32
        ``[R, logits_width or W]``, ``topk_slots`` int32 ``[R, index_topk]``) is allocated here
        (call at capture), or taken as the leading rows of ``scratch``, which forwards that never
        run at the same time can share."""
        page_table = metadata.page_table_1
        rows, width = page_table.shape
        if scratch is None:
            scratch = AttentionScratch.allocate(rows, logits_width or width, index_topk, page_table.device)
        return cls(page_table_1=page_table, seqlens=metadata.seqlens_expanded, schedule=schedule,
                   rows_per_group=rows_per_group, workspace=workspace, **scratch.view(rows))


@dataclass(frozen=True)
class AttentionWorkspace:
    """Workspaces of the Triton DSA ops for forwards of one row count (allocate once, before graph
    capture; forwards that run one after another, every layer and phase, share them).

    Attributes
    ----------
    sparse_mla : Tensor or None
        ``sparse_mla_workspace``: split the selected slots of a row (None: one pass per row,
        row-invariant).
    topk : Tensor or None
        ``topk_workspace``: split each row's top-k over several programs (None: one per row). The
        selection is exact either way.
    topk_single_launch : None or False
        ``topk_slots``'s ``single_launch``: with ``topk``, None (one launch where it fits) or False
        (five launches), from ``RuntimeOptions.topk_single_launch`` when the workspace is made;
        None without it.
    topk_candidates : Tensor or None
        ``topk_candidates`` for ``topk``'s chunks (one program per row without it): long rows
        select from candidate lists bounded by a sample (None: the passes over the whole row).
        The selection is exact either way.
    """

    sparse_mla: torch.Tensor | None = None
    topk: torch.Tensor | None = None
    topk_single_launch: bool | None = None
    topk_candidates: torch.Tensor | None = None


NO_WORKSPACE = AttentionWorkspace()


@dataclass
class AttentionScratch:
    """Indexer scratch of up to ``rows`` query rows: logits fp32 ``[rows, width]`` and selected slots
    int32 ``[rows, index_topk]``."""

    index_logits: torch.Tensor
    topk_slots: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, width: int, index_topk: int, device) -> "AttentionScratch":
        return cls(torch.empty(rows, width, device=device),
                   torch.empty(rows, index_topk, dtype=torch.int32, device=device))

    def view(self, rows: int) -> dict:
        """The leading ``rows`` rows, as ``AttentionInputs`` keyword arguments."""
        if rows > self.topk_slots.shape[0]:
            raise ValueError(f"the attention scratch holds {self.topk_slots.shape[0]} rows, {rows} asked for")
        return dict(index_logits=self.index_logits[:rows], topk_slots=self.topk_slots[:rows])


def build_extend_inputs(req_to_token: torch.Tensor, rows, prefix_lens, extend_lens):
    """Eager inputs for extending requests by contiguous new tokens (prefill chunks): request
    ``b`` (table row ``rows[b]``) gets rows for positions ``prefix_lens[b] + [0, extend_lens[b])``,
    each attending causally to ``[0, position]``.

    Returns ``(positions int64 [R], out_cache_loc int64 [R], AttentionInputs)`` with
    ``R = sum(extend_lens)``, request-major; ``page_table_1`` holds each request's table row cut
    to the longest live length (one request: a view of its row repeated with stride 0, no ``[R,
    W]`` copy), and ``index_logits`` is allocated at that width.
    """
    device = req_to_token.device
    live_width = max(int(p) + int(e) for p, e in zip(prefix_lens, extend_lens))
    positions, table_rows = [], []
    for row, prefix, extend in zip(rows, prefix_lens, extend_lens):
        positions.append(torch.arange(prefix, prefix + extend, device=device))
        table_rows.append(torch.full((extend,), int(row), device=device, dtype=torch.long))
    positions = torch.cat(positions)
    table_rows = torch.cat(table_rows)
    out_cache_loc = req_to_token[table_rows, positions].long()
    if len(rows) == 1:
        page_table = req_to_token[int(rows[0]), :live_width].expand(positions.numel(), -1)
    else:
        page_table = req_to_token[table_rows, :live_width]
    inputs = AttentionInputs(page_table_1=page_table,
                             seqlens=(positions + 1).to(torch.int32),
                             index_logits=torch.empty(positions.numel(), live_width, device=device))
    return positions, out_cache_loc, inputs
