"""Weights from the trainer to the workers, in the order a push passes: `sync_callback.py` (a transformers callback
that pushes after each step), `weight_sync.py` (`push_weights`), `adapter_mode.py` (a PEFT model's adapter alone, or
merged; `trainer_bridge.trained_base`: what of its base trains beside the adapter), `trainer_bridge.gathering` (the trainer's tensors gathered: ZeRO-3, FSDP2, PEFT), `lora_push.py` (an adapter's
tensors), `wire_specs.py` (the tensors a push announces, checked against the workers'), `push.py` (one push: begin,
buckets, commit, over a transport), `push_links.py` (its links to the workers), `commit_outcome.py` (what the
workers' answers to its commit add up to), over the client's update channel
(`trainer_bridge.client.update_channel`); `adapter_unload.py` (`unload_adapter`: a pushed adapter stops serving)."""
