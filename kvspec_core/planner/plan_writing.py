"""Writing a KV-cache plan as plain JSON data: the format version, the fields of each group,
pool and tensor, and the checksums of the plan's inputs.

:meth:`KVCachePlan.to_dict <kvspec_core.planner.plan.KVCachePlan.to_dict>` writes a plan with
these; :func:`~kvspec_core.planner.plan_loading.plan_from_dict` reads it back, checking the
version and the checksums written here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvspec_core.planner.plan_parts import KVCacheTensor, PlannedGroup, PlannedTier, Pool
from kvspec_core.specs.serialization import spec_to_dict

#: Version of :meth:`KVCachePlan.to_dict`'s format (2 added ``input_checksums``).
PLAN_FORMAT_VERSION = 2

#: Inputs of a plan that no other field of it derives from, checksummed in
#: ``input_checksums`` (``num_blocks`` stands for the pools' block counts); each group's
#: ``layers`` and ``spec`` are inputs too (``groups[0].spec``...), and so are the offload
#: ``tiers`` when a plan has some (a plan without any, or written before tiers existed,
#: has no checksum for them), and so is ``kv_sharing`` likewise.
CHECKSUMMED_INPUTS = (
    "layout",
    "context",
    "budget_bytes",
    "host_budget_bytes",
    "memoryless_layers",
    "num_blocks",
)


def input_checksums(data: Mapping[str, Any]) -> dict[str, str]:
    """A checksum of each input of the plan ``data`` describes (a document written by
    :meth:`KVCachePlan.to_dict`): :data:`CHECKSUMMED_INPUTS` and each group's layers and
    spec. Every other field follows from these and is re-derived when a plan is read back;
    a spec field that changes no derived figure (a window that needs as many blocks) could
    not be told edited otherwise. They guard against hand edits and corruption, not forgery."""
    values = {name: data[name] for name in CHECKSUMMED_INPUTS if name != "num_blocks"}
    values["num_blocks"] = [pool["num_blocks"] for pool in data["pools"]]
    for index, group in enumerate(data["groups"]):
        values[f"groups[{index}].layers"] = group["layers"]
        values[f"groups[{index}].spec"] = group["spec"]
    if data.get("tiers"):
        values["tiers"] = data["tiers"]
    if data.get("kv_sharing"):
        values["kv_sharing"] = data["kv_sharing"]
    return {
        name: hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[
            :16
        ]
        for name, value in values.items()
    }


def group_to_dict(group: PlannedGroup) -> dict[str, Any]:
    """The JSON-able fields of ``group`` in a plan document (``groups[i]``)."""
    return {
        "id": group.id,
        "kind": group.kind,
        "layers": list(group.layers),
        "block_size": group.block_size,
        "page_size_bytes": group.page_size_bytes,
        "pool": group.pool,
        "blocks_per_request": group.blocks_per_request,
        "host_resident": group.host_resident,
        "role": group.role,
        "transferable": group.transferable,
        "prefix_cacheable": group.prefix_cacheable,
        "spec": spec_to_dict(group.spec),
    }


def pool_to_dict(pool: Pool) -> dict[str, Any]:
    """The JSON-able fields of ``pool`` in a plan document (``pools[i]``)."""
    return {
        "id": pool.id,
        "num_blocks": pool.num_blocks,
        "block_bytes": pool.block_bytes,
        "groups": list(pool.groups),
        "host_resident": pool.host_resident,
        "blocks_per_request": pool.blocks_per_request,
        "fixed_blocks_per_request": pool.fixed_blocks_per_request,
        "slot_bytes": list(pool.slot_bytes),
        "alignment": pool.alignment,
        "null_block": pool.null_block,
        "max_concurrency": pool.max_concurrency,
    }


def tensor_to_dict(tensor: KVCacheTensor) -> dict[str, Any]:
    """The JSON-able fields of ``tensor`` in a plan document (``tensors[i]``)."""
    return {
        "size": tensor.size,
        "layers": list(tensor.layers),
        "layer_stride": tensor.layer_stride,
        "block_stride": tensor.block_stride,
        "offset": tensor.offset,
        "host_resident": tensor.host_resident,
        "pool": tensor.pool,
        "group": tensor.group,
        "shape": list(tensor.shape),
        "strides": list(tensor.strides),
        "raw": tensor.raw,
    }


def tier_to_dict(tier: PlannedTier) -> dict[str, Any]:
    """The JSON-able fields of ``tier`` in a plan document (``tiers[i]``)."""
    return {
        "name": tier.name,
        "budget_bytes": tier.budget_bytes,
        "path": tier.path,
        "blocks_per_pool": list(tier.blocks_per_pool),
        "bytes_allocated": tier.bytes_allocated,
    }
