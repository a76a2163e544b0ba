"""Plain, loop-based torch version of DeepSeek's EPLB ``rebalance_experts``: the reference algorithm.

Written from the algorithm's description (DeepSeek EPLB, https://github.com/deepseek-ai/EPLB), not
copied. It keeps the computational shape of DeepSeek's reference: torch tensors, a torch sort per
packing call, and Python loops over rows and items. Tests compare ``moebalance.algorithms.eplb`` against it, and
``bench/bench_eplb.py`` times it as the baseline. It checks its arguments with ``assert`` only, as the
original does; the user-facing validation lives in ``moebalance.algorithms.eplb``.

Shapes: ``L`` layers, ``E`` logical experts, ``P`` physical slots (``num_replicas``).
"""

from __future__ import annotations

import torch

__all__ = ["balanced_packing", "rebalance_experts", "replicate_experts"]


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the ``n`` items of each row into ``num_packs`` packs of ``n // num_packs`` items each.

    weight: [X, n] item weights. Returns ``(pack_index [X, n], rank_in_pack [X, n])``, both int64.
    Items are visited heaviest first (``torch.sort(descending=True)``, the default unstable sort, as in
    the original); each goes to the lightest pack that still has room (lowest pack index on ties).
    Pack weights are float32 sums.
    """
    num_rows, num_items = weight.shape
    assert num_items % num_packs == 0
    per_pack = num_items // num_packs
    if per_pack == 1:
        pack_index = torch.arange(num_items, dtype=torch.int64).expand(num_rows, num_items).clone()
        return pack_index, torch.zeros(num_rows, num_items, dtype=torch.int64)

    weight = weight.float()
    order = weight.sort(dim=-1, descending=True).indices
    pack_index = torch.full((num_rows, num_items), -1, dtype=torch.int64)
    rank_in_pack = torch.full((num_rows, num_items), -1, dtype=torch.int64)
    for row in range(num_rows):
        # One 0-d float32 tensor per pack, so every sum and comparison is done in float32.
        pack_load = [torch.zeros((), dtype=torch.float32) for _ in range(num_packs)]
        pack_size = [0] * num_packs
        for item in order[row]:
            best = -1
            for pack in range(num_packs):
                if pack_size[pack] == per_pack:
                    continue
                # Strict "<": on equal loads the earlier (lower-index) pack wins.
                if best < 0 or pack_load[pack] < pack_load[best]:
                    best = pack
            pack_index[row, item] = best
            rank_in_pack[row, item] = pack_size[best]
            pack_load[best] = pack_load[best] + weight[row, item]
            pack_size[best] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give each of the ``num_log`` experts of a row one slot, then hand out the other slots one at a time.

    weight: [X, num_log]. Each extra slot goes to the expert with the largest ``weight / count``
    (float32; ``torch.max`` picks the lowest index on ties). Returns ``(phy2log [X, num_phy],
    rank [X, num_phy], logcnt [X, num_log])``, all int64.
    """
    num_rows, num_log = weight.shape
    assert num_phy >= num_log
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(num_rows, 1)
    rank = torch.zeros(num_rows, num_phy, dtype=torch.int64)
    logcnt = torch.ones(num_rows, num_log, dtype=torch.int64)
    rows = torch.arange(num_rows)
    for slot in range(num_log, num_phy):
        chosen = (weight / logcnt).max(dim=-1).indices
        phy2log[:, slot] = chosen
        rank[:, slot] = logcnt[rows, chosen]
        logcnt[rows, chosen] += 1
    return phy2log, rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of a permutation: ``out[r, perm[r, i]] = i``."""
    out = torch.empty_like(perm)
    out.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand(perm.shape).clone())
    return out


def rebalance_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups to nodes, replicas within each node, replicas to GPUs. Returns ``(phy2log, phyrank, logcnt)``."""
    num_layers, num_logical = weight.shape
    assert num_logical % num_groups == 0
    assert num_groups % num_nodes == 0
    assert num_gpus % num_nodes == 0
    assert num_physical % num_gpus == 0
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_physical // num_gpus

    # Step 1: whole expert groups to nodes. Expert j of group g gets the "middle" id
    # (slot of g on its node + node * groups_per_node) * group_size + j.
    tokens_per_group = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
        + torch.arange(group_size, dtype=torch.int64)
    ).flatten(-2)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate experts inside each node; each node is one row.
    tokens_per_mlog = weight.gather(-1, mlog2log).view(-1, num_logical // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical // num_nodes)

    # Step 3: pack each node's replicas (load split evenly among an expert's replicas) onto its GPUs.
    tokens_per_phy = (tokens_per_mlog / mlogcnt).gather(-1, phy2mlog)
    pack_index, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    phy2pphy = pack_index * phy_per_gpu + rank_in_pack
    pphy2phy = _inverse(phy2pphy)

    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    node_offset = torch.arange(0, num_logical, num_logical // num_nodes, dtype=torch.int64).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(num_layers, num_nodes, -1) + node_offset).flatten(-2)
    phy2log = mlog2log.gather(-1, pphy2mlog)
    pphyrank = phyrank.gather(-1, pphy2phy).view(num_layers, -1)
    logcnt = mlogcnt.view(num_layers, -1).gather(-1, log2mlog)
    return phy2log, pphyrank, logcnt


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight: [L, E] load. Returns ``(phy2log [L, P], log2phy [L, E, max_count], logcnt [L, E])``."""
    num_layers, num_logical = weight.shape
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    max_count = int(logcnt.max())
    log2phy = torch.full((num_layers, num_logical * max_count), -1, dtype=torch.int64)
    slots = torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1).clone()
    log2phy.scatter_(-1, phy2log * max_count + phyrank, slots)
    return phy2log, log2phy.view(num_layers, num_logical, max_count), logcnt
