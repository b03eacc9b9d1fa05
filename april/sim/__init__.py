"""What a simulated run shares between the roles: the sim engine and sim tools a worker runs
(`actors/engines/sim_engine.py`, `actors/sim_tools.py`) and `april simulate` (`broker/sim/`).

`engine_cost` is the one cost model (with the `worker.sim_*` defaults in `april.config`), `prefix_cache` the
resume-cost rule, `sample_draw` a sample's length drawn from its identity (also the worker's `prompt_key`),
`episode_plans` a sample's episode (turns, tool latencies, observations) drawn from its identity,
`byte_tokenizer` the tokenizer used when `worker.model` is empty (sim engine, rollout records) and
`byte_chat` its conversation format (episodes played with no model). They sit here, not in `broker/sim/`,
because both the worker and the broker import them. Holds no simulator: the event loop and its engines
are `broker.sim`'s.
"""
