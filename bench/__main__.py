"""``python -m bench <subcommand>``: run one benchmark and print its table.

Subcommands::

    save-load   ckpt.save/ckpt.load vs torch DCP, torch.save and safetensors (single process)
    hf-export   ckpt export-hf (streaming) vs load-everything + save_file / save_pretrained
    multirank   4 forked gloo ranks: save as Shard(0), resharded load as Shard(1), vs DCP
    async       async save: blocking, staged, done times and memory vs DCP async_save and others
"""

from __future__ import annotations

import argparse
import sys

from bench import async_bench, hf_export, multirank, save_load

COMMANDS = {
    "save-load": (save_load, "save/load throughput vs DCP, torch.save, safetensors and dd"),
    "hf-export": (hf_export, "Hugging Face export time and peak RSS vs the naive load-then-save paths"),
    "multirank": (multirank, "4 gloo ranks: DTensor Shard(0) save, Shard(1) load vs DCP"),
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
