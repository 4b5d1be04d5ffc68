"""kvspec-transformers: run Hugging Face transformers models on kvspec's KV cache.

Every layer's cache lives in kvspec ``materialize()`` views, blocks are placed by kvspec's
``KVCacheAllocator`` with prefix caching, and attention reads K/V paged from the block tables::

    from kvspec_transformers import TransformersEngine
    engine = TransformersEngine(model)
    engine.generate(prompt_token_ids, max_new_tokens=8).token_ids
"""

from kvspec_transformers.adapter_registry import adapter_for, register_layer_adapter
from kvspec_transformers.cache import KVSpecCache
from kvspec_transformers.engine import TransformersEngine
from kvspec_transformers.errors import EngineError
from kvspec_transformers.generation import Generation
from kvspec_transformers.layer_adapters import (
    LayerAdapter,
    LayerBinding,
    MLALatentLayer,
    PagedAttentionLayer,
    StepDriven,
)
from kvspec_transformers.models import build_model, read_config, shrink_config
from kvspec_transformers.paged_attention import ATTENTION_NAME, paged_attention_forward
from kvspec_transformers.remote import RemoteOptions
from kvspec_transformers.step import StepContext

__all__ = [
    "ATTENTION_NAME",
    "EngineError",
    "Generation",
    "KVSpecCache",
    "LayerAdapter",
    "LayerBinding",
    "MLALatentLayer",
    "PagedAttentionLayer",
    "RemoteOptions",
    "StepContext",
    "StepDriven",
    "TransformersEngine",
    "adapter_for",
    "build_model",
    "paged_attention_forward",
    "read_config",
    "register_layer_adapter",
    "shrink_config",
]
