"""Logprob fidelity against the trainer, judged on a model with realistic entropy and against the trainer's own floor.

- A random model's logits are near-uniform (about ln(vocab) nats of entropy), which hides any mismatch: every token
  gets about the same logprob whatever the kernels did. `scale_to_entropy` scales the logits (through the final
  norm's weight, so tied input embeddings stay as they are) until the model's mean next-token entropy is 1-2 nats,
  as a trained model's is.
- The reference is the trainer's forward: a teacher-forced transformers forward over prompt + completion, in the
  model's dtype, with the trainer's head dtype (`fp32_head`, what TRL's `cast_lm_head_to_fp32` does and rollout's
  `fp32_logits` pairs with).
- The floor is what the trainer itself cannot tell apart: the same model's |delta| between its padded-batch forward
  (TRL's layout: prompts left-padded, completions right-padded) and its one-sequence forward over the same tokens. rollout is within it when its |delta| against the one-sequence
  forward is no larger, in mean and p99.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rollout.engine.sampling.fp32_head import fp32_projection

TARGET_ENTROPY_NATS = 1.5


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The norm right before the output head (Llama-family decoders call it `norm`), if the model has one."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    return norm if getattr(norm, "weight", None) is not None else None


@torch.inference_mode()
def scale_to_entropy(model: torch.nn.Module, prompts: list[list[int]], target: float = TARGET_ENTROPY_NATS) -> float:
    """Scale the model's logits in place so that its mean next-token entropy over `prompts` is `target` nats.

    Args:
        model: a transformers causal LM (changed in place).
        prompts: token ids to measure the entropy on (a few hundred tokens are enough).
        target: the mean entropy wanted, in nats.
    Returns:
        The mean entropy reached.
    """
    device = next(model.parameters()).device
    logits = torch.cat([model(torch.tensor([p], device=device)).logits[0].float() for p in prompts])

    def entropy(scale: float) -> float:
        log_probs = torch.log_softmax(logits * scale, -1)
        return float(-(log_probs.exp() * log_probs).sum(-1).mean())

    low, high = 0.0, 1.0
    while entropy(high) > target and high < 1e6:  # entropy falls as the logits sharpen
        low, high = high, high * 2
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if entropy(middle) > target else (low, middle)
    scale = (low + high) / 2
    norm = _final_norm(model)
    weight = norm.weight if norm is not None else model.get_output_embeddings().weight
    weight.mul_(scale)  # logits = head(norm(h)): scaling either scales the logits exactly
    return mean_entropy(model, prompts)


@torch.inference_mode()
def mean_entropy(model: torch.nn.Module, prompts: list[list[int]]) -> float:
    """The model's mean next-token entropy over every position of `prompts`, in nats."""
    device = next(model.parameters()).device
    values = []
    for prompt in prompts:
        log_probs = torch.log_softmax(model(torch.tensor([prompt], device=device)).logits[0].float(), -1)
        values.append(-(log_probs.exp() * log_probs).sum(-1))
    return float(torch.cat(values).mean())


def _head_in_fp32(model: torch.nn.Module, fp32_head: bool):
    head = model.get_output_embeddings()
    return head.register_forward_hook(fp32_projection) if fp32_head else None


@torch.inference_mode()
def teacher_forced_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], fp32_head: bool = False
) -> torch.Tensor:
    """Log-probs of `tokens` after `prompt` from one ordinary forward of the model over that one sequence (fp32
    log_softmax of its logits, in the model's own dtype up to there; with `fp32_head`, the output projection in
    fp32, as TRL's cast_lm_head_to_fp32 does)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    hook = _head_in_fp32(model, fp32_head)
    try:
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    finally:
        if hook is not None:
            hook.remove()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device=device).unsqueeze(1))[:, 0].cpu()


@torch.inference_mode()
def padded_batch_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    fp32_head: bool = False,
    batch_size: int = 8,
) -> Iterator[torch.Tensor]:
    """Log-probs of each completion from the trainer's usual forward: batches of `batch_size` sequences laid out as
    TRL's GRPOTrainer lays them out (prompts left-padded to the longest prompt, completions right-padded, one
    attention mask, no position ids). Yields one tensor per sequence, in order."""
    device = next(model.parameters()).device
    hook = _head_in_fp32(model, fp32_head)
    try:
        for first in range(0, len(prompts), batch_size):
            batch = list(zip(prompts[first : first + batch_size], completions[first : first + batch_size]))
            prompt_width = max(len(p) for p, _ in batch)
            completion_width = max(len(c) for _, c in batch)
            rows, masks = [], []
            for prompt, completion in batch:
                left, right = prompt_width - len(prompt), completion_width - len(completion)
                rows.append([0] * left + prompt + completion + [0] * right)
                masks.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
            ids, mask = torch.tensor(rows, device=device), torch.tensor(masks, device=device)
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            for row, (_, completion) in enumerate(batch):
                # The logits that predict completion token j sit at position prompt_width - 1 + j.
                positions = logits[row, prompt_width - 1 : prompt_width - 1 + len(completion)]
                picked = torch.tensor(completion, device=device).unsqueeze(1)
                yield torch.log_softmax(positions, -1).gather(1, picked)[:, 0].cpu()
    finally:
        if hook is not None:
            hook.remove()


def summary(deltas: torch.Tensor) -> dict[str, float]:
    """Mean, p99 and max of |delta|."""
    return {
        "mean": float(deltas.mean()),
        "p99": float(torch.quantile(deltas.float(), 0.99)),
        "max": float(deltas.max()),
    }


def fidelity_against_floor(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    logprobs: list[list[float]],
    fp32_head: bool,
) -> dict[str, dict[str, float]]:
    """rollout's |delta| and the trainer's floor, both against the one-sequence teacher-forced forward.

    Args:
        model: the model that generated (its reference forward runs on it).
        prompts, completions: what was generated.
        logprobs: rollout's logprob of each completion token.
        fp32_head: the trainer's head dtype (fp32 with TRL's cast_lm_head_to_fp32).
    Returns:
        {"rollout": {mean, p99, max}, "floor": {mean, p99, max}}.
    """
    single = [teacher_forced_logprobs(model, p, c, fp32_head) for p, c in zip(prompts, completions)]
    padded = list(padded_batch_logprobs(model, prompts, completions, fp32_head))
    ours = torch.cat([(torch.tensor(lp) - ref).abs() for lp, ref in zip(logprobs, single)])
    floor = torch.cat([(pad - ref).abs() for pad, ref in zip(padded, single)])
    return {"rollout": summary(ours), "floor": summary(floor)}
