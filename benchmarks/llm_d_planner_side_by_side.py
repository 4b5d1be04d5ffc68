"""kvspec's ``plan --gpu`` beside llm-d-planner 0.3.3's capacity planner on every bundled
preset, on an H100-80GB at 0.9 utilisation.

Two tables:

1. Weights. llm-d-planner asks the hub for the parameter count per stored dtype; with no
   network here it is handed kvspec's own count (kvspec's meta-device count; gpt-oss's mxfp4
   experts as the U8 bytes their blocks and scales take), so its whole-model figure equals
   kvspec's by construction and is not a comparison. What is compared: kvspec's whole-model
   count against the published ``metadata.total_size`` of the checkpoint's safetensors index
   where one is recorded (:data:`PUBLISHED_INDEX_TOTALS`), and the weights per GPU, where
   kvspec splits as vLLM shards (replicated norms and routers, the padded vocabulary) and
   llm-d-planner divides the same whole-model figure by TP.
2. KV cache. At the smallest TP at which kvspec fits one request of the model's max length
   (``max_position_embeddings``; Llama-4-Scout at 262,144):
   KV bytes per token per GPU (llm-d-planner: ``layers x 2 x kv_heads x head_dim x bytes``
   over TP for every layer; kvspec: its exact plan's bytes per request over max_model_len,
   window-limited layers, Mamba states and block rounding included), max concurrency from
   each tool end to end, and llm-d-planner's formula applied to kvspec's own KV budget (the
   gap of the KV formula alone).

llm-d-planner runs in its own environment (``scripts/llm-d-planner-env`` creates
``.venv-llmd``) through ``benchmarks/llm_d_planner_probe.py``; kvspec runs here. Usage::

    ./scripts/llm-d-planner-env && .venv/bin/python benchmarks/llm_d_planner_side_by_side.py
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvspec_core.cli.main import main
from kvspec_core.cli.table import render_table
from kvspec_core.deployment.parameters import model_weights
from kvspec_core.deployment.stored_bytes import quantization, stored_bytes
from kvspec_core.models.catalog import PRESET_SOURCES, load_preset, preset_names
from kvspec_core.models.layer_typing import num_layers
from kvspec_core.models.normalized import normalize_config

ROOT = Path(__file__).resolve().parents[1]
HYBRIDS = {
    "gemma-2-9b",
    "gpt-oss-20b",
    "llama-4-scout",
    "jamba-1.5-mini",
    "nemotron-h-56b",
    "qwen3-next-80b",
}
#: safetensors dtype names of the model dtypes the presets use.
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
#: llm-d-planner's own catalog figure for an H100-80GB (gpu_catalog.json memory_gb: 80), which
#: its planner multiplies as GiB.
LLMD_H100_GIB = 80
UTILIZATION = 0.9
#: ``metadata.total_size`` of the published ``model.safetensors.index.json`` (the hub repos
#: meta-llama/Llama-3.1-8B-Instruct, meta-llama/Llama-3.1-70B-Instruct, openai/gpt-oss-20b),
#: recorded once: the independent check of kvspec's whole-model count (the same figures as
#: tests/operator/test_gpu_weights.py pins).
PUBLISHED_INDEX_TOTALS = {
    "llama-3.1-8b": 16_060_522_496,
    "llama-3.1-70b": 141_107_412_992,
    "gpt-oss-20b": 13_761_264_768,
}
#: Presets planned at a shorter length than their config's max_position_embeddings: one
#: request of Llama-4-Scout's 10,485,760 tokens holds more KV than an H100 has at TP 8;
#: 262,144 is the length the DESIGN table plans it at.
MAX_MODEL_LEN = {"llama-4-scout": 262_144}


def kvspec_plan(name: str, tp: int) -> dict[str, Any] | None:
    out, err = io.StringIO(), io.StringIO()
    length = ["--max-model-len", str(MAX_MODEL_LEN[name])] if name in MAX_MODEL_LEN else []
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", name, "--gpu", "h100-80gb", "--tp", str(tp), "--json", *length])
    return json.loads(out.getvalue()) if code == 0 else None


def params_by_dtype(name: str) -> dict[str, int]:
    """The parameter count per stored dtype a safetensors header of the checkpoint holds."""
    raw = load_preset(name)
    config = normalize_config(raw)
    dtype = _SAFETENSORS_DTYPES[str(config.dtype).removeprefix("torch.")]
    quant = quantization(raw)
    counts: dict[str, Fraction] = {}
    for tensor in model_weights(raw, num_layers(config.fields)).tensors:
        stored = stored_bytes(tensor, config.dtype.itemsize, quant)
        if stored == tensor.numel * config.dtype.itemsize:
            counts[dtype] = counts.get(dtype, Fraction(0)) + tensor.numel
        else:  # packed mxfp4 blocks and scales: one U8 element per stored byte
            counts["U8"] = counts.get("U8", Fraction(0)) + stored
    return {key: int(value) for key, value in counts.items()}


def llm_d(requests: list[dict[str, Any]], python: Path) -> dict[str, dict[str, Any]]:
    done = subprocess.run(
        [str(python), str(ROOT / "benchmarks" / "llm_d_planner_probe.py")],
        input=json.dumps(requests),
        capture_output=True,
        text=True,
        check=True,
    )
    return {answer["name"]: answer for answer in json.loads(done.stdout)}


def gib(value: float) -> str:
    return f"{value / 2**30:,.2f}"


def main_() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llmd-python", type=Path, default=ROOT / ".venv-llmd" / "bin" / "python")
    args = parser.parse_args()
    if not args.llmd_python.exists():
        sys.exit(f"{args.llmd_python} not found: run ./scripts/llm-d-planner-env first")
    plans: dict[str, tuple[int, dict[str, Any]]] = {}
    requests = []
    for name in preset_names():
        plan = next(((tp, p) for tp in (1, 2, 4, 8) if (p := kvspec_plan(name, tp))), None)
        if plan is None:
            continue
        plans[name] = plan
        tp, report = plan
        requests.append(
            {
                "name": name,
                "config": load_preset(name),
                "params_by_dtype": params_by_dtype(name),
                "tp": tp,
                "max_model_len": report["max_model_len"],
                "gpu_memory_gib": LLMD_H100_GIB,
                "utilization": UTILIZATION,
            }
        )
    theirs = llm_d(requests, args.llmd_python)
    weight_rows, kv_rows = [], []
    for name, (tp, ours) in plans.items():
        other = theirs[name]
        bottleneck = ours["memory_per_gpu"][ours["bottleneck_stage"]]
        if "error" in other:
            weight_rows.append([name, f"{ours['weights']['checkpoint_bytes']:,}", other["error"]])
            continue
        ours_total = ours["weights"]["checkpoint_bytes"]
        if round(other["weights_bytes"]) != ours_total:
            sys.exit(f"{name}: llm-d-planner did not take the count it was handed")
        published = PUBLISHED_INDEX_TOTALS.get(name)
        weight_rows.append(
            [
                name,
                f"{ours_total:,}",
                "-" if published is None else f"{published:,}",
                "-" if published is None else f"{(ours_total - published) / published:+.3%}",
                tp,
                gib(bottleneck["weights_bytes"]),
                gib(other["weights_per_gpu_bytes"]),
            ]
        )
        their_token = other["kv_bytes_per_token"] / tp
        their_on_our_budget = ours["kv_budget_bytes"] / (their_token * ours["max_model_len"])
        kv_rows.append(
            [
                name + (" *" if name in HYBRIDS else ""),
                tp,
                f"{ours['max_model_len']:,}",
                f"{ours['kv_bytes_per_token']:,.1f}",
                f"{their_token:,.1f}",
                f"{their_token / ours['kv_bytes_per_token']:.2f}x",
                gib(ours["kv_budget_bytes"]),
                gib(other["kv_budget_bytes"] / tp),
                f"{ours['max_concurrency']:.2f}",
                other["max_concurrency"],
                f"{their_on_our_budget:.2f}",
            ]
        )
    print(
        render_table(
            [
                "preset",
                "weights kvspec (B)",
                "published index (B)",
                "gap",
                "TP",
                "per GPU kvspec (GiB)",
                "llm-d (GiB)",
            ],
            weight_rows,
            align_right=(1, 2, 3, 4, 5, 6),
        )
    )
    print()
    print(
        render_table(
            [
                "preset (* hybrid)",
                "TP",
                "max model len",
                "KV B/token/GPU kvspec",
                "llm-d",
                "llm-d/kvspec",
                "KV budget kvspec (GiB)",
                "llm-d (GiB)",
                "max conc. kvspec",
                "llm-d",
                "llm-d formula, kvspec budget",
            ],
            kv_rows,
            align_right=tuple(range(1, 11)),
        )
    )
    missing = sorted(set(PRESET_SOURCES) - set(plans))
    if missing:
        print(f"\nnot planned on an H100-80GB up to TP 8: {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main_())
