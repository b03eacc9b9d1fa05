"""The rollout-worker role: a process that wraps one inference engine and leases work from the broker."""
