"""What of a JSON schema (a request's `json` constraint, `response_format`'s schema) the grammar engine (xgrammar)
enforces, decided before anything compiles: a part it would silently drop is refused by name. In the order a schema
passes through it:

- `support.py`: `unsupported_schema_part`, the walk over every part of a schema (those its references point to
  included) and the refusals of one part's keywords (ignored ones, those beside the one keyword xgrammar follows);
- `patterns.py`: a string's `pattern` and `format`, followed alone, and lookaheads, which xgrammar drops;
- `multiples.py`: the `multipleOf` xgrammar enforces (on integers, by a small whole number, within close bounds);
- `objects.py`: object keywords whose keys xgrammar lets take another schema, or come twice;
- `branches.py`: where a `$ref` points, and whether a `oneOf`'s branches are told apart.

`rollout/constraints.py` (a `SamplingParams`' constraint fields) asks `support.py`; the engine's side is
`rollout.engine.grammar`. Nothing here imports torch, xgrammar or another part of rollout; importing this package
imports none of its modules.
"""
