"""Which KV heads a rank's attention sites hold under tensor parallelism (``report()``'s ``heads``).

Under transformers' ``from_pretrained(dir, tp_plan="auto")`` the key/value projections are sharded by
output rows (``colwise``: a DTensor placed ``Shard(0)`` on a 1-D mesh), so each rank's graph computes
``H_kv / N`` heads and its attention sites see local shapes. The pass needs nothing for that; the backend
reads the shards of each dynamo graph (:func:`key_shards`) and the pass names each site's heads
(:func:`heads_label`). The launcher and its check are a tool: :mod:`kvpass.tp`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from kvpass.patterns.attention import module_path

__all__ = ["KeyShard", "heads_label", "key_shards"]


@dataclasses.dataclass(frozen=True)
class KeyShard:
    """The rows of one attention module's key projection that this rank holds."""

    rank: int
    world: int
    rows: int  # global output features (H_kv * head_dim)
    offset: int  # first global row held here
    local: int  # rows held here


def key_shards(gm: fx.GraphModule) -> dict[str, KeyShard]:
    """``{attention module path: KeyShard}`` for the key projections of a dynamo graph whose weight is
    a DTensor sharded by rows (exactly ``Shard(0)``) on a 1-D mesh; empty when there is none.

    The weight's owner is found by where the graph uses it: a node inside ``<attn>.k_proj``'s forward
    (transformers' ``to_local()``, or the linear itself). Shard(0) follows ``torch.chunk``: rank r
    holds rows ``[r * ceil(G / N), ...)``. Anything else (strided shards of a fused QKV, 2-D meshes)
    is left out, and the report then names the rank and the local head count only."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {}
    # torch.distributed.tensor only where a process group runs: a build without distributed lacks it
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, KeyShard] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("example_value")
        if not isinstance(val, DTensor) or val.ndim != 2:
            continue
        mesh, placements = val.device_mesh, tuple(val.placements)
        if mesh.ndim != 1 or len(placements) != 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
            continue
        owners = {module_path(u) for u in node.users}
        owners = {p[: -len(".k_proj")] for p in owners if p.endswith(".k_proj")}
        if len(owners) != 1:
            continue
        rank, world, rows = mesh.get_local_rank(), mesh.size(), int(val.shape[0])
        chunk = -(-rows // world)
        offset = min(rank * chunk, rows)
        out[owners.pop()] = KeyShard(rank, world, rows, offset, min(chunk, rows - offset))
    return out


def heads_label(shard: KeyShard | None, local_heads: int, head_dim: int) -> str:
    """``"2-3 of 4"`` (this rank's KV heads of the model's) when the key projection's shard accounts
    for exactly the heads the site sees; ``"2 local, rank 1 of 2"`` when only the process group is
    known; ``""`` in a single process."""
    if shard is not None and shard.local == local_heads * head_dim and shard.offset % head_dim == 0 \
            and shard.rows % head_dim == 0:
        first = shard.offset // head_dim
        heads = f"{first}" if local_heads == 1 else f"{first}-{first + local_heads - 1}"
        return f"{heads} of {shard.rows // head_dim}"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            return f"{local_heads} local, rank {torch.distributed.get_rank()} of {world}"
    return ""
