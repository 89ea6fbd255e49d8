"""Manual check of the `vllm` rollout against the `hf` one on SmolLM2-135M-Instruct (fp32); not run in CI.

Runs in the separate vLLM environment (`bash benchmarks/setup_vllm_env.sh`):

    benchmarks/.venv-vllm/bin/python benchmarks/check_vllm_backend.py

Checks, printing one line each and exiting non-zero if any fails:
1. greedy (temperature 1): vLLM's responses equal HF's token for token; log-probs agree (max abs diff);
2. sampled (temperature 0.7, n=2): the layout (rows, masks) is sound and the reported log-probs equal
   log softmax(logits / 0.7) of the sampled tokens recomputed by an HF forward;
3. weights: after the module changes, generating without `update_weights` is refused; after
   `update_weights(perturbed)` greedy output changes and equals HF greedy on the perturbed model; after
   `update_weights(original)` it is back to the original output. The hand-over time is printed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rollout.py's prompt builder

LOG_PROB_TOLERANCE = 2e-3  # fp32, different kernels (vLLM's CPU attention vs sdpa)


def reference_log_probs(model, out, temperature: float):
    """log softmax(logits / temperature) of each response token, from one HF forward over prompt + response."""
    import torch

    batch = out.batch
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"], use_cache=False,
        ).logits.float()
    length = batch["responses"].size(1)
    log_probs = torch.log_softmax(logits[:, -length - 1 : -1] / temperature, dim=-1)
    picked = log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return picked * batch["response_mask"]


def report(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


def main() -> int:
    import torch
    from rollout import build_prompts

    from hybridflow.engines.rollout import ROLLOUTS, HFRollout, SamplingParams
    from hybridflow.engines.rollout.config import RolloutConfig
    from hybridflow.models import build_causal_lm, load_tokenizer, resolve_model_path

    torch.set_num_threads(2)
    path = resolve_model_path("smollm2-135m-instruct")
    tokenizer = load_tokenizer(path)
    model = build_causal_lm(path, dtype="float32").eval()
    prompts = build_prompts(tokenizer, 4)
    greedy = SamplingParams(temperature=1.0, max_new_tokens=32, do_sample=False)
    sampled = SamplingParams(temperature=0.7, max_new_tokens=32, n=2)
    hf = HFRollout(model, tokenizer, greedy)
    start = time.perf_counter()
    # Built from the module (saved once to /dev/shm). Configured T=0.7 sampling + T=1 greedy validation:
    # logprobs_mode=processed_logprobs, exact for both.
    vllm_rollout = ROLLOUTS.get("vllm")(
        model, tokenizer, sampled, val_sampling_params=greedy, config=RolloutConfig(name="vllm", max_model_len=1024)
    )
    print(f"vLLM start-up {time.perf_counter() - start:.1f} s, logprobs_mode={vllm_rollout.logprobs_mode}")
    validate = {"validate": True}
    results = []

    def greedy_pair(label: str):
        prompts.meta_info = validate
        ours, theirs = vllm_rollout.generate_sequences(prompts), hf.generate_sequences(prompts)
        same = torch.equal(ours.batch["responses"], theirs.batch["responses"])
        rows = (ours.batch["responses"] == theirs.batch["responses"]).all(-1).tolist()
        mask = ours.batch["response_mask"].bool() & theirs.batch["response_mask"].bool()
        diff = (ours.batch["rollout_log_probs"] - theirs.batch["rollout_log_probs"])[mask].abs().max().item()
        detail = f"rows equal {rows}, log-prob max |diff| {diff:.2e}"
        results.append(report(f"greedy equals hf ({label})", same, detail))
        results.append(report(f"greedy log-probs ({label})", diff < LOG_PROB_TOLERANCE, f"{diff:.2e}"))
        return ours.batch["responses"]

    original = greedy_pair("original weights")
    print("  sample:", repr(tokenizer.decode(original[0], skip_special_tokens=True)))

    prompts.meta_info = {}
    out = vllm_rollout.generate_sequences(prompts)
    mask = out.batch["response_mask"]
    lengths = mask.sum(-1)
    last = out.batch["responses"].gather(1, (lengths - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ended = (last == tokenizer.eos_token_id) | (lengths == sampled.max_new_tokens)
    layout_ok = out.batch["responses"].shape == (8, 32) and bool(ended.all()) and bool((lengths > 0).all())
    shape = tuple(out.batch["responses"].shape)
    results.append(report("sampled layout", layout_ok, f"shape {shape}, lengths {lengths.tolist()}"))
    diff = (out.batch["rollout_log_probs"] - reference_log_probs(model, out, 0.7)).abs().max().item()
    name = "sampled log-probs = log softmax(logits / 0.7)"
    results.append(report(name, diff < LOG_PROB_TOLERANCE, f"max |diff| {diff:.2e}"))

    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05 * param.std())
    try:
        prompts.meta_info = validate
        vllm_rollout.generate_sequences(prompts)
        results.append(report("stale module refused", False, "generated with stale weights"))
    except RuntimeError as err:
        results.append(report("stale module refused", True, str(err)[:80] + "..."))
    start = time.perf_counter()
    vllm_rollout.update_weights(model.state_dict().items())
    mib = sum(t.numel() * t.element_size() for t in saved.values()) / 2**20
    print(f"update_weights: {time.perf_counter() - start:.2f} s ({mib:.0f} MiB)")
    perturbed = greedy_pair("perturbed weights")
    changed = not torch.equal(perturbed, original)
    num_changed = int((perturbed != original).any(-1).sum())
    results.append(report("update_weights changes the output", changed, f"{num_changed} of 4 rows differ"))

    with torch.no_grad():
        model.load_state_dict(saved)
    vllm_rollout.update_weights(model.state_dict().items())
    prompts.meta_info = validate
    restored = vllm_rollout.generate_sequences(prompts).batch["responses"]
    results.append(report("update_weights back to the original", torch.equal(restored, original), ""))
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


if __name__ == "__main__":  # vLLM starts its engine in a child process that re-imports this file
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the check lines only
    sys.exit(main())
