"""Runs inside .venv-llmd (scripts/llm-d-planner-env), never in kvspec's environment: reads
one JSON request per model on stdin, answers with llm-d-planner 0.3.3's own figures.

Its capacity planner asks the Hugging Face hub for the config and the safetensors parameter
counts; here both are handed to it instead (no network): the config through transformers'
config class, the counts by replacing ``model_params_by_dtype``, the one function that
fetches them. Every figure printed is computed by llm-d-planner's code.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from planner import capacity_planner as cp
from transformers import CONFIG_MAPPING

GIB = 2**30


def probe(request: dict[str, Any]) -> dict[str, Any]:
    raw = request["config"]
    config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    name = request["name"]
    cp.model_params_by_dtype = lambda model_name, hf_token=None: request["params_by_dtype"]
    tp = request["tp"]
    answer: dict[str, Any] = {"name": name}
    try:
        answer["weights_bytes"] = cp.model_memory_req(name, config) * GIB
        answer["weights_per_gpu_bytes"] = (
            cp.per_gpu_model_memory_required(name, config, tp=tp) * GIB
        )
        answer["activation_gib"] = cp.estimate_vllm_activation_memory(config, tp=tp)
        answer["non_torch_gib"] = cp.estimate_vllm_non_torch_memory(tp, 1)
        detail = cp.KVCacheDetail(name, config, request["max_model_len"])
        answer["kv_bytes_per_token"] = detail.per_token_memory_bytes
        answer["kv_budget_bytes"] = (
            cp.allocatable_kv_cache_memory(
                name,
                config,
                request["gpu_memory_gib"],
                request["utilization"],
                tp=tp,
                max_model_len=request["max_model_len"],
            )
            * GIB
        )
        answer["max_concurrency"] = cp.max_concurrent_requests(
            name,
            config,
            request["max_model_len"],
            request["gpu_memory_gib"],
            request["utilization"],
            tp=tp,
        )
    except Exception as error:  # report llm-d-planner's own failure on this config
        answer["error"] = f"{type(error).__name__}: {error}"
    return answer


if __name__ == "__main__":
    requests = json.load(sys.stdin)
    json.dump([probe(request) for request in requests], sys.stdout)
