"""The fused, chunked vocabulary projection (`use_fused_kernels`) equals the plain head: log-probs, entropy and every
parameter's gradient, in one process (padded, packed and shared-prompt forwards) and on 2 gloo ranks (FSDP, tensor
parallel with the vocabulary split, Ulysses)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridflow.engines.training import FSDPConfig, FSDPEngine, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.engines.training.chunked_projection import chunked_log_probs
from hybridflow.engines.training.vocab_parallel import token_entropy, token_log_probs
from hybridflow.models import load_tokenizer
from hybridflow.models.config import FusedKernelOptions, ModelConfig
from hybridflow.protocol import DataProto
from hybridflow.utils.device import get_dist_backend
from tests.engines.helpers import make_batch, run_distributed

TEMPERATURE = 0.7
BASE = FSDPEngineConfig(micro_batch_size_per_gpu=4, optim=OptimConfig(lr=1e-2))
LAYOUTS = {  # one process
    "padded": BASE,
    "packed": dataclasses.replace(BASE, model=ModelConfig(use_remove_padding=True)),
    "shared_prompts": dataclasses.replace(BASE, share_prompts=True),
}
TWO_RANK_LAYOUTS = {
    "fsdp_dp2": BASE,
    "tp2_padded": dataclasses.replace(BASE, fsdp=FSDPConfig(tensor_parallel_size=2)),
    "tp2_packed": dataclasses.replace(LAYOUTS["packed"], fsdp=FSDPConfig(tensor_parallel_size=2)),
    "tp2_shared_prompts": dataclasses.replace(LAYOUTS["shared_prompts"], fsdp=FSDPConfig(tensor_parallel_size=2)),
    "sp2_packed": dataclasses.replace(LAYOUTS["packed"], ulysses_sequence_parallel_size=2),
}


def _fused(config: FSDPEngineConfig, fused: bool, chunk_size: int = 5) -> FSDPEngineConfig:
    """`config` with the fused projection on (in chunks of `chunk_size` rows, several per micro-batch) or off."""
    options = FusedKernelOptions(chunk_size=chunk_size)
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, use_fused_kernels=fused, fused_kernel_options=options)
    )


def _batch(model_dir: str) -> DataProto:
    # Prompts of 1-3 tokens from 2 distinct ones: rows share prompts, so shared-prompt forwards group them.
    batch = make_batch(len(load_tokenizer(model_dir)), batch_size=4, prompt_len=7, response_len=6, seed=3)
    batch.batch["input_ids"][2:, :7] = batch.batch["input_ids"][:2, :7]
    batch.batch["attention_mask"][2:, :7] = batch.batch["attention_mask"][:2, :7]
    batch.batch["position_ids"] = (batch.batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch


def _loss(outputs: dict[str, torch.Tensor], data: dict[str, torch.Tensor]) -> torch.Tensor:
    mask = data["response_mask"].float()
    return (-(outputs["log_probs"] * mask).sum() - 0.3 * (outputs["entropy"] * mask).sum()) / mask.sum()


def _run(engine: FSDPEngine, batch: DataProto) -> dict:
    """No-grad log-probs, entropy and sums of squared probabilities, then one training forward's outputs and every
    parameter's full gradient."""
    stats = engine.compute_token_stats(
        batch, temperature=TEMPERATURE, calculate_entropy=True, calculate_sum_pi_squared=True
    )
    log_probs, entropy = engine.compute_log_prob(batch, temperature=TEMPERATURE, calculate_entropy=True)
    assert torch.equal(log_probs, stats["log_probs"]) and torch.equal(entropy, stats["entropy"])
    engine.module.train()
    data = dict(batch.batch.items())
    outputs = engine.forward_micro_batch(data, temperature=TEMPERATURE, calculate_entropy=True)
    _loss(outputs, data).backward()
    grads = {}
    for name, param in engine.module.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[name] = grad.detach().clone().cpu()
    return dict(log_probs=log_probs, entropy=entropy, sum_pi_squared=stats["sum_pi_squared"], train_log_probs=outputs["log_probs"].detach().cpu(),
                train_entropy=outputs["entropy"].detach().cpu(), grads=grads, chunked=engine.head_chunk_size)


def _assert_equal(plain: dict, fused: dict, mask: torch.Tensor) -> None:
    assert plain["chunked"] is None and fused["chunked"] == 5
    for key in ("log_probs", "entropy", "sum_pi_squared", "train_log_probs", "train_entropy"):
        torch.testing.assert_close(fused[key][mask], plain[key][mask], atol=1e-6, rtol=0, msg=key)
    assert set(fused["grads"]) == set(plain["grads"])
    # Gradients sum over every token and (for embed_tokens, tied to the head) over vocabulary chunks in another
    # order than one matmul: a few float32 ulps of the largest entries. Measured up to 1.6e-6 on the AVX2 host
    # (under 1e-6 with AVX-512); a wrong chunk or label gives errors of the gradient's own size (1e-2 and up).
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(fused["grads"][name], grad, atol=5e-6, rtol=0, msg=f"gradient of {name}")


# ----------------------------------------------------------------------------- the function itself
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("outputs", ["log_probs", "entropy", "both"])
@pytest.mark.parametrize("softcap", [None, 2.0])  # 2.0: the logits (a few units) are in tanh's bend
def test_chunked_log_probs_equal_the_plain_head_and_its_gradients(chunk_size, outputs, softcap):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=gen).requires_grad_()
    weight = (torch.randn(300, 16, generator=gen) * 0.3).requires_grad_()
    bias = torch.randn(300, generator=gen).requires_grad_()
    labels = torch.randint(0, 300, (50,), generator=gen)
    weights_lp, weights_ent = torch.randn(50, generator=gen), torch.randn(50, generator=gen)

    def objective(log_probs, entropy):
        total = 0.0
        if outputs in ("log_probs", "both"):
            total = total + (log_probs * weights_lp).sum()
        if outputs in ("entropy", "both"):
            total = total + (entropy * weights_ent).sum()
        return total

    def plain(hidden, weight, bias):
        logits = torch.nn.functional.linear(hidden, weight, bias)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits / TEMPERATURE
        if logits.dtype == torch.float64:  # the truth: the same formulas without rounding to float32
            log_probs = logits.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
            return log_probs, torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
        return token_log_probs(logits, labels), token_entropy(logits)

    inputs = (hidden, weight, bias)
    truth_inputs = tuple(t.detach().double().requires_grad_() for t in inputs)
    truth = plain(*truth_inputs)
    truth_grads = torch.autograd.grad(objective(*truth), truth_inputs)
    expected = plain(*inputs)
    expected_grads = torch.autograd.grad(objective(*expected), inputs)
    got = chunked_log_probs(
        hidden, weight, labels, bias=bias, temperature=TEMPERATURE, chunk_size=chunk_size, calculate_entropy=True,
        softcap=softcap,
    )
    got_grads = torch.autograd.grad(objective(*got), inputs)
    # float32 log-probs and entropies of a few units: 1e-6 is a few ulps
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-6)
    # Gradients of O(10) summed over 50 rows in another order differ by float32 rounding (~1e-6): each must be as
    # close to the float64 gradient as the plain head's is.
    for name, a, b, exact in zip(("hidden", "weight", "bias"), got_grads, expected_grads, truth_grads):
        chunked_error = (a.double() - exact).abs().max().item()
        plain_error = (b.double() - exact).abs().max().item()
        assert chunked_error <= 2 * plain_error + 1e-6, f"gradient of {name}: {chunked_error:.3g} vs {plain_error:.3g}"
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"gradient of {name}")


def test_chunked_log_probs_without_entropy_and_bad_shapes():
    hidden, weight, labels = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 9])
    log_probs, entropy = chunked_log_probs(hidden, weight, labels, chunk_size=3)
    assert entropy is None
    torch.testing.assert_close(log_probs, token_log_probs(hidden @ weight.t(), labels))
    # a frozen head (LoRA): only the hidden states get a gradient
    hidden.requires_grad_()
    (grad,) = torch.autograd.grad(chunked_log_probs(hidden, weight, labels, chunk_size=3)[0].sum(), hidden)
    (expected,) = torch.autograd.grad(token_log_probs(hidden @ weight.t(), labels).sum(), hidden)
    torch.testing.assert_close(grad, expected)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_log_probs(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match=r"\(N, H\)"):
        chunked_log_probs(hidden[None], weight, labels)


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes of the operands of every matrix product dispatched while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            self.seen += [(str(func.overloadpacket), a.dtype) for a in operands[-2:]]
        return func(*args, **(kwargs or {}))


def test_backward_runs_its_products_in_the_autocast_dtype_with_float32_weights():
    """Float32 master weights under bf16 autocast (one GPU without FSDP): the backward's vocabulary products run in
    bf16 like autocast's own linear backward (float32 there takes the slow non-tensor-core kernels), and the
    gradients are as close to float64 as the plain autocast head's."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 32, generator=gen).requires_grad_()
    weight = (torch.randn(500, 32, generator=gen) * 0.2).requires_grad_()
    labels = torch.randint(0, 500, (40,), generator=gen)
    coefficients = torch.randn(40, generator=gen)

    def grads(fn, *inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            log_probs, entropy = fn(*inputs)
        objective = (log_probs * coefficients).sum() + 0.1 * entropy.sum()
        with _MatmulDtypes() as dtypes:
            result = torch.autograd.grad(objective, inputs)
        return result, dtypes.seen

    def plain(hidden, weight):
        logits = torch.nn.functional.linear(hidden, weight).float()
        return token_log_probs(logits, labels), token_entropy(logits)

    def chunked(hidden, weight):
        return chunked_log_probs(hidden, weight, labels, chunk_size=16, calculate_entropy=True)

    (got_hidden, got_weight), seen = grads(chunked, hidden, weight)
    assert seen and all(dtype == torch.bfloat16 for _, dtype in seen), seen
    assert got_hidden.dtype == got_weight.dtype == torch.float32
    (plain_hidden, plain_weight), _ = grads(plain, hidden, weight)
    truth = grads(lambda h, w: plain(h.double(), w.double()), hidden, weight)[0]
    for got, reference, exact in ((got_hidden, plain_hidden, truth[0]), (got_weight, plain_weight, truth[1])):
        error, reference_error = ((t - exact).abs().max().item() for t in (got, reference))
        assert error <= 2 * reference_error + 1e-3, (error, reference_error)
    # without autocast the products stay in float32 and equal the plain head to float32 rounding
    log_probs, entropy = chunked_log_probs(hidden, weight, labels, chunk_size=16, calculate_entropy=True)
    with _MatmulDtypes() as dtypes:
        torch.autograd.grad((log_probs * coefficients).sum() + 0.1 * entropy.sum(), (hidden, weight))
    assert {dtype for _, dtype in dtypes.seen} == {torch.float32}


# ----------------------------------------------------------------------------- the engine, one process
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_head_equals_plain_head_in_one_process(tiny_llama_dir, layout):
    batch = _batch(tiny_llama_dir)
    results = {}
    for fused in (False, True):
        torch.manual_seed(0)
        results[fused] = _run(build_fsdp_engine(tiny_llama_dir, _fused(LAYOUTS[layout], fused)), batch)
    _assert_equal(results[False], results[True], batch.batch["response_mask"].bool())
    _assert_sum_pi_squared_is_the_models(tiny_llama_dir, batch, results[False], batch.batch["response_mask"].bool())


def _assert_sum_pi_squared_is_the_models(model_dir: str, batch: DataProto, result: dict, mask: torch.Tensor) -> None:
    """sum_v pi_v^2 of each response position equals the one computed from the HF model's own logits (padded
    forward, one process, float64 softmax): the engine's layouts, heads and vocabulary splits all compute it."""
    from hybridflow.models import build_causal_lm

    model = build_causal_lm(model_dir).eval()
    width = batch.batch["responses"].size(1)
    rows = mask.size(0)
    with torch.no_grad():
        logits = model(
            input_ids=batch.batch["input_ids"][:rows], attention_mask=batch.batch["attention_mask"][:rows],
            position_ids=batch.batch["position_ids"][:rows],
        ).logits[:, -width - 1 : -1].double() / TEMPERATURE
    expected = torch.softmax(logits, dim=-1).pow(2).sum(-1).float()
    assert (expected[mask] < 0.99).all()  # a spread distribution: not a trivial 1
    torch.testing.assert_close(result["sum_pi_squared"][mask], expected[mask], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- the engine, 2 ranks
def _scenario(rank: int, world_size: int, model_dir: str, out_file: str) -> None:
    batch = _batch(model_dir)
    results = {}
    for name, config in TWO_RANK_LAYOUTS.items():
        data = batch.chunk(world_size)[rank] if name == "fsdp_dp2" else batch
        for fused in (False, True):
            torch.manual_seed(0)
            results[name, fused] = _run(build_fsdp_engine(model_dir, _fused(config, fused)), data)
    if rank == 0:
        torch.save(results, out_file)


@pytest.fixture(scope="module")
def two_rank_results(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("chunked") / "results.pt"
    run_distributed(_scenario, 2, tiny_llama_dir, str(out), backend=get_dist_backend())
    return torch.load(out, weights_only=False)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="2 ranks need 2 GPUs")
@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_fused_head_equals_plain_head_on_two_ranks(tiny_llama_dir, two_rank_results, layout):
    mask = _batch(tiny_llama_dir).batch["response_mask"].bool()
    if layout == "fsdp_dp2":  # rank 0 holds the first half of the rows
        mask = mask[: mask.size(0) // 2]
    _assert_equal(two_rank_results[layout, False], two_rank_results[layout, True], mask)
    batch = _batch(tiny_llama_dir)
    _assert_sum_pi_squared_is_the_models(tiny_llama_dir, batch, two_rank_results[layout, True], mask)
