"""Batch-invariant computation: a token's logits computed bit for bit the same whatever else is in the batch, however
its sequence is padded, and whatever the process's thread count. Used by the trainer (`trainer_bridge.batch_invariant`)
so that its forward over a padded batch equals its forward over each sequence alone. In the order a forward passes
through it:

- `positions.py`: position ids numbered from each row's first unmasked token (left padding shifts nothing);
- `matmul.py`: `invariant_linear`, every projection computed row by row the same way whatever the other rows (on a
  GPU: `triton_matmul.py`, one Triton kernel of fixed tiles); `swaps.py` runs a model's `nn.Linear` modules
  through it, and its activations through `activations.py`'s position-invariant SiLU and tanh-GELU;
- `reductions.py`: the RMSNorm's last-axis mean and the log-probs' log_softmax, each row reduced alone (on a GPU:
  `triton_rows.py`);
- `attention.py`: "rollout_invariant" attention, keys split into fixed blocks counted from each row's first unmasked
  token, the softmax's sums taken block by block in order (on the CPU: `cpu_attention.py`; on a GPU:
  `triton_attention.py`);
- `cpu_check.py`: on the CPU, the products above run on this machine with the model's shapes and the process's
  thread count before anything relies on them (a mismatch is refused by name);
- `model_support.py`: models the mode cannot make bit for bit (LongRoPE, GPT-2's Conv1D, latent attention), refused
  by name;
- `mode.py`: `batch_invariant(model)`, the context manager that turns them on for one model.
"""
