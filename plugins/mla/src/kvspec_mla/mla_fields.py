"""Fields and page-size rules shared by the MLA specs (full and sliding-window).

Both spec classes derive from different core/plugin bases, so they declare the same fields
with these validators and take the page arithmetic from :class:`MLAPaging`.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvspec_core.arithmetic import round_up
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError
from kvspec_mla.formats import ds_mla_format, is_ds_mla_format

#: Roles a sparse-MLA cache plays (DeepSeek-V3.2/V4): the attention latent or the indexer keys.
CACHE_ROLES = ("sparse", "indexer")


class MLAPageFields(Protocol):
    """What the helpers below read from an MLA spec."""

    cache_dtype_str: str | None
    model_version: str | None
    alignment: int | None
    head_size: int
    state_content_bytes: int | None
    page_size_padded: int | None


def check_cache_dtype_str(instance: Any, attribute: Any, value: object) -> None:
    """``None`` or a non-empty cache dtype string."""
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidFieldTypeError(
            type(instance).__name__, attribute.name, value, "expected None or a cache dtype str"
        )
    if not value:
        raise InvalidFieldError(
            type(instance).__name__,
            attribute.name,
            value,
            "must be None or a cache dtype name such as 'auto', 'fp8' or 'fp8_ds_mla'",
        )


def packed_record_bytes(spec: MLAPageFields) -> int | None:
    """Bytes of one token's packed ``*_ds_mla`` record, or ``None`` for a dense latent.

    A backend that publishes ``state_content_bytes`` overrides the table (the reference
    engine lets the attention backend publish its record size).
    """
    name = spec.cache_dtype_str
    if spec.state_content_bytes is not None or name is None or not is_ds_mla_format(name):
        return None
    record = ds_mla_format(type(spec).__name__, name, spec.model_version, spec.head_size)
    return record.bytes_per_token


def validate_mla_page(spec: MLAPageFields) -> None:
    """Refuse an unpublished packed record and a padded page that breaks the alignment."""
    packed_record_bytes(spec)
    if (
        spec.alignment is not None
        and spec.page_size_padded is not None
        and spec.page_size_padded % spec.alignment
    ):
        raise InvalidFieldError(
            type(spec).__name__,
            "page_size_padded",
            spec.page_size_padded,
            f"must be a multiple of alignment={spec.alignment} (or None, to pad the page up to "
            "the next multiple of alignment)",
        )


def aligned_page_size(spec: MLAPageFields, unpadded: int) -> int:
    """The page size: ``page_size_padded`` if set, else ``unpadded`` rounded up to
    ``alignment`` (the decode kernel's stride), else ``unpadded``."""
    if spec.page_size_padded is not None:
        return spec.page_size_padded
    if spec.alignment is not None:
        return round_up(unpadded, spec.alignment)
    return unpadded


class MLAPaging:
    """Mixin (listed before the attrs base) giving an MLA spec its cell and page size.

    The cell is the packed record when ``cache_dtype_str`` names one, else the base class's
    dense cell; the page is padded as :func:`aligned_page_size` says. The mixin has no
    fields (attrs ignores it); the spec class declares them.
    """

    __slots__ = ()

    def __attrs_post_init__(self) -> None:
        spec: Any = self
        validate_mla_page(spec)
        super().__attrs_post_init__()  # type: ignore[misc]  # the attrs base's check

    @property
    def state_content_size_bytes(self) -> int:
        spec: Any = self
        packed = packed_record_bytes(spec)
        if packed is not None:
            return packed
        dense: int = super().state_content_size_bytes  # type: ignore[misc]
        return dense

    @property
    def page_size_bytes(self) -> int:
        spec: Any = self
        return aligned_page_size(spec, spec.unpadded_page_size_bytes)
