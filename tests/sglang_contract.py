"""What an SGLang server accepts, read from its source: the /generate contract gate (0.5.23), the
sampling parameters' validation, and which version does what (`Features`). Used by the fake SGLang
server (tests/sglang_server.py, tests/sglang_runtime.py); paths in comments are inside the SGLang wheel
(`sglang/srt/...` unless they start with `sglang/`).

Owns the refusals a request meets before it is scheduled, with SGLang's exact messages. Does not own how
they travel over HTTP (sglang_server.py renders RequestError) nor anything after scheduling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

TOP_K_ALL = 1 << 30  # sampling/sampling_params.py: TOP_K_ALL


# The keys sglang.api.v1.SamplingParams accepts (sglang/api/v1/api_types.py: decode_SamplingParams, in
# declaration order, which is the order serde's "unknown field" message lists them in), with the JSON
# type each must have: "int", "float" (int or float), "bool", "str", "str_or_list", "int_list", "map",
# "seq", "any", "struct".
CONTRACT_SAMPLING_FIELDS: dict[str, str] = {
    "max_new_tokens": "int", "stop": "str_or_list", "stop_token_ids": "int_list",
    "stop_regex": "str_or_list", "temperature": "float", "top_p": "float", "top_k": "int",
    "min_p": "float", "frequency_penalty": "float", "presence_penalty": "float",
    "repetition_penalty": "float", "min_new_tokens": "int", "n": "int", "json_schema": "str",
    "regex": "str", "ebnf": "str", "structural_tag": "str", "ignore_eos": "bool",
    "skip_special_tokens": "bool", "spaces_between_special_tokens": "bool", "no_stop_trim": "bool",
    "stream_interval": "int", "logit_bias": "map", "sampling_seed": "int", "custom_params": "any",
    "beam_width": "int", "watermark": "struct", "choice": "seq",
}  # fmt: skip

_EXPECTED = {
    "int": "i64", "float": "f64", "bool": "a boolean", "str": "a string", "int_list": "a sequence",
    "map": "a map", "seq": "a sequence", "struct": "struct WatermarkRequestConfig",
    "str_or_list": "a value or an array of values for StringOrList",
}  # fmt: skip


def parse_version(text: str) -> tuple[int, int, int]:
    nums = [int(x) for x in re.findall(r"\d+", text)[:3]]
    padded = [*nums, 0, 0, 0]
    return padded[0], padded[1], padded[2]


@dataclass(frozen=True, slots=True)
class Features:
    """What differs between the SGLang versions the fake imitates (read from each wheel's source)."""

    version: tuple[int, int, int]

    @property
    def contract_check(self) -> bool:
        """0.5.23: entrypoints/api_contract.py checks the /generate body against sglang.api.v1 first
        (unknown sampling key -> 400 {"error": "unknown field ..."}); before, SamplingParams(**kw) raises
        TypeError there, which nothing catches (an HTTP 500)."""
        return self.version >= (0, 5, 23)

    @property
    def loads_endpoint(self) -> bool:
        """entrypoints/v1_loads.py: GET /v1/loads from 0.5.20; 0.5.6 has only /get_load."""
        return self.version >= (0, 5, 20)

    @property
    def legacy_endpoints(self) -> bool:
        """/get_load, /weight_version, /get_weight_version: gone in 0.5.21 (http_server.py)."""
        return self.version < (0, 5, 21)

    @property
    def weight_update_session(self) -> bool:
        """/begin_weight_update and /end_weight_update, and update_weights_from_distributed refused outside
        them: managers/scheduler_components/weight_updater.py from 0.5.21."""
        return self.version >= (0, 5, 21)

    @property
    def abort_dedupe(self) -> bool:
        """tokenizer_manager.py: abort_request ignores a second abort of the same rid (state.abort_sent)
        from 0.5.20 (0.5.6 forwards every one)."""
        return self.version >= (0, 5, 20)

    @property
    def total_tokens_inclusive(self) -> bool:
        """tokenizer_manager.py: _validate_one_request rejects input + max_new_tokens >= context_len in
        0.5.6, > context_len from 0.5.20."""
        return self.version < (0, 5, 20)

    @property
    def flush_failure_is_reported(self) -> bool:
        """weight_updater.py: a cache flush refused after a weight update fails the call in 0.5.23
        (flush_cache_after_weight_update returns a message); before, it is an `assert` that kills the
        scheduler, i.e. the whole server."""
        return self.version >= (0, 5, 23)

    @property
    def any_abort_status(self) -> bool:
        """tokenizer_manager.py: from 0.5.20 every abort with 400 <= status_code < 600 becomes an HTTP
        error (_handle_abort_finish_reason); 0.5.6 maps only 400, 500 and 503."""
        return self.version >= (0, 5, 20)

    @property
    def retractions_key(self) -> str:
        """meta_info key of the retraction count: "total_retractions" in 0.5.6, then "num_retractions"."""
        return "num_retractions" if self.version >= (0, 5, 20) else "total_retractions"

    @property
    def weight_version_spans(self) -> bool:
        """utils/weight_versions.py: meta_info["weight_versions"] (spans) on finished requests, 0.5.20+."""
        return self.version >= (0, 5, 20)

    @property
    def ready_endpoint(self) -> bool:
        return self.version >= (0, 5, 20)


class RequestError(Exception):
    """A request refused the way SGLang refuses it: `status` and the exact message; `kind` picks the body
    shape (sglang_server.py renders it)."""

    def __init__(self, status: int, message: str, kind: str = "value_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind  # value_error | contract | validation | http_exception | internal


def check_contract(body: dict[str, Any]) -> None:
    """0.5.23's contract gate for /generate (entrypoints/api_contract.py -> sglang/api/v1/api_types.py:
    decode_GenerateRequest, decode_SamplingParams): the sampling keys and the JSON types of the fields the
    adapter sends. Raises RequestError(400, kind="contract") with serde's message text."""
    top_level = {  # field: (accepts, expected text); lists are decoded element-wise by SGLang
        "rid": (lambda v: isinstance(v, (str, list)), "a value or an array of values for StringOrList"),
        "input_ids": (lambda v: isinstance(v, list), "a value or an array of values for TokenIdsOrList"),
        "stream": (lambda v: isinstance(v, bool), "a boolean"),
        "return_logprob": (
            lambda v: isinstance(v, (bool, list)),
            "a value or an array of values for BoolOrList",
        ),
        "logprob_start_len": (
            lambda v: isinstance(v, list) or (isinstance(v, int) and not isinstance(v, bool)),
            "a value or an array of values for Int64OrList",
        ),
    }
    for key, (accepts, expected) in top_level.items():
        value = body.get(key)
        if value is not None and not accepts(value):
            raise RequestError(400, f"invalid type: {_unexpected(value)}, expected {expected}", "contract")
    sps = body.get("sampling_params")
    for sp in sps if isinstance(sps, list) else [sps] if sps is not None else []:
        if not isinstance(sp, dict):
            raise RequestError(
                400, f"invalid type: {_unexpected(sp)}, expected struct SamplingParams", "contract"
            )
        for key, value in sp.items():
            kind = CONTRACT_SAMPLING_FIELDS.get(key)
            if kind is None:
                listed = ", ".join(f"`{f}`" for f in CONTRACT_SAMPLING_FIELDS)
                raise RequestError(400, f"unknown field `{key}`, expected one of {listed}", "contract")
            if value is None or _json_type_ok(kind, value):
                continue
            raise RequestError(
                400, f"invalid type: {_unexpected(value)}, expected {_EXPECTED[kind]}", "contract"
            )


def _json_type_ok(kind: str, value: Any) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return {
        "int": is_int,
        "float": is_int or isinstance(value, float),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "str_or_list": isinstance(value, (str, list)),
        "int_list": isinstance(value, list)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
        "map": isinstance(value, dict),
        "seq": isinstance(value, list),
        "struct": isinstance(value, dict),
        "any": True,
    }[kind]


def _unexpected(v: Any) -> str:
    """serde's `Unexpected` display (sglang/api/v1/api_types.py: _unexpected)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


@dataclass(slots=True)
class Sampling:
    """The sampling parameters of one request after sampling/sampling_params.py: SamplingParams
    __post_init__ (temperature 0 -> greedy top_k 1, top_k -1 -> TOP_K_ALL) and verify()."""

    max_new_tokens: int
    temperature: float
    top_k: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    sampling_seed: int | None
    stream_interval: int | None


SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": TOP_K_ALL, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "beam_width": None, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None,
    "logit_bias": None, "sampling_seed": None, "custom_params": None, "watermark": None,
}  # fmt: skip


def build_sampling(sp: dict[str, Any], vocab_size: int, features: Features, has_tokenizer: bool) -> Sampling:
    """SamplingParams(**sp), .normalize(tokenizer), .verify(vocab_size), in that order, as
    tokenizer_manager.py: _create_tokenized_object does. An unknown key is a TypeError in SGLang (msgspec
    "Unexpected keyword argument"), which escapes the ValueError handlers: RequestError(500, "internal")."""
    for key in sp:
        if key not in SAMPLING_DEFAULTS:
            raise RequestError(500, f"Unexpected keyword argument '{key}'", "internal")
    p = {k: (v if sp.get(k) is None else sp[k]) for k, v in SAMPLING_DEFAULTS.items()}
    p["max_new_tokens"] = sp.get("max_new_tokens", 128)  # an explicit null means "no limit" (None)
    temperature, top_k = float(p["temperature"]), int(p["top_k"])
    if sp.get("top_k") is None:
        top_k = TOP_K_ALL
    if 0 <= temperature < 1e-6:  # __post_init__: greedy
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    # normalize(None) with --skip-tokenizer-init: raise_if_tokenizer_required
    stops = p["stop"]
    if not has_tokenizer:
        if stops:
            raise RequestError(
                400,
                f"stop={stops if isinstance(stops, list) else [stops]!r} is unavailable when "
                "skip_tokenizer_init=True (requires tokenizer to decode tokens to text for matching).",
            )
        if p["min_new_tokens"] > 0:
            raise RequestError(
                400,
                f"min_new_tokens={p['min_new_tokens']} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer for eos_token_id).",
            )
    _verify(p, temperature, top_k, vocab_size, features)
    max_new = p["max_new_tokens"]
    return Sampling(
        max_new_tokens=(1 << 30) if max_new is None else int(max_new),
        temperature=temperature,
        top_k=top_k,
        stop_token_ids=frozenset(int(t) for t in (p["stop_token_ids"] or []) if t is not None),
        ignore_eos=bool(p["ignore_eos"]),
        sampling_seed=p["sampling_seed"],
        stream_interval=p["stream_interval"],
    )


def _verify(p: dict[str, Any], temperature: float, top_k: int, vocab_size: int, features: Features) -> None:
    """sampling/sampling_params.py: SamplingParams.verify; 0.5.23's messages (0.5.6's where they differ)."""
    if temperature < 0.0 or temperature != temperature or temperature == float("inf"):
        if features.version < (0, 5, 20):
            raise RequestError(400, f"temperature must be non-negative, got {temperature}.")
        raise RequestError(400, f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < p["top_p"] <= 1.0:
        raise RequestError(400, f"top_p must be in (0, 1], got {p['top_p']}.")
    if not 0.0 <= p["min_p"] <= 1.0:
        raise RequestError(400, f"min_p must be in [0, 1], got {p['min_p']}.")
    if top_k < 1:
        raise RequestError(400, f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= p[name] <= 2.0:
            raise RequestError(400, f"{name} must be in [-2, 2], got {p[name]}.")
    if not 0.0 < p["repetition_penalty"] <= 2.0:
        raise RequestError(
            400, f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {p['repetition_penalty']}."
        )
    max_new = p["max_new_tokens"]
    if max_new is not None:
        if max_new < 0:
            raise RequestError(400, f"max_new_tokens must be at least 0, got {max_new}.")
        if not p["min_new_tokens"] <= max_new:
            raise RequestError(
                400, f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {p['min_new_tokens']}."
            )
    for token_id in p["logit_bias"] or {}:
        if not 0 <= int(token_id) < vocab_size:
            raise RequestError(400, f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
    seed = p["sampling_seed"]
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise RequestError(400, f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    if sum(p[k] is not None for k in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        raise RequestError(400, "Only one of json_schema, regex, ebnf, or structural_tag can be set.")
