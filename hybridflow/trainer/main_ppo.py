"""`hybridflow train` / `python -m hybridflow.trainer.main_ppo`: compose, check, then run PPO/GRPO on Ray.

Arguments are Hydra overrides with verl's keys (`algorithm.adv_estimator=grpo data.train_batch_size=8 ...`)
plus a few flags: `--dry-run` prints the resolved config and the derived batch arithmetic and exits without
starting Ray or loading weights; `--cfg job` prints the composed config as Hydra does.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

from omegaconf import OmegaConf

logger = logging.getLogger(__name__)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split flags from Hydra overrides."""
    parser = argparse.ArgumentParser(prog="hybridflow train", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print the config and batch arithmetic, then exit")
    parser.add_argument("--cfg", choices=["job"], help="print the composed config (Hydra style) and exit")
    parser.add_argument("--config-name", default="ppo_trainer", help="YAML config name (without .yaml)")
    parser.add_argument("--config-path", default=None, help="directory of the YAML config (default: packaged)")
    args, overrides = parser.parse_known_args(list(argv))
    unknown_flags = [item for item in overrides if item.startswith("--")]
    if unknown_flags:
        parser.error(f"unknown flags {unknown_flags}; config values are given as key=value")
    return args, overrides


def exit_on_sigterm() -> None:
    """Turn SIGTERM (a scheduler or `kill` stopping the run) into SystemExit, so cleanup runs: `finally`
    blocks, Ray's shutdown, and the reward scorer pool's termination."""

    def handler(signum: int, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer; config errors print one line naming the key and exit with code 2."""
    from hybridflow.trainer.config import compose_config, to_typed, validate_config

    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        raw = compose_config(overrides, config_name=args.config_name, config_dir=args.config_path)
        if args.cfg == "job":
            print(OmegaConf.to_yaml(raw))
            return 0
        cfg = to_typed(raw)
        batch_sizes = validate_config(cfg)
    except (ValueError, ImportError) as err:
        print(f"hybridflow: config error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        for name, sizes in batch_sizes.items():
            print(sizes.table(name))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_on_sigterm()
    from hybridflow.trainer.run import run_ppo

    run_ppo(cfg, batch_sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
