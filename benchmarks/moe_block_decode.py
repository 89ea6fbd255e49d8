"""Where an upcycled MoE's rollout time goes: one MoE block (SmolLM2-135M's MLP shape as 4 experts, top-2) against
the dense MLP it was copied from, at decode and prefill token counts, for each of transformers' experts kernels.

The native rollout runs an MoE layer through transformers' own block (`experts_implementation`). A kernel of our
own is worth writing only if these kernels are far from the floor. At decode the floor is reading the weights: a
batch of tokens touches every expert, so the block reads 4x the dense MLP's weights and does 2x its FLOPs. The table
prints each kernel's time and its ratio to the dense MLP measured in the same loop (interleaved, median of
`--repeats`); the raw rows go to benchmarks/results/moe_block_decode_<UTC>.json with the host's facts:

    python benchmarks/moe_block_decode.py --repeats 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

KERNELS = ("eager", "grouped_mm", "batched_mm")
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 576, 1536, 4, 2  # SmolLM2-135M's MLP, `make demo-moe`'s upcycling


def build_blocks() -> tuple[dict[str, torch.nn.Module], torch.nn.Module]:
    """One Mixtral MoE block per experts kernel, all with the same random weights, and a dense Llama MLP."""
    from transformers import LlamaConfig, MixtralConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    blocks = {}
    for kernel in KERNELS:
        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                               num_experts_per_tok=TOP_K)
        config._experts_implementation = kernel
        blocks[kernel] = MixtralSparseMoeBlock(config).eval()
    reference = blocks[KERNELS[0]]
    for parameter in reference.parameters():
        torch.nn.init.normal_(parameter, std=0.02)  # the experts' weights are allocated uninitialised
    for block in blocks.values():
        block.load_state_dict(reference.state_dict())
    dense = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)).eval()
    return blocks, dense


def measure(blocks: dict[str, torch.nn.Module], dense: torch.nn.Module, tokens: int, repeats: int) -> dict:
    """Median seconds per call of each kernel and of the dense MLP, interleaved; kernels checked against eager."""
    x = torch.randn(1, tokens, HIDDEN)
    times: dict[str, list[float]] = {name: [] for name in [*blocks, "dense"]}
    with torch.no_grad():
        expected = blocks[KERNELS[0]](x)
        for _ in range(repeats):
            for name, module in [*blocks.items(), ("dense", dense)]:
                start = time.perf_counter()
                out = module(x)
                times[name].append(time.perf_counter() - start)
                if name != "dense" and not torch.allclose(out, expected, atol=1e-4):
                    raise AssertionError(f"{name} differs from eager by {(out - expected).abs().max():.2e}")
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    from hybridflow.utils.host import write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    blocks, dense = build_blocks()
    rows = []
    print(f"{'tokens':>6}  {'dense MLP ms':>12}  " + "  ".join(f"{k + ' ms (x dense)':>24}" for k in KERNELS))
    for tokens in args.tokens:
        seconds = measure(blocks, dense, tokens, args.repeats)
        rows.append({"tokens": tokens, **{f"{name}_s": value for name, value in seconds.items()}})
        cells = "  ".join(f"{seconds[k] * 1e3:>13.2f} ({seconds[k] / seconds['dense']:>6.2f}x)" for k in KERNELS)
        print(f"{tokens:>6}  {seconds['dense'] * 1e3:>12.2f}  {cells}")
    path = write_results("moe_block_decode", {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "experts": EXPERTS,
                                              "top_k": TOP_K, "repeats": args.repeats, "threads": args.threads},
                         rows, load_before)
    print(f"raw rows: {path}")


if __name__ == "__main__":
    main()
