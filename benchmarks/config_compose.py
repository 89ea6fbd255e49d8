"""Time composing a trainer config: Hydra's whole compose against the cached composition of a packaged config
(`trainer/config/composition.py`), interleaved, on verl-style command lines; and `load_config` (compose + typing).

Prints the median per variant and its ratio to Hydra's whole compose, measured in the same run; writes the raw
times to benchmarks/results/.

    python benchmarks/config_compose.py --repeats 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from hybridflow.trainer.config import composition
from hybridflow.trainer.config.loader import CONFIG_DIR, PPO_TREE, load_config, rewrite_overrides, schema_defaults
from hybridflow.utils.host import write_results

OVERRIDES = [
    "algorithm.adv_estimator=grpo", "data.train_batch_size=256", "data.max_prompt_length=512",
    "data.max_response_length=1024", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=native", "trainer.logger=[console,wandb]",
    "trainer.n_gpus_per_node=8", "trainer.total_epochs=15",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    composition.store_schema(PPO_TREE.schema_name, lambda: schema_defaults(PPO_TREE))
    overrides = rewrite_overrides(OVERRIDES, PPO_TREE)
    variants = {
        "hydra whole compose": lambda: composition._compose_fully("ppo_trainer", CONFIG_DIR, overrides),
        "cached composition": lambda: composition.compose_with_hydra("ppo_trainer", CONFIG_DIR, overrides,
                                                                     cacheable=True),
        "load_config (typed)": lambda: load_config(OVERRIDES),
    }
    for run in variants.values():  # warm-up: imports, the first composition
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():  # interleaved: the host's noise falls on every variant alike
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    baseline = statistics.median(times["hydra whole compose"])
    print(f"{len(OVERRIDES)} overrides, {args.repeats} repeats")
    print(f"{'variant':<22}{'median':>12}{'vs hydra':>10}")
    rows = []
    for name, samples in times.items():
        median = statistics.median(samples)
        rows.append({"variant": name, "median_s": median, "samples_s": samples})
        print(f"{name:<22}{median * 1e3:>9.1f} ms{median / baseline:>9.2f}x")
    path = write_results("config_compose", vars(args) | {"overrides": OVERRIDES}, rows, load_before)
    print(f"raw: {path}")


if __name__ == "__main__":
    main()
