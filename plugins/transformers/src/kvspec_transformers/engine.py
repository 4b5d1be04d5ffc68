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
save a reusable state only where a step ends); each decode step allocates one slot. The
model's cache is a :class:`KVSpecCache` of layer adapters and its attention implementation
the paged one
(:mod:`kvspec_transformers.paged_attention`): K/V are written to and read from the views.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DummyLayer

from kvspec_core import load_plugins
from kvspec_core.dtypes import dtype_name
from kvspec_core.models.fields import DTYPE_FIELDS
from kvspec_core.models.normalized import ModelConfig
from kvspec_core.models.planning import prepare_model
from kvspec_core.planner import materialize
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.views import KVCacheBuffers
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.remote_tier import RemoteTier
from kvspec_core.runtime.results import CachedPrefix
from kvspec_core.runtime.tiers import TieredPrefix, tiers_from_plan
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.encoder import CrossAttentionSpec, EncoderOnlyAttentionSpec
from kvspec_core.specs.kv_sharing import KVSharingSpec
from kvspec_transformers.adapter_registry import adapter_for
from kvspec_transformers.cache import KVSpecCache
from kvspec_transformers.errors import EngineError
from kvspec_transformers.generation import Generation
from kvspec_transformers.layer_adapters import LayerAdapter, LayerBinding, PagedAttentionLayer
from kvspec_transformers.model_layout import (
    check_plan_against_model,
    check_sharing_against_model,
    model_kv_sources,
)
from kvspec_transformers.offload import StepTransfers, tier_storage
from kvspec_transformers.paged_attention import (
    ATTENTION_NAME,
    CACHE_KWARG,
    register_paged_attention,
)
from kvspec_transformers.prompts import (
    max_new_tokens_of,
    prompt_token_ids_of,
    request_id_of,
    stop_token_ids_of,
)
from kvspec_transformers.remote import RemoteOptions, remote_tier
from kvspec_transformers.step import StepContext

#: Default cache budget: a few hundred-token requests of the shrunk test models.
DEFAULT_BUDGET_BYTES = 16 << 20


def _own_spec(spec: KVSpec) -> KVSpec:
    """The spec a layer computes with: a reader's ``reader_spec`` (its family and window,
    which the planner checked merge with its source's), else the layer's spec."""
    return spec.reader_spec if isinstance(spec, KVSharingSpec) else spec


#: Optional constructor arguments: the type each must have when given, and what to pass.
_OPTIONAL_ARGUMENTS: tuple[tuple[str, type, str], ...] = (
    ("kvspec_config", Mapping, "a config dict (a parsed config.json) or None to plan model.config"),
    (
        "manager",
        PluginManager,
        "a kvspec PluginManager (kvspec_core.load_plugins()) or None for the installed plugins",
    ),
    (
        "options",
        PlanOptions,
        "kvspec_core.plugins.layer_config.PlanOptions(...) (e.g. PlanOptions(block_size=8)) "
        "or None for the defaults",
    ),
)


def _check_arguments(model: object, enable_prefix_caching: object, **optional: object) -> None:
    """Refuse arguments of the wrong type up front, naming the field: otherwise they fail
    deep in planning with an ``AttributeError`` / ``TypeError`` (or, a string
    ``enable_prefix_caching="no"``, are silently taken as true)."""
    if not isinstance(model, PreTrainedModel):
        raise EngineError(
            f"model is a {type(model).__name__}; pass a transformers causal LM "
            "(a PreTrainedModel, e.g. AutoModelForCausalLM.from_config(...))"
        )
    for name, kind, expected in _OPTIONAL_ARGUMENTS:
        value = optional[name]
        if value is not None and not isinstance(value, kind):
            raise EngineError(f"{name} is a {type(value).__name__}; pass {expected}")
    if not isinstance(enable_prefix_caching, bool):
        raise EngineError(
            f"enable_prefix_caching={enable_prefix_caching!r} "
            f"({type(enable_prefix_caching).__name__}); pass True or False"
        )


def _check_one_rank(options: PlanOptions) -> None:
    """The engine runs the whole model in this one process: a plan for several TP ranks
    holds one rank's share of the KV heads (the model writes them all), and DCP shards
    token positions across ranks that do not exist; both failed later with misleading
    shape or slot errors."""
    for field in ("tensor_parallel_size", "decode_context_parallel_size"):
        value = getattr(options, field)
        if value != 1:
            raise EngineError(
                f"options.{field}={value}: the engine runs the whole model as one rank (one "
                f"process, every KV head and token), but a plan with {field} > 1 caches one "
                f"rank's share; plan with {field}=1"
            )


def _own_config(model: PreTrainedModel) -> dict[str, Any]:
    """``model.config`` as kvspec plans it. A model built without a dtype
    (``LlamaForCausalLM(config)``) has a config naming none, for which kvspec assumes
    bfloat16; the engine knows the parameters' dtype, so it names that one."""
    config = model.config.to_dict()
    if all(config.get(field) in (None, "auto") for field in DTYPE_FIELDS):
        config["dtype"] = dtype_name(model.dtype)
    return config


def _check_cache_dtype(
    model: PreTrainedModel, source: ModelConfig, options: PlanOptions, own_config: bool
) -> None:
    """With ``kv_cache_dtype`` "auto" kvspec stores K/V in the *config's* dtype. A real
    config.json names the checkpoint's dtype (often bfloat16) while the model may run in
    another (float32): every K/V would be rounded on its way into the cache, and the
    tokens would drift from transformers' with no error. An explicit ``kv_cache_dtype`` is
    a deliberate choice and is left alone."""
    if options.kv_cache_dtype != "auto":
        return
    model_dtype = model.dtype
    if source.dtype == model_dtype:
        return
    where = "model.config" if own_config else "kvspec_config"
    if source.dtype_field is not None:
        said = f"{where}'s {source.dtype_field!r} is {dtype_name(source.dtype)}"
    else:
        said = f"{where} names no dtype, so kvspec assumed {dtype_name(source.dtype)}"
    raise EngineError(
        f"the model's parameters are {dtype_name(model_dtype)} but {said}; with "
        "kv_cache_dtype 'auto' the cache would store K/V in that dtype, silently rounding "
        f"them. Set {where}'s 'dtype' / 'torch_dtype' to "
        f"{dtype_name(model_dtype)!r}, or pass options=PlanOptions(kv_cache_dtype=...) to "
        "choose the cache's dtype explicitly"
    )


def _release(files: Sequence[str], stores: Sequence[Any]) -> None:
    """What an engine owns outside Python objects: the remote stores' connections and the
    disk tier's files. A module function, not a method: ``weakref.finalize`` must not hold
    the engine (it would never be collected)."""
    for store in stores:
        store.close()
    for path in files:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


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
        host_offload_bytes: bytes of host memory for an offload tier below the device
            (``None``: none). Cached blocks the device evicts are copied there instead of
            lost, and a later request's prefix found there is loaded back before its
            forward (:mod:`kvspec_transformers.offload`). Needs prefix caching.
        disk_offload_bytes / disk_path: a disk tier below the host one: bytes, and an
            existing directory the engine creates its files in (one per pool; refused if
            one is there already; :meth:`close` removes them). Both or neither.
        remote: share prefix blocks with other replicas through a Redis/Valkey server
            (:class:`~kvspec_transformers.remote.RemoteOptions`; ``None``: no sharing).
            Needs the host tier: fetched blocks land there. ``engine.remote.counters``
            and ``engine.remote.store.counters`` say what it did.

    Refused at start (:class:`EngineError`, naming the field): arguments of the wrong type;
    ``tensor_parallel_size`` or ``decode_context_parallel_size`` other than 1 (the engine is
    one rank); with ``kv_cache_dtype`` "auto", a config dtype other than the model's (the
    cache would round K/V); a model whose attention does not go through transformers'
    ``AttentionInterface``. A refusal leaves no disk tier file behind.

    The disk tier's files and remote connections are released by :meth:`close`, by leaving
    a ``with TransformersEngine(...) as engine:`` block, or, for an engine dropped without
    either, when it is garbage-collected (or at interpreter exit).
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
        host_offload_bytes: int | None = None,
        disk_offload_bytes: int | None = None,
        disk_path: str | None = None,
        remote: RemoteOptions | None = None,
    ) -> None:
        _check_arguments(
            model,
            enable_prefix_caching,
            kvspec_config=kvspec_config,
            manager=manager,
            options=options,
        )
        options = options if options is not None else PlanOptions()
        _check_one_rank(options)
        if remote is not None and not isinstance(remote, RemoteOptions):
            raise EngineError(
                f"remote must be a kvspec_transformers.RemoteOptions, not {type(remote).__name__}"
            )
        if remote is not None and host_offload_bytes is None:
            raise EngineError(
                "remote needs a host tier (blocks fetched from other replicas land there, and "
                "the blocks published are those the device writes back to it): give "
                "host_offload_bytes"
            )
        if not enable_prefix_caching and (
            host_offload_bytes is not None or disk_offload_bytes is not None
        ):
            raise EngineError(
                "offload tiers keep prefix-cache blocks, but enable_prefix_caching=False: "
                "drop host_offload_bytes / disk_offload_bytes, or enable prefix caching"
            )
        self.model = model
        self.manager = manager if manager is not None else load_plugins()
        config = dict(kvspec_config) if kvspec_config is not None else _own_config(model)
        own_config = kvspec_config is None
        prepared = prepare_model(
            config,
            options,
            self.manager,
            max_model_len=max_model_len,
            host_offload_bytes=host_offload_bytes,
            disk_offload_bytes=disk_offload_bytes,
            disk_path=disk_path,
        )
        _check_cache_dtype(model, prepared.model.source, options, own_config)
        self.plan: KVCachePlan = prepared.plan(budget_bytes, self.manager).plan
        text_config = model.config.get_text_config()
        self._check_sharing(model, prepared.model.layers, text_config, own_config)
        # A reader is checked by the spec it reads through (its source's kind and window).
        planned_layers = {name for group in self.plan.groups for name in group.layers}
        planned_layers.update(reader for reader, _ in self.plan.kv_sharing)
        check_plan_against_model(
            text_config,
            {
                layer.index: (layer.name, _own_spec(prepared.specs[layer.name]))
                for layer in prepared.model.layers
                if layer.name in planned_layers
            },
            max_model_len,
            own_config=own_config,
        )
        self.buffers: KVCacheBuffers = materialize(self.plan, device="cpu")
        # Registered the moment the disk tier's files exist: an engine dropped without
        # close() would otherwise leave them, and a new engine refuses their directory.
        self._stores: list[Any] = []
        self._finalizer = weakref.finalize(
            self,
            _release,
            [path for tier in self.buffers.tiers.values() for path in tier.files.values()],
            self._stores,
        )
        #: Fetches other replicas' blocks before each lookup, and publishes this one's
        #: (``None`` without ``remote``).
        self.remote: RemoteTier | None = None
        try:
            self.allocator = KVCacheAllocator.from_plan(
                self.plan,
                self.manager,
                enable_prefix_caching=enable_prefix_caching,
                offload_tiers=tiers_from_plan(self.plan),
                hash_salt=None if remote is None else remote.hash_salt,
            )
            #: Runs the allocator's copies between the tiers before each forward.
            self.transfers = StepTransfers(self.allocator, tier_storage(self.buffers))
            if remote is not None:
                self.remote = remote_tier(remote, self.plan, self.allocator, self.transfers.runner)
                self._stores.extend(self.remote.stores.values())
                self.transfers.remote = self.remote
            self.bindings = self._bind(prepared.model.layers, prepared.specs)
            self.cache = KVSpecCache(self._layers())
            if self.allocator.enable_prefix_caching:
                self._check_resumable()
            # Last: the only step that changes the caller's model.
            _use_paged_attention(model)
        except BaseException:
            # Refused after materialize made the disk tier's files: remove them (the caller
            # gets no engine to close, and a new engine refuses a directory holding them).
            self._release_resources()
            raise
        # transformers >= 5 names the forward argument ``cache``; earlier ``past_key_values``.
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._ids = itertools.count()
        # One request at a time: the cache's current step, the layer adapters' bound state
        # and the allocator are shared by every call.
        self._lock = threading.Lock()
        self._running_thread: int | None = None

    # ----------------------------------------------------------------- binding
    def _check_sharing(
        self, model: Any, layers: Sequence[Any], text_config: Any, own_config: bool
    ) -> None:
        """Refuse a plan whose cross-layer KV sharing is not the model's (see
        :func:`check_sharing_against_model`)."""
        index_of = {layer.name: layer.index for layer in layers}
        check_sharing_against_model(
            model_kv_sources(model),
            {index_of[reader]: index_of[source] for reader, source in self.plan.kv_sharing},
            {layer.index: layer.name for layer in layers},
            getattr(text_config, "num_kv_shared_layers", None),
            own_config=own_config,
        )

    def _bind(self, layers: Sequence[Any], specs: Mapping[str, Any]) -> dict[int, LayerBinding]:
        group_of = {name: group.id for group in self.plan.groups for name in group.layers}
        bindings: dict[int, LayerBinding] = {}
        for layer in layers:
            source = self.plan.kv_source_of(layer.name)
            if layer.name not in group_of and source is None:
                continue  # memoryless (no blocks): nothing cached for it
            spec = _own_spec(specs[layer.name])
            if isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
                raise EngineError(
                    f"layer {layer.name} is {spec.kind}: kvspec-transformers runs decoder-only "
                    "causal LMs (no encoder, no cross-attention cache); run this "
                    "encoder-decoder model with transformers' own generate"
                )
            if layer.index in bindings:
                raise EngineError(
                    f"layers {bindings[layer.index].layer_name} and {layer.name} both have "
                    f"index {layer.index}; the engine binds one cache layer per decoder layer"
                )
            # A reader reads its source's blocks: the source's group (block table) and a
            # view aliasing the source's bytes, through its own spec (the same cache).
            bindings[layer.index] = LayerBinding(
                layer_index=layer.index,
                layer_name=layer.name,
                group=self.plan.cache_group_of(layer.name).id,
                spec=spec,
                view=self.buffers.views[layer.name],
                context=self.plan.context,
                source_layer=source,
            )
        return bindings

    def _layers(self) -> list[LayerAdapter | DummyLayer]:
        count = int(self.model.config.num_hidden_layers)
        stray = sorted(index for index in self.bindings if index >= count)
        if stray:
            raise EngineError(
                f"kvspec planned layer {self.bindings[stray[0]].layer_name} but the model has "
                f"{count} layers; plan the model's own config"
            )
        layers = [
            adapter_for(self.bindings[index]) if index in self.bindings else DummyLayer()
            for index in range(count)
        ]
        for layer in layers:
            binding: LayerBinding | None = getattr(layer, "binding", None)
            if (
                binding is not None
                and binding.source_layer is not None
                and not isinstance(layer, PagedAttentionLayer)
            ):
                raise EngineError(
                    f"layer {binding.layer_name} reads layer {binding.source_layer}'s KV "
                    f"cache (plan.kv_sharing) through a {type(layer).__name__}; "
                    "kvspec-transformers runs such layers with attention adapters only"
                )
        return layers

    def _check_resumable(self) -> None:
        """Prefix caching resumes state layers mid-sequence (after a hit, and at the step
        ends a prefill is split at); refuse it where the model's mixer cannot."""
        for adapter in self.cache.adapters:
            reason = getattr(adapter, "no_resume_reason", None)
            if reason is not None:
                raise EngineError(
                    f"layer {adapter.binding.layer_name}: {reason}; build the engine with "
                    "enable_prefix_caching=False (every request then computes its whole "
                    "prompt in one step from a zero state, as transformers does)"
                )

    def close(self) -> None:
        """Remove the disk tier's files (the engine made them; a new engine refuses a
        directory holding them) and close the remote stores' connections. The engine must
        not be used afterwards. Idempotent; an engine never closed releases them when it is
        garbage-collected."""
        with self._lock:
            self._release_resources()

    def __enter__(self) -> TransformersEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _release_resources(self) -> None:
        # The finalizer runs its callback once: later calls (and the collection) do nothing.
        self._finalizer()

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """Every planned layer's ``materialize()`` view, by kvspec layer name."""
        return self.buffers.views

    # ----------------------------------------------------------------- requests
    def generate(
        self,
        prompt_token_ids: Iterable[Any],
        max_new_tokens: int,
        *,
        request_id: str | None = None,
        stop_token_ids: Iterable[Any] | int | None = (),
    ) -> Generation:
        """Greedy decoding of ``prompt_token_ids`` for up to ``max_new_tokens`` tokens,
        reusing any cached prefix; the request's blocks are freed (and stay cached) after.

        ``prompt_token_ids``: Python ints, numpy integers or a 1-d integer array / tensor
        (see :mod:`kvspec_transformers.prompts`); ``max_new_tokens`` an integer (numpy's
        too); ``stop_token_ids`` None, token ids, or one token id (an int, as
        ``tokenizer.eos_token_id``); ``request_id`` None or a non-empty str. Generation
        stops at ``max_new_tokens``, at a stop token, or where the sequence (prompt and
        generated tokens) reaches ``max_model_len`` (``finish_reason`` ``"length"``, as
        vLLM). Calls from several
        threads run one after the other (the engine computes one request at a time). If
        the model's forward raises (or is interrupted), the error propagates and the blocks
        whose K/V it had not written leave the prefix cache
        (:meth:`KVCacheAllocator.discard_uncomputed`), so no later request hits them."""
        max_new_tokens = max_new_tokens_of(max_new_tokens)
        prompt = self._check_prompt(prompt_token_ids)
        stops = stop_token_ids_of(stop_token_ids, self._vocab_size())
        request_id = request_id_of(request_id)
        if self._running_thread == threading.get_ident():
            # Waiting on the lock would hang this thread forever.
            raise EngineError(
                "generate was called from inside a running generate on the same thread (a "
                "model hook?); the engine computes one request at a time: call it after the "
                "first returns"
            )
        with self._lock:
            self._running_thread = threading.get_ident()
            try:
                rid = request_id if request_id is not None else f"request-{next(self._ids)}"
                return self._generate(rid, prompt, max_new_tokens, stops)
            finally:
                self._running_thread = None

    def _generate(
        self, rid: str, prompt: list[int], max_new_tokens: int, stops: frozenset[int]
    ) -> Generation:
        generated: list[int] = []
        # Tokens whose K/V (or state) the model has written: what a failure may keep cached.
        written = 0
        finish_reason = "length"
        # The admission is inside the try: an interrupt right after it (its blocks cached, no
        # K/V written yet) must discard them like any failed step.
        try:
            first_pass = True
            while True:
                # A failed load drops the request (the allocator discarded it and dropped
                # the tier copy that failed), so each retry finds a shorter prefix: the
                # loop ends, at the latest when no tier hit is left.
                request = Request(rid, list(prompt))
                if self.remote is not None and first_pass:
                    # Other replicas' blocks after the local hit -> the host tier (each
                    # store call ends by its deadline; a server down or slow costs misses).
                    # Only once: a retry that fetched again would put back the very block
                    # whose load failed, and a load that keeps failing would loop forever.
                    self.remote.fetch(request)
                first_pass = False
                prefix = self.allocator.find_cached_prefix(request)
                step_ends = self._prefill_step_ends(prefix, len(prompt))
                written = prefix.num_tokens
                if self._allocate(request, step_ends[0] - written, prefix):
                    break
            for end in step_ends:
                if end != step_ends[0]:
                    self._allocate_running(request, end - written)
                logits = self._forward(rid, prompt[written:end], written)
                written = end
            while True:
                token = int(torch.argmax(logits))
                generated.append(token)
                # vLLM's order: the length caps first, then stop tokens.
                if (
                    len(generated) >= max_new_tokens
                    or len(prompt) + len(generated) >= self.allocator.max_model_len
                ):
                    break
                if token in stops:
                    finish_reason = "stop"
                    break
                request.append_token(token)
                self._allocate_running(request, 1)
                logits = self._forward(rid, [token], written)
                written += 1
        except BaseException as error:
            self.transfers.abandon()
            if self.allocator.is_running(rid):
                self.allocator.discard_uncomputed(rid, written)
            if isinstance(error, EngineError) and generated:
                error.partial = self._generation(rid, prompt, generated, prefix, "error")
            raise
        self.allocator.free(rid)
        return self._generation(rid, prompt, generated, prefix, finish_reason)

    def _generation(
        self,
        rid: str,
        prompt: list[int],
        generated: list[int],
        prefix: CachedPrefix,
        finish_reason: str,
    ) -> Generation:
        names = self.allocator.tier_names
        by_tier = (
            prefix.tokens_by_tier
            if isinstance(prefix, TieredPrefix)
            else (prefix.num_tokens,) + (0,) * (len(names) - 1)
        )
        return Generation(
            request_id=rid,
            prompt_token_ids=tuple(prompt),
            token_ids=tuple(generated),
            cached_tokens=prefix.num_tokens,
            cached_tokens_by_tier=dict(zip(names, by_tier, strict=True)),
            prefill_tokens=len(prompt) - prefix.num_tokens,
            finish_reason=finish_reason,
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

    def _check_prompt(self, prompt_token_ids: Iterable[Any]) -> list[int]:
        prompt = prompt_token_ids_of(prompt_token_ids, self._vocab_size())
        limit = self.allocator.max_model_len
        if len(prompt) > limit:
            raise EngineError(
                f"the prompt has {len(prompt)} tokens, more than max_model_len={limit}; "
                "shorten it or build the engine with a larger max_model_len"
            )
        return prompt

    def _vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def _allocate(self, request: Request, num_tokens: int, prefix: CachedPrefix | None) -> bool:
        """``allocate_slots``, then the copies it recorded (stores of the blocks it evicted,
        loads of a tier hit it admitted), before the forward may overwrite or read them.
        ``False`` when a load failed: the allocator dropped the request (admit it again)."""
        result = self.allocator.allocate_slots(request, num_tokens, prefix=prefix)
        if not result:
            raise EngineError(
                f"request {request.request_id!r}: no slots for {num_tokens} tokens "
                f"({getattr(result, 'reason', '?')}): {getattr(result, 'message', '')}"
            )
        return request.request_id not in self.transfers.run()

    def _allocate_running(self, request: Request, num_tokens: int) -> None:
        """``_allocate`` for a request already admitted: it has no loads of its own (loads
        are recorded at admission only), so being dropped is a broken allocator contract."""
        if not self._allocate(request, num_tokens, None):
            raise EngineError(
                f"request {request.request_id!r} was dropped by a failed load after its "
                "admission; the allocator records loads at admission only (a kvspec bug)"
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


def _use_paged_attention(model: PreTrainedModel) -> None:
    """Switch ``model`` to the paged attention, or refuse it. A model whose attention does
    not go through transformers' ``AttentionInterface`` (Bloom, MPT, XGLM,
    GPT-NeoX-Japanese, Falcon) keeps its own attention (transformers only logs a warning):
    it would attend over the step's K/V alone and crash deep in its own code."""
    register_paged_attention()
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    configs = (model.config, model.config.get_text_config())
    settable = getattr(type(model), "_can_set_attn_implementation", None)
    if all(config._attn_implementation == ATTENTION_NAME for config in configs) and (
        settable is None or settable()
    ):
        return
    now = model.config._attn_implementation
    if now != before and before is not None:
        # A refusal leaves the caller's model as it was.
        model.set_attn_implementation(before)
    raise EngineError(
        f"{type(model).__name__} computes attention in its own code, not through "
        "transformers' AttentionInterface (its attention implementation stays "
        f"{now!r} after set_attn_implementation({ATTENTION_NAME!r})), so it cannot read "
        "K/V paged from kvspec's cache; run it with transformers' own generate "
        "(kvspec-transformers runs models such as Llama, Mistral, Gemma, GPT-2, OPT)"
    )
