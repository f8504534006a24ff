"""Modules that moved to a new home keep their old import paths, with a `DeprecationWarning` naming the new one.

`import rollout.service.protocol` (or `from rollout.service.presets import tiny_model`) still works: a finder on
`sys.meta_path` answers each old name with the module now at its new name (the same module object, so its state and
its classes are shared). `rollout/__init__.py` installs the finder, so every path under `rollout` and
`trainer_bridge` is covered once either package is imported (`trainer_bridge` imports `rollout`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# Old module name -> where it lives now. Every entry is a path a release documented or a user could have imported.
MOVED_MODULES: dict[str, str] = {
    # the wire contract, shared by the worker and the trainer side
    "rollout.service.protocol": "rollout.protocol",
    "rollout.service.messages": "rollout.protocol.messages",
    "rollout.service.codec": "rollout.protocol.codec",
    "rollout.service.route_frames": "rollout.protocol.reply_frames",
    "rollout.protocol.route_frames": "rollout.protocol.reply_frames",
    "rollout.service.sockets": "rollout.protocol.sockets",
    "rollout.service.auth": "rollout.protocol.auth",
    "rollout.service.staging": "rollout.protocol.staging",
    "rollout.service.dist": "rollout.protocol.dist",
    "rollout.service.groups": "rollout.protocol.group_folding",
    # the built-in presets' public home
    "rollout.service.presets": "rollout.presets",
    "rollout.service.preset_catalog": "rollout.presets.catalog",
    "rollout.service.preset_names": "rollout.presets.names",
    "rollout.service.agent_preset": "rollout.presets.agent",
    # the worker's subsystems, each a folder
    "rollout.service.cli": "rollout.service.launch.cli",
    "rollout.service.worker_flags": "rollout.service.launch.flags",
    "rollout.service.startup": "rollout.service.launch.startup",
    "rollout.service.loading": "rollout.service.launch.loading",
    "rollout.service.cache_capacity": "rollout.service.launch.cache_capacity",
    "rollout.service.worker": "rollout.service.zmq.worker",
    "rollout.service.clients": "rollout.service.zmq.clients",
    "rollout.service.group_desk": "rollout.service.zmq.group_desk",
    "rollout.service.fair_queue": "rollout.service.compile.fair_queue",
    "rollout.service.limits": "rollout.service.zmq.limits",
    "rollout.service.updates": "rollout.service.weights.update_slot",
    "rollout.service.adapter_updates": "rollout.service.weights.adapter_checks",
    "rollout.service.jobs": "rollout.service.weights.jobs",
    "rollout.service.compile_child": "rollout.service.compile.child",
    "rollout.service.compile_frames": "rollout.service.compile.frames",
    "rollout.service.compile_jobs": "rollout.service.compile.jobs",
    "rollout.service.compile_link": "rollout.service.compile.link",
    "rollout.service.compile_server": "rollout.service.compile.server",
    "rollout.service.constraint_compiles": "rollout.service.compile.constraint_compiles",
    "rollout.service.metrics": "rollout.service.observability.metrics",
    "rollout.service.metrics_server": "rollout.service.observability.metrics_server",
    "rollout.service.tracing": "rollout.service.observability.tracing",
    "rollout.service.http.launch": "rollout.service.http.serving.launch",
    "rollout.service.http.settings": "rollout.service.http.serving.settings",
    "rollout.service.http.server": "rollout.service.http.serving.server",
    "rollout.service.http.connections": "rollout.service.http.serving.connections",
    "rollout.service.http.bodies": "rollout.service.http.serving.bodies",
    "rollout.service.http.guard": "rollout.service.http.serving.guard",
    "rollout.service.http.request_metrics": "rollout.service.http.serving.request_metrics",
    "rollout.service.http.app": "rollout.service.http.serving.app",
    "rollout.service.http.endpoints": "rollout.service.http.api.endpoints",
    "rollout.service.http.openai_fields": "rollout.service.http.api.openai_fields",
    "rollout.service.http.prompts": "rollout.service.http.api.prompts",
    "rollout.service.http.template_inputs": "rollout.service.http.api.template_inputs",
    "rollout.service.http.structured_fields": "rollout.service.http.api.structured_fields",
    "rollout.service.http.constraint_wait": "rollout.service.http.api.constraint_wait",
    "rollout.service.http.bridge": "rollout.service.http.api.bridge",
    "rollout.service.http.choices": "rollout.service.http.api.choices",
    "rollout.service.http.answer_size": "rollout.service.http.api.answer_size",
    "rollout.service.http.prompt_scoring": "rollout.service.http.api.prompt_scoring",
    "rollout.service.http.served_models": "rollout.service.http.api.served_models",
    "rollout.service.http.tokenize": "rollout.service.http.api.tokenize",
    "rollout.service.http.chat_tools": "rollout.service.http.tools.chat_tools",
    "rollout.service.http.tool_calls": "rollout.service.http.tools.tool_calls",
    "rollout.service.http.tool_call_stream": "rollout.service.http.tools.tool_call_stream",
    # the trainer side's subsystems
    "trainer_bridge.trl_async": "trainer_bridge.trl.async_mode",
    "trainer_bridge.trl_colocated": "trainer_bridge.trl.colocated_mode",
    "trainer_bridge.trl_generation": "trainer_bridge.trl.generation",
    "trainer_bridge.trl_partial": "trainer_bridge.trl.partial",
    "trainer_bridge.trl_routes": "trainer_bridge.trl.routes",
    "trainer_bridge.trl_settings": "trainer_bridge.trl.settings",
    "trainer_bridge.push": "trainer_bridge.weights.push",
    "trainer_bridge.push_links": "trainer_bridge.weights.push_links",
    "trainer_bridge.weight_sync": "trainer_bridge.weights.weight_sync",
    "trainer_bridge.lora_push": "trainer_bridge.weights.lora_push",
    "trainer_bridge.adapter_mode": "trainer_bridge.weights.adapter_mode",
    "trainer_bridge.sync_callback": "trainer_bridge.weights.sync_callback",
    "trainer_bridge.calls": "trainer_bridge.client.calls",
    "trainer_bridge.commands": "trainer_bridge.client.commands",
    "trainer_bridge.dispatcher": "trainer_bridge.client.dispatcher",
    "trainer_bridge.liveness": "trainer_bridge.client.liveness",
    "trainer_bridge.routing": "trainer_bridge.client.routing",
    "trainer_bridge.affinity": "trainer_bridge.client.affinity",
    "trainer_bridge.links": "trainer_bridge.client.links",
    "trainer_bridge.update_channel": "trainer_bridge.client.update_channel",
    # the engine's subsystems (the old modules rollout.engine.attention, .grammar, .lora and .manager are now the
    # packages of those names: rollout.engine.manager still exports the manager)
    "rollout.engine.request": "rollout.engine.requests.request",
    "rollout.engine.intake": "rollout.engine.requests.intake",
    "rollout.engine.outputs": "rollout.engine.requests.outputs",
    "rollout.engine.adapter_ref": "rollout.engine.requests.adapter_ref",
    "rollout.engine.route_rows": "rollout.engine.requests.route_rows",
    "rollout.engine.scheduler": "rollout.engine.scheduling.scheduler",
    "rollout.engine.batch": "rollout.engine.scheduling.batch",
    "rollout.engine.block_manager": "rollout.engine.scheduling.block_manager",
    "rollout.engine.admission": "rollout.engine.scheduling.admission",
    "rollout.engine.kv_cache": "rollout.engine.kv.kv_cache",
    "rollout.engine.block_tables": "rollout.engine.kv.block_tables",
    "rollout.engine.transfer": "rollout.engine.kv.transfer",
    "rollout.engine.attention_plan": "rollout.engine.attention.kernel_plan",
    "rollout.engine.triton_attention": "rollout.engine.attention.triton_kernel",
    "rollout.engine.model_runner": "rollout.engine.runner.model_runner",
    "rollout.engine.model_checks": "rollout.engine.runner.model_checks",
    "rollout.engine.model_lease": "rollout.engine.runner.model_lease",
    "rollout.engine.cuda_graphs": "rollout.engine.runner.cuda_graphs",
    "rollout.engine.sampler": "rollout.engine.sampling.sampler",
    "rollout.engine.sampling_slots": "rollout.engine.sampling.slots",
    "rollout.engine.slot_columns": "rollout.engine.sampling.slot_columns",
    "rollout.engine.slot_state": "rollout.engine.sampling.slot_state",
    "rollout.engine.slot_bias": "rollout.engine.sampling.logit_bias",
    "rollout.engine.slot_bans": "rollout.engine.sampling.ban_masks",
    "rollout.engine.token_bans": "rollout.engine.sampling.ban_lists",
    "rollout.engine.warpers": "rollout.engine.sampling.warpers",
    "rollout.engine.draw": "rollout.engine.sampling.draw",
    "rollout.engine.pending_samples": "rollout.engine.sampling.pending_samples",
    "rollout.engine.broken_samples": "rollout.engine.sampling.broken_samples",
    "rollout.engine.prompt_logprobs": "rollout.engine.sampling.prompt_logprobs",
    "rollout.engine.fp32_head": "rollout.engine.sampling.fp32_head",
    "rollout.engine.grammar_cache": "rollout.engine.grammar.cache",
    "rollout.engine.grammar_checks": "rollout.engine.grammar.checks",
    "rollout.engine.lora_bounds": "rollout.engine.lora.bounds",
    "rollout.engine.lora_layers": "rollout.engine.lora.layers",
    "rollout.engine.lora_weights": "rollout.engine.lora.adapter_weights",
    "rollout.engine.saved_head": "rollout.engine.lora.saved_head",
    "rollout.engine.saved_modules": "rollout.engine.lora.saved_modules",
    "rollout.engine.routes": "rollout.engine.moe.routes",
    "rollout.engine.router_taps": "rollout.engine.moe.router_taps",
    "rollout.engine.engine_weights": "rollout.engine.weights.weight_updates",
    "rollout.engine.weight_table": "rollout.engine.weights.weight_table",
    "rollout.engine.commit_modes": "rollout.engine.weights.commit_modes",
    "rollout.engine.manager_requests": "rollout.engine.manager.request_desk",
    "rollout.engine.manager_weights": "rollout.engine.manager.weight_queue",
    "rollout.engine.manager.request_api": "rollout.engine.manager.request_desk",
    "rollout.engine.manager.weight_api": "rollout.engine.manager.weight_queue",
    "rollout.engine.engine_loop": "rollout.engine.manager.engine_thread",
    "rollout.engine.commands": "rollout.engine.manager.commands",
    "rollout.engine.pause": "rollout.engine.manager.pause",
    "rollout.engine.results": "rollout.engine.manager.results",
    "rollout.engine.weight_queue": "rollout.engine.manager.weight_queue",
    "rollout.engine.kernel_variants": "rollout.benchmarks.kernels.variants",
    "rollout.engine.kernel_compile": "rollout.benchmarks.kernels.compile",
    # what every console script shares
    "rollout.cli_parser": "rollout.cli.parser",
    "rollout.batch_config_flags": "rollout.cli.batch_config_flags",
    "rollout.extras": "rollout.cli.extras",
    "rollout.hub": "rollout.cli.hub",
    # what of a JSON schema the grammar engine enforces
    "rollout.schema_support": "rollout.json_schema.support",
    "rollout.schema_branches": "rollout.json_schema.branches",
}


class MovedModuleLoader(importlib.abc.Loader):
    """Loads an old module name as the module at its new name."""

    def __init__(self, new_name: str):
        """
        Args:
            new_name: the module's name now.
        """
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new_name}: import it from there (the old path will be removed)",
            DeprecationWarning,
            stacklevel=find_caller_level(),
        )
        return importlib.import_module(self.new_name)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at its new name is already executed."""


def find_caller_level() -> int:
    """The `stacklevel` of the first frame outside the import machinery (the user's import statement)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or frame.f_globals is globals()):
        frame, level = frame.f_back, level + 1
    return level


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of `MOVED_MODULES`."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec:
        new_name = MOVED_MODULES.get(fullname)
        if new_name is None:
            return None  # type: ignore[return-value]
        return importlib.machinery.ModuleSpec(fullname, MovedModuleLoader(new_name))


def install() -> None:
    """Put the finder on `sys.meta_path` (once)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
