"""What a caller asks of the engine and gets back, in that order:

- `group_spec.py`: `GroupSpec`, one group as a caller asks for it (every way in builds one);
- `intake.py`: a `GroupSpec` checked against the model and resolved into the group's leader (its prompt read by
  `prompt_ids.py`, settings given as keywords merged by `keyword_fields.py`; bans that leave nothing to draw first
  refused by `bans.py`);
- `request.py`: one sample being generated (`Request`), with the adapter it is served with (`adapter_ref.py`) and the
  MoE routes it recorded (`route_rows.py`);
- `outputs.py`: `GenerationOutput`, what one sample produced.
"""
