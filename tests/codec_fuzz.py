"""A fast, seeded fuzz loop for the wire codec: millions of inputs where hypothesis manages thousands.

Each input starts from the valid encoded frames of a message of every registered kind (the examples of
tests/test_codec.py) or from random bytes, and gets 1-3 mutations: byte flips, inserts, deletes and
truncations (header, body or array buffers), frames dropped, duplicated, appended or swapped, the header's
version or kind changed, and msgpack body edits (a field removed, added or given a hostile value: negative,
huge, NaN, infinite, wrong type, nested). The property is the one of test_codec.py: `decode` raises only
`ProtocolError` with a known reason, or returns a schema-exact, valid message that round-trips.

`python tests/codec_fuzz.py --inputs 1000000` runs it from the command line (the figure in
docs/reliability.md); `python tests/codec_fuzz.py --atheris -runs=200000` runs the same property under
atheris (coverage-guided libFuzzer, `pip install atheris`), seeded with a valid frame set of every kind;
tests/test_codec_fuzz.py runs a short version in the default suite.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_codec import EXAMPLES, REASONS, assert_valid_message, framed_of, frames_of

from april import protocol as P
from april.codec import ProtocolError

HOSTILE: list[Any] = [
    -1, -(2**63), 2**63, 2**64 - 1, 0, 1, math.nan, math.inf, -math.inf, -0.0, 1e308, True, None,
    "", "x" * 300, b"\x00\xff", [], [1, 2, 3], {}, {"a": 1}, [[[[[]]]]], ["<i8", 0, 3], [2, "<f4", 1],
    [b"\x00" * 8, "<i8", 1], [b"\x00" * 7, "<i8", 1], [b"", "<f4", 0], [b"\x00" * 4, "<i8", 1],
]  # fmt: skip


def _body(frames: list[bytes]) -> Any:
    return msgpack.unpackb(frames[1], raw=False, strict_map_key=False)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


class Fuzzer:
    def __init__(self, seed: int, max_bytes: int = 1 << 20) -> None:
        self.rng = random.Random(seed)
        self.max_bytes = max_bytes
        # both wire forms of every example: small arrays inline in the body, and every array in a frame
        self.valid = [frames_of(m) for m in EXAMPLES.values()] + [framed_of(m) for m in EXAMPLES.values()]
        self.kinds = sorted(P.KIND_OF.values())
        self.field_names = sorted({str(p[-1]) for f in self.valid for p in _paths(_body(f)) if p})
        self.outcomes: Counter[str] = Counter()

    # ------------------------------------------------------------------ inputs

    def _bytes(self, n: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, n))

    def _value(self) -> Any:
        if self.rng.random() < 0.7:
            return self.rng.choice(HOSTILE)
        return self.rng.choice(
            [self.rng.randint(-(2**40), 2**40), self.rng.uniform(-1e6, 1e6), self._bytes(8)]
        )

    def _edit(self, frame: bytes, op: str) -> bytes:
        f = bytearray(frame)
        if op == "insert":
            pos = self.rng.randint(0, len(f))
            f[pos:pos] = self._bytes(4) or b"\x00"
        elif f and op == "flip":
            pos = self.rng.randrange(len(f))
            f[pos] ^= self.rng.randint(1, 255)
        elif f and op == "delete":
            pos = self.rng.randrange(len(f))
            del f[pos : pos + self.rng.randint(1, 4)]
        elif f and op == "truncate":
            del f[self.rng.randrange(len(f)) :]
        return bytes(f)

    def _edit_body(self, frames: list[bytes]) -> None:
        try:
            body = _body(frames)
        except Exception:  # already garbled: nothing to re-pack
            return
        paths = _paths(body)
        op = self.rng.choice(["remove", "add", "change", "change"])
        if op == "remove":
            candidates = [p for p in paths if p]
            if candidates:
                path = self.rng.choice(candidates)
                del _at(body, path[:-1])[path[-1]]
        elif op == "add":
            maps = [p for p in paths if isinstance(_at(body, p), dict)]
            if maps:
                key = self.rng.choice(self.field_names) if self.rng.random() < 0.7 else self._bytes(4).hex()
                _at(body, self.rng.choice(maps))[key] = self._value()
        else:
            path = self.rng.choice(paths)
            if path:
                _at(body, path[:-1])[path[-1]] = self._value()
            else:
                body = self._value()
        frames[1] = msgpack.packb(body, use_bin_type=True)

    def _mutate(self, frames: list[bytes]) -> list[bytes]:
        op = self.rng.choice(
            ["flip", "insert", "delete", "truncate", "drop", "duplicate", "append", "swap", "header"]
            + 3 * ["flip_buffer", "body"]
        )
        n = len(frames)
        if op in ("flip", "insert", "delete", "truncate", "flip_buffer"):
            first = 2 if op == "flip_buffer" else 0  # same-length buffer edits reach validate()
            if n > first:
                i = self.rng.randrange(first, n)
                frames[i] = self._edit(frames[i], "flip" if op == "flip_buffer" else op)
        elif op == "drop" and n:
            del frames[self.rng.randrange(n)]
        elif op == "duplicate" and n:
            frames.insert(self.rng.randint(0, n), frames[self.rng.randrange(n)])
        elif op == "append":
            frames.append(self._bytes(16))
        elif op == "swap" and n >= 2:
            i, j = self.rng.sample(range(n), 2)
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "header" and n:
            version = self.rng.choice([P.PROTOCOL_VERSION, P.PROTOCOL_VERSION + 1, 0, -1, 2**40])
            kind = self.rng.choice([*self.kinds, 0, -1, 999, 2**63])
            frames[0] = msgpack.packb(self.rng.choice([[version, kind], [version], [version, kind, 0], kind]))
        elif op == "body" and n >= 2:
            self._edit_body(frames)
        return frames

    def one(self) -> list[bytes]:
        if self.rng.random() < 0.1:  # random frames, now and then with a valid header
            frames = [self._bytes(64) for _ in range(self.rng.randint(0, 5))]
            if frames and self.rng.random() < 0.5:
                frames[0] = msgpack.packb([P.PROTOCOL_VERSION, self.rng.choice(self.kinds)])
            return frames
        frames = list(self.rng.choice(self.valid))
        for _ in range(self.rng.randint(1, 3)):
            frames = self._mutate(frames)
        return frames

    # ------------------------------------------------------------------ the property

    def check(self, frames: list[bytes]) -> None:
        try:
            msg = P.decode(frames, self.max_bytes)
        except ProtocolError as err:
            if err.reason not in REASONS or not str(err):
                raise AssertionError(f"unknown reason {err.reason!r}: {err}; frames {frames!r}") from None
            self.outcomes[err.reason] += 1
            return
        except Exception as exc:
            raise AssertionError(f"decode raised {type(exc).__name__}: {exc}; frames {frames!r}") from exc
        assert_valid_message(msg)
        self.outcomes["accepted"] += 1

    def run(self, inputs: int) -> Counter[str]:
        for _ in range(inputs):
            self.check(self.one())
        return self.outcomes


def split_frames(data: bytes) -> list[bytes]:
    """atheris inputs as frames: [u16 length, bytes] repeated (at most MAX_FRAMES + 2 frames)."""
    frames, i = [], 0
    while i + 2 <= len(data) and len(frames) < 10:
        n = int.from_bytes(data[i : i + 2], "little")
        frames.append(data[i + 2 : i + 2 + n])
        i += 2 + n
    return frames


def join_frames(frames: list[bytes]) -> bytes:
    return b"".join(len(f).to_bytes(2, "little") + f for f in frames)


def run_atheris(libfuzzer_args: list[str]) -> int:
    """Coverage-guided fuzzing with atheris (libFuzzer), seeded with every valid message kind."""
    import tempfile

    import atheris

    atheris.instrument_all()  # the codec modules are imported already (by test_codec)
    fuzzer = Fuzzer(0)
    corpus = Path(tempfile.mkdtemp(prefix="april-codec-corpus-"))
    for i, frames in enumerate(fuzzer.valid):
        (corpus / f"seed-{i}").write_bytes(join_frames(frames))
    atheris.Setup([sys.argv[0], *libfuzzer_args, str(corpus)], lambda data: fuzzer.check(split_frames(data)))
    atheris.Fuzz()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Fuzz april.codec.decode with mutated frames.")
    p.add_argument("--inputs", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atheris", action="store_true", help="coverage-guided (atheris); -runs=N etc. follow")
    args, rest = p.parse_known_args(argv)
    if args.atheris:
        return run_atheris(rest)
    started = time.monotonic()
    outcomes = Fuzzer(args.seed).run(args.inputs)
    wall = time.monotonic() - started
    print(
        json.dumps(
            {
                "inputs": args.inputs,
                "seed": args.seed,
                "wall_s": round(wall, 1),
                "inputs_per_s": round(args.inputs / wall),
                "only_protocol_error": True,
                "outcomes": dict(outcomes.most_common()),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
