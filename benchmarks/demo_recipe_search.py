"""Choose the demo's recipe by measurement: each candidate trains with several seeds, then its final model is
scored greedily on held-out problems (`hybridflow eval`: another generator seed, every training and validation
question left out) against the base model on the same problems.

    python benchmarks/demo_recipe_search.py --candidate demo --candidate lr3e-5_t1.0_24 --seeds 1 2 3
    python benchmarks/demo_recipe_search.py --preset smollm2_add3 --candidate ent3e-3_cos_40 --seeds 1 2 3

`--preset` picks the task (a preset of `hybridflow.data.preprocess.reasoning_gym`): the demo's `smollm2_easy` by
default, with the demo's data; another preset's data (512 training, 64 validation prompts, seed 0) is written under
outputs/recipe_search/<preset>/ on first use, and its runs go there too.

A candidate is a name in CANDIDATES: overrides of the demo config (`grpo_smollm2_demo`). A run whose final
checkpoint already exists under outputs/recipe_search/<candidate>_seed<S> is not trained again, only scored.
The table gives per candidate: training minutes (the sum of its steps and validations, from metrics.jsonl),
held-out greedy accuracy (flexible extraction, the demo's) mean +- sd over seeds, and the paired gain over the
base model with each seed's 95% interval. Raw rows (per-problem marks too) go to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hybridflow.evaluation.heldout import evaluate, excluded_questions, heldout_problems, paired_gain_interval
from hybridflow.data.preprocess.reasoning_gym import PRESETS
from hybridflow.trainer.plot import read_metrics
from hybridflow.utils.host import write_results

REPO = Path(__file__).resolve().parents[1]
DEMO_PRESET = "smollm2_easy"
BASE_MODEL = "smollm2-135m-instruct"

# The demo's recipe before 2026-11-28 (no entropy bonus, a constant lr), written out so that the candidates measured
# against it keep their meaning now that the demo config has the entropy bonus and the cosine decay.
LR, TEMPERATURE = "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.rollout.temperature"
PLAIN = ["actor_rollout_ref.actor.entropy_coeff=0.0", "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
         "actor_rollout_ref.actor.optim.min_lr_ratio=0.0"]
ENTROPY_COSINE = ["actor_rollout_ref.actor.entropy_coeff=0.003",
                  "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                  "actor_rollout_ref.actor.optim.min_lr_ratio=0.1"]

DYNAMIC_SAMPLING_16 = ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc",
                       "data.gen_batch_size=16", "trainer.total_epochs=8"]

# name -> (total steps, overrides of grpo_smollm2_demo). A name always means the same recipe, since a run whose
# final checkpoint exists is scored again rather than trained: `make demo` since 2026-11-28 is `ent3e-3_cos_40`;
# before it, `make demo` was `plain_40` (its rows in benchmarks/results/ up to 2026-11-28T06 are named `demo_40`).
CANDIDATES: dict[str, tuple[int, list[str]]] = {
    "demo": (14, PLAIN),  # the plain recipe cut at the old demo's 14 steps
    "plain_40": (40, PLAIN),
    "ent3e-3_cos_40": (40, ENTROPY_COSINE),  # `make demo`
    # the demo's recipe for three times the steps (a harder task's hour): 512 prompts make 64 steps an epoch
    "ent3e-3_cos_120": (120, [*ENTROPY_COSINE, "trainer.total_epochs=2"]),
    # lr 3e-5 collapsed the entropy by step 11 without the bonus (docs/recipes.md); with the bonus and the decay it
    # may learn faster than 2e-5 and still end stable.
    "ent3e-3_cos_lr3e-5_40": (40, [*ENTROPY_COSINE, f"{LR}=3e-5"]),
    # TRL 1.16's GRPOTrainer at the demo's settings (`benchmarks/trl_grpo_baseline.py --recipe demo`, its own
    # environment benchmarks/.venv-trl): the learning comparison at equal samples. The list is its arguments.
    "trl_demo_40": (40, ["--recipe", "demo"]),
    "lr3e-5_t1.0_24": (24, [*PLAIN, f"{LR}=3e-5", f"{TEMPERATURE}=1.0"]),
    "lr2e-5_t1.0_24": (24, [*PLAIN, f"{LR}=2e-5", f"{TEMPERATURE}=1.0"]),
    "lr5e-5_t1.0_24": (24, [*PLAIN, f"{LR}=5e-5", f"{TEMPERATURE}=1.0"]),
    "lr2e-5_t1.0_32_r32": (32, [*PLAIN, f"{LR}=2e-5", f"{TEMPERATURE}=1.0",
                                "data.max_response_length=32"]),
    "lr2e-5_t1.0_40_r32": (40, [*PLAIN, f"{LR}=2e-5", f"{TEMPERATURE}=1.0",
                                "data.max_response_length=32"]),
    "dyn_24": (24, [*PLAIN, "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"]),
    "answer_line_40": (40, [*PLAIN, f"custom_reward_function.path={REPO / 'benchmarks' / 'answer_line_reward.py'}"]),
    "answer_line_b05_40": (40, [*PLAIN, f"custom_reward_function.path={REPO / 'benchmarks' / 'answer_line_reward.py'}",
                                "+custom_reward_function.reward_kwargs.format_bonus=0.5"]),
    # DAPO's clip-higher. In the demo's update (one mini-batch, one epoch: exactly on-policy) every ratio is 1 and
    # nothing is clipped (pg_clipfrac 0), so this run is the plain recipe again: a control of what the code changes
    # since the demo's seed-1 run (fused AdamW among them) do to one seed's result. Clipping acts with
    # ppo_mini_batch_size < train_batch_size or ppo_epochs > 1.
    "clip_high028_40": (40, [*PLAIN, "actor_rollout_ref.actor.clip_ratio_high=0.28"]),
    "lr3e-5_t1.0_32_r32": (32, [*PLAIN, f"{LR}=3e-5", f"{TEMPERATURE}=1.0",
                                "data.max_response_length=32"]),
    # The same 64 samples a step as 4 prompts x 16: a group finds a right answer more often on the problems the
    # base model rarely solves (its pass@8 on negative differences is 1.6%), so fewer groups are flat.
    # DAPO's dynamic sampling on the demo's recipe: each step generates 16 prompts' groups at a time (generation is
    # about a fifth of a demo step, the update the rest) and trains on the first 8 that are not flat, so every
    # update carries 8 informative groups instead of about 4. Filtering consumes prompts faster than one per slot,
    # hence the epochs over the 512 prompts (prompts the policy has mastered are filtered out again).
    "ent3e-3_cos_dyn16_40": (40, [*ENTROPY_COSINE, *DYNAMIC_SAMPLING_16]),
    # the same cut to 28 steps: its steps cost about 1.7x the demo's (two generation batches of 128 samples), so
    # 28 of them take about the demo's 40 steps' time
    "ent3e-3_cos_dyn16_28": (28, [*ENTROPY_COSINE, *DYNAMIC_SAMPLING_16]),
    # The demo's base recipe on SmolLM2 upcycled into a 4-expert top-2 Mixtral (`python -m hybridflow.models.upcycle
    # --target_dir outputs/smollm2_moe`, which starts as the dense model's function): issue 29's held-out gain of the
    # laptop MoE, against the same dense base model.
    "moe_upcycled_ent3e-3_cos_40": (40, [*ENTROPY_COSINE, f"actor_rollout_ref.model.path={REPO / 'outputs' / 'smollm2_moe'}"]),
    "n16_p4_40": (40, [*PLAIN, "data.train_batch_size=4", "actor_rollout_ref.rollout.n=16",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"]),
}


def search_dir(preset: str) -> Path:
    """Where a preset's runs and base-model cache live (the demo's task: outputs/recipe_search itself)."""
    root = REPO / "outputs" / "recipe_search"
    return root if preset == DEMO_PRESET else root / preset


def data_dir(preset: str) -> Path:
    """The preset's training and validation parquet files, written on first use for presets other than the demo's."""
    if preset == DEMO_PRESET:
        return REPO / "outputs" / "demo" / "data"
    directory = search_dir(preset) / "data"
    if not (directory / "train.parquet").is_file():
        subprocess.run([sys.executable, "-m", "hybridflow.data.preprocess.reasoning_gym", "--preset", preset,
                        "--local_dir", str(directory), "--train_size", "512", "--test_size", "64", "--seed", "0"],
                       cwd=REPO, check=True)
    return directory


def run_dir_of(candidate: str, seed: int, preset: str = DEMO_PRESET) -> Path:
    return search_dir(preset) / f"{candidate}_seed{seed}"


TRL_PYTHON = REPO / "benchmarks" / ".venv-trl" / "bin" / "python"


def train_with_trl(candidate: str, seed: int, preset: str) -> Path:
    """A `trl_*` candidate: TRL's trainer with the same model, prompts and scorer; its final model directory."""
    steps, arguments = CANDIDATES[candidate]
    run_dir = run_dir_of(candidate, seed, preset)
    final = run_dir / f"global_step_{steps}"
    if not final.is_dir():
        if not TRL_PYTHON.is_file():
            raise SystemExit(f"{TRL_PYTHON} is missing: make TRL's environment as benchmarks/trl_grpo_baseline.py says")
        from hybridflow.models.catalogue import resolve_model_path

        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        command = [
            str(TRL_PYTHON), str(REPO / "benchmarks" / "trl_grpo_baseline.py"), *arguments,
            "--model", str(resolve_model_path(BASE_MODEL)), "--data", str(data_dir(preset) / "train.parquet"),
            "--steps", str(steps), "--seed", str(seed), "--output-dir", str(run_dir / "trainer"),
            "--save-dir", str(final), "--metrics-file", str(run_dir / "metrics.jsonl"),
        ]
        subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return final


def train(candidate: str, seed: int, preset: str = DEMO_PRESET) -> Path:
    """Train one candidate with one seed (unless its final checkpoint exists); its final global_step dir."""
    if candidate.startswith("trl_"):
        return train_with_trl(candidate, seed, preset)
    steps, overrides = CANDIDATES[candidate]
    run_dir = run_dir_of(candidate, seed, preset)
    final = run_dir / f"global_step_{steps}"
    if not final.is_dir():
        data = data_dir(preset)
        # A run cut short earlier left its steps in metrics.jsonl (and no checkpoint to resume: save_freq is the
        # last step); its minutes must not count as this run's.
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        command = [
            sys.executable, "-m", "hybridflow.trainer.main_ppo", "--config-name", "grpo_smollm2_demo", *overrides,
            f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]",
            f"trainer.total_training_steps={steps}", f"trainer.test_freq={max(1, steps // 4)}",
            f"trainer.save_freq={steps}", f"trainer.seed={seed}", f"data.seed={seed}", "trainer.logger=[file]",
            f"trainer.default_local_dir={run_dir}",
        ]
        subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    return final


def training_minutes(run_dir: Path) -> float:
    """Minutes of training steps and in-run validations (start-up and checkpoint saves left out)."""
    seconds = sum(r.get("timing_s/step", 0.0) + r.get("timing_s/testing", 0.0) for r in read_metrics(run_dir))
    return seconds / 60


def base_record(problems, dataset, num_problems: int, eval_seed: int, preset: str) -> dict:
    """The base model's evaluation on these problems, cached in the preset's search dir (greedy, so it does not
    change between runs); the cache is keyed by the problem count, the seed and the questions themselves."""
    questions = [problem.question for problem in problems]
    cache = search_dir(preset) / f"base_{num_problems}_seed{eval_seed}.json"
    if cache.is_file():
        cached = json.loads(cache.read_text())
        if cached.get("questions") == questions:
            return cached["record"]
    record = evaluate([BASE_MODEL], problems, dataset, ["ours"], 64, 64)[0]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"questions": questions, "record": record}))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidate", action="append", required=True, choices=sorted(CANDIDATES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--num_problems", type=int, default=256)
    parser.add_argument("--eval_seed", type=int, default=12345)
    parser.add_argument("--preset", default=DEMO_PRESET, choices=sorted(PRESETS), help="the task (see above)")
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    task, config, _ = PRESETS[args.preset]
    data = data_dir(args.preset)
    problems, dataset = heldout_problems(task, dict(config), args.num_problems, args.eval_seed,
                                         excluded_questions([data / "train.parquet", data / "test.parquet"]))
    rows = []
    base = base_record(problems, dataset, args.num_problems, args.eval_seed, args.preset)
    rows.append({"candidate": "base", "seed": None, "acc": base["acc_flexible"], "acc_strict": base["acc_strict"],
                 "correct": base["correct"]["flexible"]})
    for candidate in args.candidate:
        for seed in args.seeds:
            started = time.monotonic()
            final = train(candidate, seed, args.preset)
            record = evaluate([str(final)], problems, dataset, ["ours"], 64, 64)[0]
            gain, gain_low, gain_high = paired_gain_interval(base["correct"]["flexible"], record["correct"]["flexible"])
            rows.append({
                "candidate": candidate, "seed": seed, "overrides": CANDIDATES[candidate][1],
                "steps": CANDIDATES[candidate][0], "train_min": training_minutes(final.parent),
                "acc": record["acc_flexible"], "acc_strict": record["acc_strict"],
                "gain": gain, "gain_ci95": [gain_low, gain_high],
                "correct": record["correct"]["flexible"], "wall_s": time.monotonic() - started,
            })
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "correct"}), flush=True)
    print(f"\nbase model: {100 * rows[0]['acc']:.1f}% on {args.num_problems} held-out problems (flexible extraction)")
    print("| candidate | seeds | training min | held-out acc mean +- sd | gain mean +- sd | per-seed gain [95% CI] |")
    print("|---|---|---|---|---|---|")
    for candidate in args.candidate:
        runs = [r for r in rows if r["candidate"] == candidate]
        accs, gains = [100 * r["acc"] for r in runs], [100 * r["gain"] for r in runs]
        sd = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
        per_seed = ", ".join(f"{100 * r['gain']:+.1f} [{100 * r['gain_ci95'][0]:.1f}, {100 * r['gain_ci95'][1]:.1f}]"
                             for r in runs)
        print(f"| {candidate} | {len(runs)} | {statistics.mean(r['train_min'] for r in runs):.1f} | "
              f"{statistics.mean(accs):.1f} +- {sd(accs):.1f} | {statistics.mean(gains):+.1f} +- {sd(gains):.1f} | "
              f"{per_seed} |")
    path = write_results("demo_recipe_search", {"candidates": {c: CANDIDATES[c] for c in args.candidate},
                                                "seeds": args.seeds, "num_problems": args.num_problems,
                                                "preset": args.preset,
                                                "eval_seed": args.eval_seed}, rows, load_before)
    print(f"raw results: {path}")


if __name__ == "__main__":
    main()
