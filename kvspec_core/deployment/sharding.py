"""The weights one GPU holds under tensor and pipeline parallelism, split as vLLM shards them.

Tensor parallelism (every rank holds the same bytes):

* the vocabulary embedding and the LM head are vocab-parallel: vLLM pads the vocabulary to a
  multiple of 64 rows and gives each rank 1/TP of the padded rows (so a rank may hold a few
  rows more than the checkpoint); so is Gemma-3n's per-layer embedding table;
* norms, other embedding tables (positions), MoE routers, MLA's down-projections
  (``kv_a_proj_with_mqa``, ``q_a_proj``), Gemma-3n's per-layer gate and projection and AltUp
  coefficients, the biases of row-parallel linears (``o_proj``, ``down_proj``,
  ``out_proj``, ``fc2``), plain convolutions (Whisper's encoder ``conv1`` / ``conv2``) and a
  gated norm one head wide (Qwen3-Next's gated delta-net) are replicated: every rank holds
  all of them;
* K and V projections split by KV head; at TP above the KV head count vLLM replicates
  heads, so each rank holds one head's rows;
* every other tensor (the attention and MLP linears, the experts, Mamba's projections,
  causal ``conv1d``, gated norm and per-head parameters, a vision tower's linears) is split
  1/TP.

Not modelled: a fused ``qkv_proj`` (Phi-3) is split 1/TP even above its KV head count (Phi-3's
32 KV heads meet that only at TP 64), and a vision tower's class and position embeddings
(a few MB) are split like its linears. Nor is the padding vLLM gives mxfp4 experts per rank,
which depends on the MoE kernel it picks at load time (``mxfp4_round_up_hidden_size_and_
intermediate_size`` in vLLM's ``fused_moe/oracle/mxfp4.py``: Triton rounds each rank's
intermediate size up to 64; Marlin and FlashInfer TRT-LLM round it up to 128 and the hidden
size to 256, +9% of gpt-oss-20b's expert bytes at TP 1 and +13.8% from TP 2).

Pipeline parallelism: decoder layer ``i`` lives on the stage :func:`stage_ranges` gives it
(vLLM's split); the tensors outside the decoder layers live where the architecture's vLLM
class builds them (:mod:`pipeline_placement`): Llama's embedding on stage 0 and its final
norm and LM head on the last stage (which holds its own copy of a tied embedding), but
gpt-oss's, Jamba's, Nemotron-H's, Gemma's or Qwen3-MoE's on every stage, and Llama-4's
vision tower on every stage. An architecture the table does not list is refused at PP > 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

from kvspec_core.deployment.parameters import (
    EMBEDDING,
    KV_PROJECTION,
    NORM,
    REPLICATED_LINEAR,
    REPLICATED_PARAMETER,
    ROUTER,
    ROW_BIAS,
    VOCAB,
    VOCAB_TABLE,
    ModelWeights,
    WeightTensor,
)
from kvspec_core.deployment.pipeline_placement import (
    FIRST,
    StagePlacement,
    stage_placement,
    stages_holding,
)

#: vLLM pads the vocabulary to a multiple of this before splitting it (DEFAULT_VOCAB_PADDING_SIZE
#: in vllm/model_executor/layers/vocab_parallel_embedding.py).
VOCAB_PADDING = 64
_REPLICATED = frozenset(
    {EMBEDDING, NORM, ROUTER, REPLICATED_LINEAR, REPLICATED_PARAMETER, ROW_BIAS}
)
_VOCAB_PARALLEL = frozenset({VOCAB, VOCAB_TABLE})


def tp_share(tensor: WeightTensor, tp: int) -> Fraction:
    """The fraction of ``tensor``'s stored bytes one of ``tp`` ranks holds."""
    if tensor.role in _REPLICATED or (tp == 1 and tensor.role not in _VOCAB_PARALLEL):
        return Fraction(1)
    if tensor.role in _VOCAB_PARALLEL:
        rows = tensor.shape[0]
        padded = math.ceil(rows / VOCAB_PADDING) * VOCAB_PADDING
        return Fraction(math.ceil(padded / tp), rows)
    if tensor.role == KV_PROJECTION and tensor.kv_heads and tensor.shape[0] % tensor.kv_heads == 0:
        return Fraction(max(1, tensor.kv_heads // tp), tensor.kv_heads)
    return Fraction(1, tp)


def _stages(
    tensor: WeightTensor,
    weights: ModelWeights,
    ranges: Sequence[tuple[int, int]],
    placement: StagePlacement | None,
) -> set[int]:
    """The stages holding ``tensor`` (``placement``: ``None`` for one stage)."""
    if tensor.layer is not None:
        return {next(i for i, (start, end) in enumerate(ranges) if start <= tensor.layer < end)}
    if placement is None:
        return {0}
    before = tensor.name in weights.before_layers
    if tensor.role == VOCAB:
        place = placement.embedding if before else placement.lm_head
    else:
        place = placement.before_layers if before else placement.after_layers
    stages = set(stages_holding(place, len(ranges)))
    if tensor.role == VOCAB and before and weights.tied_embeddings and place == FIRST:
        stages.add(len(ranges) - 1)  # the last stage's LM head is tied to its own copy
    return stages


def stage_weight_bytes(
    weights: ModelWeights,
    stored: Mapping[str, Fraction],
    tp: int,
    ranges: Sequence[tuple[int, int]],
) -> list[Fraction]:
    """Bytes of weights one GPU of each pipeline stage holds at ``tp`` (``stored``: each
    tensor's checkpoint bytes by name); a :class:`ConfigError` at more than one stage for an
    architecture whose placement vLLM's code was not read for."""
    placement = stage_placement(weights.architecture) if len(ranges) > 1 else None
    totals = [Fraction(0)] * len(ranges)
    for tensor in weights.tensors:
        share = stored[tensor.name] * tp_share(tensor, tp)
        for stage in _stages(tensor, weights, ranges, placement):
            totals[stage] += share
    return totals
