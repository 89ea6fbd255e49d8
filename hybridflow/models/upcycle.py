"""Sparse upcycling: a dense Llama-family model turned into a Mixtral mixture of experts that computes the same
function, so an MoE starts from the dense model's competence (Komatsuzaki et al., "Sparse Upcycling", 2023).

Every MLP is copied into `num_experts` experts and a router is added. Mixtral normalises the top-k routing weights
to sum to 1, so while the experts are copies the layer's output is the dense MLP's whatever the router says (the
logits equal the dense model's up to float rounding). The router starts from small random weights; training makes
the experts diverge, since each token's gradient reaches its experts in proportion to their routing weights.

    python -m hybridflow.models.upcycle --model smollm2-135m-instruct --target_dir outputs/smollm2_moe
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedModel

__all__ = ["upcycle_to_mixtral", "main"]

_SOURCE_TYPES = ("llama", "mistral")


def upcycle_to_mixtral(
    dense: PreTrainedModel, num_experts: int = 4, top_k: int = 2, router_std: float = 0.02, seed: int = 0
) -> MixtralForCausalLM:
    """A Mixtral with `dense`'s attention, norms and embeddings, `num_experts` copies of each MLP and a fresh router
    (N(0, router_std), seeded) per layer; `top_k` experts per token. Raises ValueError for what cannot be copied."""
    config = dense.config
    if config.model_type not in _SOURCE_TYPES:
        raise ValueError(f"upcycling takes a dense model of type {_SOURCE_TYPES}, got {config.model_type!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise ValueError(f"the dense model sets {flag}=True; Mixtral layers have no biases to copy it into")
    moe_config = MixtralConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=getattr(config, "head_dim", None),
        hidden_act=config.hidden_act, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_parameters=config.rope_parameters,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, sliding_window=None,
        num_local_experts=num_experts, num_experts_per_tok=top_k, initializer_range=config.initializer_range,
    )
    dtype = next(dense.parameters()).dtype
    moe = MixtralForCausalLM(moe_config).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        dense_state = dense.state_dict()
        for name, tensor in moe.state_dict().items():
            if ".mlp." not in name:
                tensor.copy_(dense_state[name])
        for dense_layer, moe_layer in zip(dense.model.layers, moe.model.layers, strict=True):
            mlp, block = dense_layer.mlp, moe_layer.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # Mixtral splits gate, then up
            block.experts.gate_up_proj.copy_(gate_up.expand(num_experts, *gate_up.shape))
            block.experts.down_proj.copy_(mlp.down_proj.weight.expand(num_experts, *mlp.down_proj.weight.shape))
            router = torch.randn(block.gate.weight.shape, generator=generator) * router_std
            block.gate.weight.copy_(router.to(dtype))
    if config.tie_word_embeddings:
        moe.tie_weights()
    return moe.eval()


def main(argv: list[str] | None = None) -> Path:
    """Upcycle `--model` (a catalogue name or model directory) and save it with its tokenizer to `--target_dir`."""
    from hybridflow.models import build_causal_lm, load_tokenizer, resolve_model_path
    from hybridflow.models.loader import save_model_and_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a catalogue name or a dense Llama-family model directory")
    parser.add_argument("--target_dir", required=True)
    parser.add_argument("--num_experts", type=int, default=4)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--router_std", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    target = Path(args.target_dir).expanduser()
    if target.exists() and any(target.iterdir()):
        raise SystemExit(f"--target_dir {target} is not empty: upcycling never overwrites a saved model")
    path = resolve_model_path(args.model)
    moe = upcycle_to_mixtral(build_causal_lm(path), args.num_experts, args.top_k, args.router_std, args.seed)
    saved = save_model_and_tokenizer(moe, load_tokenizer(path), target)
    print(f"wrote {saved}: {args.num_experts} experts, top-{args.top_k}, from {args.model}")
    return Path(saved)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
