"""What the graph pass found, kept beside Inductor's cache so that a warm start reports it too.

A hit in Inductor's FX graph cache (or the AOTAutograd cache in front of it) skips the pass: the
compiled code is right, since its ops carry the backend's handle and the site ids as constants, but
the backend would not learn which sites exist, their layers and patterns, or which sites were left
exact and why. So whenever the pass runs under a backend with ``cache=True``, its records are written
to ``<inductor cache dir>/kvpass/<key>.json``, keyed by what the backend can compute before compiling:
the pass's ``uuid()`` (pass code, policy, options, handle) and the dynamo graph (its code, the module
path of every node and the metadata of every input). On a hit the backend reads that record back and
replays it (:func:`restore`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch._dynamo.utils import counters

from kvpass.patterns.attention import Unmatched

if TYPE_CHECKING:
    from kvpass.lowering.graph_pass import GraphRecord, PassHost

#: Bumped when the record's layout changes, so that old records are not misread.
FORMAT = 2


def _meta(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return (f"T({type(v).__name__},{tuple(v.shape)},{tuple(v.stride())},{v.dtype},{v.device.type},"
                f"{v.requires_grad})")
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return f"{type(v).__name__}({v})"
    return type(v).__name__


def graph_key(uuid: str, gm: torch.fx.GraphModule) -> str:
    """The record's key for dynamo graph ``gm`` compiled under a pass with ``uuid``."""
    h = hashlib.sha256(f"kvpass-graph-record-{FORMAT}|{torch.__version__}|{uuid}".encode())
    h.update(gm.code.encode())
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        paths = [str(v[0]) if isinstance(v, tuple) else str(v) for v in stack.values()]
        h.update(f"\n{n.name}|{','.join(paths)}".encode())
        if n.op == "placeholder":
            h.update(_meta(n.meta.get("example_value")).encode())
    return h.hexdigest()


def _path(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "kvpass" / f"{key}.json"


def save(key: str, records: list[GraphRecord]) -> None:
    """Write what the pass found in the graphs of one compile (best effort: a read-only cache
    directory only costs the next process a compile with the caches off)."""
    body = {
        "format": FORMAT,
        "records": [
            {"kind": r.kind, "sites": r.sites, "unmatched": [dataclasses.asdict(u) for u in r.unmatched],
             "linears": r.linears}
            for r in records
        ],
    }
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old record or the new one
    except OSError:
        return


def restore(key: str, backend: PassHost) -> bool:
    """Replay the record of ``key`` into ``backend`` (site ids, site infos, graph records); False,
    changing nothing, when there is no readable record or its site ids clash with the backend's."""

    try:
        body = json.loads(_path(key).read_text())
        if body.get("format") != FORMAT:
            return False
        records = [(r["kind"], r["sites"], [Unmatched(**u) for u in r["unmatched"]], int(r["linears"]))
                   for r in body["records"]]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    with backend._lock:
        claims = {}
        for _, rows, _, _ in records:
            for row in rows:
                claims.setdefault(row["module"], (row["layer"], row["site"]))
        if not backend._claim_sites(claims):
            return False
    for kind, rows, unmatched, linears in records:
        for row in rows:
            info = backend._note_site(row["site"], row["module"], row["layer"],
                                      row["pattern"].removesuffix(" (owned)"))
            if "estimate" in row:
                info.estimate = row["estimate"]
            info.fetch_in_attention = row.get("fetch") == "in attention"
            if "heads" in row:
                backend._heads[row["site"]] = row["heads"]
        backend._record_graph(kind, rows, unmatched, linears)
        counters["kvpass"]["graphs_from_cache"] += 1
    return True
