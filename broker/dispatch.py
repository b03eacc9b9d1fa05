"""Dispatch: which samples each worker with free slots is leased now, the one rule the broker core applies.

`assign` takes the workers with credit (in registration order) and leases from the books and the running
evaluation: evaluation samples first, up to each worker's credit in registration order (they are few and
the evaluation waits for its slowest); then each worker's pinned partials (their environment state is in its
memory: `BrokerState.take_pinned`, never leased elsewhere); then, with `algo.resume_affinity`, queued
partials back to the
worker they left while it has room (`BrokerState.take_held_partials`); then training samples spread over
the workers by free slots relative to size (`policy.spread_leases`), so no engine runs more sequences than
its share while another idles; and what a worker could not take (a partial newer than its weights) to the
others with credit left, most free first. Samples leave the dispatch queue in its order whoever gets them.

Only workers on current weights get work (`policy.serves_current_weights`): one still syncing the newest
version (a network fetch takes a while) would generate every token under an older policy than the
learner's. Its spread share is kept for it (the first worker to load a version does not take a whole
round) and it is leased work once it serves the version (or reported it cannot load it: then it works on
within the staleness bound). Knows nothing of messages, credit bookkeeping or time.
"""

from __future__ import annotations

from broker import policy
from broker.decisions import Work
from broker.evaluation import Evaluations
from broker.peers import WorkerPeer
from broker.state import BrokerState


def assign(
    state: BrokerState, evals: Evaluations, peers: list[WorkerPeer], train: bool
) -> tuple[list[Work], list[int], bool]:
    """For each of `peers`: the work leased to it and how many of its first items are evaluation samples;
    and whether any of them serves the current weights. `train` False: evaluation samples only."""
    current = [
        policy.serves_current_weights(p.version, p.failed_version, state.version, state.algo) for p in peers
    ]
    work: list[Work] = [
        evals.take_work(p.peer_id, p.credit, state.new_lease_id) if ok else []
        for p, ok in zip(peers, current, strict=True)
    ]
    greedy = [len(w) for w in work]
    if train and state.dispatch_allowed():
        _lease_training(state, peers, work, current)
    return work, greedy, any(current)


def _lease_training(
    state: BrokerState, peers: list[WorkerPeer], work: list[Work], current: list[bool]
) -> None:
    """Add each `current` worker's spread share of training samples to `work` (the others' shares stay
    queued for them); then what a worker left (take_work leaves a partial newer than its weights queued)
    to the current workers with credit left, most free first."""
    free = [p.credit - len(w) for p, w in zip(peers, work, strict=True)]
    room = [f if ok else 0 for f, ok in zip(free, current, strict=True)]
    pinned = state.take_pinned([p.peer_id for p in peers], room, [p.version for p in peers])
    for i, items in enumerate(pinned):
        work[i] += items
        free[i] -= len(items)
    if state.algo.resume_affinity:
        room = [f if ok else 0 for f, ok in zip(free, current, strict=True)]
        held = state.take_held_partials([p.peer_id for p in peers], room, [p.version for p in peers])
        for i, items in enumerate(held):
            work[i] += items
            free[i] -= len(items)
    shares = policy.spread_leases(state.leasable_samples(), free, [p.slots for p in peers])
    short = False
    for peer, items, share, ok in zip(peers, work, shares, current, strict=True):
        if share and ok:
            got = state.take_work(peer.peer_id, share, peer.version)
            items += got
            short = short or len(got) < share
    if not short:
        return
    order = sorted(range(len(peers)), key=lambda i: -(peers[i].credit - len(work[i])) / peers[i].slots)
    for i in order:
        left = peers[i].credit - len(work[i])
        if current[i] and left > 0 and state.leasable_samples():
            work[i] += state.take_work(peers[i].peer_id, left, peers[i].version)
