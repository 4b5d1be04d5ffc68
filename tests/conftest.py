"""Session-wide test settings: no test ever reaches the Hugging Face hub (a MODEL that reads as
``org/name`` is looked up in the local hub cache only)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
