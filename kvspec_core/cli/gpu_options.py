"""``kvspec plan``'s GPU options: ``--memory`` or ``--gpu`` / ``--gpu-memory``, and the
GPU's memory, utilization, pipeline split and overheads as
:func:`~kvspec_core.deployment.gpu_budget.gpu_budget` takes them."""

from __future__ import annotations

import argparse
from typing import Any

from kvspec_core.cli.ascii_numbers import match_ascii_decimal
from kvspec_core.cli.sizes import UNITS, parse_size
from kvspec_core.deployment.gpu_budget import DEFAULT_UTILIZATION
from kvspec_core.deployment.gpus import find_gpu
from kvspec_core.deployment.overheads import calibration_batched_tokens
from kvspec_core.errors import ConfigError
from kvspec_core.models.ingest import DEFAULT_MAX_IN_FLIGHT_TOKENS


def gpu_requested(args: argparse.Namespace) -> bool:
    """Whether the KV budget comes from a GPU (``--gpu`` or ``--gpu-memory``)."""
    return args.gpu is not None or args.gpu_memory is not None


def check_budget_options(args: argparse.Namespace) -> None:
    """Exactly one of ``--memory`` (the KV budget) and ``--gpu`` / ``--gpu-memory`` (the GPU
    it is derived from); the GPU-only options only with a GPU."""
    if args.memory is not None and gpu_requested(args):
        raise ConfigError(
            "--memory is the KV budget itself and --gpu / --gpu-memory derive it from the GPU; "
            "give one of them"
        )
    if args.memory is None and not gpu_requested(args):
        raise ConfigError(
            "kvspec plan needs --memory SIZE (the KV-cache budget, e.g. 40GiB) or --gpu NAME "
            "(the budget a GPU has left after the weights, e.g. --gpu h100-80gb)"
        )
    if not gpu_requested(args):
        for option, value in (
            ("--gpu-memory-utilization", args.gpu_memory_utilization),
            ("--overhead", args.overhead),
        ):
            if value is not None:
                raise ConfigError(f"{option} applies to --gpu / --gpu-memory; add --gpu NAME")
    resolve_in_flight_tokens(args)


def resolve_in_flight_tokens(args: argparse.Namespace) -> None:
    """``--max-in-flight-tokens``, defaulted: on a GPU whose overheads come from the table,
    the batch they were measured at (vLLM's activation peak is a forward of that many
    tokens); more is refused there, the larger peak not being measured."""
    calibrated = calibration_batched_tokens()
    from_table = gpu_requested(args) and args.overhead is None
    if args.max_in_flight_tokens is None:
        args.max_in_flight_tokens = calibrated if from_table else DEFAULT_MAX_IN_FLIGHT_TOKENS
    elif from_table and args.max_in_flight_tokens > calibrated:
        raise ConfigError(
            f"--max-in-flight-tokens {args.max_in_flight_tokens:,} with --gpu: the activation "
            f"peak kvspec subtracts was measured at {calibrated:,} batched tokens (vLLM's "
            "profiling forward runs max_num_batched_tokens tokens, so it grows with them), "
            f"and at {args.max_in_flight_tokens:,} it is larger by an amount not measured "
            "here; pass --overhead SIZE (activation + non-torch per GPU, as vLLM logs them at "
            f"that batch) or --max-in-flight-tokens {calibrated} or less"
        )


def gpu_memory(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """The GPU's memory in bytes (``--gpu-memory``, else the catalog's ``--gpu``) and the
    ``gpu`` object of the ``--json`` document, less what the budget adds."""
    if args.gpu_memory is not None:
        memory = parse_size(args.gpu_memory, what="--gpu-memory")
        gpu = find_gpu(args.gpu) if args.gpu is not None else None
        return memory, {
            "name": gpu.name if gpu else "custom",
            "description": gpu.description if gpu else "a GPU of --gpu-memory",
            "memory_bytes": memory,
            "memory_source": "--gpu-memory",
        }
    gpu = find_gpu(args.gpu)
    return gpu.memory_bytes, {
        "name": gpu.name,
        "description": gpu.description,
        "memory_bytes": gpu.memory_bytes,
        "memory_source": gpu.source,
    }


def budget_options(args: argparse.Namespace, memory: int) -> dict[str, Any]:
    """``gpu_budget``'s keyword arguments for a GPU of ``memory`` bytes, all but ``tp``."""
    return {
        "memory_bytes": memory,
        "utilization": DEFAULT_UTILIZATION
        if args.gpu_memory_utilization is None
        else args.gpu_memory_utilization,
        "pp": args.pp,
        "partition": args.pp_partition,
        "overhead_bytes": None if args.overhead is None else _overhead_bytes(args.overhead),
    }


def _overhead_bytes(text: str) -> int:
    """``--overhead``: a size, or zero (to compare against an engine log whose overheads
    are already folded into ``--gpu-memory``)."""
    stripped = text.strip(" \t")
    number = match_ascii_decimal(stripped)
    unit = stripped[number[1] :].strip(" \t").lower() or "b" if number is not None else None
    if number is not None and number[0] == 0 and unit in UNITS:
        return 0
    return parse_size(text, what="--overhead")  # a size, or the error naming what is wrong
