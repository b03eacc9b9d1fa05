"""The codec fuzz loop of tests/codec_fuzz.py: 20k mutated inputs in the default suite, 10^6 slow-marked.

The property: `decode` raises only ProtocolError (with a known reason) or returns a valid message.
"""

from __future__ import annotations

import pytest
from codec_fuzz import Fuzzer, join_frames, split_frames


def test_20k_mutated_inputs_raise_only_protocol_error() -> None:
    outcomes = Fuzzer(seed=0).run(20_000)
    assert sum(outcomes.values()) == 20_000
    # the mutations reach every layer: frames, header, msgpack, schema, buffers, value checks, and some
    # mutated inputs are still valid messages (which then round-trip)
    for reason in ("bad_frames", "bad_header", "bad_msgpack", "wrong_type", "bad_buffer", "invalid_value"):
        assert outcomes[reason] > 0, outcomes
    assert outcomes["accepted"] > 0


def test_atheris_framing_round_trips() -> None:
    frames = [b"\x92\x01\x01", b"", b"x" * 300]
    assert split_frames(join_frames(frames)) == frames


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_million_mutated_inputs_raise_only_protocol_error() -> None:
    outcomes = Fuzzer(seed=1).run(1_000_000)
    assert sum(outcomes.values()) == 1_000_000
