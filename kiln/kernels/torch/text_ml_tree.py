"""PyTorch kernel of ai.onnx.ml TreeEnsemble: every (sample, tree) pair walks its tree at
once, one level per step, so the cost is depth x (batch x trees) tensor ops."""

from __future__ import annotations

import math

import numpy as np
import torch

from kiln.kernels.registry import register
from kiln.ops import text_ml as T

# nodes_modes
_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)


def _members(a, modes: np.ndarray) -> np.ndarray:
    """Set-membership values per node as a NaN-padded [nodes, max_members] table; the
    attribute lists each MEMBER node's set in node order, sets separated by NaN."""
    n_nodes = len(modes)
    sets: list[list[float]] = [[] for _ in range(n_nodes)]
    vals = list(np.asarray(a.membership_values).reshape(-1)) if a.membership_values is not None \
        else []
    it = iter(vals)
    for i in np.nonzero(modes == _MEMBER)[0]:
        for v in it:
            if math.isnan(v):
                break
            sets[i].append(float(v))
    width = max((len(s) for s in sets), default=0) or 1
    table = np.full((n_nodes, width), np.nan)
    for i, s in enumerate(sets):
        table[i, :len(s)] = s
    return table


def _prepare(a, dtype: torch.dtype) -> dict:
    modes = np.asarray(a.nodes_modes).reshape(-1).astype(np.int64)
    n_nodes = len(modes)
    missing = a.nodes_missing_value_tracks_true or (0,) * n_nodes

    def t(v, dt=torch.int64):
        return torch.tensor(np.asarray(v).reshape(-1), dtype=dt)

    return {
        "feature": t(a.nodes_featureids), "mode": t(modes),
        "split": t(np.asarray(a.nodes_splits, dtype=np.float64), dtype),
        "true_id": t(a.nodes_truenodeids), "false_id": t(a.nodes_falsenodeids),
        "true_leaf": t(a.nodes_trueleafs).bool(), "false_leaf": t(a.nodes_falseleafs).bool(),
        "missing_true": t(missing).bool(),
        "members": torch.tensor(_members(a, modes), dtype=dtype),
        "leaf_target": t(a.leaf_targetids),
        "leaf_weight": t(np.asarray(a.leaf_weights, dtype=np.float64), dtype),
        "roots": t(a.tree_roots),
    }


def _compare(p: dict, x: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """Whether each (sample, tree) takes the true branch of its current node."""
    mode, split = p["mode"][node], p["split"][node]
    conds = torch.stack([x <= split, x < split, x >= split, x > split, x == split, x != split,
                         (x[..., None] == p["members"][node]).any(-1)])
    cond = conds.gather(0, mode[None]).squeeze(0)
    return cond | (torch.isnan(x) & p["missing_true"][node])


def _leaves(p: dict, x: torch.Tensor) -> torch.Tensor:
    """Leaf index reached by every sample in every tree: [batch, trees]."""
    roots = p["roots"]
    # a root whose two branches are the same leaf is itself that leaf
    root_leaf = p["true_leaf"][roots] & p["false_leaf"][roots] & (
        p["true_id"][roots] == p["false_id"][roots])
    batch = x.shape[0]
    idx = torch.where(root_leaf, p["true_id"][roots], roots).expand(batch, -1).clone()
    leaf = root_leaf.expand(batch, -1).clone()
    rows = torch.arange(batch)[:, None]
    for _ in range(len(p["mode"]) + 1):
        if bool(leaf.all()):
            break
        node = torch.where(leaf, 0, idx)
        values = x[rows, p["feature"][node]]
        go_true = _compare(p, values, node)
        nxt = torch.where(go_true, p["true_id"][node], p["false_id"][node])
        nxt_leaf = torch.where(go_true, p["true_leaf"][node], p["false_leaf"][node])
        idx = torch.where(leaf, idx, nxt)
        leaf = leaf | nxt_leaf
    return idx


def _aggregate(a, weights: torch.Tensor, targets: torch.Tensor, batch: int, n_trees: int):
    agg = a.aggregate_function
    out = torch.zeros((batch, a.n_targets), dtype=weights.dtype)
    if agg in (0, 1):  # AVERAGE, SUM
        out.scatter_add_(1, targets, weights)
        return out / n_trees if agg == 0 else out
    if agg in (2, 3):  # MIN, MAX: targets no tree reaches keep the dtype's extreme
        info = torch.finfo(weights.dtype)
        out.fill_(info.max if agg == 2 else info.min)
        return out.scatter_reduce(1, targets, weights, "amin" if agg == 2 else "amax")
    raise ValueError(f"TreeEnsemble: unknown aggregate_function {agg}")


def _post(kind: int, y: torch.Tensor) -> torch.Tensor:
    if kind == 0:
        return y
    if kind == 1:
        return torch.softmax(y, -1)
    if kind == 2:
        return torch.sigmoid(y)
    if kind == 3:  # softmax that leaves exact zeros at zero
        e = torch.where(y == 0, 0.0, torch.exp(y - y.amax(-1, keepdim=True)))
        return e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(y.dtype).tiny)
    if kind == 4:
        return math.sqrt(2) * torch.erfinv(2 * y - 1)
    raise ValueError(f"TreeEnsemble: unknown post_transform {kind}")


@register(T.TreeEnsemble)
def tree_ensemble(n, x):
    key = ("tree", x.dtype)
    if key not in n.cache:
        n.cache[key] = _prepare(n.a, x.dtype)
    p = n.cache[key]
    x2 = x.reshape(x.shape[0], -1) if x.ndim != 1 else x.reshape(1, -1)
    leaf = _leaves(p, x2)
    y = _aggregate(n.a, p["leaf_weight"][leaf], p["leaf_target"][leaf], x2.shape[0],
                   len(p["roots"]))
    return _post(n.a.post_transform or 0, y)
