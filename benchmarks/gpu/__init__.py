"""The GPU check's parts (`benchmarks/gpu_check.py`): one module a phase, the device's identity and peak,
the FLOPs arithmetic, the model shapes, and the wheels the lent GPU machine is given (`make gpu-wheels`).
Nothing here runs at import time; each phase module has one `run(params, progress)` entry point."""
