"""``python -m bench <subcommand>``: run one benchmark and print its table.

Subcommands::

    save-load   ckpt.save/ckpt.load vs torch DCP, torch.save and safetensors (single process)
    async       async save: blocking, staged, done times and memory vs DCP async_save and others
"""

from __future__ import annotations

import argparse
import sys

from bench import async_bench, save_load

COMMANDS = {
    "save-load": (save_load, "save/load throughput vs DCP, torch.save, safetensors and dd"),
    "async": (async_bench, "async save: blocking/staged/done vs DCP async_save, torch.save, safetensors"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description="ckpt benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    module, _ = COMMANDS[args.command]
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
