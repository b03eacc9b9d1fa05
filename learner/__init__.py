"""The learner role: consumes exactly-N batches, steps the optimizer, publishes weights."""
