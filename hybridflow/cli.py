"""The `hybridflow` command: sub-commands dispatch to the module that owns each job."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# sub-command -> ("module:function", help). Each function takes the remaining argv.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("hybridflow.trainer.main_ppo:main", "run PPO/GRPO (Hydra overrides with verl's keys; --dry-run checks)"),
    "train-one-step-off": (
        "hybridflow.trainer.off_policy.main_one_step_off:main",
        "one-step off-policy PPO/GRPO on split pools: the next batch generates while this one trains",
    ),
    "train-fully-async": (
        "hybridflow.trainer.off_policy.main_fully_async:main",
        "fully async PPO/GRPO on split pools: a rollouter streams samples under a staleness bound",
    ),
    "sft": ("hybridflow.trainer.sft.main:main", "supervised fine-tuning, full or LoRA (verl SFT keys; --dry-run)"),
    "generate": ("hybridflow.trainer.main_generation:main",
                 "sample responses for every prompt of a parquet file (verl main_generation keys; --dry-run)"),
    "score": ("hybridflow.trainer.main_eval:main",
              "score the generated responses of a parquet file per data source (verl main_eval keys; --dry-run)"),
    "merge": ("hybridflow.engines.training.merge:main", "export a sharded checkpoint (LoRA merged) to a Hugging Face directory"),
    "eval": ("hybridflow.evaluation.heldout:main", "greedy accuracy of models on held-out reasoning-gym problems, with intervals"),
    "plot": ("hybridflow.trainer.plot:main", "write PNG plots of a run's metrics (RUN_DIR/metrics.jsonl)"),
    "doctor": ("hybridflow.doctor:main", "print versions, devices, Ray status and whether the demo model is installed"),
}


def _load(target: str) -> Callable[[Sequence[str]], int | None]:
    module_name, function_name = target.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hybridflow` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training for LLMs (HybridFlow design).")
    choices = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        choices.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        parser.error(f"unknown command {command!r}; choose from {', '.join(SUBCOMMANDS)}")
    result = _load(SUBCOMMANDS[command][0])(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
