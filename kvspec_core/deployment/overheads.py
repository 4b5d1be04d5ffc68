"""vLLM's memory besides weights and KV cache, per GPU: the PyTorch activation peak of its
profiling pass and non-torch memory (CUDA context, NCCL buffers). The figures are data
(``overheads.json``, beside this module, which says where each comes from)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

import attrs

#: Bytes in one GiB (the table's unit).
GIB = 2**30
#: Config fields whose presence marks a mixture-of-experts model (as llm-d-planner tells them).
_MOE_FIELDS = (
    "n_routed_experts",
    "n_shared_experts",
    "num_experts",
    "num_experts_per_tok",
    "num_local_experts",
)
#: Architectures llm-d-planner calibrates as multimodal.
_MULTIMODAL_ARCHITECTURES = frozenset(
    {
        "PixtralForConditionalGeneration",
        "Mistral3ForConditionalGeneration",
        "LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration",
    }
)


@attrs.frozen(kw_only=True)
class Overheads:
    """Per-GPU memory vLLM holds besides weights and KV cache.

    Attributes:
        activation_bytes: the PyTorch activation peak (CUDA graphs included).
        non_torch_bytes: CUDA context and communication buffers.
        basis: how the figures were chosen (``calibrated LlamaForCausalLM``, ``moe base``,
            ``--overhead``).
        source: where they come from.
    """

    activation_bytes: int
    non_torch_bytes: int
    basis: str
    source: str

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.non_torch_bytes


@functools.cache
def overhead_table() -> dict[str, Any]:
    """The parsed ``overheads.json``."""
    text = resources.files("kvspec_core.deployment").joinpath("overheads.json").read_text("utf-8")
    table: dict[str, Any] = json.loads(text)
    return table


def calibration_batched_tokens() -> int:
    """The batched tokens per step of the runs the activation figures come from (vLLM
    profiles that many tokens, so its peak grows with them; see ``overheads.json``)."""
    tokens: int = overhead_table()["calibration_batched_tokens"]
    return tokens


def _gib(value: float) -> int:
    return round(value * GIB)


def _kind(raw: Mapping[str, Any], architecture: str) -> str:
    if architecture in _MULTIMODAL_ARCHITECTURES:
        return "multimodal"
    text = raw.get("text_config")
    fields = text if isinstance(text, Mapping) else raw
    return "moe" if any(field in fields for field in _MOE_FIELDS) else "dense"


def estimate_overheads(raw: Mapping[str, Any], tp: int, pp: int) -> Overheads:
    """The table's overheads for the model config ``raw`` at ``tp`` x ``pp``: the activation
    peak calibrated for its architecture, else its kind's base figure (MoE, multimodal,
    dense); non-torch memory by parallelism (NCCL all-reduce buffers dominate at TP > 1)."""
    table = overhead_table()
    architectures = raw.get("architectures")
    architecture = (
        architectures[0]
        if isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
        else ""
    )
    if architecture in table["activation_gib"]:
        activation = table["activation_gib"][architecture]
        basis = f"calibrated {architecture}"
    else:
        kind = _kind(raw, architecture)
        activation = table["activation_base_gib"][kind]
        basis = f"{kind} base figure ({architecture or 'no architecture'} not calibrated)"
    non_torch_key = "tpN" if tp > 1 else "tp1_ppN" if pp > 1 else "tp1_pp1"
    return Overheads(
        activation_bytes=_gib(activation),
        non_torch_bytes=_gib(table["non_torch_gib"][non_torch_key]),
        basis=basis,
        source=table["source"],
    )


def overridden_overheads(total_bytes: int) -> Overheads:
    """``--overhead SIZE``: one per-GPU figure in place of the table's (kept as activation)."""
    return Overheads(
        activation_bytes=total_bytes, non_torch_bytes=0, basis="--overhead", source="--overhead"
    )
