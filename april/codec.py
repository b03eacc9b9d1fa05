"""Encoding and strict decoding of protocol messages to ZeroMQ frames.

Frames are `[header, body, *buffers]`: `header = msgpack([PROTOCOL_VERSION, kind])`, `body` a msgpack map
with exactly the message's fields, and every numpy array field referenced from the body: a large array as
its own frame (zero-copy on both sides), `[frame_index, dtype, length]`; a small one, when the encoder is
given an inline budget (protocol messages are), inside the body as `[bytes, dtype, length]`. Each frame
costs a sender and a receiver a few microseconds whatever its size, and a message of small arrays (a
lease, a one-sample result) had a dozen: inline, it has two.

The schema of each message is read once from its dataclass annotations: scalars (int, float, str, bool),
enums, `list[...]`, `dict[str, ...]`, `X | None`, nested frozen dataclasses ("structs") and 1-D arrays
declared with `Annotated[..., ArraySpec(dtype)]`. Decoding checks everything (header, version, kind,
missing/extra fields, types, sizes) and then calls the struct's `validate()` if it has one; any failure is a
`ProtocolError` carrying a short `reason` (used for per-reason counters) and a message naming what was wrong.
No pickle, no eval: only msgpack scalars, maps, lists and raw little-endian buffers.

A struct is closed unless it declares `EVOLVABLE: ClassVar[bool] = True`. An evolvable struct (the
broker's status records, `april.status`) is read across versions: a field with a default may be absent
(it takes the default: a field added later), and fields it does not declare are skipped (a field a newer
sender added). Every field it declares is still checked exactly. Commands stay closed: a message that is
only half understood must not be acted on.

Does not know the message types: `april.protocol` registers them.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

Frame = bytes | memoryview
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
MAX_FRAMES = 1024
MAX_HEADER_BYTES = 64
MAX_BODY_BYTES = 64 * 1024 * 1024  # the map of scalars; bulk data travels in buffer frames
INLINE_ARRAY_MAX_BYTES = 16 * 1024  # an array at most this size may travel inside the body ...
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ProtocolError(Exception):
    """A message that does not follow the protocol. `reason` is a short counter key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """Marks a field as a 1-D little-endian numpy array of this dtype, sent as its own frame."""

    dtype: str  # numpy dtype string, e.g. "<i4"


Int32Array = typing.Annotated[npt.NDArray[np.int32], ArraySpec("<i4")]
Int64Array = typing.Annotated[npt.NDArray[np.int64], ArraySpec("<i8")]
UInt8Array = typing.Annotated[npt.NDArray[np.uint8], ArraySpec("|u1")]
Float32Array = typing.Annotated[npt.NDArray[np.float32], ArraySpec("<f4")]
Float64Array = typing.Annotated[npt.NDArray[np.float64], ArraySpec("<f8")]

# ---------------------------------------------------------------------------------------------------
# Type specs: a tiny schema language compiled from annotations.


@dataclass(frozen=True, slots=True)
class _Scalar:
    py: type


@dataclass(frozen=True, slots=True)
class _Enum:
    cls: type[enum.Enum]


@dataclass(frozen=True, slots=True)
class _Optional:
    inner: _Spec


@dataclass(frozen=True, slots=True)
class _List:
    inner: _Spec


@dataclass(frozen=True, slots=True)
class _Dict:
    inner: _Spec


@dataclass(frozen=True, slots=True)
class _Array:
    dtype: np.dtype[Any]


@dataclass(frozen=True, slots=True)
class _Struct:
    cls: type
    fields: tuple[tuple[str, _Spec], ...]
    evolvable: bool = False  # defaulted fields may be absent, undeclared ones are skipped
    required: frozenset[str] = frozenset()  # fields without a default (all fields of a closed struct)


_Spec = _Scalar | _Enum | _Optional | _List | _Dict | _Array | _Struct
_SCHEMAS: dict[type, _Struct] = {}


def struct_schema(cls: type) -> _Struct:
    """Compile (once) and return the schema of a dataclass."""
    cached = _SCHEMAS.get(cls)
    if cached is not None:
        return cached
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = tuple(
        (f.name, _compile(hints[f.name], f"{cls.__name__}.{f.name}")) for f in dataclasses.fields(cls)
    )
    evolvable = getattr(cls, "EVOLVABLE", False) is True
    required = frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if not evolvable or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    )
    schema = _Struct(cls, fields, evolvable, required)
    _SCHEMAS[cls] = schema
    return schema


def _compile(tp: Any, where: str) -> _Spec:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        for meta in tp.__metadata__:
            if isinstance(meta, ArraySpec):
                return _Array(np.dtype(meta.dtype))
        raise TypeError(f"{where}: Annotated without ArraySpec")
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(tp)) != 2:
            raise TypeError(f"{where}: only `X | None` unions are supported")
        return _Optional(_compile(args[0], where))
    if origin is list:
        return _List(_compile(typing.get_args(tp)[0], where))
    if origin is dict:
        key, value = typing.get_args(tp)
        if key is not str:
            raise TypeError(f"{where}: dict keys must be str")
        return _Dict(_compile(value, where))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _Enum(tp)
    if tp in (int, float, str, bool, bytes):
        return _Scalar(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return struct_schema(tp)
    raise TypeError(f"{where}: unsupported field type {tp!r}")


# ---------------------------------------------------------------------------------------------------
# Encoding


@dataclass(slots=True)
class _Encoding:
    buffers: list[Frame]  # the array frames so far
    inline_left: int  # bytes of small arrays the body may still take (0: every array in a frame)


_Encoder = Callable[[Any, _Encoding], Any]  # (value, out) -> what msgpack packs
_ENCODERS: dict[_Spec, _Encoder] = {}
_FIELD_ENCODERS: dict[type, tuple[tuple[str, _Encoder], ...]] = {}


def encode_struct(obj: Any, out: _Encoding) -> dict[str, Any]:
    """Body map of a dataclass instance; arrays go inline or are appended to `out.buffers`."""
    fields = _FIELD_ENCODERS.get(type(obj))
    if fields is None:
        fields = tuple((name, _encoder(spec)) for name, spec in struct_schema(type(obj)).fields)
        _FIELD_ENCODERS[type(obj)] = fields
    return {name: encode(getattr(obj, name), out) for name, encode in fields}


def _encoder(spec: _Spec) -> _Encoder:
    """The encoding function of a spec, chosen once, as `_decoder` is for decoding."""
    cached = _ENCODERS.get(spec)
    if cached is None:
        cached = _ENCODERS[spec] = _make_encoder(spec)
    return cached


def _make_encoder(spec: _Spec) -> _Encoder:
    match spec:
        case _Array(dtype):
            return _array_encoder(dtype)
        case _Enum():
            return lambda value, out: value.value
        case _Optional(inner):
            encode = _encoder(inner)
            return lambda value, out: None if value is None else encode(value, out)
        case _List(_Scalar(py)) if py is not float:  # str, int, bool: encoded as they are
            return lambda value, out: list(value)
        case _List(_Dict(_Scalar(py))) if py is str:
            return lambda value, out: [dict(v) for v in value]
        case _List(inner):
            encode = _encoder(inner)
            return lambda value, out: [encode(v, out) for v in value]
        case _Dict(inner):
            encode = _encoder(inner)
            return lambda value, out: {k: encode(v, out) for k, v in value.items()}
        case _Struct():
            return encode_struct
        case _Scalar(py) if py is float:
            return lambda value, out: float(value)
    return lambda value, out: value


def _array_encoder(dtype: np.dtype[Any]) -> _Encoder:
    """Arrays of one dtype: inline while the body has room for them, else a frame of their own."""
    code = dtype.str

    def encode(value: Any, out: _Encoding) -> list[Any]:
        arr = np.ascontiguousarray(value, dtype=dtype)
        if arr.ndim != 1:
            raise ValueError(f"array fields must be 1-D, got shape {arr.shape}")
        if out.inline_left > 0 and arr.nbytes <= min(INLINE_ARRAY_MAX_BYTES, out.inline_left):
            out.inline_left -= arr.nbytes
            return [arr.tobytes(), code, int(arr.shape[0])]
        out.buffers.append(arr.data.cast("B"))
        return [len(out.buffers) + 1, code, int(arr.shape[0])]  # frame index counts header, body

    return encode


def encode_map(obj: Any) -> dict[str, Any]:
    """The map of a dataclass instance that has no array fields (e.g. for a JSON document)."""
    out = _Encoding([], 0)
    body = encode_struct(obj, out)
    if out.buffers:
        raise ValueError(f"{type(obj).__name__} has array fields: it needs frames, not a map")
    return body


def encode_frames(version: int, kind: int, msg: Any, inline_bytes: int = 0) -> list[Frame]:
    """`[header, body, *buffers]`. Arrays of at most INLINE_ARRAY_MAX_BYTES go inside the body while
    their total stays within `inline_bytes` (0: every array in its own frame, as files are written)."""
    out = _Encoding([], inline_bytes)
    body = encode_struct(msg, out)
    return [msgpack.packb([version, kind]), msgpack.packb(body, use_bin_type=True), *out.buffers]


# ---------------------------------------------------------------------------------------------------
# Decoding


def _unpack(data: Frame, what: str, limit: int) -> Any:
    n = len(data)
    if n > limit:
        raise ProtocolError("oversize", f"{what}: {n} bytes, limit {limit}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=0,
        )
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise ProtocolError("bad_msgpack", f"{what}: not valid msgpack ({type(exc).__name__})") from exc
    except RecursionError as exc:
        raise ProtocolError("bad_msgpack", f"{what}: nested too deeply") from exc


def decode_header(frames: Sequence[Frame], version: int) -> int:
    """Check the frame count, header and protocol version; return the message kind code."""
    if len(frames) < 2:
        raise ProtocolError("bad_frames", f"expected at least 2 frames (header, body), got {len(frames)}")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError("oversize", f"{len(frames)} frames, limit {MAX_FRAMES}")
    header = _unpack(frames[0], "header", MAX_HEADER_BYTES)
    if (
        not isinstance(header, list)
        or len(header) != 2
        or not all(type(x) is int for x in header)  # bool is not a valid header field
    ):
        raise ProtocolError("bad_header", f"header must be [protocol_version, kind] integers, got {header!r}")
    got_version, kind = header
    if got_version != version:
        raise ProtocolError("wrong_version", f"protocol version {got_version}, expected {version}")
    return int(kind)


def decode_file_version(frames: Sequence[Frame], versions: Sequence[int]) -> int:
    """Which of `versions` (the one this code writes first, then older ones it still reads) a file's
    record was written in; a ProtocolError naming the first when it is none of them."""
    for version in versions[1:]:
        try:
            decode_header(frames, version)
            return version
        except ProtocolError as exc:
            if exc.reason != "wrong_version":
                raise
    decode_header(frames, versions[0])
    return versions[0]


def decode_body(cls: type, frames: Sequence[Frame], max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode and validate frames[1:] as an instance of dataclass `cls`."""
    total = sum(len(f) for f in frames)
    if total > max_bytes:
        raise ProtocolError("oversize", f"{cls.__name__}: {total} bytes, limit {max_bytes}")
    body = _unpack(frames[1], f"{cls.__name__} body", min(max_bytes, MAX_BODY_BYTES))
    used: set[int] = set()
    obj = _decode_struct(body, struct_schema(cls), frames, used, cls.__name__)
    if len(used) != len(frames) - 2:
        raise ProtocolError(
            "bad_buffer", f"{cls.__name__}: {len(frames) - 2} buffer frames, {len(used)} referenced"
        )
    return obj


def decode_map(cls: type, raw: object, where: str = "") -> Any:
    """Decode and validate a map (e.g. a parsed JSON document) as an instance of dataclass `cls`, with the
    checks of a message body; a struct with array fields cannot be read this way (`bad_buffer`)."""
    return _decode_struct(raw, struct_schema(cls), (), set(), where or cls.__name__)


_Decoder = Callable[[Any, Sequence[Frame], set[int], str], Any]  # (raw, frames, used, where) -> value
_DECODERS: dict[_Spec, _Decoder] = {}
_FIELD_DECODERS: dict[type, tuple[frozenset[str], tuple[tuple[str, _Decoder], ...]]] = {}


def _decode_struct(raw: Any, schema: _Struct, frames: Sequence[Frame], used: set[int], where: str) -> Any:
    names, decoders = _field_decoders(schema)
    # a body with exactly the declared fields (string keys, since they equal the names) is the common
    # case: the checks below are for the others, and for evolvable structs
    if type(raw) is not dict or raw.keys() != names or schema.evolvable:
        _check_map(raw, where)
        missing = [name for name, _ in schema.fields if name in schema.required and name not in raw]
        if missing:
            raise ProtocolError("missing_field", f"{where}: missing field(s) {', '.join(missing)}")
        if not schema.evolvable:
            extra = sorted(set(raw) - names)
            if extra:
                raise ProtocolError("extra_field", f"{where}: unknown field(s) {', '.join(map(str, extra))}")
    values = {
        name: decode(raw[name], frames, used, f"{where}.{name}")
        for name, decode in decoders
        if name in raw  # an evolvable struct's absent field takes its default
    }
    obj = schema.cls(**values)
    validate: Callable[[], None] | None = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as exc:
            raise ProtocolError("invalid_value", f"{where}: {exc}") from exc
    return obj


def _field_decoders(schema: _Struct) -> tuple[frozenset[str], tuple[tuple[str, _Decoder], ...]]:
    """The struct's field names, and each field's decoder (made once per struct)."""
    cached = _FIELD_DECODERS.get(schema.cls)
    if cached is None:
        names = frozenset(name for name, _ in schema.fields)
        cached = (names, tuple((name, _decoder(spec)) for name, spec in schema.fields))
        _FIELD_DECODERS[schema.cls] = cached
    return cached


def _decoder(spec: _Spec) -> _Decoder:
    """The decoding function of a spec, chosen once: a message's dozens of values then cost a call each,
    not a walk through every kind of spec."""
    cached = _DECODERS.get(spec)
    if cached is None:
        cached = _DECODERS[spec] = _make_decoder(spec)
    return cached


def _make_decoder(spec: _Spec) -> _Decoder:
    match spec:
        case _Array(dtype):
            return _array_decoder(dtype)
        case _Scalar(py):
            return lambda raw, frames, used, where: _decode_scalar(raw, py, where)
        case _Enum(cls):
            return lambda raw, frames, used, where: _decode_enum(raw, cls, where)
        case _Optional(inner):
            decode = _decoder(inner)
            return lambda raw, frames, used, where: None if raw is None else decode(raw, frames, used, where)
        case _List(inner):
            return lambda raw, frames, used, where: _decode_list(raw, inner, frames, used, where)
        case _Dict(inner):
            return lambda raw, frames, used, where: _decode_dict(raw, inner, frames, used, where)
        case _Struct():
            return lambda raw, frames, used, where: _decode_struct(raw, spec, frames, used, where)
    raise AssertionError(f"unhandled spec {spec!r}")  # pragma: no cover


def _decode_enum(raw: Any, cls: type[enum.Enum], where: str) -> Any:
    try:
        if type(raw) is not int:
            raise TypeError(raw)
        return cls(raw)
    except (ValueError, TypeError):
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ProtocolError("invalid_value", f"{where}: {_show(raw)} is not one of {allowed}") from None


def _decode_list(raw: Any, inner: _Spec, frames: Sequence[Frame], used: set[int], where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise ProtocolError("wrong_type", f"{where}: expected a list, got {type(raw).__name__}")
    if _all_plain(raw, inner):  # hot path: lists of strings / bytes / str->str maps (one per sample)
        return raw
    decode = _decoder(inner)
    return [decode(v, frames, used, f"{where}[{i}]") for i, v in enumerate(raw)]


def _decode_dict(
    raw: Any, inner: _Spec, frames: Sequence[Frame], used: set[int], where: str
) -> dict[str, Any]:
    _check_map(raw, where)
    decode = _decoder(inner)
    return {k: decode(v, frames, used, f"{where}[{k!r}]") for k, v in raw.items()}


def _decode_scalar(raw: Any, py: type, where: str) -> Any:
    if py is float:
        if type(raw) in (float, int):
            return float(raw)
    elif py is int:
        if type(raw) is int and INT64_MIN <= raw <= INT64_MAX:
            return raw
    elif type(raw) is py:
        return raw
    raise ProtocolError("wrong_type", f"{where}: expected {py.__name__}, got {_show(raw)}")


def _array_decoder(dtype: np.dtype[Any]) -> _Decoder:
    """The decoder of one dtype's array refs: `[inline bytes or frame index, dtype code, length]`. Its
    code and item size are read once here, not per value (a message of samples carries over a dozen)."""
    code, itemsize = dtype.str, dtype.itemsize

    def decode(raw: Any, frames: Sequence[Frame], used: set[int], where: str) -> np.ndarray[Any, Any]:
        ok = type(raw) is list and len(raw) == 3 and type(raw[0]) in (int, bytes) and type(raw[2]) is int
        if not ok or raw[1] != code:
            raise ProtocolError(
                "wrong_type",
                f"{where}: expected array ref [frame or bytes, {code!r}, length], got {_show(raw)}",
            )
        index, _, length = raw
        if type(index) is bytes:  # inline in the body
            if length < 0 or len(index) != length * itemsize:
                raise ProtocolError(
                    "bad_buffer", f"{where}: {len(index)} inline bytes, expected {length} x {itemsize}"
                )
            return np.frombuffer(index, dtype=dtype)
        if not 2 <= index < len(frames) or index in used:
            raise ProtocolError("bad_buffer", f"{where}: frame index {index} missing or reused")
        used.add(index)
        buf = frames[index]
        if length < 0 or len(buf) != length * itemsize:
            raise ProtocolError(
                "bad_buffer", f"{where}: frame has {len(buf)} bytes, expected {length} x {itemsize}"
            )
        return np.frombuffer(buf, dtype=dtype)

    return decode


def _check_map(raw: Any, where: str) -> None:
    if not isinstance(raw, dict):
        raise ProtocolError("wrong_type", f"{where}: expected a map, got {_show(raw)}")
    for key in raw:
        if type(key) is not str:
            raise ProtocolError("wrong_type", f"{where}: map keys must be strings, got {_show(key)}")


def _show(raw: Any) -> str:
    """A short description of a received value for an error message (never a full or recursive repr)."""
    if isinstance(raw, list | dict):
        return f"{type(raw).__name__} of {len(raw)} items"
    if isinstance(raw, str | bytes):
        text = repr(raw[:40])
        return f"{type(raw).__name__} {text}{'...' if len(raw) > 40 else ''}"
    return f"{type(raw).__name__} {raw!r}"


_STR = _Scalar(str)
_BYTES = _Scalar(bytes)
_ONLY_STR = frozenset({str})
_ONLY_BYTES = frozenset({bytes})
_ONLY_DICT = frozenset({dict})


def _all_plain(raw: list[Any], inner: _Spec) -> bool:
    """True when every item of a list of `str`, of `bytes` or of `dict[str, str]` already has exactly
    that type (then the decoded msgpack value is the result as is). Anything else takes the checked path."""
    if inner == _STR:
        return set(map(type, raw)) <= _ONLY_STR
    if inner == _BYTES:
        return set(map(type, raw)) <= _ONLY_BYTES
    if inner == _Dict(_STR):  # map(type, ...) runs in C: a per-item generator cost more than the rest
        if not set(map(type, raw)) <= _ONLY_DICT:
            return False
        keys = set(map(type, chain.from_iterable(raw)))
        values = set(map(type, chain.from_iterable(d.values() for d in raw)))
        return keys <= _ONLY_STR and values <= _ONLY_STR
    return False
