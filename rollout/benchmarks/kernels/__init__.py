"""The Triton kernel's variants, beside the tests and benchmarks that use them:

- `variants.py`: every variant the engine can launch, with the arguments of one launch;
- `compile.py`: compiling them for sm_90 and sm_80 without a GPU, checking shared memory
  (`python -m rollout.benchmarks.kernels.compile`).
"""
