"""Sampling: one step's logits to tokens and log-probs, each sample with its own parameters (`sampler.py`).

The parameters live on the device in per-slot tables (`slots.py`, the token-dependent state in `slot_state.py`), and
a step gathers its rows' columns (`slot_columns.py`). The pipeline, in order:

- `logit_bias.py`: `logit_bias` added to the model's logits;
- penalties (in `sampler.py`), then `ban_lists.py` / `ban_masks.py`: the tokens each sample bans, as lists and as
  one mask per step;
- `warpers.py`: temperature, top_k, top_p, min_p, typical_p and the rest;
- `draw.py`: the seeded draw, one counter-based uniform number per row;
- `sampled_logprobs.py`: the drawn tokens' log-probs, in each row's `logprob_mode`, and top entries (equal scores
  ranked by token id whatever else the step asks);
- `sampler_graphs.py`: the pass captured as a CUDA graph, replayed in one launch where it fits;
- `pending_samples.py`: the sampled tokens on their way to the host; `broken_samples.py`: samples whose logits turned
  non-finite;
- `prompt_logprobs.py`: prompt log-probs from the prefill; `fp32_head.py`: the output head in fp32.
"""
