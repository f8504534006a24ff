"""Structured outputs on xgrammar:

- `vocabulary.py`: the vocabulary grammars are matched over (the tokenizer's, its special tokens never text);
- `checks.py`: constraints that compile but can never be followed, refused before a request is admitted;
- `cache.py`: a tokenizer's compiled grammars, least recently used evicted past a byte budget;
- `constraints.py`: a request's matcher, and the token masks the sampler applies each step;
- `cpu_bounds.py`: the CPU time following a sample's grammar may take before the sample is ended;
- `length_goal.py`: short of min_new_tokens, masks pruned of the tokens after which every path ends too soon.
"""
