"""The `april` command line: thin commands that compose the roles, and the dashboard."""
