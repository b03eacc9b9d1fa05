"""The broker role: the only meeting point of workers and learner (docs/design.md section 2).

`broker.server` (sockets and the poll loop), `broker.state` (the books), `broker.snapshot`
(persistence), `broker.peers` (liveness and rejection counters), `broker.status` (builds the status record,
`april.status`).
Never imports torch.
"""
