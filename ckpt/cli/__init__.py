"""The ``ckpt`` command: thin typer commands over library calls."""
