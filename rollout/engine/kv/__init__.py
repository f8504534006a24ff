"""The paged KV cache on the device, and the copies that feed it:

- `kv_cache.py`: every layer's paged K/V tensors (sized from `num_blocks` or free memory) and the CPU swap space;
- `block_tables.py`: the running requests' block tables, one persistent host table a step gathers rows from;
- `transfer.py`: host <-> device copies that never make the host wait for the device.
"""
