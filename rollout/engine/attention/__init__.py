"""Paged attention, in the order a forward reaches it:

- `paged_metadata.py`: the step's plan every layer shares (cache slots, groups of sequences and their block tables);
- `paged.py`: the "rollout_paged" attention registered in transformers' `AttentionInterface`;
- `kernel_plan.py`: the launch plan of the Triton kernel (query tiles, key slices);
- `triton_kernel.py`: one Triton kernel for decode, prefill and mixed batches over the paged cache;
- `kernel_tiles.py`: the device functions the kernels are built from (a tile's rows, the online-softmax update).

Compiling the kernel's variants for sm_90 / sm_80 without a GPU lives beside the benchmarks
(`rollout.benchmarks.kernels`).
"""
