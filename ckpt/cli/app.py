"""The ``ckpt`` typer application: one module per command group, registered here."""

from __future__ import annotations

import typer

from ckpt.cli.inspect_verify import inspect_cmd, verify_cmd
from ckpt.cli.manage import gc_cmd, ls_cmd

app = typer.Typer(name="ckpt", help="Parallelism-agnostic checkpoints for PyTorch training.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.command("inspect")(inspect_cmd)
app.command("verify")(verify_cmd)
app.command("ls")(ls_cmd)
app.command("gc")(gc_cmd)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
