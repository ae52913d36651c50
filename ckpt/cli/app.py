"""The ``ckpt`` typer application. One module per command group under ``ckpt/cli/``; each defines
``register(app)``. Modules are listed here so that commands appear in a stable order."""

from __future__ import annotations

import importlib

import typer

from ckpt.cli.common import EXIT_CODE_HELP, CkptGroup

app = typer.Typer(name="ckpt", help="Parallelism-agnostic checkpoints for PyTorch training.", epilog=EXIT_CODE_HELP,
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=CkptGroup)

COMMAND_MODULES = ["inspect_verify", "manage", "reshard", "convert", "hf", "train"]

def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("ckpt")
        except PackageNotFoundError:  # run from a source tree
            from ckpt import __version__ as v
        typer.echo(f"ckpt {v}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Parallelism-agnostic checkpoints for PyTorch training."""


for _name in COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"ckpt.cli.{_name}")
    except ModuleNotFoundError as e:
        if e.name != f"ckpt.cli.{_name}":
            raise
        continue
    _mod.register(app)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()


__all__ = ["app", "COMMAND_MODULES", "main"]
