"""`april keys`: create the CurveZMQ key files a broker needs to bind a non-loopback address.

`april keys generate DIR` makes the broker's and the default client's key pairs and authorises the client;
`april keys add-client DIR NAME` mints one more client pair, ready to copy to another host;
`april keys add-weights DIR` mints the learner's weight-service pair in a directory made before it had one.
The file layout and every check are `april.keys`'; this module only parses options and prints what it made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from april import keys

keys_app = typer.Typer(
    help="CurveZMQ keys: needed to bind the broker on a non-loopback address.", no_args_is_help=True
)

DirArg = Annotated[Path, typer.Argument(help="The key directory (broker.curve_keys_dir).", file_okay=False)]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Replace existing keys (old clients are locked out).")
]


@keys_app.command("generate")
def generate_command(keys_dir: DirArg, force: ForceOpt = False) -> None:
    """Create DIR/broker.key[_secret], DIR/client.key[_secret], DIR/weights.key[_secret] (the learner's
    weight service) and DIR/authorized/client.key."""
    made = keys.generate(keys_dir, force)
    for path in made:
        print(path)
    print(
        f"set broker.curve_keys_dir = {str(keys_dir)!r} for every role; "
        f"keep {keys_dir / 'broker.key_secret'} on the broker's host only and "
        f"{keys_dir / 'weights.key_secret'} on the learner's"
    )


@keys_app.command("add-client")
def add_client_command(
    keys_dir: DirArg,
    name: Annotated[str, typer.Argument(help="The client's name (its key becomes authorized/NAME.key).")],
    force: ForceOpt = False,
) -> None:
    """Mint a client pair NAME, authorise it, and put a copyable key directory in DIR/clients/NAME/."""
    out = keys.add_client(keys_dir, name, force)
    print(
        f"{out}: copy this directory to the client's host and set broker.curve_keys_dir to it there "
        "(a running broker picks up the new key by itself)"
    )


@keys_app.command("add-weights")
def add_weights_command(keys_dir: DirArg, force: ForceOpt = False) -> None:
    """Create DIR/weights.key[_secret], the learner's weight-service pair (copied into DIR/clients/*/)."""
    for path in keys.add_weights(keys_dir, force):
        print(path)
    print(f"copy {keys_dir / 'weights.key'} into the key directory of every worker on another host")
