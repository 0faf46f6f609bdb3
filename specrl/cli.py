"""The ``specrl`` command line. Subcommands import their heavy dependencies lazily."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module with add_args(parser) and run(args), help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("specrl.demo", "the main job on the embedded default model"),
    "generate": ("specrl.generate", "decode prompts with speculative decoding"),
    "draft": ("specrl.drafttrain.cli", "train and evaluate draft models"),
    "profile": ("specrl.profiling", "measure the step cost model on this machine"),
    "collect": ("specrl.collect", "record decode traces for the replay env"),
    "evaluate": ("specrl.evaluate", "compare policies over a load sweep (replay or live)"),
    "validate-replay": ("specrl.validate", "check the replay env against the live engine"),
    "train": ("specrl.train", "train an RL speculation policy on the replay env"),
    "export": ("specrl.runtime.export", "export a trained policy (or a rule) to a runtime controller"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specrl", description="RL for speculative-decoding policies.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_args(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # specrl never downloads at run time
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    from specrl.errors import SpecRLError

    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except SpecRLError as e:
        print(f"specrl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
