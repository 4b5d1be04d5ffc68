"""Spec classes of the core: the protocol and the families every model needs."""

from kvspec_core.specs.attention import AttentionSpec
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.encoder import CrossAttentionSpec, EncoderOnlyAttentionSpec
from kvspec_core.specs.full_attention import FullAttentionSpec, SinkFullAttentionSpec
from kvspec_core.specs.kv_sharing import KVSharingSpec
from kvspec_core.specs.serialization import spec_from_dict, spec_to_dict
from kvspec_core.specs.uniform import UniformTypeSpecs, iter_layer_specs

__all__ = [
    "AttentionSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "KVSharingSpec",
    "KVSpec",
    "SinkFullAttentionSpec",
    "UniformTypeSpecs",
    "iter_layer_specs",
    "spec_from_dict",
    "spec_to_dict",
]
