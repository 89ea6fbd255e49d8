"""The command line shared by `hybridflow train` and `hybridflow sft`: Hydra overrides plus a few flags.

`--help [SECTION]` lists every key (type, default, doc line), `--cfg job` prints the composed config as Hydra
does, `--dry-run` checks everything and prints the resolved config and the batch arithmetic without starting
Ray or loading weights. A config error prints one line naming the key and exits with code 2.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hybridflow.trainer.config.loader import ConfigTree, compose_config, to_typed, written_keys


@dataclass(frozen=True)
class TrainerCommand:
    """What one trainer plugs into the shared command line."""

    prog: str
    """Name shown in usage lines, e.g. 'hybridflow train'."""
    description: str
    """One paragraph for --help."""
    tree: ConfigTree
    """The trainer's config tree."""
    validate: Callable[[Any], Any]
    """Cross-component checks of a typed config; returns what the run needs (e.g. batch sizes)."""
    describe: Callable[[Any, Any], str]
    """The dry-run tables of the typed config and what `validate` returned."""
    run: Callable[[Any, Any], Any]
    """Runs the job from the typed config and `validate`'s result."""
    prepare: Callable[[Any], None] | None = None
    """Adjusts the composed (untyped) config in place before it is typed, for a trainer whose verl counterpart
    reads a key differently (see the off-policy trainers' `rollout.mode`)."""


def aligned_table(title: str, rows: Sequence[tuple[str, int]]) -> str:
    """`[title]` and one `label  value` line per row, labels padded to one width (the dry-run's arithmetic)."""
    width = max(len(label) for label, _ in rows)
    return "\n".join([f"[{title}]"] + [f"  {label:<{width}}  {value}" for label, value in rows])


def parse_args(command: TrainerCommand, argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split flags from Hydra overrides."""
    parser = argparse.ArgumentParser(prog=command.prog, description=command.description, add_help=False)
    parser.add_argument("-h", "--help", nargs="?", const="", default=None, metavar="SECTION",
                        help="list every config key (or those of SECTION, e.g. actor_rollout_ref.actor) and exit")
    parser.add_argument("--dry-run", action="store_true", help="check the config, print it and the batch arithmetic")
    parser.add_argument("--cfg", choices=["job"], help="print the composed config (Hydra style) and exit")
    parser.add_argument("--config-name", default=None, help="YAML config name (without .yaml)")
    parser.add_argument("--config-path", default=None, help="directory of the YAML config (default: packaged)")
    args, overrides = parser.parse_known_args(list(argv))
    unknown_flags = [item for item in overrides if item.startswith("--")]
    if unknown_flags:
        parser.error(f"unknown flags {unknown_flags}; config values are given as key=value")
    args.usage = parser.format_help()
    return args, overrides


def exit_on_sigterm() -> None:
    """Turn SIGTERM (a scheduler or `kill` stopping the run) into SystemExit, so cleanup runs: `finally`
    blocks, Ray's shutdown, and the reward scorer pool's termination."""

    def handler(signum: int, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(command: TrainerCommand, argv: Sequence[str] | None = None) -> int:
    """Compose, check, then run (or only print, per the flags)."""
    from omegaconf import OmegaConf

    from hybridflow.trainer.config.help import format_help

    args, overrides = parse_args(command, sys.argv[1:] if argv is None else argv)
    try:
        if args.help is not None:
            print(args.usage if not args.help else "", end="")
            print(format_help(command.tree, args.help or None))
            return 0
        raw = compose_config(overrides, command.tree, args.config_name, args.config_path)
        if args.cfg == "job":
            print(OmegaConf.to_yaml(raw))
            return 0
        if command.prepare is not None:
            command.prepare(raw)
        cfg = to_typed(raw, command.tree, written_keys(overrides, command.tree))
        checked = command.validate(cfg)
    except (ValueError, ImportError) as err:
        print(f"{command.prog}: config error: {command.tree.as_written(str(err), overrides)}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(OmegaConf.to_yaml(asdict(cfg)))
        print(command.describe(cfg, checked))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_on_sigterm()
    command.run(cfg, checked)
    return 0
