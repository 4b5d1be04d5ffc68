"""Every weight tensor of a model, read from transformers' model code built on the meta
device (no download, no memory): names, shapes and what each tensor is for, which is what
:mod:`kvspec_core.deployment.sharding` needs to split them as vLLM does.

The model class is the config's ``architectures[0]`` where transformers has it (the class
the checkpoint was saved from, with its vision tower or encoder), else the causal-LM class
transformers maps the config to. Tied input and output embeddings are one tensor.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from kvspec_core.errors import ConfigError
from kvspec_core.models.normalized import HF_EXTRA_INSTALL, quiet_transformers

#: Names transformers gives decoder layer lists.
_LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer")
#: Layer-list paths that are not the language model's decoder.
_NOT_DECODER = ("vision", "encoder", "audio", "image")

VOCAB = "vocab"  # the vocabulary embedding or the LM head (vocab-parallel in vLLM)
VOCAB_TABLE = "vocab_table"  # another table vLLM builds vocab-parallel (Gemma-3n's per layer)
EMBEDDING = "embedding"  # any other embedding table (positions...): replicated
REPLICATED_PARAMETER = "replicated_parameter"  # a bare parameter vLLM keeps whole on each rank
NORM = "norm"  # a normalisation's scale or bias: replicated
ROUTER = "router"  # a mixture-of-experts router (vLLM's ReplicatedLinear)
REPLICATED_LINEAR = "replicated_linear"  # MLA's down-projections (ReplicatedLinear in vLLM)
KV_PROJECTION = "kv_projection"  # k_proj / v_proj: heads replicated when TP > KV heads
ROW_BIAS = "row_bias"  # the bias of a row-parallel linear: added once, so replicated
EXPERTS = "experts"  # fused expert weights (3-D): sharded
SHARDED = "sharded"  # every other tensor: split over the TP ranks

#: Attribute names of row-parallel linears (their biases are replicated).
_ROW_PARALLEL = frozenset({"o_proj", "down_proj", "out_proj", "fc2", "dense_4h_to_h", "wo"})
#: Attribute names of MoE routers.
_ROUTERS = frozenset({"gate", "router", "shared_expert_gate"})
#: Linears vLLM builds as ReplicatedLinear: MLA's down-projections; Gemma-3n's per-layer
#: input gate and projection and its AltUp coefficients and router (vLLM's gemma3n.py:89-105,
#: 493-501).
_REPLICATED_LINEARS = frozenset(
    {
        "kv_a_proj_with_mqa",
        "q_a_proj",
        "per_layer_input_gate",
        "per_layer_projection",
        "correction_coefs",
        "prediction_coefs",
        "modality_router",
    }
)
#: torch convolutions vLLM builds as plain ``nn.Conv1d`` / ``Conv2dLayer`` modules, whole on
#: every rank (Whisper's encoder ``conv1`` / ``conv2``, whisper.py:517; SigLIP's patch
#: embedding, siglip.py:267), except the state mixers' causal ``conv1d`` (Mamba, gated
#: delta-net), a column-parallel linear split with the channels it convolves.
_PLAIN_CONVOLUTIONS = frozenset({"Conv1d", "Conv2d", "Conv3d"})
_SHARDED_CONVOLUTIONS = frozenset({"conv1d"})
#: Embedding tables besides the vocabulary that vLLM builds as VocabParallelEmbedding (split
#: over TP): Gemma-3n's per-layer inputs (vLLM's gemma3n.py:619).
_VOCAB_TABLES = frozenset({"embed_tokens_per_layer"})
#: Bare parameters vLLM keeps whole on every rank: Gemma-3n AltUp's output scale
#: (gemma3n.py:122).
_REPLICATED_PARAMETERS = frozenset({"correct_output_scale"})


@attrs.frozen(kw_only=True)
class WeightTensor:
    """One weight tensor of the model.

    Attributes:
        name: its parameter name (``model.layers.3.self_attn.k_proj.weight``).
        shape: its shape.
        role: how vLLM splits it over TP ranks (the constants of this module).
        layer: the decoder layer index it belongs to, or ``None`` outside the decoder layers.
        kv_heads: for a KV projection, the KV heads its rows hold.
    """

    name: str
    shape: tuple[int, ...]
    role: str
    layer: int | None
    kv_heads: int | None = None

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@attrs.frozen(kw_only=True)
class ModelWeights:
    """A model's weight tensors as its code builds them.

    Attributes:
        model_class: the class built.
        architecture: the config's ``architectures[0]`` (the class vLLM builds), else
            ``model_class``.
        tensors: every tensor, in the model's order; tied ones once.
        tied_embeddings: whether the LM head is the input embedding.
        num_layers: decoder layers (the layer indices of ``tensors``).
        before_layers: names of tensors outside the decoder layers that come before them
            (the embedding, a vision tower): pipeline stage 0 holds them; the rest (final
            norm, LM head) the last stage.
    """

    model_class: str
    architecture: str
    tensors: tuple[WeightTensor, ...]
    tied_embeddings: bool
    num_layers: int
    before_layers: frozenset[str]

    @property
    def parameters(self) -> int:
        return sum(tensor.numel for tensor in self.tensors)


def _model_class(raw: Mapping[str, Any], config: Any) -> Any:
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    architectures = raw.get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        found = getattr(transformers, architectures[0], None)
        if found is not None:
            return found
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING):
        try:
            return mapping[type(config)]
        except KeyError:
            continue
    raise ConfigError(
        f"transformers has no model class for model_type {raw.get('model_type')!r}, so its "
        "parameters cannot be counted; put the checkpoint's model.safetensors.index.json "
        "beside its config.json (its metadata.total_size is the weights' size)"
    )


def _decoder_layer_list(model: Any, count: int) -> str:
    import torch

    candidates = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
        and len(module) == count
        and name.rsplit(".", 1)[-1] in _LAYER_LIST_NAMES
    ]
    decoder = [name for name in candidates if not any(part in name for part in _NOT_DECODER)]
    chosen = decoder or candidates
    if not chosen:
        raise ConfigError(
            f"transformers' {type(model).__name__} has no decoder layer list of "
            f"{count} layers; check 'num_hidden_layers'"
        )
    return chosen[0]


def _role(model: Any, name: str, shape: tuple[int, ...], vocab_names: set[str]) -> str:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    attribute = owner_name.rsplit(".", 1)[-1]
    owner_class = type(owner).__name__
    if name in vocab_names:
        return VOCAB
    if attribute in _VOCAB_TABLES:
        return VOCAB_TABLE
    if leaf in _REPLICATED_PARAMETERS:
        return REPLICATED_PARAMETER
    if "Embedding" in owner_class:
        return EMBEDDING
    if "Norm" in owner_class or "norm" in attribute.lower():
        # vLLM shards Mamba-2's gated norm with the heads it normalises, but not one of one
        # head's width applied to every head (Qwen3-Next's gated delta-net, weight head_v_dim).
        if "Gated" in owner_class and not _per_head_norm(model, owner_name, shape):
            return SHARDED
        return NORM
    if owner_class in _PLAIN_CONVOLUTIONS and attribute not in _SHARDED_CONVOLUTIONS:
        return REPLICATED_LINEAR
    if attribute in _ROUTERS:
        return ROUTER
    if attribute in _REPLICATED_LINEARS:
        return REPLICATED_LINEAR
    if attribute in ("k_proj", "v_proj"):
        return KV_PROJECTION
    if leaf == "bias" and attribute in _ROW_PARALLEL:
        return ROW_BIAS
    if leaf.endswith("down_proj_bias"):
        return ROW_BIAS
    if len(shape) == 3:
        return EXPERTS
    return SHARDED


def _per_head_norm(model: Any, owner_name: str, shape: tuple[int, ...]) -> bool:
    """Whether the norm ``owner_name`` (inside a mixer) has one head's width: its mixer's
    ``head_v_dim`` (transformers' gated delta-net)."""
    mixer = model.get_submodule(owner_name.rpartition(".")[0])
    return getattr(mixer, "head_v_dim", None) == shape[0] if len(shape) == 1 else False


def _kv_heads(model: Any, name: str) -> int | None:
    owner_name = name.rpartition(".")[0]
    attention = model.get_submodule(owner_name.rpartition(".")[0])
    for source in (attention, getattr(attention, "config", None)):
        for field in ("num_key_value_heads", "num_kv_heads"):
            value = getattr(source, field, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


_LAYER_INDEX = re.compile(r"^\.(\d+)\.")


@functools.lru_cache(maxsize=16)
def _read(config_json: str, num_layers: int) -> ModelWeights:
    import torch
    from transformers import CONFIG_MAPPING

    raw = json.loads(config_json)
    with quiet_transformers():
        config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
        model_class = _model_class(raw, config)
        with torch.device("meta"):
            model = model_class._from_config(config)
    layers = _decoder_layer_list(model, num_layers)
    inputs = model.get_input_embeddings()
    outputs = model.get_output_embeddings()
    tied = outputs is not None and outputs.weight is inputs.weight
    by_identity = {id(p): n for n, p in model.named_parameters()}
    vocab_names = {by_identity[id(inputs.weight)]}
    if outputs is not None:
        vocab_names.add(by_identity[id(outputs.weight)])
    tensors = []
    before: set[str] = set()
    seen_layers = False
    for name, parameter in model.named_parameters():
        shape = tuple(parameter.shape)
        layer = None
        if name.startswith(layers + "."):
            match = _LAYER_INDEX.match(name[len(layers) :])
            layer = int(match[1]) if match else None
            seen_layers = True
        elif not seen_layers:
            before.add(name)
        role = _role(model, name, shape, vocab_names)
        tensors.append(
            WeightTensor(
                name=name,
                shape=shape,
                role=role,
                layer=layer,
                kv_heads=_kv_heads(model, name) if role == KV_PROJECTION else None,
            )
        )
    architectures = raw.get("architectures")
    named = isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
    return ModelWeights(
        model_class=model_class.__name__,
        architecture=architectures[0] if named else model_class.__name__,
        tensors=tuple(tensors),
        tied_embeddings=tied,
        num_layers=num_layers,
        before_layers=frozenset(before),
    )


def model_weights(raw: Mapping[str, Any], num_layers: int) -> ModelWeights:
    """The weight tensors of the model the config ``raw`` describes (``num_layers`` decoder
    layers); a clear error when transformers is missing or does not know the model."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        raise ConfigError(
            "counting a model's parameters needs transformers, which is not installed "
            f"({HF_EXTRA_INSTALL}); or put the checkpoint's model.safetensors.index.json "
            "beside its config.json"
        ) from None
    if raw.get("model_type") not in CONFIG_MAPPING:
        raise ConfigError(
            f"transformers does not know model_type {raw.get('model_type')!r}, so the "
            "model's parameters cannot be counted; put the checkpoint's "
            "model.safetensors.index.json beside its config.json"
        )
    config_json = json.dumps(dict(raw), sort_keys=True, default=repr)
    try:
        return _read(config_json, num_layers)
    except ConfigError:
        raise
    except Exception as error:  # transformers' model code failing on this config
        raise ConfigError(
            f"transformers could not build model_type {raw.get('model_type')!r} on the meta "
            f"device to count its parameters ({type(error).__name__}: {error}); put the "
            "checkpoint's model.safetensors.index.json beside its config.json"
        ) from None
