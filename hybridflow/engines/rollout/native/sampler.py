"""Token choice for the native rollout: greedy, or sampling with temperature, top-k and top-p, plus the
log-prob of the chosen token under softmax(raw_logits / temperature) (before top-k/top-p, as the hf backend
and the training engine compute it).

Sampling draws by inverse CDF on a CPU (`sample_from_weights`) and by an exponential race on accelerators
(`race_from_weights`): the same distribution without the vocabulary scan. Top-p with a large vocabulary: a full
sort of (rows, vocab) costs more than the rest of a small decode step on a CPU, so the nucleus is first looked for
among the `_TOP_P_CANDIDATES` most likely tokens (a partial top-k); only rows whose nucleus is not inside that set
fall back to a full sort. The result is the same set.
"""

from __future__ import annotations

from types import ModuleType

import torch

from hybridflow.engines.rollout.base import SamplingParams

_TOP_P_CANDIDATES = 1024


def compute_token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[token].

    logits: (rows, vocab) float32; tokens: (rows,) int64 -> (rows,) float32.
    """
    scaled = logits / temperature if temperature != 1.0 else logits
    picked = scaled.gather(1, tokens[:, None]).squeeze(1)
    return picked - torch.logsumexp(scaled, dim=-1)


def _nucleus_mask(sorted_log_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """True for tokens outside the nucleus (the smallest prefix of mass >= top_p; the first token is kept),
    as transformers' `TopPLogitsWarper` decides.

    sorted_log_probs: (rows, k) normalised over the whole vocabulary, descending -> (rows, k) bool.
    """
    probs = sorted_log_probs.exp()
    mass_before = torch.cumsum(probs, dim=-1) - probs
    return mass_before >= top_p


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the top-p nucleus to -inf (in place). logits: (rows, vocab) -> the same tensor."""
    total = torch.logsumexp(logits, dim=-1, keepdim=True)
    k = min(_TOP_P_CANDIDATES, logits.size(-1))
    top_logits, top_ids = torch.topk(logits, k, dim=-1)
    covered = torch.exp(torch.logsumexp(top_logits, dim=-1) - total.squeeze(-1)) >= top_p
    rows = covered.nonzero().squeeze(1)
    if rows.numel():  # nucleus inside the candidates: keep only its tokens
        keep = ~_nucleus_mask(top_logits[rows] - total[rows], top_p)
        kept = torch.full_like(logits[rows], float("-inf"))
        kept.scatter_(1, top_ids[rows], torch.where(keep, top_logits[rows], float("-inf")))
        logits[rows] = kept
    rest = (~covered).nonzero().squeeze(1)
    if rest.numel():
        sorted_logits, sorted_ids = torch.sort(logits[rest], dim=-1, descending=True)
        drop = _nucleus_mask(sorted_logits - total[rest], top_p)
        logits[rest] = logits[rest].scatter(1, sorted_ids, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set logits below the k-th largest to -inf (in place). logits: (rows, vocab) -> the same tensor."""
    if top_k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
    return logits.masked_fill_(logits < kth, float("-inf"))


def sample_from_weights(weights: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability proportional to `weights` (consumed: cumsum in place).

    Inverse-CDF sampling with one uniform number per row: on a CPU `torch.multinomial` over a 49k vocabulary
    costs several times more than a decode step's sampling should (measured in docs/performance.md).
    `searchsorted(..., right=True)` returns the first index whose cumulative weight exceeds the draw, so an
    index of weight 0 is never chosen. weights: (rows, vocab) float32 >= 0 -> (rows,) int64.
    """
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1:]
    draw = torch.rand(total.shape, device=weights.device, dtype=weights.dtype) * total
    draw = torch.minimum(draw, torch.nextafter(total, torch.zeros_like(total)))  # u * total may round up
    return torch.searchsorted(cdf, draw, right=True).squeeze(1)


def race_from_weights(weights: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability proportional to `weights` (consumed: divided in place), by an
    exponential race: index i arrives at time E_i / w_i with E_i ~ Exp(1) independent, so the first arrival,
    argmax w_i / E_i, is i with probability w_i / sum(w). It is what vLLM samples with.

    No scan over the vocabulary: one random fill, one division and an argmax, all elementwise or reductions. On an
    H200 the inverse CDF's `cumsum` over qwen2's 152k vocabulary took 0.22 ms of a 5.1 ms decode step
    (docs/performance.md), many times its memory-bandwidth time. On a CPU the scan is cheap and the compiled kernel
    samples in one pass, so CPUs keep the inverse CDF. An index of weight 0 is never chosen: E is kept above 0, so
    w / E is 0 for it and positive for the largest weight. weights: (rows, vocab) float32 >= 0 -> (rows,) int64.
    """
    arrivals = torch.empty_like(weights).exponential_().clamp_min_(torch.finfo(weights.dtype).tiny)
    return weights.div_(arrivals).argmax(dim=-1)


def draw_for(device: torch.device):
    """The draw a device samples with: the inverse CDF on a CPU, the exponential race elsewhere."""
    return sample_from_weights if device.type == "cpu" else race_from_weights


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, kernels: ModuleType | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row and report its log-prob.

    logits: (rows, vocab) float32 raw logits -> tokens (rows,) int64, log_probs (rows,) float32.
    Sampling uses the global torch RNG (seed it with `torch.manual_seed` for reproducible runs).
    kernels: the compiled CPU kernels; plain temperature sampling of CPU float32 logits then runs in one
    pass per row (`sample_rows`, the same inverse-CDF rule and the same uniform draws).
    """
    plain = params.do_sample and params.top_k <= 0 and params.top_p >= 1.0
    if kernels is not None and plain and logits.device.type == "cpu" and logits.dtype == torch.float32:
        uniforms = torch.rand(logits.size(0), dtype=torch.float32)
        return kernels.sample_rows(logits.contiguous(), float(params.temperature), uniforms)
    if not params.do_sample:
        tokens = logits.argmax(dim=-1)
        return tokens, compute_token_log_probs(logits, tokens, params.log_prob_temperature)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    top = scaled.max(dim=-1, keepdim=True).values  # the most likely token survives every filter
    if params.top_k > 0 or params.top_p < 1.0:
        filtered = scaled.clone()
        if params.top_k > 0:
            apply_top_k(filtered, params.top_k)
        if params.top_p < 1.0:
            apply_top_p(filtered, params.top_p)
        log_normalizer = torch.logsumexp(scaled, dim=-1, keepdim=True)
        weights = filtered.sub_(top).exp_()
    else:
        weights = (scaled - top).exp_()
        log_normalizer = top + weights.sum(dim=-1, keepdim=True).log()
    tokens = draw_for(weights.device)(weights)
    picked = scaled.gather(1, tokens[:, None])
    return tokens, (picked - log_normalizer).squeeze(1)
