"""Built-in environments that need nothing but april itself (the calculator task). The environment
registry the worker loads specs from, which also holds the sandboxed `python` environment, is
`actors.tool_runner.BUILTIN_ENVIRONMENTS`."""
