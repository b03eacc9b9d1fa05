"""Flat ragged (columnar) wire form of a list of samples.

`SampleBatch` carries S samples as a handful of 1-D arrays: one entry per sample for the scalars, and
concatenated token / log-prob / segment arrays with `*_offsets` of length S+1 (sample i owns
`x[offsets[i]:offsets[i+1]]`). Segments travel as int64 triples `(version, start, end)`, offsets counted in
segments, an episode's observation spans as int64 pairs `(start, end)`, its state as one bytes value
per sample (b"" for a single-turn one), and the broker's lease spans as their ends (int64) and workers.
This keeps a 2k-token sample at two arrays of bytes on the wire instead of 4k msgpack items, and lets the
receiver slice views without copying.

`validate()` is called by the codec after decoding, so a malformed batch is a ProtocolError before any role
sees it. Owns the conversion to and from `april.records.Sample`; knows nothing about sockets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from operator import attrgetter
from typing import Any

import numpy as np

from april.codec import Float32Array, Float64Array, Int32Array, Int64Array, UInt8Array
from april.records import MAX_WORKER_ID, FinishReason, LeaseSpan, Sample, SampleStatus, Segment, Span

# plain ints, as april.records' codes: numpy compares with an enum member several times slower
_STATUS_MAX = int(max(SampleStatus))
_FINISH_MAX = int(max(FinishReason))
_SAMPLE_FIELDS = attrgetter(
    "group_id",
    "index",
    "status",
    "finish_reason",
    "resumes",
    "reward",
    "prompt_ids",
    "response_ids",
    "response_logprobs",
    "segments",
    "prompt_text",
    "metadata",
    "error",
    "observations",
    "episode",
    "leases",
)
_SEGMENT_FIELDS = attrgetter("version", "start", "end")
_STATUSES = {int(m): m for m in SampleStatus}
_FINISH_REASONS = {int(m): m for m in FinishReason}
LOGPROB_TOLERANCE = 1e-3  # engines round; a log-prob above this is not a probability
_NO_SPANS = np.zeros(0, dtype=np.int64)  # the observations of a batch without any: one shared empty array


@dataclass(frozen=True, slots=True)
class SampleBatch:
    group_id: Int64Array  # [S]
    index: Int32Array  # [S]
    status: UInt8Array  # [S] SampleStatus codes
    finish_reason: UInt8Array  # [S] FinishReason codes
    resumes: Int32Array  # [S]
    reward: Float64Array  # [S], NaN = not scored
    prompt_offsets: Int64Array  # [S+1]
    prompt_ids: Int32Array  # [sum prompt lengths]
    response_offsets: Int64Array  # [S+1]
    response_ids: Int32Array  # [sum response lengths]
    response_logprobs: Float32Array  # [sum response lengths]
    segment_offsets: Int64Array  # [S+1], in segments
    segments: Int64Array  # [3 x total segments]: version, start, end
    observation_offsets: Int64Array  # [S+1], in spans
    observations: Int64Array  # [2 x total spans]: start, end of each observation
    prompt_text: list[str]  # [S]
    metadata: list[dict[str, str]]  # [S]
    error: list[str]  # [S]
    episode: list[bytes]  # [S], b"" for a single-turn sample
    lease_offsets: Int64Array  # [S+1], in lease spans
    lease_ends: Int64Array  # [L]: the response's length when that lease came back
    lease_workers: list[str]  # [L]: the worker that returned it

    def __len__(self) -> int:
        return int(self.group_id.shape[0])

    @property
    def response_tokens(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def model_tokens(self) -> int:
        """Response tokens the model generated (the segments'): all of them but the observations'."""
        spans = self.observations.reshape(-1, 2)
        return self.response_tokens - int((spans[:, 1] - spans[:, 0]).sum())

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistency (lengths, offsets, codes, segments, log-probs)."""
        s = len(self)
        for name in ("index", "status", "finish_reason", "resumes", "reward"):
            if getattr(self, name).shape[0] != s:
                raise ValueError(f"{name} has {getattr(self, name).shape[0]} entries for {s} samples")
        for name in ("prompt_text", "metadata", "error", "episode"):
            if len(getattr(self, name)) != s:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {s} samples")
        _check_offsets("prompt_offsets", self.prompt_offsets, s, self.prompt_ids.shape[0])
        _check_offsets("response_offsets", self.response_offsets, s, self.response_ids.shape[0])
        if self.segments.shape[0] % 3:
            raise ValueError(f"segments length {self.segments.shape[0]} is not a multiple of 3")
        _check_offsets("segment_offsets", self.segment_offsets, s, self.segments.shape[0] // 3)
        if self.observations.shape[0] % 2:
            raise ValueError(f"observations length {self.observations.shape[0]} is not a multiple of 2")
        if self.observations.shape[0]:
            _check_offsets(
                "observation_offsets", self.observation_offsets, s, self.observations.shape[0] // 2
            )
        elif self.observation_offsets.shape[0] != s + 1 or self.observation_offsets.any():
            # no observation in the batch (every single-turn one): one check of the offsets for all
            _check_offsets("observation_offsets", self.observation_offsets, s, 0)
        if self.response_logprobs.shape[0] != self.response_ids.shape[0]:
            raise ValueError(
                f"{self.response_logprobs.shape[0]} log-probs for {self.response_ids.shape[0]} tokens"
            )
        if s and (self.status.max() > _STATUS_MAX or self.finish_reason.max() > _FINISH_MAX):
            raise ValueError("status or finish_reason code out of range")
        if s and (self.group_id.min() < 0 or self.index.min() < 0 or self.resumes.min() < 0):
            raise ValueError("negative group_id, index or resumes")
        if self.prompt_ids.shape[0] and self.prompt_ids.min() < 0:
            raise ValueError("negative prompt token id")
        if self.response_ids.shape[0]:
            if self.response_ids.min() < 0:
                raise ValueError("negative response token id")
            lp = self.response_logprobs
            if not np.isfinite(lp).all() or float(lp.max()) > LOGPROB_TOLERANCE:
                raise ValueError("log-probs must be finite and <= 0")
        if np.isinf(self.reward).any():
            raise ValueError("reward is infinite")
        seg = self.segments.reshape(-1, 3)
        if seg.shape[0] and (seg[:, 0].min() < 0 or (seg[:, 2] <= seg[:, 1]).any()):
            raise ValueError("segments need version >= 0 and end > start")
        if self.observations.shape[0]:
            self._validate_episodes()
        else:  # no episode in the batch: the segments alone tile each response
            self._validate_segments()
        self._validate_leases()

    def _validate_leases(self) -> None:
        """Per sample: lease ends rise within [0, response length]; one worker id per end."""
        ends, s = self.lease_ends, len(self)
        if len(self.lease_workers) != ends.shape[0]:
            raise ValueError(f"lease_workers has {len(self.lease_workers)} entries for {ends.shape[0]} ends")
        _check_offsets("lease_offsets", self.lease_offsets, s, ends.shape[0])
        if not ends.shape[0]:
            return
        if not all(0 < len(w) <= MAX_WORKER_ID for w in self.lease_workers):
            raise ValueError(f"lease_workers must be 1..{MAX_WORKER_ID} characters")
        owner = np.repeat(np.arange(s), self.lease_offsets[1:] - self.lease_offsets[:-1])
        lengths = self.response_offsets[1:] - self.response_offsets[:-1]
        bad = (ends < 0) | (ends > lengths[owner])
        inner = owner[1:] == owner[:-1]
        bad[1:] |= inner & (ends[1:] < ends[:-1])
        if bad.any():
            i = int(owner[np.argmax(bad)])
            raise ValueError(f"sample {i}: lease ends must rise within [0, {int(lengths[i])}]")

    def _validate_segments(self) -> None:
        """Per sample: segments tile [0, n) contiguously with non-decreasing versions (vectorised)."""
        seg = self.segments.reshape(-1, 3)
        lengths = self.response_offsets[1:] - self.response_offsets[:-1]
        first, stop = self.segment_offsets[:-1], self.segment_offsets[1:]
        has = stop > first
        missing = (lengths != 0) & ~has
        if missing.any():
            i = int(np.argmax(missing))
            raise ValueError(f"sample {i}: {int(lengths[i])} response tokens but no segment")
        if not has.any():
            return
        bad_edges = (seg[first[has], 1] != 0) | (seg[stop[has] - 1, 2] != lengths[has])
        starts = np.zeros(seg.shape[0], dtype=bool)
        starts[first[has]] = True
        inner = ~starts[1:]  # segment pairs (j, j+1) inside one sample
        bad_pairs = inner & ((seg[1:, 1] != seg[:-1, 2]) | (seg[1:, 0] < seg[:-1, 0]))
        if bad_edges.any() or bad_pairs.any():
            culprits = [int(np.flatnonzero(has)[np.argmax(bad_edges)])] if bad_edges.any() else []
            if bad_pairs.any():  # the sample owning the first bad pair
                culprits.append(int(np.searchsorted(self.segment_offsets, np.argmax(bad_pairs), "right")) - 1)
            i = min(culprits)
            raise ValueError(
                f"sample {i}: segments do not tile [0, {int(lengths[i])}) with non-decreasing versions"
            )

    def _validate_episodes(self) -> None:
        """Per sample: segments and observations, each in order, tile [0, n) together; segments carry
        non-decreasing versions; observation tokens have log-prob 0.0 (vectorised)."""
        seg, obs = self.segments.reshape(-1, 3), self.observations.reshape(-1, 2)
        if (obs[:, 1] <= obs[:, 0]).any():
            raise ValueError("observations need end > start")
        s = len(self)
        lengths = self.response_offsets[1:] - self.response_offsets[:-1]
        seg_owner = np.repeat(np.arange(s), self.segment_offsets[1:] - self.segment_offsets[:-1])
        obs_owner = np.repeat(np.arange(s), self.observation_offsets[1:] - self.observation_offsets[:-1])
        bad = (lengths != 0) & (np.bincount(np.concatenate([seg_owner, obs_owner]), minlength=s) == 0)
        # neighbours (j, j+1) within one sample: segments in order with versions up, observations in order
        inner = seg_owner[1:] == seg_owner[:-1]
        bad[seg_owner[1:][inner & ((seg[1:, 1] < seg[:-1, 2]) | (seg[1:, 0] < seg[:-1, 0]))]] = True
        inner = obs_owner[1:] == obs_owner[:-1]
        bad[obs_owner[1:][inner & (obs[1:, 0] < obs[:-1, 1])]] = True
        # every span of a sample by position: the first starts at 0, each one where the one before ended,
        # the last ends at the response's length
        owner = np.concatenate([seg_owner, obs_owner])
        start, end = np.concatenate([seg[:, 1], obs[:, 0]]), np.concatenate([seg[:, 2], obs[:, 1]])
        order = np.lexsort((start, owner))
        owner, start, end = owner[order], start[order], end[order]
        first = np.ones(owner.shape[0] + 1, dtype=bool)  # span k opens its sample; one past the last
        first[1:-1] = owner[1:] != owner[:-1]
        previous_end = np.concatenate([[0], end[:-1]])
        broken = np.where(first[:-1], start != 0, start != previous_end) | (
            first[1:] & (end != lengths[owner])
        )
        bad[owner[broken]] = True
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"sample {i}: segments and observations do not tile [0, {int(lengths[i])}) in order, with "
                "non-decreasing versions"
            )
        # observation tokens in `response_logprobs`: a running count, +1 where a span starts, -1 where it ends
        edges = np.zeros(self.response_logprobs.shape[0] + 1, dtype=np.int64)
        np.add.at(edges, self.response_offsets[obs_owner] + obs[:, 0], 1)
        np.add.at(edges, self.response_offsets[obs_owner] + obs[:, 1], -1)
        wrong = (np.cumsum(edges[:-1]) > 0) & (self.response_logprobs != 0)
        if wrong.any():
            i = int(np.searchsorted(self.response_offsets, np.argmax(wrong), "right")) - 1
            raise ValueError(f"sample {i}: observation tokens need log-prob 0.0")

    @classmethod
    def from_samples(cls, samples: Sequence[Sample]) -> SampleBatch:
        # one C-level pass reads every field of every sample, and zip(*) turns the rows into columns: a
        # comprehension per field cost a third more on the broker's leases, logged groups and batches
        n = len(samples)
        (
            gid,
            idx,
            status,
            finish,
            resumes,
            reward,
            prompts,
            ids,
            lps,
            segs,
            text,
            meta,
            error,
            obs,
            episode,
            leases,
        ) = zip(*map(_SAMPLE_FIELDS, samples), strict=True) if n else ((),) * 16
        prompt_offsets = _offsets(map(len, prompts), n)
        response_offsets = _offsets(map(len, ids), n)
        segment_offsets = _offsets(map(len, segs), n)
        # a batch without an episode (every single-turn one) skips the spans' pass
        observation_offsets = _offsets(map(len, obs), n) if any(obs) else np.zeros(n + 1, dtype=np.int64)
        flat = list(map(_SEGMENT_FIELDS, chain.from_iterable(segs)))
        # a batch whose samples never came back (fresh leases) skips the spans' pass
        lease_offsets = _offsets(map(len, leases), n) if any(leases) else np.zeros(n + 1, dtype=np.int64)
        spans: list[LeaseSpan] = list(chain.from_iterable(leases)) if lease_offsets[-1] else []
        return cls(
            group_id=np.array(gid, dtype=np.int64),
            index=np.array(idx, dtype=np.int32),
            status=np.fromiter(status, dtype=np.uint8, count=n),
            finish_reason=np.fromiter(finish, dtype=np.uint8, count=n),
            resumes=np.array(resumes, dtype=np.int32),
            reward=np.array(reward, dtype=np.float64),
            prompt_offsets=prompt_offsets,
            prompt_ids=_cat(prompts, np.int32, int(prompt_offsets[-1])),
            response_offsets=response_offsets,
            response_ids=_cat(ids, np.int32, int(response_offsets[-1])),
            response_logprobs=_cat(lps, np.float32, sum(map(len, lps))),  # as many as ids in a valid one
            segment_offsets=segment_offsets,
            segments=np.array(flat, dtype=np.int64).reshape(-1),
            observation_offsets=observation_offsets,
            # a Span is a (start, end) tuple: the spans' items in order are the column
            observations=np.fromiter(
                chain.from_iterable(chain.from_iterable(obs)),
                dtype=np.int64,
                count=2 * int(observation_offsets[-1]),
            )
            if observation_offsets[-1]
            else _NO_SPANS,
            prompt_text=list(text),
            metadata=[dict(m) for m in meta],
            error=list(error),
            episode=list(episode),
            lease_offsets=lease_offsets,
            lease_ends=np.fromiter((span.end for span in spans), dtype=np.int64, count=len(spans)),
            lease_workers=[span.worker for span in spans],
        )

    def with_leases(self, samples: Sequence[Sample]) -> SampleBatch:
        """This batch with the lease spans of `samples` (the same samples, in order: as the broker keeps
        them once returned) in place of its own; the other columns are shared, not copied."""
        if len(samples) != len(self):
            raise ValueError(f"with_leases: {len(samples)} samples for a batch of {len(self)}")
        spans = [span for s in samples for span in s.leases]
        return dataclasses.replace(
            self,
            lease_offsets=_offsets((len(s.leases) for s in samples), len(samples)),
            lease_ends=np.fromiter((span.end for span in spans), dtype=np.int64, count=len(spans)),
            lease_workers=[span.worker for span in spans],
        )

    def to_samples(self) -> list[Sample]:
        """Samples whose arrays are views into this batch (no copies)."""
        po, ro, so = (
            self.prompt_offsets.tolist(),
            self.response_offsets.tolist(),
            self.segment_offsets.tolist(),
        )
        segs = [Segment(v, a, b) for v, a, b in self.segments.reshape(-1, 3).tolist()]
        spans = (
            [Span(a, b) for a, b in self.observations.reshape(-1, 2).tolist()]
            if self.observations.size
            else []
        )
        oo = self.observation_offsets.tolist() if spans else []
        leases = [LeaseSpan(w, e) for w, e in zip(self.lease_workers, self.lease_ends.tolist(), strict=True)]
        lo = self.lease_offsets.tolist() if leases else []
        gids, idx = self.group_id.tolist(), self.index.tolist()
        # codes were checked by validate: index the members (an enum call per code costs more)
        status = [_STATUSES[c] for c in self.status.tolist()]
        finish = [_FINISH_REASONS[c] for c in self.finish_reason.tolist()]
        resumes, reward = self.resumes.tolist(), self.reward.tolist()
        prompts, ids, lps = self.prompt_ids, self.response_ids, self.response_logprobs
        # positional arguments in field order: keywords cost a third more, once per received sample
        return [
            Sample(
                gids[i],
                idx[i],
                prompts[po[i] : po[i + 1]],
                ids[ro[i] : ro[i + 1]],
                lps[ro[i] : ro[i + 1]],
                tuple(segs[so[i] : so[i + 1]]),
                status[i],
                finish[i],
                resumes[i],
                reward[i],
                text,
                meta,
                error,
                tuple(spans[oo[i] : oo[i + 1]]) if spans else (),
                episode,
                tuple(leases[lo[i] : lo[i + 1]]) if leases else (),
            )
            for i, text, meta, error, episode in zip(
                range(len(self)), self.prompt_text, self.metadata, self.error, self.episode, strict=True
            )
        ]


EPISODE_COLUMNS = ("observation_offsets", "observations", "episode")  # added by protocol 3
LEASE_COLUMNS = ("lease_offsets", "lease_ends", "lease_workers")  # added by protocol 4


def add_missing_columns(raw: Any, frames: Sequence[bytes | memoryview]) -> Any:
    """The msgpack map of a `SampleBatch` encoded by an earlier protocol (a file of an older format) with
    the columns it lacks, empty: before protocol 3 no observations and no episode state, before 4 no lease
    spans. `frames` are the record's frames (its arrays' data). Anything that is not such a map is
    returned as it is, for the decoder to reject."""
    if not isinstance(raw, dict):
        return raw
    ref = raw.get("group_id")
    if not (isinstance(ref, list) and len(ref) == 3 and type(ref[2]) is int and ref[2] >= 0):
        return raw
    where, _, count = ref
    if type(where) is int and 2 <= where < len(frames):
        where = frames[where]
    if not isinstance(where, bytes | memoryview) or len(where) != 8 * count:  # not S samples' group ids
        return raw
    out = dict(raw)
    no_offsets = [bytes(8 * (count + 1)), "<i8", count + 1]
    if not any(name in raw for name in EPISODE_COLUMNS):
        out.update(observation_offsets=no_offsets, observations=[b"", "<i8", 0], episode=[b""] * count)
    if not any(name in raw for name in LEASE_COLUMNS):
        out.update(lease_offsets=no_offsets, lease_ends=[b"", "<i8", 0], lease_workers=[])
    return out


def _check_offsets(name: str, offsets: np.ndarray, count: int, total: int) -> None:
    if offsets.shape[0] != count + 1:
        raise ValueError(f"{name} has {offsets.shape[0]} entries, expected {count + 1}")
    # compare neighbours instead of np.diff, which wraps around for int64 extremes
    if offsets[0] != 0 or offsets[-1] != total or (offsets[1:] < offsets[:-1]).any():
        raise ValueError(f"{name} must rise from 0 to {total}")


def _offsets(lengths: Iterable[int], n: int) -> np.ndarray:
    """[0, l0, l0 + l1, ...]: the n + 1 offsets of consecutive pieces of these lengths."""
    return np.fromiter(accumulate(lengths, initial=0), dtype=np.int64, count=n + 1)


def _cat(arrays: Sequence[np.ndarray], dtype: type, total: int) -> np.ndarray:
    """The arrays end to end (`total` elements): none is read when there are none (fresh samples)."""
    return np.concatenate(arrays).astype(dtype, copy=False) if total else np.zeros(0, dtype)
