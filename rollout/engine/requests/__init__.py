"""What a caller asks of the engine and gets back, in that order:

- `intake.py`: a prompt and its settings checked against the model and resolved into a group's leader;
- `request.py`: one sample being generated (`Request`), with the adapter it is served with (`adapter_ref.py`) and the
  MoE routes it recorded (`route_rows.py`);
- `outputs.py`: `GenerationOutput`, what one sample produced.
"""
