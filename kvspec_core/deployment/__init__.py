"""What a model takes on a GPU besides its KV cache: the GPU catalog, the weights each rank
holds (from the checkpoint's safetensors metadata or an exact parameter count, split over
tensor and pipeline parallel ranks as vLLM shards them) and vLLM's overheads, so that
``kvspec plan MODEL --gpu NAME`` can give the planner the KV budget that is left.

A layer between the CLI and :mod:`kvspec_core.models`: it reads model configs, the CLI
reads it.
"""
