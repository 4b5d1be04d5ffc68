"""Arguments shared by the commands that plan a model (``plan``, ``simulate``)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.ascii_numbers import (
    ASCII_INTEGER_FORM,
    match_ascii_decimal,
    parse_ascii_integer,
)
from kvspec_core.cli.sizes import parse_size
from kvspec_core.deployment.gpu_budget import tp_candidates, tp_refusal
from kvspec_core.errors import ConfigError, InvalidFieldError
from kvspec_core.models.fields import MAX_LAYERS
from kvspec_core.models.ingest import DEFAULT_MAX_IN_FLIGHT_TOKENS, ModelLayers
from kvspec_core.models.trained_length import trained_max_model_len
from kvspec_core.planner.tiers import OffloadTierError, check_disk_directory
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.validation import MAX_FIELD_VALUE

DEFAULT_KV_CACHE_DTYPE = "auto"


def positive_int(text: str) -> int:
    """argparse type: an int in ``[1, MAX_FIELD_VALUE]`` in ASCII digits."""
    value = parse_ascii_integer(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not {ASCII_INTEGER_FORM}")
    if not 1 <= value <= MAX_FIELD_VALUE:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer in [1, {MAX_FIELD_VALUE}]")
    return value


#: The largest ``--block-size``: 256x vLLM's largest attention block (256 tokens on CUDA).
MAX_BLOCK_SIZE = 65_536


def block_size(text: str) -> int:
    """argparse type: tokens per attention block, in ``[1, MAX_BLOCK_SIZE]`` (a larger one
    made the spec's own page size overflow, reported as a plugin's bug)."""
    value = positive_int(text)
    if value > MAX_BLOCK_SIZE:
        raise argparse.ArgumentTypeError(
            f"{text!r} tokens per block is over {MAX_BLOCK_SIZE:,}; engines use 16 to 256 "
            "(vLLM's default 16)"
        )
    return value


def seed(text: str) -> int:
    """argparse type: a trace seed, an int (a leading ``-`` allowed) in ASCII digits."""
    value = parse_ascii_integer(text, signed=True)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer written with the ASCII digits 0-9 (a leading '-' "
            "allowed; no '_' or other digits)"
        )
    return value


def plot_file(text: str) -> str:
    """argparse type: the PNG file ``--plot`` writes; an empty name is refused (it used to
    plot nothing and succeed)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is an empty file name; give the PNG file to write, such as plot.png"
        )
    if "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} holds a NUL character; no file has one")
    # Checked before any work (a sweep of replays used to run first, then fail to write).
    path = Path(text)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(
            f"{text!r}: the plot is a PNG image; give a file name ending in .png"
        )
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give the PNG file to write")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r}: its directory {str(folder)!r} does not exist; create it first"
        )
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written here (permission denied)")
    return text


def layer_partition(text: str) -> list[int]:
    """argparse type: comma-separated positive layer counts (``27,27,26``)."""
    counts: list[int] = []
    for part in text.split(","):
        count = parse_ascii_integer(part)
        if count is None:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of layer counts such as 27,27,26 "
                f"(each {ASCII_INTEGER_FORM})"
            )
        if not 1 <= count <= MAX_LAYERS:
            raise argparse.ArgumentTypeError(
                f"{text!r}: each stage's layer count must be an integer in [1, {MAX_LAYERS}]"
            )
        counts.append(count)
    return counts


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """``--pp`` (pipeline stages) and ``--pp-partition`` (explicit layers per stage)."""
    parser.add_argument(
        "--pp",
        type=positive_int,
        default=1,
        metavar="N",
        help="pipeline parallel size: layers split over N stages as vLLM splits "
        "them, each planned on its own GPU with the same --memory (default 1)",
    )
    parser.add_argument(
        "--pp-partition",
        type=layer_partition,
        metavar="A,B,...",
        help="layers per pipeline stage, overriding the even split (as vLLM's "
        "VLLM_PP_LAYER_PARTITION); one count per --pp stage",
    )


# ----------------------------------------------------------------- offload tiers (plan)
def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host-memory`` (host offload tier) and ``--disk`` / ``--disk-size`` (disk tier)."""
    parser.add_argument(
        "--host-memory",
        metavar="SIZE",
        help="host DRAM for an offload tier beside the GPU pools (256GiB...): each pool gets "
        "host blocks in the GPU split's proportions",
    )
    parser.add_argument(
        "--disk",
        metavar="PATH",
        help="an existing, writable directory for a disk offload tier (one file per pool); "
        "needs --disk-size",
    )
    parser.add_argument(
        "--disk-size", metavar="SIZE", help="bytes the disk tier may use (2TiB...); needs --disk"
    )


def offload_tier_options(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """``prepare_model``'s tier options from ``--host-memory``, ``--disk``, ``--disk-size``,
    refused naming the option before anything is planned (``command``: ``"kvspec plan"``...)."""
    if args.disk_size is not None and args.disk is None:
        raise ConfigError("--disk-size needs --disk PATH, the directory of the disk tier's files")
    if args.disk is not None and args.disk_size is None:
        raise ConfigError("--disk needs --disk-size SIZE, the bytes the disk tier may use")
    options: dict[str, Any] = {
        "host_offload_bytes": None
        if args.host_memory is None
        else parse_size(args.host_memory, what="--host-memory"),
        "disk_offload_bytes": None
        if args.disk_size is None
        else parse_size(args.disk_size, what="--disk-size"),
        "disk_path": args.disk,
    }
    if args.disk is not None:
        try:
            check_disk_directory(command, "--disk", args.disk)
        except InvalidFieldError as error:
            raise ConfigError(f"--disk {args.disk!r} {error.allowed}") from None
    return options


def offload_tier_error(error: OffloadTierError) -> ConfigError:
    """``error`` in the command line's words: the option and the least size that works."""
    option = "--host-memory" if error.tier == "host" else "--disk-size"
    return ConfigError(
        f"{option} {format_size(error.budget)} is too small for the {error.tier} offload tier: "
        f"every GPU pool needs one block beside its null block there, "
        f"{format_size(error.needed)} ({error.needed:,} B) in all; pass {option} "
        f"{error.needed} or more, or leave the tier out"
    )


def add_model_arguments(
    parser: argparse.ArgumentParser,
    *,
    kv_dtype_help: str,
    repeatable_kv_dtype: bool = False,
    memory_required: bool = True,
) -> None:
    """MODEL, ``--memory`` and the planning options (block size, KV dtype, TP, DCP, lengths),
    plus ``--json``. ``memory_required=False``: the command checks ``--memory`` itself (plan
    takes ``--gpu`` instead)."""
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a preset name (see `kvspec models`), a config.json path, a folder holding one, "
        "or a Hugging Face hub id (org/name[@revision]; needs kvspec-core[hf]; read from the "
        "hub cache, HF_HUB_OFFLINE=1 honoured)",
    )
    parser.add_argument(
        "--memory",
        required=memory_required,
        metavar="SIZE",
        help="KV-cache budget: 40GiB, 512MiB, 80GB, or a number of bytes",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        metavar="N",
        help=(
            "longest request in tokens (default: the config's length as vLLM derives it: its "
            "smallest length field, times a linear or dynamic RoPE factor)"
        ),
    )
    parser.add_argument(
        "--allow-long-max-model-len",
        action="store_true",
        help="plan a --max-model-len longer than the model was built for (vLLM refuses it "
        "unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)",
    )
    parser.add_argument(
        "--block-size",
        type=block_size,
        default=16,
        metavar="N",
        help="tokens per attention block (default 16; never inflated)",
    )
    if repeatable_kv_dtype:
        parser.add_argument("--kv-cache-dtype", action="append", metavar="D", help=kv_dtype_help)
    else:
        parser.add_argument(
            "--kv-cache-dtype", default=DEFAULT_KV_CACHE_DTYPE, metavar="D", help=kv_dtype_help
        )
    parser.add_argument(
        "--tp", type=positive_int, default=1, metavar="N", help="tensor parallel size (default 1)"
    )
    parser.add_argument(
        "--dcp",
        type=positive_int,
        default=1,
        metavar="N",
        help="decode context parallel size (default 1)",
    )
    # A command taking --gpu (memory_required=False) resolves the default itself
    # (gpu_options.resolve_in_flight_tokens): it depends on --gpu and --overhead.
    parser.add_argument(
        "--max-in-flight-tokens",
        type=positive_int,
        default=DEFAULT_MAX_IN_FLIGHT_TOKENS if memory_required else None,
        metavar="N",
        help=f"tokens scheduled per step (default {DEFAULT_MAX_IN_FLIGHT_TOKENS}"
        + (
            ""
            if memory_required
            else "; with --gpu and no --overhead, 8192: the overheads' calibration"
        )
        + ")",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def utilization(text: str) -> float:
    """argparse type: a share of GPU memory in (0, 1], as vLLM's --gpu-memory-utilization,
    in ASCII digits (``float`` would read other scripts' digits and ``_``)."""
    stripped = text.strip(" \t")
    number = match_ascii_decimal(stripped)
    whole = number is not None and number[1] == len(stripped)
    value = float(number[0]) if number is not None and whole else math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a share of GPU memory; give a number in (0, 1] such as 0.9"
        )
    return value


def add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpu`` and the options that derive the KV budget from a GPU (``kvspec plan``)."""
    parser.add_argument(
        "--gpu",
        metavar="NAME",
        help="plan on this GPU instead of a --memory budget: the KV budget is its memory x "
        "--gpu-memory-utilization less the weights one GPU holds and vLLM's overheads "
        "(h100-80gb, h200, b200, a100-80gb, a100-40gb, l40s, l4)",
    )
    parser.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="the GPU's total memory (81559MiB...), overriding the catalog's, or for a GPU "
        "it does not list",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=utilization,
        metavar="F",
        help="share of the GPU's memory the engine may use (default 0.9, as vLLM's)",
    )
    parser.add_argument(
        "--overhead",
        metavar="SIZE",
        help="activation + non-torch memory per GPU, replacing the calibrated table's figure",
    )


def plan_options(args: argparse.Namespace, kv_cache_dtype: str) -> PlanOptions:
    """The :class:`PlanOptions` the parsed arguments ask for, with ``kv_cache_dtype``."""
    return PlanOptions(
        block_size=args.block_size,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=args.tp,
        decode_context_parallel_size=args.dcp,
    )


def kv_cache_dtypes(args: argparse.Namespace) -> list[str]:
    """The ``--kv-cache-dtype`` values, in the order given, each once; ``[auto]`` when none is
    given. A plan uses the first; ``--plot`` draws one curve per value. One string (the
    option as ``simulate`` parses it, not repeatable) is one dtype, not its characters."""
    given = args.kv_cache_dtype
    values = [given] if isinstance(given, str) else given
    return list(dict.fromkeys(values or [DEFAULT_KV_CACHE_DTYPE]))


def check_tp_accepted(raw_config: Any, tp: int) -> None:
    """Refuse a ``--tp`` vLLM refuses for the model (:func:`tp_refusal`: the attention heads,
    KV heads or Mamba-2 heads and groups do not split), naming the sizes it accepts: a
    plan for it would describe ranks no engine builds."""
    refusal = tp_refusal(raw_config, tp)
    if refusal is not None:
        accepted = ", ".join(map(str, tp_candidates(raw_config)))
        raise ConfigError(
            f"--tp {tp}: vLLM refuses it for this model ({refusal}); it accepts {accepted}"
        )


def check_max_model_len(model: ModelLayers, args: argparse.Namespace) -> None:
    """Refuse a ``--max-model-len`` longer than the model was built for
    (:func:`trained_max_model_len`, as vLLM derives it) unless
    ``--allow-long-max-model-len``: positions past it are untrained, so the plan would
    describe no working deployment."""
    asked = args.max_model_len
    trained = trained_max_model_len(model)
    if asked is None or trained is None or asked <= trained[0] or args.allow_long_max_model_len:
        return
    length, source = trained
    raise ConfigError(
        f"--max-model-len {asked:,} is longer than the {length:,} tokens {model.name} was "
        f"built for ({source}); vLLM refuses it (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1), as "
        "positions past it are untrained. Pass --max-model-len "
        f"{length} or less, or --allow-long-max-model-len to plan it anyway"
    )
