"""The vllm rollout on one CUDA device with a real vLLM 0.32 (the supported set, `vllm_versions`): the engine in
this process (external launcher), greedy parity with the hf rollout, weights handed over by name through the
worker extension, and a sleep/wake cycle. Needs a GPU and the vllm environment; skipped elsewhere."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, RolloutConfig, SamplingParams
from hybridflow.single_controller.base.worker import find_free_port
from tests.engines.helpers import encode_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (benchmarks/setup_vllm_env.sh)"),
]

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "1 + 1 =", "Write a haiku about the sea:"]
GREEDY = SamplingParams(temperature=1.0, max_new_tokens=16, do_sample=False)


@pytest.fixture(scope="module")
def engine():
    """One vLLM engine for the module (a process holds one external-launcher engine comfortably)."""
    from hybridflow.engines.rollout.vllm import VLLMRollout
    from hybridflow.env import scoped_environ, set_dist_env
    from hybridflow.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(MODEL)
    tokenizer = load_tokenizer(path)
    config = RolloutConfig(name="vllm", prompt_length=64, response_length=32, dtype="float32",
                           gpu_memory_utilization=0.3)
    with scoped_environ():
        set_dist_env(0, 1, 0, "127.0.0.1", str(find_free_port()))
        rollout = VLLMRollout(path, tokenizer, GREEDY, val_sampling_params=GREEDY, config=config)
    return rollout, path, tokenizer


def _responses(rollout, tokenizer) -> torch.Tensor:
    return rollout.generate_sequences(encode_prompts(tokenizer, PROMPTS)).batch["responses"].cpu()


def test_engine_runs_in_this_process_in_the_configured_dtype(engine):
    rollout, _, _ = engine
    assert type(rollout.llm.llm_engine.engine_core).__name__ == "InprocClient"
    assert str(rollout.llm.llm_engine.model_config.dtype) == "torch.float32"
    assert rollout.llm.llm_engine.model_config.max_model_len == 96


def test_greedy_matches_the_hf_rollout(engine):
    from hybridflow.models import build_causal_lm

    rollout, path, tokenizer = engine
    hf = HFRollout(build_causal_lm(path, dtype="float32").cuda(), tokenizer, GREEDY)
    ours, theirs = _responses(rollout, tokenizer), _responses(hf, tokenizer)
    assert torch.equal(ours[:, :8], theirs[:, :8])  # fp32 both; later tokens may flip on near-ties


def test_update_weights_by_name_changes_and_restores_the_output(engine):
    from hybridflow.models import build_causal_lm

    rollout, path, tokenizer = engine
    before = _responses(rollout, tokenizer)
    module = build_causal_lm(path, dtype="float32").cuda()
    scrambled = [(name, tensor.flip(0) if tensor.dim() == 2 else tensor) for name, tensor in module.state_dict().items()]
    rollout.update_weights(iter(scrambled))
    assert not torch.equal(_responses(rollout, tokenizer), before)
    rollout.update_weights(iter(module.state_dict().items()))
    assert torch.equal(_responses(rollout, tokenizer), before)


def test_sleep_frees_memory_and_wake_up_restores_the_engine(engine):
    rollout, _, tokenizer = engine
    before = _responses(rollout, tokenizer)
    used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    rollout.sleep()
    assert torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0] < used
    rollout.wake_up()
    assert torch.equal(_responses(rollout, tokenizer), before)
