"""MLAAttentionSpec's engine helpers: the latent cell's columns, reads and slots."""

from __future__ import annotations

import pytest
import torch
from mla_testkit import latent_fields

from kvspec_core.errors import KVSpecError
from kvspec_mla import MLAAttentionSpec


def test_a_deepseek_cell_is_the_512_latent_then_the_64_rope_key() -> None:
    spec = MLAAttentionSpec(**latent_fields())
    assert spec.latent_columns(64) == (slice(0, 512), slice(512, 576))
    cell = torch.arange(576)
    latent, rope_key = spec.latent_columns(64)
    assert cell[latent].numel() + cell[rope_key].numel() == spec.head_size


@pytest.mark.parametrize("rope", [0, 576, 600, True, 64.0])
def test_latent_columns_refuse_a_rope_width_leaving_no_latent(rope: object) -> None:
    with pytest.raises(KVSpecError, match=r"qk_rope_head_dim=.* must be an int in"):
        MLAAttentionSpec(**latent_fields()).latent_columns(rope)  # type: ignore[arg-type]


def test_a_packed_record_has_no_dense_columns() -> None:
    spec = MLAAttentionSpec(**latent_fields(dtype=torch.uint8, cache_dtype_str="fp8_ds_mla"))
    with pytest.raises(KVSpecError, match="packs the latent into a kernel record"):
        spec.latent_columns(64)


def test_mla_reads_the_whole_request_unless_a_window_is_recorded() -> None:
    assert MLAAttentionSpec(**latent_fields()).first_attended_position(1000) == 0
    windowed = MLAAttentionSpec(**latent_fields(sliding_window=128))
    assert windowed.first_attended_position(1000) == 873


def test_one_latent_slot_per_token() -> None:
    spec = MLAAttentionSpec(**latent_fields())
    blocks, states = spec.slot_mapping([4, 9], torch.tensor([0, 15, 16, 31]))
    assert blocks.tolist() == [4, 4, 9, 9] and states.tolist() == [0, 15, 0, 15]
