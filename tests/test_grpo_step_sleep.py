"""`rollout-bench grpo-step` on CUDA measures what each colocated `sleep()` frees by wrapping the engine's `sleep`
(`step_system._measured_sleep`); the wrapper must take what the trainer's own calls pass, such as the end of
`train()`'s `sleep(graphs=True)` (`ColocatedGeneration.close`), or the benchmark's `train()` raises after its steps."""

from __future__ import annotations

from types import SimpleNamespace

from rollout import ContinuousBatchingConfig
from rollout.benchmarks.grpo.step_system import _measured_sleep
from rollout.presets import tiny_model
from trainer_bridge import ColocatedEngine
from trainer_bridge.trl.colocated_mode import ColocatedGeneration


def test_the_measured_sleep_takes_the_end_of_trains_sleep_and_records_a_rounds():
    engine = ColocatedEngine(tiny_model(0), ContinuousBatchingConfig(num_blocks=16))
    freed: list[int] = []
    engine.sleep = _measured_sleep(engine.sleep, freed)
    engine.sleep()  # a round's (sleep_between_rounds)
    assert len(freed) == 1 and engine.is_sleeping
    engine.wake()
    ColocatedGeneration.close(SimpleNamespace(engine=engine))  # the end of train(): sleep(graphs=True)
    assert len(freed) == 1 and engine.is_sleeping
    engine.close()
