"""KV-cache dtypes and quantisation modes as data.

A quant mode says how many bits one K and one V element take and how many scale bytes each
(token, head) pair carries; a KV-cache dtype is an engine-facing name (``fp8``,
``int8_per_token_head``, ...) bound to a storage torch dtype and a quant mode. Plugins add
new ones through the ``kvspec_register_kv_dtypes`` hook; nothing else hard-codes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction

import attrs
import torch

from kvspec_core.arithmetic import cdiv
from kvspec_core.errors import InvalidFieldError, PluginError, UnknownNameError
from kvspec_core.validation import (
    instance_of,
    is_bool,
    non_empty_str,
    non_negative_int,
    optional,
    tuple_of,
)


def _positive_bits(instance: object, attribute: attrs.Attribute[object], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, Fraction)) or not 0 < value <= 64:
        raise InvalidFieldError(
            type(instance).__name__, attribute.name, value, "must be an int or Fraction in (0, 64]"
        )


@attrs.frozen(kw_only=True)
class KVQuantMode:
    """How K/V elements are stored when quantised.

    Attributes:
        name: stable identifier (``"fp8_per_tensor"``).
        key_bits / value_bits: bits per K / V element; ``None`` means the storage dtype's width.
        scale_bytes_per_token_head: bytes of scales (and zero points) stored with each
            (token, head) pair, K and V together.
        per_token_head: whether scales are dynamic per token-head.
    """

    name: str = attrs.field(validator=non_empty_str)
    key_bits: Fraction | int | None = attrs.field(default=None, validator=optional(_positive_bits))
    value_bits: Fraction | int | None = attrs.field(
        default=None, validator=optional(_positive_bits)
    )
    scale_bytes_per_token_head: int = attrs.field(default=0, validator=non_negative_int)
    per_token_head: bool = attrs.field(default=False, validator=is_bool)

    @property
    def is_quantized(self) -> bool:
        return self.name != "none"

    def element_bits(self, dtype: torch.dtype) -> tuple[Fraction, Fraction]:
        """Bits of one K and one V element stored in ``dtype`` under this mode."""
        width = dtype.itemsize * 8
        key_bits = self.key_bits if self.key_bits is not None else width
        value_bits = self.value_bits if self.value_bits is not None else width
        return Fraction(key_bits), Fraction(value_bits)

    def content_bytes(self, head_size: int, head_size_v: int, dtype: torch.dtype) -> int:
        """Bytes one (token, head) cell takes: K and V elements, packed, plus scales."""
        key_bits, value_bits = self.element_bits(dtype)
        packed = head_size * key_bits + head_size_v * value_bits
        return cdiv(packed.numerator, packed.denominator * 8) + self.scale_bytes_per_token_head


NO_QUANT = KVQuantMode(name="none")

#: The quant modes the core knows: every mode of the reference engine. Per-token-head scales
#: default to one float32 for K and one for V (8 bytes); int4 adds asymmetric zero points as
#: float16 scale + zero point for K and V (8 bytes); NVFP4 stores an fp8 scale per 16 elements
#: (modelled as 4.5 bits per element); TurboQuant stores a float16 norm for K and V (4 bytes).
BUILTIN_QUANT_MODES: tuple[KVQuantMode, ...] = (
    NO_QUANT,
    KVQuantMode(name="fp8_per_tensor", key_bits=8, value_bits=8),
    KVQuantMode(
        name="int8_per_token_head",
        key_bits=8,
        value_bits=8,
        scale_bytes_per_token_head=8,
        per_token_head=True,
    ),
    KVQuantMode(
        name="fp8_per_token_head",
        key_bits=8,
        value_bits=8,
        scale_bytes_per_token_head=8,
        per_token_head=True,
    ),
    KVQuantMode(
        name="int4_per_token_head",
        key_bits=4,
        value_bits=4,
        scale_bytes_per_token_head=8,
        per_token_head=True,
    ),
    # 4 data bits + one 8-bit scale per 16 elements = 4.5 bits per element.
    KVQuantMode(name="nvfp4", key_bits=Fraction(9, 2), value_bits=Fraction(9, 2)),
    KVQuantMode(name="turboquant_k8v4", key_bits=8, value_bits=4, scale_bytes_per_token_head=4),
    KVQuantMode(name="turboquant_4bit_nc", key_bits=4, value_bits=4, scale_bytes_per_token_head=4),
    KVQuantMode(name="turboquant_k3v4_nc", key_bits=3, value_bits=4, scale_bytes_per_token_head=4),
    KVQuantMode(name="turboquant_3bit_nc", key_bits=3, value_bits=3, scale_bytes_per_token_head=4),
    # Opaque byte layout; the MLA plugin sizes its pages from the cache dtype string.
    KVQuantMode(name="nvfp4_ds_mla"),
)


@attrs.frozen(kw_only=True)
class KVCacheDtype:
    """An engine-facing KV-cache dtype name.

    Attributes:
        name: the name users pass (``--kv-cache-dtype fp8``).
        storage_dtype: torch dtype of the cache views; ``None`` means the model's dtype
            (only ``auto``).
        quant_mode: how elements are quantised.
        aliases: other names for the same thing.
    """

    name: str = attrs.field(validator=non_empty_str)
    storage_dtype: torch.dtype | None = attrs.field(
        validator=optional(instance_of(torch.dtype, "expected a torch.dtype"))
    )
    quant_mode: KVQuantMode = attrs.field(
        default=NO_QUANT, validator=instance_of(KVQuantMode, "expected a KVQuantMode")
    )
    aliases: tuple[str, ...] = attrs.field(
        default=(), validator=tuple_of(non_empty_str, "expected a tuple of names")
    )

    def resolve_storage(self, model_dtype: torch.dtype) -> torch.dtype:
        """The torch dtype a cache of this kind is stored in for a model of ``model_dtype``."""
        return self.storage_dtype if self.storage_dtype is not None else model_dtype


BUILTIN_KV_CACHE_DTYPES: tuple[KVCacheDtype, ...] = (
    KVCacheDtype(name="auto", storage_dtype=None),
    KVCacheDtype(name="bfloat16", storage_dtype=torch.bfloat16, aliases=("bf16",)),
    KVCacheDtype(name="float16", storage_dtype=torch.float16, aliases=("half", "fp16")),
    KVCacheDtype(name="float32", storage_dtype=torch.float32, aliases=("float", "fp32")),
    KVCacheDtype(
        name="fp8",
        storage_dtype=torch.float8_e4m3fn,
        quant_mode=BUILTIN_QUANT_MODES[1],
        aliases=("fp8_e4m3",),
    ),
    KVCacheDtype(
        name="fp8_e5m2", storage_dtype=torch.float8_e5m2, quant_mode=BUILTIN_QUANT_MODES[1]
    ),
    KVCacheDtype(
        name="int8_per_token_head", storage_dtype=torch.int8, quant_mode=BUILTIN_QUANT_MODES[2]
    ),
    KVCacheDtype(
        name="fp8_per_token_head",
        storage_dtype=torch.float8_e4m3fn,
        quant_mode=BUILTIN_QUANT_MODES[3],
    ),
    KVCacheDtype(
        name="int4_per_token_head", storage_dtype=torch.uint8, quant_mode=BUILTIN_QUANT_MODES[4]
    ),
    KVCacheDtype(name="nvfp4", storage_dtype=torch.uint8, quant_mode=BUILTIN_QUANT_MODES[5]),
    *(
        KVCacheDtype(name=mode.name, storage_dtype=torch.uint8, quant_mode=mode)
        for mode in BUILTIN_QUANT_MODES[6:10]
    ),
    KVCacheDtype(
        name="nvfp4_ds_mla", storage_dtype=torch.uint8, quant_mode=BUILTIN_QUANT_MODES[10]
    ),
)


class KVDtypeRegistry:
    """Known KV-cache dtypes by name and alias; one per plugin manager, never global."""

    def __init__(self) -> None:
        self._by_name: dict[str, KVCacheDtype] = {}
        self._owner: dict[str, str] = {}

    def register(self, kv_dtype: KVCacheDtype, owner: str) -> None:
        """Add ``kv_dtype``; a name another owner registered is refused naming both."""
        if not isinstance(kv_dtype, KVCacheDtype):
            raise PluginError(
                f"plugin {owner!r} registered {kv_dtype!r} as a KV dtype; expected a KVCacheDtype"
            )
        names = (kv_dtype.name, *kv_dtype.aliases)
        folded = {known.casefold(): known for known in self._by_name}
        for name in names:
            if name in self._by_name and self._by_name[name] != kv_dtype:
                raise PluginError(
                    f"KV dtype name {name!r} registered by {owner!r} is already registered by "
                    f"{self._owner[name]!r}"
                )
            known = folded.get(name.casefold())
            if known is not None and known != name and self._by_name[known] != kv_dtype:
                # --kv-cache-dtype FP8 picking a plugin's dtype where fp8 is the core's would
                # be a silent surprise: names differing only in case are one name.
                raise PluginError(
                    f"KV dtype name {name!r} registered by {owner!r} differs only in case from "
                    f"{known!r}, registered by {self._owner[known]!r}; choose another name"
                )
        for name in names:
            # An identical re-registration keeps the first owner, so that a later rollback of
            # the repeating plugin cannot remove a dtype the first one still provides.
            if name not in self._by_name:
                self._by_name[name] = kv_dtype
                self._owner[name] = owner

    def remove_owner(self, owner: str) -> None:
        """Drop everything ``owner`` registered (rollback of a failed plugin)."""
        for name in [n for n, o in self._owner.items() if o == owner]:
            del self._by_name[name]
            del self._owner[name]

    def owner_of(self, name: str) -> str:
        self.get(name)
        return self._owner[name]

    def get(self, name: str) -> KVCacheDtype:
        """The KV dtype called ``name``; an unknown name is refused listing the known ones."""
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown KV cache dtype {name!r}; known: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __iter__(self) -> Iterator[KVCacheDtype]:
        return iter({id(d): d for d in self._by_name.values()}.values())
