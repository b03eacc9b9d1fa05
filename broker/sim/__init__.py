"""`april simulate`: the broker's own core driven in virtual time.

`broker.sim.model` runs one mode (the real `broker.core.BrokerCore`, simulated engines and learner, an
event queue); `broker.sim.engines` the vectorised engines, whose step cost is
`april.sim.engine_cost` (the sim engine's too); `broker.sim.figures` turns a run into the per-mode figures
of bench.json. No sockets, no wall clock, no torch.
"""
