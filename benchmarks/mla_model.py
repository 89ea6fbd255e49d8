"""Save a random DeepSeek-V3-shaped model (multi-head latent attention, a dense first layer, routed + shared
experts) with SmolLM2's tokenizer, for the rollout benchmark:

    python benchmarks/mla_model.py outputs/bench/mla_model
    python benchmarks/rollout.py --model outputs/bench/mla_model --workloads 16x128 --backends hf,native

The shape (58M parameters): hidden 512, 8 layers, 8 heads, q_lora_rank 192, kv_lora_rank 128, rope 32 + nope 64
query/key dims, v 64, 8 routed experts of 256 (top 2) and one shared. DeepSeek-V3's layout at a laptop's size,
not its proportions. Random weights: the benchmark ignores eos, so every backend does the same work.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

from hybridflow.models import load_tokenizer
from hybridflow.models.loader import save_model_and_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    args = parser.parse_args()
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, q_lora_rank=192, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    print(save_model_and_tokenizer(model, tokenizer, args.out), f"{params_m:.1f}M")


if __name__ == "__main__":
    main()
