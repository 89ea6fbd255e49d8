#!/usr/bin/env bash
# Agentic RL recipe: a short SFT warm-up, then GRPO with the tool agent and a calculator (SmolLM2-135M, CPU).
# The warm-up's demonstrations call the calculator in half of them and answer directly in the other half, so the
# warmed-up model calls the tool only sometimes (about 30% of sampled answers, never greedily) and RL is what
# teaches it to: the held-out accuracy and the tool-call rate it gains are RL's. Measured results are in the README.
#   bash examples/calculator_agent/run.sh
set -euo pipefail
OUT=outputs/calculator_agent
export RAY_AUTH_MODE=disabled
test -f $OUT/data/train.parquet || python examples/calculator_agent/make_data.py --local_dir $OUT/data \
  --tool_fraction 0.5 --test_size 256
if [ ! -d $OUT/sft_merged ]; then
  hybridflow sft data.train_files=[$OUT/data/sft_train.parquet] data.val_files=[$OUT/data/sft_val.parquet] \
    data.multiturn.enable=True data.max_length=512 data.train_batch_size=16 data.micro_batch_size_per_gpu=8 \
    model.partial_pretrain=smollm2-135m-instruct model.use_remove_padding=True optim.lr=5e-5 \
    trainer.total_training_steps=8 trainer.test_freq=-1 trainer.save_freq=-1 trainer.logger=[console,file] \
    trainer.default_local_dir=$OUT/sft trainer.n_gpus_per_node=1
  hybridflow merge --local_dir "$OUT/sft/global_step_$(cat $OUT/sft/latest_checkpointed_iteration.txt)" --target_dir $OUT/sft_merged
fi
python -m hybridflow.trainer.main_ppo --config-name grpo_smollm2_calculator_agent "$@"
