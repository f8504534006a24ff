"""LoRA adapters served unmerged, several side by side in one batch:

- `adapter_files.py`: an adapter directory's files, checked before peft reads them;
- `adapter_weights.py`: one adapter's weights as the engine takes them (from peft or named tensors);
- `adapter_specs.py`: which tensors an adapter may bring (names, dtypes, shapes, ranks);
- `bounds.py`: how large adapters may be (rank, memory);
- `adapter_table.py`: the stacked layout every loaded adapter lives in; `layers.py`: the hooks of the LoRA layers;
- `saved_modules.py`, `saved_head.py`: modules an adapter trains whole (peft's `modules_to_save`).
"""
