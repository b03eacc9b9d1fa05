"""Inference engines behind the `actors.engine.Engine` interface; each module imports its own heavy deps."""
