"""vLLM's control routes on the worker's HTTP API (`rollout-worker --http --enable-control-routes`), in the order a
call passes: `flags.py` (the flags, checked before the model loads), `routes.py` (pause, resume, abort, prefix cache,
server facts, weight updates from a directory; 501 for NCCL transfer), `route_params.py` (what a route may be given
beside its parameters), `allowed_dirs.py` (the directories they may read), `checkpoint_dir.py` (a checkpoint read into
one weight update), `adapter_routes.py` (LoRA adapters by path), `server_info.py` (vLLM's `vllm_config` shape). The
engine side is `manager.control` (`ServingControl`)."""
