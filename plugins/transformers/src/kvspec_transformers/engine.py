"""A greedy, one-request-at-a-time engine running a transformers model on kvspec's cache.

::

    engine = TransformersEngine(model)          # plans model.config, materialises the views
    result = engine.generate(prompt_token_ids, max_new_tokens=8)
    result.token_ids, result.cached_tokens, result.prefill_tokens

What happens: kvspec plans the model's config (its own config ingestion and family plugins
give the layer specs), ``materialize()`` allocates the pools and views every layer, and a
``KVCacheAllocator`` with prefix caching places blocks. Each request looks up its cached
prefix, allocates the prefill's slots after it, and runs the model on the uncached suffix
only (in several steps where a layer adapter asks, see ``prefill_step_ends``: state layers
save a reusable state only where a step ends); each decode step allocates one slot. The model's cache is a :class:`KVSpecCache` of
layer adapters and its attention implementation the paged one
(:mod:`kvspec_transformers.paged_attention`): K/V are written to and read from the views.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DummyLayer

from kvspec_core import load_plugins
from kvspec_core.errors import ConfigError, KVSpecError
from kvspec_core.models.planning import prepare_model
from kvspec_core.planner import materialize
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.views import KVCacheBuffers
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.results import CachedPrefix
from kvspec_transformers.cache import KVSpecCache
from kvspec_transformers.layer_adapters import LayerAdapter, LayerBinding, adapter_for
from kvspec_transformers.paged_attention import (
    ATTENTION_NAME,
    CACHE_KWARG,
    register_paged_attention,
)
from kvspec_transformers.step import StepContext

#: Default cache budget: a few hundred-token requests of the shrunk test models.
DEFAULT_BUDGET_BYTES = 16 << 20


class EngineError(KVSpecError, RuntimeError):
    """The engine could not run a request (no blocks, a bad prompt, a model it cannot bind)."""


@attrs.frozen(kw_only=True)
class Generation:
    """One finished request.

    Attributes:
        request_id: the id it ran under.
        prompt_token_ids: the prompt.
        token_ids: the generated tokens (greedy).
        cached_tokens: prompt tokens found in the prefix cache (not recomputed).
        prefill_tokens: prompt tokens the prefill step computed (``len(prompt) - cached``).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    cached_tokens: int
    prefill_tokens: int


class TransformersEngine:
    """Runs ``model`` (a transformers causal LM) with every layer's cache in kvspec views.

    Args:
        model: the model; its attention implementation is switched to the paged one.
        kvspec_config: the config dict kvspec plans (default: ``model.config.to_dict()``).
        manager: the kvspec plugin manager (default: installed plugins).
        max_model_len: longest request admitted.
        budget_bytes: bytes of KV cache the plan may use.
        options: kvspec planning options (block size, KV dtype...).
        enable_prefix_caching: reuse cached prefixes across requests.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        kvspec_config: Mapping[str, Any] | None = None,
        manager: PluginManager | None = None,
        max_model_len: int = 256,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        options: PlanOptions | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.model = model
        self.manager = manager if manager is not None else load_plugins()
        config = dict(kvspec_config) if kvspec_config is not None else model.config.to_dict()
        prepared = prepare_model(
            config, options if options is not None else PlanOptions(), self.manager,
            max_model_len=max_model_len,
        )
        self.plan: KVCachePlan = prepared.plan(budget_bytes, self.manager).plan
        self.buffers: KVCacheBuffers = materialize(self.plan, device="cpu")
        self.allocator = KVCacheAllocator.from_plan(
            self.plan, self.manager, enable_prefix_caching=enable_prefix_caching
        )
        self.bindings = self._bind(prepared.model.layers, prepared.specs)
        self.cache = KVSpecCache(self._layers())
        register_paged_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        # transformers >= 5 names the forward argument ``cache``; earlier ``past_key_values``.
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._ids = itertools.count()

    # ----------------------------------------------------------------- binding
    def _bind(self, layers: Sequence[Any], specs: Mapping[str, Any]) -> dict[int, LayerBinding]:
        group_of = {name: group.id for group in self.plan.groups for name in group.layers}
        bindings = {}
        for layer in layers:
            if layer.name not in group_of:
                continue  # memoryless (no blocks): nothing cached for it
            bindings[layer.index] = LayerBinding(
                layer_index=layer.index,
                layer_name=layer.name,
                group=group_of[layer.name],
                spec=specs[layer.name],
                view=self.buffers.views[layer.name],
                context=self.plan.context,
            )
        return bindings

    def _layers(self) -> list[LayerAdapter | DummyLayer]:
        count = int(getattr(self.model.config, "num_hidden_layers"))
        stray = sorted(index for index in self.bindings if index >= count)
        if stray:
            raise EngineError(
                f"kvspec planned layer {self.bindings[stray[0]].layer_name} but the model has "
                f"{count} layers; plan the model's own config"
            )
        return [
            adapter_for(self.bindings[index]) if index in self.bindings else DummyLayer()
            for index in range(count)
        ]

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """Every planned layer's ``materialize()`` view, by kvspec layer name."""
        return self.buffers.views

    # ----------------------------------------------------------------- requests
    def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        request_id: str | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> Generation:
        """Greedy decoding of ``prompt_token_ids`` for up to ``max_new_tokens`` tokens,
        reusing any cached prefix; the request's blocks are freed (and stay cached) after."""
        prompt = self._check_prompt(prompt_token_ids, max_new_tokens)
        rid = request_id if request_id is not None else f"request-{next(self._ids)}"
        request = Request(rid, list(prompt))
        prefix = self.allocator.find_cached_prefix(request)
        step_ends = self._prefill_step_ends(prefix, len(prompt))
        self._allocate(request, step_ends[0] - prefix.num_tokens, prefix)
        generated: list[int] = []
        try:
            computed = prefix.num_tokens
            for end in step_ends:
                if computed > prefix.num_tokens:
                    self._allocate(request, end - computed, None)
                logits = self._forward(rid, prompt[computed:end], computed)
                computed = end
            while True:
                token = int(torch.argmax(logits))
                generated.append(token)
                if len(generated) >= max_new_tokens or token in stop_token_ids:
                    break
                request.append_token(token)
                self._allocate(request, 1, None)
                logits = self._forward(rid, [token], len(request.token_ids) - 1)
        finally:
            self.allocator.free(rid)
        return Generation(
            request_id=rid,
            prompt_token_ids=tuple(prompt),
            token_ids=tuple(generated),
            cached_tokens=prefix.num_tokens,
            prefill_tokens=len(prompt) - prefix.num_tokens,
        )

    def _prefill_step_ends(self, prefix: CachedPrefix, num_tokens: int) -> list[int]:
        """Where the prefill's steps end: the prompt's end, plus (with prefix caching) every
        end a layer adapter asks for; state layers save a reusable state only where a step
        ends on a block boundary."""
        ends = {num_tokens}
        if self.allocator.enable_prefix_caching:
            for adapter in self.cache.adapters:
                ask = getattr(adapter, "prefill_step_ends", None)
                if ask is not None:
                    ends.update(ask(prefix.num_tokens, num_tokens, prefix.checkpoint_at))
        return sorted(end for end in ends if end > prefix.num_tokens)

    def _check_prompt(self, prompt_token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
            max_new_tokens < 1
        ):
            raise EngineError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
        prompt = list(prompt_token_ids)
        vocab = int(getattr(self.model.config, "vocab_size"))
        if not prompt:
            raise EngineError("prompt_token_ids is empty; give at least one token")
        for index, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise EngineError(
                    f"prompt_token_ids[{index}]={token!r} must be a token id in [0, {vocab})"
                )
        return prompt

    def _allocate(self, request: Request, num_tokens: int, prefix: CachedPrefix | None) -> None:
        result = self.allocator.allocate_slots(request, num_tokens, prefix=prefix)
        if not result:
            if self.allocator.is_running(request.request_id):
                self.allocator.free(request.request_id)
            raise EngineError(
                f"request {request.request_id!r}: no slots for {num_tokens} tokens "
                f"({getattr(result, 'reason', '?')}): {getattr(result, 'message', '')}"
            )

    def _forward(self, request_id: str, tokens: Sequence[int], start: int) -> torch.Tensor:
        step = StepContext(
            request_id=request_id,
            start=start,
            num_tokens=len(tokens),
            block_tables=self.allocator.block_ids(request_id),
        )
        self.cache.begin_step(step)
        arguments: dict[str, Any] = {
            "input_ids": torch.tensor([list(tokens)], dtype=torch.long),
            "position_ids": step.positions.unsqueeze(0),
            self._cache_argument: self.cache,
            "use_cache": True,
            CACHE_KWARG: self.cache,
        }
        with torch.no_grad():
            output = self.model(**arguments)
        self.cache.finish_step(step)
        return output.logits[0, -1]
