"""april: Active Partial Rollouts for LLM reinforcement learning.

The shared core every role imports: configuration (`april.config`), sample records and staleness tags
(`april.records`, `april.wire_records`), the wire protocol (`april.protocol`, `april.codec`,
`april.transport`), the ledger (`april.ledger`) and prompt sources (`april.data`). Pure Python with
numpy, msgpack and pyzmq; never imports torch.
"""

__version__ = "0.1.0"
