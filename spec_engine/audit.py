"""Token-forcing audit: is a decoding system lossless with respect to its target?

Benchmark accuracy cannot tell a lossless system from a subtly biased one. Instead each output is
teacher-forced through a scorer (the target with an FP32 LM head): a *mismatch* is an output token
that differs from the scorer's argmax given the same prefix, its *margin* the log-prob gap to that
argmax. An autoregressive baseline run of the stock target is scored the same way; it mismatches too
(near-ties broken differently by kernel rounding). The verdict (BACKGROUND.md, "Token forcing"):

* delta = the baseline's largest first-divergence margin rounded up to a multiple of 1/8 (at least 1/8);
* reject if the system's mismatch rate exceeds the baseline's by more than 0.5 points, or if the
  system has more large mismatches (margin >= 2 delta) than the baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .verify import CausalLM, head_weight


@dataclass
class ForcedSequence:
    tokens: int
    mismatch_positions: list[int]
    mismatch_margins: list[float]  # nats, >= 0
    min_top2_gap: float  # smallest gap between the scorer's best and second-best log-prob over the output

    @property
    def first_divergence_margin(self) -> float | None:
        return self.mismatch_margins[0] if self.mismatch_margins else None


@dataclass
class ForcingStats:
    sequences: list[ForcedSequence] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sequences)

    @property
    def mismatches(self) -> int:
        return sum(len(s.mismatch_positions) for s in self.sequences)

    @property
    def rate(self) -> float:
        return self.mismatches / max(1, self.tokens)

    @property
    def margins(self) -> list[float]:
        return [m for s in self.sequences for m in s.mismatch_margins]

    @property
    def max_first_divergence_margin(self) -> float:
        firsts = [s.first_divergence_margin for s in self.sequences if s.first_divergence_margin is not None]
        return max(firsts, default=0.0)

    def large(self, threshold: float) -> int:
        return sum(1 for m in self.margins if m >= threshold)

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "mismatches": self.mismatches,
            "mismatch_rate": self.rate,
            "max_margin": max(self.margins, default=0.0),
            "max_first_divergence_margin": self.max_first_divergence_margin,
        }


@dataclass
class Verdict:
    lossless: bool
    reasons: list[str]
    delta: float
    system: dict
    baseline: dict

    def as_dict(self) -> dict:
        return {
            "verdict": "accept" if self.lossless else "reject",
            "reasons": self.reasons,
            "delta": self.delta,
            "system": self.system,
            "baseline": self.baseline,
        }


class Scorer:
    """The target run causally over prompt + output, its LM head applied in FP32."""

    def __init__(self, model):
        self.lm = CausalLM(model)

    @torch.no_grad()
    def force(self, prompt_ids: torch.Tensor, output_ids: torch.Tensor) -> ForcedSequence:
        prompt_ids = torch.as_tensor(prompt_ids).reshape(-1).long()
        output_ids = torch.as_tensor(output_ids).reshape(-1).long()
        if prompt_ids.numel() == 0:
            raise ValueError("Scorer.force: empty prompt")
        n = output_ids.numel()
        if n == 0:
            return ForcedSequence(0, [], [], math.inf)
        dev = self.lm.device
        seq = torch.cat([prompt_ids, output_ids[:-1]]).to(dev).view(1, -1)
        cache = self.lm.new_cache(seq.shape[1] + 1)
        hidden = self.lm.prefill(cache, seq)[0, prompt_ids.numel() - 1 :]  # rows that predict the output
        w = head_weight(self.lm.lm_head).float()
        b = getattr(self.lm.lm_head, "bias", None)
        logp = torch.log_softmax(torch.nn.functional.linear(hidden.float(), w, None if b is None else b.float()), -1)
        top2 = torch.topk(logp, 2, dim=-1)
        best = top2.indices[:, 0]
        out = output_ids.to(dev)
        margins = top2.values[:, 0] - logp.gather(1, out.view(-1, 1)).squeeze(1)
        mism = (best != out).nonzero().flatten().tolist()
        gaps = top2.values[:, 0] - top2.values[:, 1]
        return ForcedSequence(n, mism, [float(margins[i]) for i in mism], float(gaps.min()))

    def force_all(self, prompts, outputs) -> ForcingStats:
        if len(prompts) != len(outputs):
            raise ValueError(f"Scorer.force_all: {len(prompts)} prompts but {len(outputs)} outputs")
        return ForcingStats([self.force(p, o) for p, o in zip(prompts, outputs)])


def verdict(system: ForcingStats, baseline: ForcingStats, rate_tolerance: float = 0.005) -> Verdict:
    delta = max(0.125, math.ceil(baseline.max_first_divergence_margin * 8) / 8)
    large_sys, large_base = system.large(2 * delta), baseline.large(2 * delta)
    reasons = []
    if system.rate > baseline.rate + rate_tolerance:
        reasons.append(f"mismatch rate {system.rate:.4%} > baseline {baseline.rate:.4%} + {rate_tolerance:.2%}")
    if large_sys > large_base:
        reasons.append(f"{large_sys} mismatches with margin >= {2 * delta:.3f} nat vs {large_base} in the baseline")
    sys_d, base_d = system.as_dict(), baseline.as_dict()
    sys_d["large_mismatches"], base_d["large_mismatches"] = large_sys, large_base
    return Verdict(not reasons, reasons, delta, sys_d, base_d)


def audit(model, prompts, system_outputs, baseline_outputs, rate_tolerance: float = 0.005) -> Verdict:
    """Force both systems' outputs through the target (FP32 head) and compare (see module doc)."""
    scorer = Scorer(model)
    return verdict(
        scorer.force_all(prompts, system_outputs), scorer.force_all(prompts, baseline_outputs), rate_tolerance
    )
