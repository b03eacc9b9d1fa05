"""`april simulate`: the broker's own books and scheduling policy driven in virtual time.

`broker.sim.model` runs one mode (the real `BrokerState` and `april.policy`, simulated engines and
learner, an event queue); `broker.sim.engines` is the vectorised engine cost model; `broker.sim.figures`
turns a run into the per-mode figures of bench.json. No sockets, no wall clock, no torch.
"""
