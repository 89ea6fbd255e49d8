"""The rollout registry's specs: what each built-in backend can do, plug-ins, and no backend-name branches
elsewhere (config checks and workers read the spec)."""

from __future__ import annotations

import ast
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hybridflow.engines.rollout import ROLLOUTS, RolloutSpec, register_rollout, rollout_spec

PACKAGE = Path(__file__).resolve().parents[3] / "hybridflow"


def test_built_in_specs_say_what_each_backend_can_do():
    hf, native, vllm = (rollout_spec(name) for name in ("hf", "native", "vllm"))
    assert all(spec.returns_log_probs for spec in (hf, native, vllm))
    assert [name for name in ROLLOUTS.names() if rollout_spec(name).log_probs_match_trainer] == ["native"]
    assert [name for name in ROLLOUTS.names() if rollout_spec(name).tensor_parallel] == ["hf", "native", "vllm"]
    assert hf.tensor_parallel_on_cpu and native.tensor_parallel_on_cpu and not vllm.tensor_parallel_on_cpu
    assert hf.runs_vision and hf.records_routing and not native.runs_vision and not vllm.records_routing
    assert vllm.reads_engine_keys and not hf.reads_engine_keys and not native.reads_engine_keys
    assert native.unsupported_model_reason({"model_type": "llama"}) is None
    assert native.unsupported_model_reason({"model_type": "qwen3_moe", "num_experts": 8}) is None
    assert native.unsupported_model_reason({"model_type": "deepseek_v3", "n_routed_experts": 8}) is None
    assert "mixture-of-experts" in native.unsupported_model_reason({"model_type": "gpt_oss", "num_local_experts": 8})
    assert hf.unsupported_model_reason({"model_type": "anything"}) is None  # no check declared


def test_specs_and_names_load_without_torch():
    code = ("import sys\nfrom hybridflow.engines.rollout import rollout_spec\n"
            "rollout_spec('native').unsupported_model_reason({'model_type': 'llama'})\n"
            "print('torch' in sys.modules)\n")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_a_plug_in_declares_what_it_can_do_or_nothing(monkeypatch):
    from hybridflow.engines.rollout import registry

    # registered for this test only: other tests list the backends
    monkeypatch.setattr(ROLLOUTS, "_entries", dict(ROLLOUTS._entries))
    monkeypatch.setattr(ROLLOUTS, "_lazy", dict(ROLLOUTS._lazy))
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    declared, bare = f"mine_{uuid.uuid4().hex[:6]}", f"bare_{uuid.uuid4().hex[:6]}"
    register_rollout(declared, "my_package.rollout:MyRollout", RolloutSpec(returns_log_probs=True))
    ROLLOUTS.register(bare, object)
    assert rollout_spec(declared).returns_log_probs and rollout_spec(bare) == RolloutSpec()
    with pytest.raises(ValueError, match="already registered"):
        register_rollout(declared, "my_package.rollout:Other")
    with pytest.raises(KeyError, match="hf"):
        rollout_spec("hf_typo")


BACKEND_NAMES = {"hf", "native", "vllm"}
# Comparisons with a backend's name that are not about `rollout.name` (path relative to hybridflow/, line text).
NOT_BACKENDS = {("tools/base.py", 'kind != "native"')}


def _name_branches(tree: ast.AST, source: str) -> list[tuple[int, str]]:
    """(line, text) of each comparison of something with a backend's name (`== "vllm"`, `in ("hf", ...)`)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            if any(isinstance(item, ast.Constant) and item.value in BACKEND_NAMES for item in items):
                found.append((node.lineno, ast.get_source_segment(source, node)))
                break
    return found


def test_no_backend_name_branch_outside_the_registry():
    branches = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("engines/rollout/"):
            continue  # the registry, the specs and the backends themselves
        source = path.read_text()
        branches += [(relative, line, text) for line, text in _name_branches(ast.parse(source), source)
                     if (relative, text) not in NOT_BACKENDS]
    assert not branches, f"branches on a rollout backend's name; read rollout_spec(name) instead: {branches}"


def test_the_branch_finder_finds_a_branch():
    source = 'if rollout.name == "vllm":\n    pass\nif x in ("hf", "y"):\n    pass\nif z == "other":\n    pass\n'
    assert [line for line, _ in _name_branches(ast.parse(source), source)] == [1, 3]


def test_native_reads_its_vllm_equivalents_and_still_refuses_the_other_vllm_keys(tiny_llama_dir):
    from hybridflow.engines.rollout import SamplingParams
    from hybridflow.engines.rollout.config import RolloutConfig
    from hybridflow.models import build_causal_lm, load_tokenizer
    from hybridflow.utils.config import ConfigFieldError

    native = ROLLOUTS.get("native")
    assert native.kwargs_from_config(RolloutConfig(name="native", enforce_eager=True)) == {"cuda_graphs": False}
    assert native.kwargs_from_config(RolloutConfig(name="native", enforce_eager=False)) == {"cuda_graphs": True}
    assert native.kwargs_from_config(RolloutConfig(name="native")) == {"cuda_graphs": True}  # None: graphs on CUDA
    # vLLM's max_num_seqs / max_num_batched_tokens are the native engine's slots and prefill chunk, where set
    kwargs = native.kwargs_from_config(RolloutConfig(name="native", max_num_seqs=6, max_num_batched_tokens=96))
    assert kwargs == {"cuda_graphs": True, "max_num_seqs": 6, "max_prefill_tokens": 96}
    rollout = native(build_causal_lm(tiny_llama_dir), load_tokenizer(tiny_llama_dir), SamplingParams(), **kwargs)
    assert (rollout.batcher.max_num_seqs, rollout.batcher.max_prefill_tokens) == (6, 96)
    with pytest.raises(ConfigFieldError, match=r"max_model_len=64 sets the vllm engine, but name='native' does not "
                                               r"read it; use name in \['vllm'\]"):
        RolloutConfig(name="native", max_model_len=64)
    with pytest.raises(ConfigFieldError, match=r"max_num_seqs=64 sets the vllm engine, but name='hf' does not read it; "
                                               r"use name in \['native', 'vllm'\]"):
        RolloutConfig(name="hf", max_num_seqs=64)
    with pytest.raises(ConfigFieldError, match="enforce_eager=True sets the vllm engine, but name='hf' does not read"):
        RolloutConfig(name="hf", enforce_eager=True)


@pytest.mark.parametrize("name", ["hf", "native", "vllm"])
def test_engine_keys_a_backend_declares_reach_its_constructor(name):
    import inspect

    from hybridflow.engines.rollout.config import _VLLM_ONLY_KEYS, RolloutConfig

    spec = rollout_spec(name)
    assert set(spec.engine_keys) <= set(_VLLM_ONLY_KEYS)
    if spec.reads_engine_keys:
        return  # takes the whole section (config=...)
    backend = ROLLOUTS.get(name)
    kwargs = backend.kwargs_from_config(RolloutConfig(name=name))
    assert set(kwargs) <= set(inspect.signature(backend.__init__).parameters)
    assert bool(kwargs) == bool(spec.engine_keys)  # a declared key is passed on; nothing else is
