"""Routing replay for MoE policies (verl's R2 and R3), and how often the trained model routes as the rollout did.

An MoE policy's rollout engine and its Megatron model can send the same token to different experts: their kernels
round differently, and a top-k over near-equal scores flips. The gradient then belongs to a routing the sampler never
used. Replay removes that at the source: every Megatron pass of the actor takes each token's top-k experts from a
record instead of its own router, and recomputes the routing weights from the trained router's scores over those
experts, so the router still learns.
- R3: the record is the rollout engine's (`GenerationResult.routed_experts`), carried in `RolloutBatch.routed_experts`.
- R2: the record is the old-log-prob pass's own routing, which the update replays.

The record of a batch is [B, L, MoE layers, top-k] int16 over the batch's token columns, -1 where a token has none
(padding, a response's last token, which no engine feeds back, and tool answers): such a token routes freely.

Megatron-Core's top-k routing asks `router.router_replay` for each token's experts when one is set
(`moe_utils.topk_routing_with_score_function`, Megatron-Core 0.16 and 0.19); a `RouterTap` stands in that place, so one
place, the model family's own router, decides how a family routes (softmax or DeepSeek-V3's grouped, biased sigmoid).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Iterator, Literal, Optional

import torch

TapMode = Literal["free", "measure", "replay", "record"]


class RouterTap:
    """One MoE layer's router: routes freely ("free"), or compares its own top-k with a target and then keeps its own
    ("measure"), takes the target ("replay"), or keeps its own and records it ("record"). Where a target has experts
    for a token, the router counts whether its own top-k is the same set.

    A forward sets the target; activation recompute runs the router again during the backward, in the order the
    forwards ran (every schedule keeps that order per model chunk), so replayed targets also queue for it."""

    def __init__(self, moe_layer: int) -> None:
        self.moe_layer = moe_layer
        self.mode: TapMode = "free"
        self.target: Optional[torch.Tensor] = None
        self.recomputes: collections.deque[Optional[torch.Tensor]] = collections.deque()
        self.in_backward = False
        self.recorded: Optional[torch.Tensor] = None
        self.agreeing: Optional[torch.Tensor] = None  # [agreeing, compared] (token, layer) pairs, summed on device

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        """Megatron-Core's hook (RouterReplay's signature): the (scores, expert ids) of each token's top-k."""
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.in_backward:  # a recompute: the forward's choice again
            if self.mode != "replay":
                return own_scores, own
            target = self.recomputes.popleft()
            if target is None:
                return own_scores, own
            target = target.to(scores.device)
        else:
            if self.mode == "record":
                self.recorded = own.detach()
            if self.target is None:
                return own_scores, own
            target = self.target.to(scores.device)
            known = (target >= 0).all(dim=-1)
            same = (own.sort(dim=-1).values == target.long().sort(dim=-1).values).all(dim=-1) & known
            counts = torch.stack([same.sum(), known.sum()])
            self.agreeing = counts if self.agreeing is None else self.agreeing + counts
            if self.mode != "replay":
                return own_scores, own
        known = (target >= 0).all(dim=-1, keepdim=True)
        chosen = torch.where(known, target.long(), own)
        return scores.gather(1, chosen), chosen


def moe_layer_numbers(config) -> list[int]:
    """The 1-based numbers of the decoder layers whose MLP is routed, in order (the record's MoE-layer axis)."""
    frequency = config.moe_layer_freq
    pattern = frequency if isinstance(frequency, list) else [int(i % frequency == 0) for i in range(config.num_layers)]
    return [number for number, routed in enumerate(pattern, start=1) if routed]


class RoutingTaps:
    """The taps of a model's routers on this rank (its pipeline stage's MoE layers, in every virtual stage), and what a
    pass over a batch does with them: `passing(mode)` around the pass; a recording pass fills `recorded`."""

    def __init__(self, chunks: list) -> None:
        self.taps: list[tuple[object, RouterTap]] = []  # (chunk, tap), in layer order within each chunk
        config = _config(chunks[0])
        numbers = moe_layer_numbers(config)
        self.moe_layers, self.topk = len(numbers), config.moe_router_topk
        self.sequence_parallel = config.sequence_parallel
        for chunk in chunks:
            model = chunk.module if hasattr(chunk, "module") else chunk
            for layer in model.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    tap = RouterTap(numbers.index(layer.layer_number))
                    router.router_replay = tap  # where Megatron-Core's own RouterReplay would sit
                    self.taps.append((chunk, tap))
        self._grid: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def passing(self, mode: TapMode, batch=None) -> Iterator[None]:
        """Every router in `mode` for the duration of a pass (over `batch` when recording); free routing after."""
        for _, tap in self.taps:
            tap.mode, tap.target, tap.recorded, tap.agreeing, tap.in_backward = mode, None, None, None, False
            tap.recomputes.clear()
        if mode == "record":
            rows, columns = batch.input_ids.shape
            self._grid = torch.full((rows * columns, self.moe_layers, self.topk), -1, dtype=torch.int32,
                                    device="cuda" if torch.cuda.is_available() else "cpu")
        try:
            yield
        finally:
            for _, tap in self.taps:
                tap.mode, tap.target = "free", None
                tap.recomputes.clear()

    @contextlib.contextmanager
    def forward(self, chunk, micro_batch) -> Iterator[None]:
        """One micro-batch's forward through `chunk`: its taps take their targets from the micro-batch's record
        (`routed_experts`; none: a filler, or no record, and they route freely), then wait for a recompute in the
        backward; a recording pass keeps what they chose."""
        taps = [tap for owner, tap in self.taps if owner is chunk and tap.mode != "free"]
        record = micro_batch.routed_experts
        for tap in taps:
            tap.in_backward = False
            tap.target = None if record is None else self.router_order(record[:, :, tap.moe_layer])
            if tap.mode == "replay":
                tap.recomputes.append(tap.target)
        yield
        for tap in taps:
            tap.in_backward = True
        if self._grid is not None:
            cells = self.router_order(micro_batch.token_cells)
            real = cells >= 0
            for tap in taps:
                if tap.recorded is not None:
                    self._grid[cells[real], tap.moe_layer] = tap.recorded[real].to(self._grid.dtype)
                    tap.recorded = None

    def router_order(self, per_position: torch.Tensor) -> torch.Tensor:
        """[n, T, ...] over a micro-batch's input positions -> [tokens, ...] in the order this rank's routers see them:
        the model runs [T, n], and sequence parallelism gives each tensor-parallel rank one contiguous part of T."""
        by_position = per_position.transpose(0, 1)
        if self.sequence_parallel:
            from megatron.core import parallel_state as ps

            tp = ps.get_tensor_model_parallel_world_size()
            by_position = by_position.chunk(tp, dim=0)[ps.get_tensor_model_parallel_rank()]
        return by_position.reshape(-1, *by_position.shape[2:])

    def recorded(self, batch) -> torch.Tensor:
        """The recording pass's routing of `batch` as every rank recorded it: [B, L, MoE layers, k] int16, -1 where
        no rank routed a token. Collective (all ranks): each rank holds its rows, sequence chunk and layers."""
        grid, self._grid = self._grid, None
        torch.distributed.all_reduce(grid, op=torch.distributed.ReduceOp.MAX)
        return grid.view(*batch.input_ids.shape, self.moe_layers, self.topk).to(torch.int16).cpu()

    def agreement(self) -> tuple[int, int]:
        """(agreeing, compared) (token, MoE layer) pairs over every rank since the last call, then reset: a pair
        agrees when the router's own top-k is the record's set. Collective (all ranks)."""
        counts = torch.zeros(2, dtype=torch.long, device="cuda" if torch.cuda.is_available() else "cpu")
        for _, tap in self.taps:
            if tap.agreeing is not None:
                counts += tap.agreeing.to(counts.device)
                tap.agreeing = None
        # Without sequence parallelism the TP ranks count the same tokens alike: the ratio is unchanged.
        torch.distributed.all_reduce(counts)
        agreeing, compared = counts.tolist()
        return agreeing, compared


def _config(chunk):
    return (chunk.module if hasattr(chunk, "module") else chunk).config
