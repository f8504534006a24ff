"""Speculative decoding (`ContinuousBatchingConfig(speculative="suffix")`), in the order a drafted step passes:

- `suffix_pool.py`: one prompt's samples (its group's, earlier rounds') indexed for proposals;
- `drafter.py`: `SuffixDrafter`, which proposes drafts for thin decoding batches, where they pay;
- `verify.py`: the drafted step's verification, drawing each token as plain decoding would.
"""
