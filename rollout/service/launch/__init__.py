"""Starting a worker (`rollout-worker`), in the order it happens: `cli.py` parses the flags (`flags.py` says what
they mean, without torch; `speculative_flags.py` the speculative decoding ones), `rollout.service.address_checks` checks the addresses it will listen on, `preload_checks.py` checks what small files tell (the context, adapter ranks), `loading.py` loads
the device, model and tokenizer, `startup.py` builds the engine, sockets and servers (`start_adapters.py`: the --lora adapters served from the start), and `cache_capacity.py` says what
the KV cache holds."""
