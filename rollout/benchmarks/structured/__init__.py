"""`rollout-bench structured`: what structured outputs cost.

- `structured_flags.py`: the flags; `structured.py`: the run;
- `grammar_engines.py`: xgrammar against llguidance; `bench_tokenizer.py`: a production-sized vocabulary, in code.
"""
