"""Hypothesis strategies for samples of episodes: model turns and observations in random order.

Samples are built only through the records API (`extend`, `observed`, `with_episode`, `resumed`, and the
broker's `returned_by` at an abort), as a worker's episode driver and the broker build them, so every
drawn sample is one the system can produce: several observation spans, turns under rising policy
versions, aborts and resumes between any two steps, and single-turn samples (no observation, empty
episode state) among them.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from april.records import FinishReason, Sample

TOKENS = st.integers(min_value=0, max_value=50_000)
LOGPROBS = st.floats(min_value=-20.0, max_value=0.0, width=32)


@st.composite
def turns(draw: st.DrawFn, sample: Sample, steps: int) -> Sample:
    """`sample` (leased) after up to `steps` random steps of its episode; still RUNNING."""
    version = sample.segments[-1].version if sample.segments else draw(st.integers(0, 3), label="version")
    for _ in range(draw(st.integers(0, steps), label="steps")):
        step = draw(st.sampled_from(["model", "model", "observation", "abort", "state"]), label="step")
        if step == "model":
            version += draw(st.integers(0, 1), label="new weights")
            n = draw(st.integers(0, 5), label="model tokens")
            ids = draw(st.lists(TOKENS, min_size=n, max_size=n), label="ids")
            lps = draw(st.lists(LOGPROBS, min_size=n, max_size=n), label="logprobs")
            sample = sample.extend(ids, lps, version, FinishReason.NONE)
        elif step == "observation":
            sample = sample.observed(draw(st.lists(TOKENS, max_size=5), label="observation"))
        elif step == "abort":
            worker = draw(st.sampled_from(["w0", "w1"]), label="worker")
            sample = sample.extend([], [], version, FinishReason.ABORT).returned_by(worker, sample.leases)
            sample = sample.resumed()
        else:
            sample = sample.with_episode(draw(st.binary(max_size=24), label="episode state"))
    return sample


@st.composite
def episodes(
    draw: st.DrawFn, group_id: int = 0, index: int = 0, *, finished: bool = False, steps: int = 8
) -> Sample:
    """One sample of an episode; `finished`: ended by a last model turn (STOP) and scored."""
    prompt = draw(st.lists(TOKENS, min_size=1, max_size=6), label="prompt")
    fresh = Sample(group_id, index, np.array(prompt, np.int32), metadata={"answer": "7"}).resumed()
    sample = draw(turns(fresh, steps))
    if finished:
        version = sample.segments[-1].version if sample.segments else 0
        n = draw(st.integers(1, 4), label="last turn")
        ids = draw(st.lists(TOKENS, min_size=n, max_size=n), label="last ids")
        lps = draw(st.lists(LOGPROBS, min_size=n, max_size=n), label="last logprobs")
        reward = draw(st.sampled_from([0.0, 1.0, -0.5]), label="reward")
        sample = sample.extend(ids, lps, version, FinishReason.STOP).scored(reward)
    return sample
