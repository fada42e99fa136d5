"""Latent transition model: scheduling actions applied in latent space (TransH).

The initial program is encoded once to a latent ``z0`` (size ``d``); each scheduling action
``a_t`` then moves the state by a learned TransH step

    w(a) = normalize(W_w a),  d(a) = W_d a,  z' = z - (w . z) w + d(a)

(optionally plus a small residual MLP of ``(z, a)``), where ``a`` is the action vector of
:class:`ActionEmbedding` over :func:`cwm.features.action_features.encode_actions` features. The
predicted terminal state ``z_T`` is what the downstream ranker sees.

Training (:class:`Transition`) supervises the rollout with the encoded true intermediate
states (usually after IR-changing actions, always the terminal one): an L2 state-matching term
plus a margin ranking term against the true states of the other trajectories of the batch.

With ``perf_weight > 0`` the latent is also made performance-aware: a small score head over
``(z_T, z_T - z0)`` is trained with a within-task pairwise loss on measured latencies, so that
trajectories of one task that differ in speed end in latents that differ along the head's
direction. State matching alone cannot do that: E's targets erase within-task differences.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..errors import CwmError
from ..features.action_features import (
    ARG_NAMES,
    KNOWN_KINDS,
    MAX_TILE_FACTORS,
    NUM_ARGS,
    encode_actions,
    encode_actions_batch,
)
from ..io import read_config, write_config
from ..model import distributed

log = logging.getLogger(__name__)

CONFIG_FILE = "transition_config.json"
WEIGHTS_FILE = "transition.safetensors"
FORMAT = "cwm.transition"


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass
class TransitionConfig:
    state_dim: int = 64
    action_dim: int = 64
    hidden: int = 128
    residual_mlp: bool = False
    margin: float = 0.5
    match_weight: float = 1.0
    rank_weight: float = 0.5
    lr: float = 2e-3
    epochs: int = 20
    batch_size: int = 64
    seed: int = 0
    num_kinds: int = len(KNOWN_KINDS)
    num_args: int = NUM_ARGS
    # also feed each tile factor relative to the loop it splits, and the innermost factor against
    # the SIMD widths (relative_tile_inputs); derived from the raw columns inside the model
    relative_tiles: bool = False
    # within-task ranking loss on a score head over z_T (0: state matching only, the paper's F)
    perf_weight: float = 0.0
    perf_hidden: int = 64
    # latency pairs closer than this relative gap are label noise, not an order to learn
    perf_min_gap: float = 0.03
    # trajectories of one ranking group per chunk of a batch (pairs form within a chunk)
    perf_group_size: int = 16

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TransitionConfig":
        if not isinstance(d, dict):
            raise CwmError(f"transition config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CwmError(f"unknown transition config keys: {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:  # pragma: no cover - defensive
            raise CwmError(f"bad transition config: {e}") from e


# --------------------------------------------------------------------------------------------
# Relative tile inputs
# --------------------------------------------------------------------------------------------

# Raw tile columns hold log2(1 + f_i) per factor and log2(1 + n): a factor means nothing without the
# extent it splits, and whether the innermost factor fills whole vectors is not a smooth function of it.
_TILE0 = ARG_NAMES.index("tile_0")
_TILE_COUNT = ARG_NAMES.index("tile_count")
RELATIVE_TILE_NAMES = tuple(
    [f"tile_{i}_log_share" for i in range(MAX_TILE_FACTORS)]  # log2(f_i) / log2(extent)
    + ["inner_div4", "inner_div8", "inner_div16",  # innermost factor a multiple of SSE / AVX2 / AVX-512 fp32 lanes
       "inner_below8", "inner_below16",  # innermost factor shorter than one AVX2 / AVX-512 vector
       "spatial_tile"]  # 4 or more levels: a spatial loop of multi-level tiling (reduction loops get 2 or 3)
)


def relative_tile_inputs(args: torch.Tensor) -> torch.Tensor:
    """``[n, len(RELATIVE_TILE_NAMES)]`` from raw action arguments ``[n, NUM_ARGS]``; zeros for actions
    that are not tiles and for tiles with an unresolved factor."""
    f = torch.round(torch.exp2(args[:, _TILE0:_TILE0 + MAX_TILE_FACTORS]) - 1).clamp(min=0)
    n = torch.round(torch.exp2(args[:, _TILE_COUNT]) - 1).clamp(0, MAX_TILE_FACTORS).long()
    used = torch.arange(MAX_TILE_FACTORS, device=args.device)[None, :] < n[:, None]
    known = used & (f > 0)
    complete = (n > 0) & (known.sum(1) == n)
    logf = torch.where(known, torch.log2(f.clamp(min=1)), torch.zeros_like(f))
    log_extent = logf.sum(1, keepdim=True)
    share = torch.where(complete[:, None] & (log_extent > 0), logf / log_extent.clamp(min=1e-6), torch.zeros_like(f))
    inner = f.gather(1, (n - 1).clamp(min=0)[:, None]).squeeze(1)
    inner = torch.where(complete, inner, torch.zeros_like(inner))
    has = inner > 0
    flags = torch.stack([has & (torch.remainder(inner, 4) == 0), has & (torch.remainder(inner, 8) == 0),
                         has & (torch.remainder(inner, 16) == 0), has & (inner < 8), has & (inner < 16),
                         complete & (n >= 4)], dim=1)
    return torch.cat([share, flags.to(args.dtype)], dim=1)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class ActionEmbedding(nn.Module):
    """Action vector of size ``action_dim`` from the kind id and the numeric arguments.

    ``a = E[kind] + W2 gelu(W1 args + H[kind])``: a kind embedding summed with an MLP over
    the arguments whose hidden layer also sees the kind (``H[kind]`` is the first layer's
    contribution of a one-hot kind, a lookup), so argument effects can depend on the kind.
    Both tables use padding index 0.
    """

    def __init__(self, config: TransitionConfig):
        super().__init__()
        self.kind_emb = nn.Embedding(config.num_kinds, config.action_dim, padding_idx=0)
        self.kind_hidden = nn.Embedding(config.num_kinds, config.hidden, padding_idx=0)
        extra = len(RELATIVE_TILE_NAMES) if config.relative_tiles else 0
        self.arg_in = nn.Linear(config.num_args + extra, config.hidden)
        self.arg_out = nn.Linear(config.hidden, config.action_dim)
        nn.init.normal_(self.kind_hidden.weight, std=0.1)
        with torch.no_grad():
            self.kind_hidden.weight[0].zero_()

    def forward(self, kind: torch.Tensor, args: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.arg_in(args) + self.kind_hidden(kind))
        return self.kind_emb(kind) + self.arg_out(h)


class TransH(nn.Module):
    """TransH step ``z' = z - (w.z) w + d`` with action-dependent unit normal ``w``."""

    def __init__(self, config: TransitionConfig):
        super().__init__()
        self.normal = nn.Linear(config.action_dim, config.state_dim)
        self.translation = nn.Linear(config.action_dim, config.state_dim)
        self.residual: nn.Module | None = None
        if config.residual_mlp:
            self.residual = nn.Sequential(
                nn.Linear(config.state_dim + config.action_dim, config.hidden),
                nn.GELU(),
                nn.Linear(config.hidden, config.state_dim),
            )
            last = self.residual[-1]
            nn.init.normal_(last.weight, std=1e-3)
            nn.init.zeros_(last.bias)

    def params(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit normal ``w(a)`` and translation ``d(a)`` (any leading shape)."""
        weight = torch.cat([self.normal.weight, self.translation.weight], dim=0)
        bias = torch.cat([self.normal.bias, self.translation.bias], dim=0)
        wd = F.linear(a, weight, bias)
        n = self.normal.out_features
        return F.normalize(wd[..., :n], dim=-1, eps=1e-12), wd[..., n:]

    @staticmethod
    def project_translate(z: torch.Tensor, w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return z - (z * w).sum(-1, keepdim=True) * w + d

    def forward(self, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        w, d = self.params(a)
        out = self.project_translate(z, w, d)
        if self.residual is not None:
            out = out + self.residual(torch.cat([z, a], dim=-1))
        return out


class TransitionModel(nn.Module):
    """Action embedding + TransH; :meth:`rollout` runs padded batches of trajectories."""

    def __init__(self, config: TransitionConfig):
        super().__init__()
        self.config = config
        self.embed = ActionEmbedding(config)
        self.step = TransH(config)
        self.score_head: nn.Module | None = None
        if config.perf_weight > 0:
            d = config.state_dim
            self.score_head = nn.Sequential(nn.Linear(2 * d, config.perf_hidden), nn.GELU(),
                                            nn.Linear(config.perf_hidden, 1))

    def score(self, z0: torch.Tensor, z_T: torch.Tensor) -> torch.Tensor:
        """The score head's output ``[B]`` (higher = predicted faster) for terminal latents ``z_T``
        rolled out from ``z0``."""
        if self.score_head is None:
            raise CwmError("this transition model has no score head (trained with perf_weight 0)")
        return self.score_head(torch.cat([z_T, z_T - z0], dim=-1)).squeeze(-1)

    def action_inputs(self, args: torch.Tensor) -> torch.Tensor:
        """What the action embedding reads from flat raw arguments ``[n, NUM_ARGS]``."""
        if not self.config.relative_tiles:
            return args
        return torch.cat([args, relative_tile_inputs(args)], dim=-1)

    def action_params(
        self, kind: torch.Tensor, args: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """TransH unit normal ``w``, translation ``d`` and, with the residual MLP, the action
        vector (else None) for flat ``kind [n]``, ``args [n, A]`` (``action_inputs`` of the raw ones)."""
        if self.step.residual is not None:
            a = self.embed(kind, args)
            w, d = self.step.params(a)
            return w, d, a
        kind_sorted, order = torch.sort(kind, stable=True)
        raw = self._folded_params(_segments(kind_sorted), args.index_select(0, order))
        raw = torch.empty_like(raw).index_copy_(0, order, raw)
        D = self.step.normal.out_features
        return F.normalize(raw[:, :D], dim=-1, eps=1e-12), raw[:, D:], None

    def _folded_params(
        self, segments: list[tuple[int, int, int]], args: torch.Tensor
    ) -> torch.Tensor:
        """Unnormalized normal and translation ``[n, 2d]`` for rows grouped by kind.

        The action vector is never materialized: its last linear layer and the two TransH
        maps fold into one ``[2d, hidden]`` matrix, and the per-kind terms (kind embedding,
        the kind's share of the hidden layer, biases) become per-kind rows added to each
        kind's contiguous block of rows. Same function as ``TransH.params(ActionEmbedding)``
        up to rounding, with fewer kernels and passes over memory.
        """
        emb, step = self.embed, self.step
        h = args @ emb.arg_in.weight.t()
        _add_rows(h, emb.kind_hidden.weight + emb.arg_in.bias, segments)
        h = F.gelu(h)
        wc = torch.cat([step.normal.weight, step.translation.weight], dim=0)  # [2D, A]
        bc = torch.cat([step.normal.bias, step.translation.bias], dim=0)  # [2D]
        out = h @ (wc @ emb.arg_out.weight).t()
        _add_rows(out, (emb.kind_emb.weight + emb.arg_out.bias) @ wc.t() + bc, segments)
        return out

    def rollout(
        self,
        z0: torch.Tensor,
        kind: torch.Tensor,
        args: torch.Tensor,
        mask: torch.Tensor,
        return_all: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Roll ``z0 [B,d]`` through actions ``kind [B,T]``, ``args [B,T,A]``, ``mask [B,T]``.

        Returns ``(z_all [B,T+1,d], z_T [B,d])``: ``z_all[:, t]`` is the state after ``t``
        actions; steps where ``mask`` is 0 leave the state exactly unchanged, so ``z_T`` is
        the state after the last real action of each row. ``return_all=False`` skips
        collecting ``z_all`` (returned as None).
        """
        B, T = kind.shape
        if T == 0:
            return (z0.unsqueeze(1) if return_all else None), z0
        D = z0.shape[-1]
        keep = mask.to(torch.bool)
        # Action parameters only for the real steps; row t*B + b of a time-major buffer.
        tb = keep.t().nonzero()  # [n, 2] (t, b)
        t_idx, b_idx = tb[:, 0], tb[:, 1]
        src = b_idx * T + t_idx
        dst = t_idx * B + b_idx
        kind_real = kind.reshape(-1).index_select(0, src)
        flat_args = self.action_inputs(args.reshape(B * T, -1))
        residual = self.step.residual
        if residual is None:
            kind_sorted, order = torch.sort(kind_real, stable=True)
            raw = self._folded_params(
                _segments(kind_sorted), flat_args.index_select(0, src.index_select(0, order))
            )
            dst = dst.index_select(0, order)
            buf = raw.new_empty(T * B, 2 * D)
            # padded steps: u = 0, d = 0, so z - (u.z) u / |u|^2 + d is exactly z
            pad_rows = (~keep.t()).reshape(-1).nonzero().squeeze(1)
            if pad_rows.numel():
                buf.index_fill_(0, pad_rows, 0.0)
            buf = buf.index_copy_(0, dst, raw).view(T, B, 2 * D)
            u, d = buf[..., :D], buf[..., D:]
            # w = u / |u| (F.normalize semantics); padded rows: 0 * 1e24 = 0
            inv = 1.0 / (u * u).sum(-1, keepdim=True).clamp(min=1e-24)  # [T,B,1]
            z = z0
            states = [z0] if return_all else None
            for t in range(T):
                ut = u[t]
                z = torch.addcmul(z + d[t], (z * ut).sum(-1, keepdim=True) * inv[t], ut, value=-1.0)
                if states is not None:
                    states.append(z)
            return (torch.stack(states, dim=1) if states is not None else None), z

        w_real, d_real, a_real = self.action_params(kind_real, flat_args.index_select(0, src))
        w = w_real.new_zeros(T * B, D).index_copy_(0, dst, w_real).view(T, B, D)
        d = d_real.new_zeros(T * B, D).index_copy_(0, dst, d_real).view(T, B, D)
        a = a_real.new_zeros(T * B, a_real.shape[-1]).index_copy_(0, dst, a_real).view(T, B, -1)
        keep_tm = keep.t().unsqueeze(-1)
        z = z0
        states = [z0] if return_all else None
        for t in range(T):
            wt = w[t]
            nz = torch.addcmul(z + d[t], (z * wt).sum(-1, keepdim=True), wt, value=-1.0)
            nz = nz + residual(torch.cat([z, a[t]], dim=-1))
            z = torch.where(keep_tm[t], nz, z)
            if states is not None:
                states.append(z)
        return (torch.stack(states, dim=1) if states is not None else None), z


def _segments(kind_sorted: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(kind, start, end)`` of each run of equal ids in a sorted 1-D tensor."""
    if kind_sorted.numel() == 0:
        return []
    ids, counts = torch.unique_consecutive(kind_sorted, return_counts=True)
    out, start = [], 0
    for k, c in zip(ids.tolist(), counts.tolist()):
        out.append((k, start, start + c))
        start += c
    return out


def _add_rows(x: torch.Tensor, table: torch.Tensor, segments: list[tuple[int, int, int]]) -> None:
    """In place: ``x[s:e] += table[k]`` for each segment (autograd-safe)."""
    for k, s, e in segments:
        x[s:e] += table[k]


def rollout(
    model: TransitionModel,
    z0: torch.Tensor,
    kind: torch.Tensor,
    args: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional form of :meth:`TransitionModel.rollout`."""
    return model.rollout(z0, kind, args, mask)


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


def pad_batch(
    encoded: Sequence[dict[str, np.ndarray]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad ``encode_actions`` outputs to ``(kind, args, mask)``.

    ``kind [B,T]`` int64 (0 = padding), ``args [B,T,NUM_ARGS]`` float32 (zeros at padding),
    ``mask [B,T]`` bool, with ``T`` the longest trajectory.
    """
    B = len(encoded)
    kinds = [e["kind"] for e in encoded]
    argss = [e["args"] for e in encoded]
    lengths = [int(len(k)) for k in kinds]
    T = max(lengths, default=0)
    kind = np.zeros((B, T), dtype=np.int64)
    args = np.zeros((B, T, NUM_ARGS), dtype=np.float32)
    mask = np.arange(T) < np.array(lengths, dtype=np.int64).reshape(B, 1)
    if T and all(
        type(k) is np.ndarray and k.dtype == np.int64 and k.shape == (n,)
        and type(a) is np.ndarray and a.dtype == np.float32 and a.shape == (n, NUM_ARGS)
        for k, a, n in zip(kinds, argss, lengths)
    ):  # encode_actions outputs: two copies in all
        kind[mask] = np.concatenate(kinds)
        args[mask] = np.concatenate(argss)
    else:
        for i, (k, a, n) in enumerate(zip(kinds, argss, lengths)):
            if n:
                kind[i, :n] = k
                args[i, :n] = a
    return torch.from_numpy(kind), torch.from_numpy(args), torch.from_numpy(mask)


def encode_batch(
    actions_list: Sequence[Sequence[dict]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pad_batch([encode_actions(a) for a in actions_list])``: featurize once, predict often.

    Uses :func:`cwm.features.action_features.encode_actions_batch` (cached, padded in one go)."""
    b = encode_actions_batch(actions_list)
    return torch.from_numpy(b["kind"]), torch.from_numpy(b["args"]), torch.from_numpy(b["mask"])


# --------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------


def _fill_states(
    targets: torch.Tensor, target_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the latest known true state at or before each step (earlier steps take the
    first known one). Steps beyond a row's length therefore get its terminal state.
    Returns (states [B,S,d], valid [B] rows that have any known state)."""
    B, S, _ = targets.shape
    m = target_mask.to(torch.bool)
    idx = torch.arange(S, device=targets.device).expand(B, S)
    last = torch.where(m, idx, torch.full_like(idx, -1)).cummax(dim=1).values  # [B,S]
    first = torch.where(m, idx, torch.full_like(idx, S)).min(dim=1).values  # [B]
    src = torch.where(last >= 0, last, first.unsqueeze(1).clamp(max=S - 1))
    states = targets.gather(1, src.unsqueeze(-1).expand_as(targets))
    return states, m.any(dim=1)


def rollout_loss(
    z_all: torch.Tensor,
    targets: torch.Tensor,
    target_mask: torch.Tensor,
    negatives: torch.Tensor | None = None,
    margin: float = 0.5,
    *,
    negative_mask: torch.Tensor | None = None,
    match_weight: float = 1.0,
    rank_weight: float = 0.5,
    eps: float = 1e-9,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Multi-step rollout loss.

    * ``match``: mean over supervised ``(b, t)`` (``target_mask``) of
      ``||z_all[b,t] - targets[b,t]||_2``.
    * ``rank``: mean over supervised ``(b, t)`` and negatives ``b' != b`` of
      ``max(0, margin + ||z_all[b,t] - targets[b,t]|| - ||z_all[b,t] - neg[b',t]||)``.
      ``neg[b', t]`` defaults to the true state of row ``b'`` at step ``t``: its latest known
      state at or before ``t`` (its terminal state where ``t`` is past its end). Pass
      ``negatives [B,T+1,d]`` (and optionally ``negative_mask [B,T+1]``) to override.
      Negatives that equal the positive (identical trajectory prefixes) are skipped.

    Returns ``(match_weight * match + rank_weight * rank, {"match": ..., "rank": ...})``.
    """
    m = target_mask.to(torch.bool)
    zero = z_all.sum() * 0.0
    if not bool(m.any()):
        return zero, {"match": zero.detach(), "rank": zero.detach()}

    diff = z_all - targets
    pos_dist = torch.sqrt((diff * diff).sum(-1) + eps)  # [B,S]
    mf = m.to(z_all.dtype)
    n_sup = mf.sum()
    match = (pos_dist * mf).sum() / n_sup

    if negatives is None:
        neg_states, row_ok = _fill_states(targets, m)
        neg_valid = row_ok.unsqueeze(1).expand_as(m)
    else:
        neg_states = negatives
        neg_valid = (
            torch.ones_like(m) if negative_mask is None else negative_mask.to(torch.bool)
        )
    neg_states = neg_states.detach()

    B = z_all.shape[0]
    rank = zero
    if B > 1 and rank_weight != 0.0:
        # per step t: distances between prediction of row b and negative of row b'  [S,B,B]
        zt = z_all.transpose(0, 1)
        nt = neg_states.transpose(0, 1)
        pt = targets.detach().transpose(0, 1)
        d_neg = torch.sqrt(_pairwise_sq(zt, nt) + eps)
        # skip negatives equal to the positive (true state of b vs negative of b')
        scale = (pt * pt).sum(-1).unsqueeze(-1) + (nt * nt).sum(-1).unsqueeze(-2)
        distinct = _pairwise_sq(pt, nt) > 1e-6 * scale + 1e-10
        pos = pos_dist.transpose(0, 1).unsqueeze(-1)  # [S,B,1]
        eye = torch.eye(B, dtype=torch.bool, device=z_all.device)
        pair = (
            m.transpose(0, 1).unsqueeze(-1)
            & neg_valid.transpose(0, 1).unsqueeze(1)
            & ~eye
            & distinct
        )
        hinge = torch.clamp(margin + pos - d_neg, min=0.0)
        pf = pair.to(z_all.dtype)
        n_pair = pf.sum()
        if n_pair > 0:
            rank = (hinge * pf).sum() / n_pair
    total = match_weight * match + rank_weight * rank
    return total, {"match": match.detach(), "rank": rank.detach()}


def within_task_rank_loss(
    scores: torch.Tensor, log_latency: torch.Tensor, group: torch.Tensor, min_gap: float = 0.03
) -> torch.Tensor:
    """Pairwise logistic (RankNet) loss over the pairs of one group whose latencies differ by more
    than ``min_gap`` (relative): ``mean softplus(s_slow - s_fast)``. ``scores``, ``log_latency``
    and ``group`` are ``[B]``; non-finite latencies take part in no pair. 0 when no pair exists."""
    ok = torch.isfinite(log_latency)
    lat = torch.where(ok, log_latency, torch.zeros_like(log_latency))
    faster = (lat.unsqueeze(1) + float(np.log1p(min_gap))) < lat.unsqueeze(0)  # [i, j]: i faster than j
    pair = faster & (group.unsqueeze(1) == group.unsqueeze(0)) & ok.unsqueeze(1) & ok.unsqueeze(0)
    if not bool(pair.any()):
        return scores.sum() * 0.0
    margin = scores.unsqueeze(0) - scores.unsqueeze(1)  # [i, j] = s_j - s_i
    return F.softplus(margin[pair]).mean()


def _pairwise_sq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``||a[s,i] - b[s,j]||^2`` for ``a, b [S,B,d]`` -> ``[S,B,B]``."""
    sq = (a * a).sum(-1).unsqueeze(-1) + (b * b).sum(-1).unsqueeze(-2) - 2.0 * a @ b.transpose(1, 2)
    return sq.clamp(min=0.0)


def _group_batches(group_ids: np.ndarray, chunk: int, batch_size: int, rng) -> list[np.ndarray]:
    """One epoch's batches for the within-task loss: each group's rows shuffled and cut into chunks
    of at most ``chunk``, the chunks shuffled and packed into batches of about ``batch_size`` rows."""
    chunks = []
    for g in np.unique(group_ids):
        rows = rng.permutation(np.flatnonzero(group_ids == g))
        chunks.extend(rows[c : c + chunk] for c in range(0, len(rows), max(1, chunk)))
    per_batch = max(1, batch_size // max(1, chunk))
    order = rng.permutation(len(chunks))
    return [np.concatenate([chunks[i] for i in order[b : b + per_batch]])
            for b in range(0, len(order), per_batch)]


# --------------------------------------------------------------------------------------------
# Estimator
# --------------------------------------------------------------------------------------------


def _as_z(z0: Any, d: int, what: str = "z0") -> np.ndarray:
    z = np.asarray(z0, dtype=np.float32)
    if z.ndim != 2 or z.shape[1] != d:
        raise CwmError(f"{what} must have shape [N, {d}], got {list(z.shape)}")
    return z


class Transition:
    """Scikit-learn style estimator around :class:`TransitionModel`.

    ``fit`` learns from initial latents, action trajectories and encoded true states;
    ``predict`` returns predicted terminal latents. Learned state: ``model_``, ``history_``.
    """

    def __init__(self, config: TransitionConfig | None = None):
        self.config = config if config is not None else TransitionConfig()
        self.model_: TransitionModel | None = None
        self.history_: list[dict] = []

    # -- construction ------------------------------------------------------------------------

    def _new_model(self) -> TransitionModel:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(self.config.seed))
            return TransitionModel(self.config)

    def _check_fitted(self) -> TransitionModel:
        if self.model_ is None:
            raise CwmError("the transition model is not fitted; call fit() or load() first")
        return self.model_

    # -- training ----------------------------------------------------------------------------

    def fit(
        self,
        z0: np.ndarray,
        actions_list: Sequence[Sequence[dict]],
        targets: Sequence[dict[int, np.ndarray]],
        *,
        progress: bool = True,
        max_seconds: float | None = None,
        warm_start: bool = False,
        epochs: int | None = None,
        latencies: Sequence[float] | None = None,
        groups: Sequence[str] | None = None,
    ) -> "Transition":
        """Train on ``N`` trajectories.

        ``latencies`` and ``groups`` (one per trajectory; the ranking group is usually the task)
        train the score head when ``config.perf_weight > 0``: batches are then made of chunks of
        ``perf_group_size`` trajectories of one group, and the within-task pairwise loss
        (:func:`within_task_rank_loss`) on ``(z_T, z_T - z0)`` joins the rollout loss. A
        trajectory's targets may be empty: it then trains the score head only.

        ``targets[i]`` maps a step ``t`` (number of actions applied, ``1..T_i``) to the encoded
        true state after ``t`` actions; other steps are ignored. Training stops early after
        ``max_seconds`` (checked between mini-batches). With ``warm_start`` a fitted model
        continues from its weights (fine-tuning) instead of a fresh initialization; ``epochs``
        overrides the configured number.

        Inside a torch.distributed process group (see :mod:`cwm.model.distributed`) the model trains
        as a DistributedDataParallel module, each rank on its share of every epoch's batches
        (batches without targets are left out first); ``history_`` averages over all ranks.
        """
        cfg = self.config
        d = int(cfg.state_dim)
        z0 = _as_z(z0, d)
        N = z0.shape[0]
        if len(actions_list) != N or len(targets) != N:
            raise CwmError(
                f"fit needs as many trajectories and target dicts as z0 rows: "
                f"{N} z0, {len(actions_list)} trajectories, {len(targets)} targets"
            )
        if N == 0:
            raise CwmError("fit needs at least one trajectory")
        start = time.monotonic()
        encoded = [encode_actions(a) for a in actions_list]
        tgt_steps: list[np.ndarray] = []
        tgt_vals: list[np.ndarray] = []
        for i, (e, tg) in enumerate(zip(encoded, targets)):
            T = len(e["kind"])
            steps, vals = [], []
            for t, v in sorted((tg or {}).items(), key=lambda kv: int(kv[0])):
                t = int(t)
                if 1 <= t <= T:
                    v = np.asarray(v, dtype=np.float32).reshape(-1)
                    if v.shape[0] != d:
                        raise CwmError(
                            f"target state for trajectory {i} step {t} has size {v.shape[0]}, "
                            f"expected {d}"
                        )
                    steps.append(t)
                    vals.append(v)
            tgt_steps.append(np.asarray(steps, dtype=np.int64))
            tgt_vals.append(np.stack(vals) if vals else np.zeros((0, d), np.float32))

        perf = float(cfg.perf_weight) > 0 and latencies is not None
        if perf:
            if groups is None or len(latencies) != N or len(groups) != N:
                raise CwmError(f"fit needs one latency and one group per trajectory: {N} trajectories, "
                               f"{len(latencies)} latencies, {0 if groups is None else len(groups)} groups")
            with np.errstate(divide="ignore", invalid="ignore"):
                log_lat = np.log(np.asarray(latencies, dtype=np.float64))
            log_lat = np.where(np.isfinite(log_lat), log_lat, np.nan).astype(np.float32)
            group_ids = np.unique(np.asarray([str(g) for g in groups]), return_inverse=True)[1]
        if warm_start and self.model_ is not None:
            model = copy.deepcopy(self.model_)
        else:
            model = self._new_model()
        model.train()
        n_epochs = int(cfg.epochs if epochs is None else epochs)
        parallel = distributed.is_distributed()

        def forward(zb, kind, args, mask):
            z_all, z_T = model.rollout(zb, kind, args, mask)
            return z_all, z_T, (model.score(zb, z_T) if perf else None)

        rollout = distributed.ddp(forward, model) if parallel else forward
        opt = torch.optim.Adam(model.parameters(), lr=float(cfg.lr))
        rng = np.random.default_rng(int(cfg.seed))
        bs = max(1, int(cfg.batch_size))
        self.history_ = []
        stop = False
        for epoch in range(n_epochs):
            sums = {"loss": 0.0, "match": 0.0, "rank": 0.0, "perf": 0.0}
            n_batches = 0
            if perf:
                batches = _group_batches(group_ids, int(cfg.perf_group_size), bs, rng)
            else:
                order = rng.permutation(N)
                batches = [order[b0 : b0 + bs] for b0 in range(0, N, bs)]
            if parallel:  # every step of every rank must run a backward pass, so skip no batch
                batches = [idx for idx in batches if perf or any(len(tgt_steps[i]) for i in idx)]
            for idx, weight in distributed.shard(batches) if parallel else ((b, 1.0) for b in batches):
                kind, args, mask = pad_batch([encoded[i] for i in idx])
                zb = torch.from_numpy(z0[idx])
                S = kind.shape[1] + 1
                tg = np.zeros((len(idx), S, d), dtype=np.float32)
                tm = np.zeros((len(idx), S), dtype=bool)
                for r, i in enumerate(idx):
                    tg[r, 0] = z0[i]  # known initial state: usable as a negative only
                    if len(tgt_steps[i]):
                        tg[r, tgt_steps[i]] = tgt_vals[i]
                        tm[r, tgt_steps[i]] = True
                tgt = torch.from_numpy(tg)
                tmask = torch.from_numpy(tm)
                if not tm.any() and not perf:
                    continue
                z_all, z_T, scores = rollout(zb, kind, args, mask)
                known = tmask.clone()
                known[:, 0] = True
                neg, row_ok = _fill_states(tgt, known)
                loss, parts = rollout_loss(
                    z_all,
                    tgt,
                    tmask,
                    negatives=neg,
                    margin=float(cfg.margin),
                    negative_mask=row_ok.unsqueeze(1).expand_as(tmask),
                    match_weight=float(cfg.match_weight),
                    rank_weight=float(cfg.rank_weight),
                )
                if perf:
                    perf_loss = within_task_rank_loss(
                        scores, torch.from_numpy(log_lat[idx]),
                        torch.from_numpy(group_ids[idx]), float(cfg.perf_min_gap))
                    loss = loss + float(cfg.perf_weight) * perf_loss
                    parts["perf"] = perf_loss.detach()
                opt.zero_grad(set_to_none=True)
                (loss * weight if weight != 1.0 else loss).backward()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                if weight:
                    sums["loss"] += float(loss.detach())
                    sums["match"] += float(parts["match"])
                    sums["rank"] += float(parts["rank"])
                    sums["perf"] += float(parts.get("perf", 0.0))
                    n_batches += 1
                if distributed.time_up(start, max_seconds):
                    stop = True
                    break
            if parallel:
                *totals, n_batches = distributed.all_reduce_sum([*sums.values(), n_batches])
                sums, n_batches = dict(zip(sums, totals)), int(n_batches)
            if n_batches:
                rec = {k: v / n_batches for k, v in sums.items()}
                rec.update(epoch=epoch, batches=n_batches, seconds=round(time.monotonic() - start, 3))
                if stop:
                    rec["partial"] = True
                self.history_.append(rec)
                msg = (
                    f"transition epoch {epoch + 1}/{n_epochs}: loss {rec['loss']:.4f} "
                    f"(match {rec['match']:.4f}, rank {rec['rank']:.4f}, perf {rec['perf']:.4f}) "
                    f"{rec['seconds']:.1f}s"
                )
                log.info(msg)
                if progress and distributed.is_main():
                    print(msg, file=sys.stderr, flush=True)
            if stop:
                log.info("transition training stopped after %.1fs", time.monotonic() - start)
                break
        del rollout  # drops a DDP wrapper and its gradient hooks
        model.eval()
        self.model_ = model
        return self

    # -- inference ---------------------------------------------------------------------------

    def predict(
        self, z0: np.ndarray, actions_list: Sequence[Sequence[dict]], batch_size: int = 512
    ) -> np.ndarray:
        """Predicted terminal latents ``[N, d]`` (float32)."""
        z0 = _as_z(z0, int(self.config.state_dim))
        if len(actions_list) != z0.shape[0]:
            raise CwmError(
                f"predict got {z0.shape[0]} z0 rows but {len(actions_list)} trajectories"
            )
        model = self._check_fitted()
        out = np.empty_like(z0)
        bs = max(1, int(batch_size))
        for s in range(0, z0.shape[0], bs):
            batch = encode_batch(actions_list[s : s + bs])
            out[s : s + bs] = self._predict_tensors(model, z0[s : s + bs], batch)
        return out

    @property
    def has_score_head(self) -> bool:
        return self.model_ is not None and self.model_.score_head is not None

    def scores(self, z0: np.ndarray, z_T: np.ndarray) -> np.ndarray:
        """The score head on terminal latents ``z_T [N, d]`` rolled out from ``z0 [N, d]``:
        ``[N]`` float32, higher = predicted faster (within a task)."""
        model = self._check_fitted()
        d = int(self.config.state_dim)
        z0, z_T = _as_z(z0, d), _as_z(z_T, d, "z_T")
        with torch.inference_mode():
            return model.score(torch.from_numpy(np.ascontiguousarray(z0)),
                               torch.from_numpy(np.ascontiguousarray(z_T))).numpy().astype(np.float32)

    def predict_encoded(
        self,
        z0: np.ndarray,
        encoded_batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        batch_size: int = 4096,
    ) -> np.ndarray:
        """Like :meth:`predict` on a precomputed :func:`pad_batch` / :func:`encode_batch` output."""
        z0 = _as_z(z0, int(self.config.state_dim))
        kind, args, mask = (torch.as_tensor(x) for x in encoded_batch)
        mask = mask.to(torch.bool)
        if kind.shape[0] != z0.shape[0]:
            raise CwmError(f"predict got {z0.shape[0]} z0 rows but {kind.shape[0]} trajectories")
        model = self._check_fitted()
        out = np.empty_like(z0)
        bs = max(1, int(batch_size))
        for s in range(0, z0.shape[0], bs):
            sl = slice(s, s + bs)
            m = mask[sl]
            # trim trailing all-padding columns of this chunk
            T = int(m.any(dim=0).nonzero().max()) + 1 if bool(m.any()) else 0
            part = (kind[sl, :T], args[sl, :T], m[:, :T])
            out[sl] = self._predict_tensors(model, z0[sl], part)
        return out

    @staticmethod
    def _predict_tensors(model: TransitionModel, z0: np.ndarray, batch) -> np.ndarray:
        kind, args, mask = batch
        with torch.inference_mode():
            _, zT = model.rollout(
                torch.from_numpy(np.ascontiguousarray(z0)),
                torch.as_tensor(kind, dtype=torch.long),
                torch.as_tensor(args, dtype=torch.float32),
                torch.as_tensor(mask).to(torch.bool),
                return_all=False,
            )
        return zT.numpy()

    def rollout_states(
        self, z0: np.ndarray, actions_list: Sequence[Sequence[dict]]
    ) -> list[np.ndarray]:
        """All predicted states per trajectory: ``[T_i + 1, d]`` each (row 0 is ``z0``)."""
        z0 = _as_z(z0, int(self.config.state_dim))
        model = self._check_fitted()
        kind, args, mask = encode_batch(actions_list)
        with torch.inference_mode():
            z_all, _ = model.rollout(torch.from_numpy(z0), kind, args, mask)
        lengths = mask.sum(1).tolist()
        return [z_all[i, : int(n) + 1].numpy().copy() for i, n in enumerate(lengths)]

    # -- persistence -------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write ``transition_config.json`` and ``transition.safetensors`` into ``directory``."""
        from safetensors.torch import save_file

        model = self._check_fitted()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_config(directory / CONFIG_FILE, FORMAT, self.config.to_dict(), known_kinds=list(KNOWN_KINDS),
                     arg_names=list(ARG_NAMES), history=self.history_)
        state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": FORMAT})
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "Transition":
        from safetensors.torch import load_file

        directory = Path(directory)
        cfg_path = directory / CONFIG_FILE
        w_path = directory / WEIGHTS_FILE
        meta = read_config(directory, CONFIG_FILE, (WEIGHTS_FILE,), FORMAT, "transition model")
        try:
            config = TransitionConfig.from_dict(meta.get("config"))
        except CwmError as e:
            raise CwmError(f"{cfg_path}: {e}") from e
        if list(meta.get("known_kinds", [])) != list(KNOWN_KINDS) or list(
            meta.get("arg_names", [])
        ) != list(ARG_NAMES):
            raise CwmError(
                f"{cfg_path} was written with different action features "
                "(instruction kinds or argument columns); retrain the transition model"
            )
        if config.num_kinds != len(KNOWN_KINDS) or config.num_args != NUM_ARGS:
            raise CwmError(
                f"{cfg_path}: num_kinds/num_args ({config.num_kinds}/{config.num_args}) do not "
                f"match this version ({len(KNOWN_KINDS)}/{NUM_ARGS})"
            )
        est = cls(config)
        model = est._new_model()
        try:
            state = load_file(str(w_path))
        except Exception as e:  # safetensors raises its own error types
            raise CwmError(f"cannot read {w_path}: {e}") from e
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        bad = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
        if missing or extra or bad:
            raise CwmError(
                f"{w_path} does not match {cfg_path}: "
                f"missing {missing[:5]}, unexpected {extra[:5]}, wrong shape {bad[:5]}"
            )
        model.load_state_dict(state)
        model.eval()
        est.model_ = model
        est.history_ = list(meta.get("history") or [])
        return est


__all__ = [
    "ActionEmbedding",
    "CONFIG_FILE",
    "RELATIVE_TILE_NAMES",
    "Transition",
    "TransitionConfig",
    "TransitionModel",
    "TransH",
    "WEIGHTS_FILE",
    "encode_batch",
    "pad_batch",
    "relative_tile_inputs",
    "rollout",
    "rollout_loss",
    "within_task_rank_loss",
]
