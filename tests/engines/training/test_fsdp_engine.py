"""The training engine in a single process (no process group): accumulation, skips, packing, values, state."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.engines.training import FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.models import build_causal_lm, load_tokenizer
from hybridflow.models.config import ModelConfig
from hybridflow.utils.flops import ForwardWork
from tests.engines.helpers import make_batch, seq_mean_nll

CONFIG = FSDPEngineConfig(micro_batch_size_per_gpu=8, optim=OptimConfig(lr=1e-2, clip_grad=1.0))
PACKED = dataclasses.replace(CONFIG, model=ModelConfig(use_remove_padding=True))


@pytest.fixture(scope="module")
def batch(tiny_llama_dir):
    return make_batch(len(load_tokenizer(tiny_llama_dir)), batch_size=8, seed=3)


def _params(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.named_full_params()}


def test_grad_accumulation_over_4_micro_batches_equals_one_big_batch(tiny_llama_dir, batch):
    big = build_fsdp_engine(tiny_llama_dir, CONFIG)
    small = build_fsdp_engine(tiny_llama_dir, dataclasses.replace(CONFIG, micro_batch_size_per_gpu=2))
    big_metrics = big.train_batch(batch, seq_mean_nll)
    small_metrics = small.train_batch(batch, seq_mean_nll)
    assert small_metrics["loss"] == pytest.approx(big_metrics["loss"], abs=1e-6)
    assert small_metrics["grad_norm"] == pytest.approx(big_metrics["grad_norm"], abs=1e-6)
    # The accumulated gradient is checked by the loss and grad norm above (1e-6; a wrong scale of the micro-batch
    # losses moves the norm by far more). The parameters after one AdamW step are looser: its first update is
    # lr * g / (|g| + eps), so an entry whose gradient is near eps turns float32 reduction-order noise into up to
    # lr (1e-2) of change. Measured: 0 on the AVX-512 host, 2.4e-5 on the AVX2 host; an update that skipped a
    # micro-batch moves parameters by about lr.
    a, b = _params(big), _params(small)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-4, rtol=0)
    assert set(small_metrics) >= {"loss", "grad_norm", "lr", "num_skipped_steps", "nll"}


def test_gradient_checkpointing_gives_the_same_step(tiny_llama_dir, batch):
    plain = build_fsdp_engine(tiny_llama_dir, CONFIG)
    config = dataclasses.replace(CONFIG, model=ModelConfig(enable_gradient_checkpointing=True))
    checkpointed = build_fsdp_engine(tiny_llama_dir, config)
    module = checkpointed.module  # the flag's name differs across transformers 5.x releases
    assert getattr(module, "is_activation_checkpointing", None) or getattr(module, "is_gradient_checkpointing")
    a = plain.train_batch(batch, seq_mean_nll)
    b = checkpointed.train_batch(batch, seq_mean_nll)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_offload_keeps_the_saved_tensors_on_the_host_and_the_step(tiny_llama_dir, batch, monkeypatch,
                                                                              checkpointing):
    """model.enable_activation_offload: every tensor the training forward saves goes through torch's save_on_cpu
    hooks (on a CPU rank they stay where they are), with and without gradient checkpointing; the step is unchanged."""
    packed: list[torch.device] = []

    class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook

            def counted(tensor):
                packed.append(tensor.device)
                return pack(tensor)

            self.pack_hook = counted

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    model = ModelConfig(enable_gradient_checkpointing=checkpointing)
    plain = build_fsdp_engine(tiny_llama_dir, dataclasses.replace(CONFIG, model=model))
    offloaded = build_fsdp_engine(
        tiny_llama_dir, dataclasses.replace(CONFIG, model=dataclasses.replace(model, enable_activation_offload=True))
    )
    a = plain.train_batch(batch, seq_mean_nll)
    assert not packed  # off: torch's hooks are never installed
    b = offloaded.train_batch(batch, seq_mean_nll)
    assert len(packed) > 10 and all(device.type == "cpu" for device in packed)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-6)
    for name, tensor in _params(plain).items():
        torch.testing.assert_close(tensor, _params(offloaded)[name], atol=1e-6, rtol=0)


def test_list_of_micro_batches_and_dict_batches(tiny_llama_dir, batch):
    """A dict (or TensorDict) batch is wrapped once at the engine's entry: the loss sees a DataProto, the results
    equal the DataProto batch's; anything else is refused naming the type."""
    engine = build_fsdp_engine(tiny_llama_dir, CONFIG)
    as_dicts = [{key: part.batch[key] for key in part.batch.keys()} for part in batch.split(4)]
    log_probs_dict, _ = engine.compute_log_prob(as_dicts[0])
    log_probs_proto, _ = engine.compute_log_prob(batch.split(4)[0])
    torch.testing.assert_close(log_probs_dict, log_probs_proto)
    seen = []

    def loss_fn(outputs, micro_batch):
        seen.append(type(micro_batch).__name__)
        return seq_mean_nll(outputs, micro_batch)

    assert engine.train_batch(as_dicts, loss_fn)["num_skipped_steps"] == 0
    assert seen == ["DataProto"] * len(as_dicts)
    with pytest.raises(TypeError, match="DataProto or a mapping / TensorDict .* not list"):
        engine.compute_log_prob([1, 2, 3])


def test_non_finite_grad_norm_skips_the_step(tiny_llama_dir, batch):
    engine = build_fsdp_engine(tiny_llama_dir, CONFIG)
    before = _params(engine)

    def nan_loss(outputs, micro_batch):
        loss, metrics = seq_mean_nll(outputs, micro_batch)
        return loss * float("nan"), metrics

    metrics = engine.train_batch(batch, nan_loss)
    assert metrics["num_skipped_steps"] == 1
    for name, tensor in _params(engine).items():
        assert torch.equal(tensor, before[name])
    assert engine.train_batch(batch, seq_mean_nll)["num_skipped_steps"] == 0


def test_remove_padding_matches_padded_forward(tiny_llama_dir, batch):
    padded = build_fsdp_engine(tiny_llama_dir, CONFIG)
    packed = build_fsdp_engine(tiny_llama_dir, PACKED)
    mask = batch.batch["response_mask"].bool()
    lp_a, ent_a = padded.compute_log_prob(batch, temperature=0.7, calculate_entropy=True)
    lp_b, ent_b = packed.compute_log_prob(batch, temperature=0.7, calculate_entropy=True)
    torch.testing.assert_close(lp_a[mask], lp_b[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_a[mask], ent_b[mask], atol=1e-5, rtol=0)
    loss_a = padded.train_batch(batch, seq_mean_nll)["loss"]
    loss_b = packed.train_batch(batch, seq_mean_nll)["loss"]
    assert loss_a == pytest.approx(loss_b, abs=1e-5)


def test_value_engine_values_and_training(tiny_llama_dir, batch):
    padded = build_fsdp_engine(tiny_llama_dir, CONFIG, model_kind="value")
    packed = build_fsdp_engine(tiny_llama_dir, PACKED, model_kind="value")
    values = padded.compute_values(batch, micro_batch_size=3)
    assert values.shape == batch.batch["responses"].shape
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(values[mask], packed.compute_values(batch)[mask], atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="causal LM"):
        padded.compute_log_prob(batch)

    def value_loss(outputs, micro_batch):
        m = micro_batch.batch["response_mask"].float()
        loss = ((outputs["values"] - 1.0) ** 2 * m).sum() / m.sum()
        return loss, {}

    first = padded.train_batch(batch, value_loss)["loss"]
    for _ in range(3):
        last = padded.train_batch(batch, value_loss)["loss"]
    assert last < first


def test_checkpoint_resume_and_hf_export(tiny_llama_dir, batch, tmp_path):
    config = dataclasses.replace(
        CONFIG,
        optim=OptimConfig(lr=1e-2, lr_warmup_steps=1, lr_scheduler_type="cosine", total_training_steps=5),
    )
    engine = build_fsdp_engine(tiny_llama_dir, config, tokenizer=load_tokenizer(tiny_llama_dir))
    engine.train_batch(batch, seq_mean_nll)
    engine.lr_scheduler_step()
    engine.save_checkpoint(tmp_path / "ckpt")
    expected_rng = torch.rand(3)  # the draw right after the save: what a restored RNG must give again
    lr_before = engine.train_batch(batch, seq_mean_nll)["lr"]
    expected = _params(engine)

    resumed = build_fsdp_engine(tiny_llama_dir, config)
    torch.manual_seed(12345)  # a different state, which load_checkpoint must replace
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(torch.rand(3), expected_rng)
    assert resumed.train_batch(batch, seq_mean_nll)["lr"] == lr_before
    for name, tensor in _params(resumed).items():
        assert torch.equal(tensor, expected[name]), name

    resumed.save_hf_model(tmp_path / "hf", tokenizer=load_tokenizer(tiny_llama_dir))
    reloaded = build_causal_lm(tmp_path / "hf")
    ids = batch.batch["input_ids"][:2]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, resumed.module(input_ids=ids).logits)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert (tmp_path / "ckpt" / "huggingface" / "config.json").is_file()


def test_checkpoint_parts_are_saved_and_read_as_asked(tiny_llama_dir, batch, tmp_path):
    """verl's save_contents / load_contents: a model-only checkpoint holds the weight shards and the layout; a
    resume that reads its optimizer is refused naming the part; reading the model alone restores the weights and
    leaves a fresh optimizer."""
    from hybridflow.engines.training.engine_state import saved_parts

    engine = build_fsdp_engine(tiny_llama_dir, CONFIG)
    engine.train_batch(batch, seq_mean_nll)
    engine.save_checkpoint(tmp_path / "weights", contents=("model",))
    assert saved_parts(tmp_path / "weights") == {"model"} and (tmp_path / "weights" / "layout.json").is_file()
    assert not list((tmp_path / "weights").glob("optim_*")) and not list((tmp_path / "weights").glob("extra_*"))
    fresh = build_fsdp_engine(tiny_llama_dir, CONFIG)
    with pytest.raises(FileNotFoundError, match=r"holds no \['optimizer', 'extra'\] \(it holds \['model'\]"):
        fresh.load_checkpoint(tmp_path / "weights")
    fresh.load_checkpoint(tmp_path / "weights", contents=("model",))
    trained = _params(engine)
    for name, tensor in _params(fresh).items():
        assert torch.equal(tensor, trained[name]), name
    assert not fresh.optimizer.state  # AdamW starts fresh: its moments were not read
    with pytest.raises(ValueError, match="unknown checkpoint parts"):
        engine.save_checkpoint(tmp_path / "bad", contents=("hf_model",))


def test_load_checkpoint_with_missing_files_names_the_problem(tiny_llama_dir, tmp_path):
    engine = build_fsdp_engine(tiny_llama_dir, CONFIG)
    with pytest.raises(FileNotFoundError, match=r"holds no \['model', 'optimizer', 'extra'\]"):
        engine.load_checkpoint(tmp_path)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompts"])
def test_engine_counts_the_tokens_its_forwards_compute(tiny_llama_dir, batch, layout):
    """`pop_work`: tokens, attention pairs and projected positions, apart for no-grad and training forwards; a shared
    prompt counts once per micro-batch."""
    config = {"padded": CONFIG, "packed": PACKED, "shared_prompts": dataclasses.replace(CONFIG, share_prompts=True)}
    engine = build_fsdp_engine(tiny_llama_dir, config[layout])
    mask = batch.batch["attention_mask"]
    lengths, response_len = mask.sum(-1), batch.batch["responses"].size(1)
    separate = (int(lengths.sum()), int((lengths**2).sum()), int(mask[:, -response_len:].sum()))
    engine.compute_log_prob(batch)
    no_grad, training = engine.pop_work().values()
    assert training == ForwardWork()
    # (make_batch's prompts all differ, so shared-prompt forwards count them as separate sequences too)
    assert (no_grad.num_tokens, no_grad.attention_pairs, no_grad.num_projected) == separate
    if layout == "shared_prompts":
        shared = batch.select_idxs([0, 0, 0, 1])  # 3 rows with one prompt: it is computed once
        engine.forward_micro_batch(shared)
        work = engine.pop_work()[True]
        prompt, responses = int(mask[0, :-response_len].sum()), mask[[0, 0, 0, 1], -response_len:].sum(-1).tolist()
        other_prompt = int(mask[1, :-response_len].sum())
        assert work.num_tokens == prompt + sum(responses) + other_prompt
        expected_pairs = prompt**2 + sum(2 * prompt * r + r * r for r in responses[:3]) + (other_prompt + responses[3])**2
        assert work.attention_pairs == expected_pairs
    engine.train_batch(batch, seq_mean_nll)
    assert engine.pop_work()[True].num_tokens == separate[0]
    assert engine.pop_work() == {False: ForwardWork(), True: ForwardWork()}
