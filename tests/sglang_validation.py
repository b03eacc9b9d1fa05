"""Request bodies judged by SGLang's own code: run with the python of a virtualenv that has the sglang
wheel installed (`pip install --no-deps sglang==0.5.23` plus what its imports need; see
tests/test_sglang_server.py), never imported by the test suite itself.

Reads `{"vocab_size": N, "items": [{"path": "/generate", "body": {...}}, ...]}` on stdin and prints
`{"sglang_version", "unavailable": {piece: import error}, "verdicts": [{piece: null | error text}]}`:
for /generate
  - "contract": sglang.api.v1.api_types.GenerateRequest.from_json_value (0.5.23's HTTP gate,
    entrypoints/api_contract.py), only where the installed version has it;
  - "generate_req_input": pydantic validation of io_struct.GenerateReqInput (what FastAPI does with the
    body) and normalize_batch_and_arguments();
  - "sampling_params": SamplingParams(**sampling_params), .normalize(None) (--skip-tokenizer-init),
    .verify(vocab_size), as tokenizer_manager.py: _create_tokenized_object does;
for a control endpoint
  - "struct": pydantic validation of its io_struct request type, and "ignored_keys": the keys SGLang
    drops silently (msgspec_struct_pydantic_core_schema ignores unknown keys).
A piece whose module cannot be imported is left out of the verdicts and named in "unavailable".
"""

from __future__ import annotations

import json
import sys
from typing import Any

CONTROL_TYPES = {
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}


def _load(unavailable: dict[str, str]) -> dict[str, Any]:
    pieces: dict[str, Any] = {}
    try:
        from sglang.api.v1 import api_types

        pieces["contract"] = api_types
    except Exception as e:  # absent before 0.5.23, or its imports fail
        unavailable["contract"] = f"{type(e).__name__}: {e}"
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams

        pieces["sampling_params"] = SamplingParams
    except Exception as e:
        unavailable["sampling_params"] = f"{type(e).__name__}: {e}"
    try:
        import pydantic
        from sglang.srt.managers import io_struct

        pieces["io_struct"] = io_struct
        pieces["pydantic"] = pydantic
    except Exception as e:
        unavailable["generate_req_input"] = f"{type(e).__name__}: {e}"
        unavailable["struct"] = unavailable["generate_req_input"]
    return pieces


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def judge_generate(body: dict[str, Any], vocab_size: int, pieces: dict[str, Any]) -> dict[str, str | None]:
    verdict: dict[str, str | None] = {}
    if "contract" in pieces:
        try:
            pieces["contract"].GenerateRequest.from_json_value(body)
            verdict["contract"] = None
        except Exception as e:
            verdict["contract"] = _error(e)
    if "io_struct" in pieces:
        try:
            adapter = pieces["pydantic"].TypeAdapter(pieces["io_struct"].GenerateReqInput)
            adapter.validate_python(body).normalize_batch_and_arguments()
            verdict["generate_req_input"] = None
        except Exception as e:
            verdict["generate_req_input"] = _error(e)
    if "sampling_params" in pieces:
        try:
            sp = pieces["sampling_params"](**(body.get("sampling_params") or {}))
            sp.normalize(None)
            sp.verify(vocab_size)
            verdict["sampling_params"] = None
        except Exception as e:
            verdict["sampling_params"] = _error(e)
    return verdict


def judge_control(path: str, body: dict[str, Any], pieces: dict[str, Any]) -> dict[str, Any]:
    if "io_struct" not in pieces:
        return {}
    import msgspec

    cls = getattr(pieces["io_struct"], CONTROL_TYPES[path])
    fields = {f.name for f in msgspec.structs.fields(cls)}
    verdict: dict[str, Any] = {"ignored_keys": sorted(set(body) - fields)}
    try:
        pieces["pydantic"].TypeAdapter(cls).validate_python(body)
        verdict["struct"] = None
    except Exception as e:
        verdict["struct"] = _error(e)
    return verdict


def main() -> None:
    request = json.load(sys.stdin)
    unavailable: dict[str, str] = {}
    pieces = _load(unavailable)
    try:
        from sglang.version import __version__ as version
    except Exception as e:
        version = f"unknown ({_error(e)})"
    verdicts = []
    for item in request["items"]:
        if item["path"] == "/generate":
            verdicts.append(judge_generate(item["body"], int(request["vocab_size"]), pieces))
        else:
            verdicts.append(judge_control(item["path"], item["body"], pieces))
    json.dump({"sglang_version": version, "unavailable": unavailable, "verdicts": verdicts}, sys.stdout)


if __name__ == "__main__":
    main()
