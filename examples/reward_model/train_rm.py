"""Train a small reward model on SmolLM2 from preference pairs made offline on a reasoning-gym task.

1. The policy (SmolLM2-135M-Instruct) samples `--n` answers per training prompt with the native engine.
2. The task's verifier scores them; within a prompt, a correct answer is paired against an incorrect one.
3. A value head on SmolLM2 is trained with the Bradley-Terry loss through hybridflow's training engine (one
   process), and its pair accuracy is measured on held-out prompts before and after.
4. The model is saved as a token-classification checkpoint that `reward_model.model.path` loads.
With `--sft_file`, the verified-correct answers are also written as SFT rows (prompt messages, response): SFT on
them gives the teacher of the on-policy distillation example.

Run (after `make demo` wrote the data):
    python examples/reward_model/train_rm.py --train_file outputs/demo/data/train.parquet --out outputs/rm
then GRPO with it:
    hybridflow train --config-name grpo_smollm2_demo reward_model.enable=True reward_model.model.path=outputs/rm \
        trainer.default_local_dir=outputs/rm_grpo/run
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from hybridflow.algorithms.preference import bradley_terry_loss, preference_pairs
from hybridflow.data import RLHFDataset, collate_fn
from hybridflow.data.config import RLHFDataConfig
from hybridflow.engines.rollout import ROLLOUTS, RolloutConfig, SamplingParams
from hybridflow.engines.training import FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.models.config import ModelConfig
from hybridflow.protocol import DataProto
from hybridflow.rewards.score import default_compute_score


def sample_answers(model_path: str, tokenizer, dataset: RLHFDataset, n: int, response_length: int, seed: int,
                   temperature: float):
    """Every prompt's `n` sampled answers: (prompt rows repeated n times, response ids, response mask, texts)."""
    rollout = ROLLOUTS.get("native")(
        model_path, tokenizer,
        SamplingParams.from_config(RolloutConfig(name="native", temperature=temperature, response_length=response_length),
                                   response_length),
    )
    rows = collate_fn([dataset[i] for i in range(len(dataset))])
    prompts = DataProto.from_single_dict({k: rows[k] for k in ("input_ids", "attention_mask", "position_ids")})
    prompts = prompts.repeat(n, interleave=True)
    torch.manual_seed(seed)
    output = rollout.generate_sequences(prompts)
    mask = output.batch["response_mask"]
    texts = tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(output.batch["responses"], mask)],
                                   skip_special_tokens=True)
    return rows, output, texts


def write_correct_answers(path: str, dataset: RLHFDataset, texts: list[str], scores: list[float], n: int) -> None:
    """SFT rows (`prompt`: the chat messages, `response`: the answer) of every verified-correct answer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": dataset[i // n]["raw_prompt"], "response": text}
            for i, (text, score) in enumerate(zip(texts, scores)) if score >= 1.0]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    print(f"wrote {len(rows)} correct answers to {path}")


def pair_batch(output: DataProto, pairs: list[tuple[int, int]], pad_token_id: int) -> DataProto:
    """Rows [chosen_0, rejected_0, chosen_1, ...]; responses get one extra pad column, so that the value at
    response index L (the output at the last response token) exists for every length L."""
    index = torch.tensor([i for pair in pairs for i in pair])
    batch = output.batch
    extra = torch.full((len(index), 1), pad_token_id, dtype=torch.long)
    input_ids = torch.cat([batch["input_ids"][index], extra], dim=1)
    attention_mask = torch.cat([batch["attention_mask"][index], torch.zeros_like(extra)], dim=1)
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": torch.cat([batch["responses"][index], extra], dim=1),
        "response_mask": torch.cat([batch["response_mask"][index], torch.zeros_like(extra)], dim=1),
    })


def pairwise_loss(outputs: dict[str, torch.Tensor], micro_batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley-Terry loss of a micro-batch holding whole (chosen, rejected) pairs."""
    lengths = micro_batch.batch["response_mask"].sum(-1).to(outputs["values"].device)
    scores = outputs["values"].gather(1, lengths[:, None]).squeeze(1)
    return bradley_terry_loss(scores[0::2], scores[1::2])


def pair_accuracy(engine, batch: DataProto) -> float:
    """Share of pairs whose chosen answer the reward model scores higher (scores as the RM worker reads them)."""
    scores = engine.compute_scores(batch, micro_batch_size=16)
    return float((scores[0::2] > scores[1::2]).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train_file", default="outputs/demo/data/train.parquet")
    parser.add_argument("--out", default="outputs/rm")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num_prompts", type=int, default=256)
    parser.add_argument("--n", type=int, default=4, help="answers sampled per prompt")
    parser.add_argument("--response_length", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--pairs_per_step", type=int, default=16)
    parser.add_argument("--held_out", type=float, default=0.2, help="share of prompts kept for evaluation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft_file", default=None, help="also write the correct answers here (parquet)")
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out} is not empty; choose a new directory (nothing is overwritten)")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    random.seed(args.seed)

    model_path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_path)
    data_config = RLHFDataConfig(train_files=[args.train_file], max_prompt_length=96,
                                 max_response_length=args.response_length, return_raw_chat=True)
    dataset = RLHFDataset(args.train_file, tokenizer, data_config, max_samples=args.num_prompts)

    start = time.perf_counter()
    rows, output, texts = sample_answers(
        model_path, tokenizer, dataset, args.n, args.response_length, args.seed, args.temperature
    )
    gen_s = time.perf_counter() - start
    sources = np.repeat(rows["data_source"], args.n)
    truths = np.repeat([r["ground_truth"] for r in rows["reward_model"]], args.n)
    infos = np.repeat(rows["extra_info"], args.n)
    results = [default_compute_score(s, t, g, i) for s, t, g, i in zip(sources, texts, truths, infos)]
    scores = [float(r["score"] if isinstance(r, dict) else r) for r in results]
    prompt_ids = [str(i // args.n) for i in range(len(scores))]
    if args.sft_file:
        write_correct_answers(args.sft_file, dataset, texts, scores, args.n)
    pairs = preference_pairs(prompt_ids, scores)
    held_out_prompts = set(random.sample(sorted(set(prompt_ids)), int(len(set(prompt_ids)) * args.held_out)))
    train_pairs = [p for p in pairs if prompt_ids[p[0]] not in held_out_prompts]
    eval_pairs = [p for p in pairs if prompt_ids[p[0]] in held_out_prompts]
    print(f"sampled {len(scores)} answers in {gen_s:.0f} s, verifier accuracy {np.mean(scores):.3f}; "
          f"{len(train_pairs)} training pairs, {len(eval_pairs)} held-out pairs")

    engine = build_fsdp_engine(model_path, FSDPEngineConfig(
        model=ModelConfig(path=model_path, use_remove_padding=True),
        optim=OptimConfig(lr=args.lr, weight_decay=0.0), micro_batch_size_per_gpu=8,
    ), model_kind="value", tokenizer=tokenizer)
    eval_batch = pair_batch(output, eval_pairs, tokenizer.pad_token_id)
    before = pair_accuracy(engine, eval_batch)
    history = []
    start = time.perf_counter()
    for epoch in range(args.epochs):
        random.shuffle(train_pairs)
        for first in range(0, len(train_pairs) - args.pairs_per_step + 1, args.pairs_per_step):
            step_pairs = train_pairs[first:first + args.pairs_per_step]
            metrics = engine.train_batch(pair_batch(output, step_pairs, tokenizer.pad_token_id), pairwise_loss)
            history.append({k: metrics[k] for k in ("loss", "rm/accuracy", "grad_norm")})
        print(f"epoch {epoch + 1}: loss {np.mean([h['loss'] for h in history[-8:]]):.3f}, "
              f"held-out pair accuracy {pair_accuracy(engine, eval_batch):.3f}")
    train_s = time.perf_counter() - start
    after = pair_accuracy(engine, eval_batch)
    engine.save_hf_model(out, tokenizer)
    summary = {
        "answers": len(scores), "verifier_accuracy_of_samples": float(np.mean(scores)),
        "train_pairs": len(train_pairs), "held_out_pairs": len(eval_pairs),
        "held_out_pair_accuracy_before": before, "held_out_pair_accuracy_after": after,
        "generation_s": gen_s, "training_s": train_s, "epochs": args.epochs,
    }
    (out / "rm_training.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
