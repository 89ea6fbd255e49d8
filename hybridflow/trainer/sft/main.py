"""`hybridflow sft` / `python -m hybridflow.trainer.sft.main`: compose, check, then run SFT (local or on Ray).

Arguments are Hydra overrides with verl's SFT keys (`data.train_files=[...] model.partial_pretrain=...
model.lora_rank=8 ...`) plus the flags of `hybridflow train`: `--dry-run` prints the resolved config and the
batch arithmetic and exits without starting Ray or loading weights; `--cfg job` prints the composed config.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from omegaconf import OmegaConf

CONFIG_NAME = "sft_trainer"
SCHEMA_NAME = "sft_trainer_schema"


def load_sft_config(overrides: Sequence[str] | None = None, config_name: str = CONFIG_NAME, config_dir=None):
    """Compose and type the SFT config (`__post_init__` checks run; cross-checks: `validate_sft_config`)."""
    from hybridflow.trainer.config import compose_config, to_typed
    from hybridflow.trainer.sft.config import SFTConfig

    raw = compose_config(list(overrides or []), config_name, config_dir, schema=SFTConfig, schema_name=SCHEMA_NAME)
    return raw, to_typed(raw, SFTConfig)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split flags from Hydra overrides."""
    parser = argparse.ArgumentParser(prog="hybridflow sft", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print the config and batch arithmetic, then exit")
    parser.add_argument("--cfg", choices=["job"], help="print the composed config (Hydra style) and exit")
    parser.add_argument("--config-name", default=CONFIG_NAME, help="YAML config name (without .yaml)")
    parser.add_argument("--config-path", default=None, help="directory of the YAML config (default: packaged)")
    args, overrides = parser.parse_known_args(list(argv))
    unknown_flags = [item for item in overrides if item.startswith("--")]
    if unknown_flags:
        parser.error(f"unknown flags {unknown_flags}; config values are given as key=value")
    return args, overrides


def main(argv: Sequence[str] | None = None) -> int:
    """Run SFT; config errors print one line naming the key and exit with code 2."""
    from hybridflow.trainer.sft.config import format_batch_table, validate_sft_config

    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        raw, cfg = load_sft_config(overrides, args.config_name, args.config_path)
        if args.cfg == "job":
            print(OmegaConf.to_yaml(raw))
            return 0
        table = validate_sft_config(cfg)
    except (ValueError, ImportError) as err:
        print(f"hybridflow sft: config error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        print(format_batch_table(table))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from hybridflow.trainer.main_ppo import exit_on_sigterm
    from hybridflow.trainer.sft.trainer import run_sft

    exit_on_sigterm()

    run_sft(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
