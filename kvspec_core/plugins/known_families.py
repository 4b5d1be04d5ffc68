"""Which distribution provides each family, so a missing one is named in errors."""

from __future__ import annotations

#: Spec kind name -> distribution that registers it.
KIND_DISTRIBUTIONS: dict[str, str] = {
    "mla_attention": "kvspec-mla",
    "sliding_window_mla": "kvspec-mla",
    "hidden_state_cache": "kvspec-mla",
    "circular_buffer": "kvspec-mla",
    "mamba": "kvspec-mamba",
    "sliding_window": "kvspec-sliding-window",
    "reference_sliding_window": "kvspec-sliding-window",
    "kpool_tail": "kvspec-sliding-window",
    "chunked_local_attention": "kvspec-chunked-local",
    "hisparse_hot": "kvspec-hisparse",
    "hisparse_resident": "kvspec-hisparse",
    "hisparse_group": "kvspec-hisparse",
}

#: Normalised layer type (see ``LayerConfig.layer_type``) -> distribution that claims it.
LAYER_TYPE_DISTRIBUTIONS: dict[str, str] = {
    "mla_attention": "kvspec-mla",
    "sliding_mla_attention": "kvspec-mla",
    "mamba": "kvspec-mamba",
    "linear_attention": "kvspec-mamba",
    "sliding_attention": "kvspec-sliding-window",
    "chunked_attention": "kvspec-chunked-local",
}


def install_hint(distribution: str) -> str:
    """How to install a bundled family's distribution: by name, or (not on PyPI yet) from
    its folder in a checkout."""
    folder = distribution.removeprefix("kvspec-").replace("-", "_")
    return f"pip install {distribution} (from a checkout: pip install plugins/{folder})"
