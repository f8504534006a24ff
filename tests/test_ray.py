"""`rollout.ray.RolloutFleet` on a local Ray cluster started here (2 CPU workers of the tiny preset, one fleet for the
module; the tests run in order and share it). References: transformers' own `generate` of the same weights
(greedy), the versions each completion carries, the worker processes themselves (gone after shutdown), and TRL's own
GRPO metrics for the trainer test.
"""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from rollout.presets import tiny_model  # noqa: E402
from rollout.ray import RolloutFleet  # noqa: E402
from trainer_bridge import PromptGroup, RolloutClient, push_weights, unload_adapter  # noqa: E402

CPU_WORKER = ["--device", "cpu", "--num-blocks", "128", "--log-level", "WARNING"]
PROMPTS = [[(13 * i + 7 * j + 5) % 997 + 4 for j in range(9 + i)] for i in range(12)]
GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 24}


@functools.cache
def reference(seed: int, prompt_index: int) -> list[int]:
    """Greedy tokens of transformers' own `generate` with tiny_model(seed) for PROMPTS[prompt_index] (no stop token)."""
    model = tiny_model(seed)
    prompt = torch.tensor([PROMPTS[prompt_index]])
    with torch.no_grad():
        output = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=GREEDY["max_new_tokens"],
            min_new_tokens=GREEDY["max_new_tokens"],
            eos_token_id=None,
            pad_token_id=0,
        )
    return output[0, prompt.shape[1] :].tolist()


def groups(indices) -> list[PromptGroup]:
    return [PromptGroup(PROMPTS[i], n=2, sampling=GREEDY, group_id=f"p{i}-{time.monotonic_ns()}") for i in indices]


def check_results(results, submitted: list[PromptGroup], seed: int, version: int) -> None:
    """Every group came back once, every sample greedy-equal to transformers' generate, from weights `version`."""
    assert sorted(r.group_id for r in results) == sorted(g.group_id for g in submitted), "a group lost or duplicated"
    by_id = {g.group_id: PROMPTS.index(g.prompt_ids) for g in submitted}
    for result in results:
        for completion in result.completions:
            assert completion.token_ids == reference(seed, by_id[result.group_id]), result.group_id
            assert completion.policy_versions == [[version, 0]], (result.group_id, completion.policy_versions)


def worker_stats(client: RolloutClient) -> dict[str, dict]:
    return {entry["address"]: entry for entry in client.stats()}


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def fleet(cluster):
    started = time.monotonic()
    fleet = RolloutFleet.launch(
        2, resources_per_worker={"CPU": 1}, worker_args=CPU_WORKER, ready_timeout=120, http=True
    )
    fleet.launch_s = time.monotonic() - started
    yield fleet
    fleet.shutdown()


@pytest.fixture(scope="module")
def client(fleet):
    return fleet.client(timeout=120, heartbeat_s=0.2, dead_after_s=3.0)


def test_bad_launch_arguments_are_named():
    for kwargs, name in [
        ({"num_workers": 0}, "num_workers"),
        ({"worker_args": ["--bind", "tcp://0.0.0.0:1"]}, "--bind"),
        ({"worker_args": ["--mod", "other"]}, "--mod"),  # no abbreviation of a flag the fleet sets
        ({"worker_args": ["--num-blocks", "many"]}, "--num-blocks"),
        ({"worker_args": "--device cpu"}, "worker_args: a list of rollout-worker command-line arguments"),
        ({"worker_args": ["--api-key", "mine"]}, "--api-key is set by the fleet"),  # fleet.api_key serves
        ({"placement_strategy": "ANYWHERE"}, "placement_strategy"),
        ({"resources_per_worker": {"GPU": -1}}, "resources_per_worker"),
        ({"max_restarts": -2}, "max_restarts"),
        ({"http": "no"}, "http: True or False"),  # a string was taken as True: the fleet served the API
    ]:
        with pytest.raises(ValueError, match=name):
            RolloutFleet.launch(**{"num_workers": 1, **kwargs})


def test_a_random_api_key_that_begins_with_a_dash_reaches_the_worker():
    """secrets.token_urlsafe may begin with "-": the key still parses as --api-key's value (it once read as a flag
    and failed the fleet's start at random)."""
    from types import SimpleNamespace

    from rollout.ray.actor import worker_argv, worker_parser

    files = SimpleNamespace(worker_secret="w.key_secret", trainer_keys="trainers")
    argv = worker_argv(["--model", "tiny", "--device", "cpu"], "10.0.0.7", files, True, "-Xk3y")
    args = worker_parser().parse_args(argv)
    assert args.api_key == "-Xk3y" and args.bind == "tcp://10.0.0.7:*" and args.http == "10.0.0.7:0"


def test_two_workers_serve_groups_like_transformers_generate(fleet, client):
    assert len(fleet.addresses) == len(fleet.workers) == 2 and all(a.startswith("tcp://") for a in fleet.addresses)
    assert sorted(client.worker_addresses) == sorted(fleet.addresses)
    assert len(client.stats()) == 2  # both answered: the groups are balanced over both, none waits for a worker
    submitted = groups(range(8))
    check_results(list(client.generate_many(submitted)), submitted, seed=0, version=0)
    served = worker_stats(client)
    assert all(served[address]["generated_tokens"] > 0 for address in fleet.addresses), "one worker got no group"
    print(f"launch to serving: {fleet.launch_s:.1f} s")


def test_workers_serve_at_normal_priority_not_rays(fleet):
    """Ray starts actors at niceness 15 unless told otherwise; every thread of a fleet's worker (the serving loop,
    torch's, the HTTP server's) runs at 0, so a busy neighbour cannot stall it. Reference: the kernel's own record
    of each thread."""
    for worker in fleet.workers:
        pid = ray.get(worker.info.remote())["pid"]
        niceness = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                niceness[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
        assert len(niceness) > 2 and set(niceness.values()) == {0}, niceness


def test_http_on_every_worker_with_the_fleets_api_key(fleet):
    """http=True: each worker serves the OpenAI API on its node's address; the official client with the fleet's key
    gets the greedy tokens the ZeroMQ path gives, a wrong key gets 401."""
    import openai

    assert len(fleet.http_urls) == 2 and all(url.startswith("http://") for url in fleet.http_urls)
    for url in fleet.http_urls:
        answer = openai.OpenAI(base_url=url + "/v1", api_key=fleet.api_key).completions.create(
            model="tiny",
            prompt=[PROMPTS[0]],
            max_tokens=24,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert answer.choices[0].model_extra["token_ids"] == reference(0, 0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=fleet.http_urls[0] + "/v1", api_key="wrong").completions.create(
            model="tiny", prompt="x", max_tokens=2
        )


@functools.cache
def lora_policy() -> torch.nn.Module:
    """A PeftModel over tiny_model(1) with a random, non-zero LoRA adapter on every Linear."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(tiny_model(1), config).eval()


def test_a_killed_worker_restarts_and_copies_the_newest_weights_from_its_peer(fleet, client):
    """The fleet serves tiny_model(1) as the base of a LoRA adapter "policy" (one push, version 5, base included);
    the restarted worker gets both from its peer: base groups equal transformers' generate, "policy" groups equal
    peft's, and the adapter keeps its version."""
    result = push_weights(client, lora_policy(), version=5, adapter_name="policy")
    assert (result.version, result.base_included) == (5, True)
    client.adapter = None  # groups below sample with the base unless they name the adapter
    killed_address = fleet.addresses[0]
    submitted = groups(range(12))
    results, killed_at = [], None
    for result in client.generate_many(submitted):
        results.append(result)
        if killed_at is None:  # mid-run: the other groups are in flight on both workers
            ray.kill(fleet.workers[0], no_restart=False)
            killed_at = time.monotonic()
    check_results(results, submitted, seed=1, version=5)

    # Ray restarts the actor: a new process with a new address, which joins the client once it holds version 5,
    # copied from its peer (nothing was pushed since). Groups keep going meanwhile; none may see old weights.
    def restarted_serves() -> bool:
        batch = groups(range(4))
        check_results(list(client.generate_many(batch)), batch, seed=1, version=5)
        address = fleet.addresses[0]
        if address == killed_address or address not in client.worker_addresses:
            return False
        return worker_stats(client).get(address, {}).get("generated_tokens", 0) > 0

    wait_until(restarted_serves, 90, "the restarted worker to serve")
    print(f"restart to serving again: {time.monotonic() - killed_at:.1f} s")
    assert killed_address not in client.worker_addresses
    stats = worker_stats(client)
    assert {entry["policy_version"] for entry in stats.values()} == {5}
    assert len({entry["base_id"] for entry in stats.values()}) == 1  # the peer's named base, not an unnamed one
    restarted = fleet.client(timeout=60)
    for address in fleet.addresses[1:]:
        restarted.remove_worker(address)
    try:
        assert stats[fleet.addresses[0]]["adapters"]["policy"]["version"] == 5
        group = PromptGroup(PROMPTS[0], sampling=GREEDY, adapter="policy")
        completion = restarted.generate(group).completions[0]
        with torch.no_grad():
            prompt = torch.tensor([PROMPTS[0]])
            expected = lora_policy().generate(input_ids=prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert completion.token_ids == expected[0, len(PROMPTS[0]) :].tolist()
        assert completion.token_ids != reference(1, 0)  # the adapter changes what is sampled
        assert (completion.adapter, completion.adapter_version) == ("policy", 5)
    finally:
        restarted.close()


def test_scale_up_copies_weights_and_scale_down_resubmits_in_flight_groups(fleet, client):
    fleet.scale(3)
    assert len(fleet.addresses) == 3 and sorted(client.worker_addresses) == sorted(fleet.addresses)
    assert {entry["address"]: entry["policy_version"] for entry in client.stats()} == dict.fromkeys(fleet.addresses, 5)

    # torch.distributed across the fleet: one process group (gloo) spanning this process and the three workers.
    result = push_weights(client, tiny_model(2), version=6, transport="torch.distributed", dist_backend="gloo")
    assert [w["version"] for w in result.workers] == [6, 6, 6]

    submitted = groups(range(12))
    results, shrunk = [], False
    for result in client.generate_many(submitted):
        results.append(result)
        if not shrunk:  # two of three workers leave with groups in flight
            fleet.scale(1)
            shrunk = True
    check_results(results, submitted, seed=2, version=6)
    assert len(fleet.addresses) == 1 and client.worker_addresses == fleet.addresses


def test_rollout_grpo_trainer_takes_the_fleet(fleet, tmp_path):
    """A LoRA run (`peft_config`): every sync pushes the adapter alone to both workers (the base once)."""
    from peft import LoraConfig

    from rollout.presets import tiny_tokenizer
    from trainer_bridge.trl import RolloutGRPOTrainer
    from trl_helpers import dataset, grpo_config, id_reward

    groups_before = created_groups()
    free_bundle = bool(fleet._membership.free_bundles)  # scale(1) emptied a whole group when a worker it kept was
    fleet.scale(2)  # silent under load (removed first, rightly): only then may a new placement group be made
    if free_bundle:  # back in the bundle scale(1) freed: no new placement group
        assert created_groups() == groups_before and not fleet._membership.free_bundles
    else:
        assert len(created_groups() - groups_before) == 1
    trainer = RolloutGRPOTrainer(
        model=tiny_model(0),
        reward_funcs=id_reward,
        args=grpo_config(tmp_path, temperature=0.7),
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        rollout_workers=fleet,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    assert sorted(trainer.rollout_client.worker_addresses) == sorted(fleet.addresses)
    bytes_before = sum(entry["weight_update_bytes"] for entry in trainer.rollout_client.stats())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == 2 and len(logs) == 2
    for entry in logs:  # TRL's own metrics: the fleet's logprobs are the trainer's (fp32 on both sides)
        assert entry["sampling/sampling_logp_difference/mean"] < 1e-4, entry
        assert entry["rollout/policy_lag_max"] == 0.0
    stats = trainer.rollout_client.stats()
    versions = {entry["policy_version"] for entry in stats}
    assert len(versions) == 1 and versions.pop() > 6  # both workers took every push
    assert {entry["adapters"]["default"]["version"] for entry in stats} == {entry["policy_version"] for entry in stats}
    model = trainer.accelerator.unwrap_model(trainer.model)
    adapter = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if "lora_" in n)
    base = sum(t.numel() * t.element_size() for t in tiny_model(0).parameters())
    pushed = sum(entry["weight_update_bytes"] for entry in stats) - bytes_before
    assert pushed == 2 * (base + 2 * adapter)  # two syncs to two workers: the base once, the adapter each time
    trainer.rollout_client.close()


def test_a_worker_that_missed_a_push_catches_up_from_its_peer(fleet, client):
    """A push and an adapter unload through a client that left one worker out: the fleet copies the newest weights to
    that worker from its peer within seconds (no further push), unloading the adapter its peer serves no more, and
    it serves them."""
    behind = fleet.addresses[1]
    version = max(entry["policy_version"] for entry in client.stats()) + 1
    push_weights(client, lora_policy(), version=version, adapter_name="extra")  # on both workers
    client.adapter = None
    solo = fleet.client(timeout=60)
    solo.remove_worker(behind)
    assert unload_adapter(solo, "extra") == 0
    push_weights(solo, tiny_model(3), version=version + 1)
    solo.close()
    version += 1
    wait_until(lambda: worker_stats(client).get(behind, {}).get("policy_version") == version, 30, "the catch-up")
    assert "extra" not in worker_stats(client)[behind]["adapters"]
    before = worker_stats(client)[behind]["generated_tokens"]
    submitted = groups(range(8))
    check_results(list(client.generate_many(submitted)), submitted, seed=3, version=version)
    assert worker_stats(client)[behind]["generated_tokens"] > before, "the caught-up worker got no group"


def test_too_few_resources_is_a_clear_error_within_the_timeout(cluster):
    groups_before = created_groups()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="could not place 2 worker") as raised:
        RolloutFleet.launch(2, resources_per_worker={"CPU": 64}, worker_args=CPU_WORKER, placement_timeout=2)
    assert time.monotonic() - started < 15
    # What the cluster has, as a user asks for it: not the fleet's placement group's bundle resources (two names per
    # bundle, "CPU_group_0_<id>"), which buried the CPUs in the message.
    assert "the cluster has {'CPU': 6.0," in str(raised.value)
    assert "_group_" not in str(raised.value) and "node:" not in str(raised.value)
    with pytest.raises(ValueError, match="resources_per_worker"):
        RolloutFleet.launch(1, resources_per_worker={"CPU": 1, "object_store_memory": 1e9}, worker_args=CPU_WORKER)
    assert created_groups() == groups_before, "a failed launch left its placement group behind"


def created_groups() -> set:
    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"}


def test_shutdown_leaves_no_actor_and_no_worker_process(fleet, client):
    pids = [ray.get(actor.info.remote())["pid"] for actor in fleet.workers]
    groups_before = created_groups()
    assert groups_before
    fleet.shutdown()
    fleet.shutdown()  # twice is fine
    wait_until(lambda: all(process_gone(pid) for pid in pids), 30, "the worker processes to end")
    assert not created_groups() & groups_before, "a placement group was left behind"
    with pytest.raises(Exception, match="closed"):
        client.generate(groups([0])[0])
    with pytest.raises(RuntimeError, match="shut down"):
        fleet.scale(2)


EXIT_WITHOUT_SHUTDOWN = """
import sys
import torch  # noqa: F401 - imported first, as in a trainer: its exit hooks come before Ray's
import ray
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20)
from rollout.ray import RolloutFleet
fleet = RolloutFleet.launch(1, resources_per_worker={"CPU": 1}, worker_args=sys.argv[1:])
print(ray.get(fleet.workers[0].info.remote())["pid"], flush=True)
"""


def test_a_fleet_left_running_at_exit_is_shut_down(tmp_path):
    """A script that never calls shutdown(): the interpreter exits promptly and cleanly, and the worker is gone."""
    import subprocess
    import sys

    started = time.monotonic()
    finished = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_SHUTDOWN, *CPU_WORKER], capture_output=True, text=True, timeout=180
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert time.monotonic() - started < 90
    pid = int(finished.stdout.split()[-1])
    wait_until(lambda: process_gone(pid), 30, "the worker process to end")


def test_threads_left():
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("rollout-fleet")]
    assert not leftover, leftover


def test_a_scale_down_removes_workers_that_do_not_serve_first():
    """Dead or restarting workers (not joined) go first, then those behind the newest weights, then the newest: a
    scale-down had removed the newest whatever the state, keeping a killed worker and dropping the only current one."""
    from rollout.ray.fleet import _least_serving_first
    from rollout.ray.membership import Slot

    old, killed, behind, new = (Slot(actor=name, group=None, bundle=0, joined=name) for name in "abcd")
    killed.joined = None
    behind.behind_since = 1.0
    assert [slot.actor for slot in _least_serving_first([old, killed, behind, new])] == ["b", "c", "d", "a"]
    dead = Slot(actor="e", group=None, bundle=0, joined="e", dead="gone")
    assert _least_serving_first([old, new, dead])[0] is dead
    assert _least_serving_first([old, new], silent={id(old)})[0] is old  # no answer just now: killed, restarting
