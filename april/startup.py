"""Start-up failures that a restart would meet again, and the exit code that says so.

A worker or learner whose CUDA pieces cannot be built or initialised (a GPU torch cannot use, a DeepSpeed
op that does not compile) fails the same way every time it starts. It raises `StartupError` with one line
naming the role, the cause and the fix; the `april` command prints it as `april: error: <line>` and exits
`STARTUP_EXIT`, and `april up` reports it once instead of restarting the child (cli/up_cmd.py). A bad
input (a config value, a model directory) is a user error instead (exit 2), which `april up` does not
restart either. Owns the type and the code only: the roles decide what is permanent.
"""

STARTUP_EXIT = 3  # a role could not start, and would not on a restart: `april up` does not restart it


class StartupError(Exception):
    """A role cannot start on this machine as configured; the message is one line: "role: cause; fix"."""
