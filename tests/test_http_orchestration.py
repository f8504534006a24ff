"""Clients written for vLLM's HTTP API, unchanged, against `rollout-worker --http --enable-control-routes`:

- an RL orchestration loop written only with `httpx` and vLLM's documented routes (pause -> update the weights from
  a checkpoint directory -> resume -> generate), checked against transformers' `generate` on the new weights and
  against the `policy_versions` of every token, a held sample's included;
- a bad checkpoint refused by name (unreadable, a wrong shape, NaN under `--check-finite`), the old weights still
  serving;
- lm-evaluation-harness with `tokenizer_backend="remote"` (its RemoteTokenizer reads /tokenizer_info, /tokenize and
  /detokenize), its log-likelihoods checked against a teacher-forced forward.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from control_helpers import Stream
from safetensors.torch import load_file, save_file

from rollout.presets import tiny_model, tiny_tokenizer
from service_helpers import Worker, free_port

CONTROL = {"Authorization": "Bearer operator"}
TOKENIZER = tiny_tokenizer()
METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def server(shared):
    port = free_port()
    flags = ["--http", f"127.0.0.1:{port}", "--enable-control-routes", "--enable-tokenizer-info-endpoint"]
    flags += ["--log-level", "INFO", "--metrics-port", str(METRICS_PORT)]  # the weight updates' log lines, counts
    server = Worker(*flags, "--control-api-key", "operator", "--control-allowed-dirs", str(shared), "--check-finite")
    server.url = f"http://127.0.0.1:{port}"
    yield server
    server.close()


@pytest.fixture(scope="module")
def url(server):
    return server.url


def greedy(prompt_ids: list[int], model: torch.nn.Module, count: int) -> list[int]:
    """transformers' own greedy continuation."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=count, do_sample=False, min_new_tokens=count)
    return out[0, len(prompt_ids) :].tolist()


def stream_versions(url: str, prompt: str, started: threading.Event, into: list) -> None:
    """Stream a long completion; collect each chunk's (token ids, policy_versions)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 128, "temperature": 0, "ignore_eos": True}
    body.update(stream=True, return_token_ids=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                into.append((choice.get("token_ids") or [], choice.get("policy_versions") or []))
                started.set()


def metric(name: str) -> float:
    """One sample of the worker's Prometheus metrics."""
    lines = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics").text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(f"{name} ")))


def test_an_httpx_orchestration_loop_updates_the_weights_between_pause_and_resume(server, url, shared):
    new_model = tiny_model(seed=7)
    new_model.save_pretrained(shared / "step-1")
    checkpoint_bytes = sum(tensor.nbytes for tensor in load_file(shared / "step-1" / "model.safetensors").values())
    bytes_before = metric("rollout_weight_update_bytes_total")
    pause_before = metric("rollout_weight_update_pause_seconds_total")
    prompt = "the quick brown fox"
    prompt_ids = TOKENIZER(prompt)["input_ids"]
    with httpx.Client(base_url=url, headers=CONTROL, timeout=60) as http:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        before = http.post("/v1/completions", json=body).json()["choices"][0]
        assert before["token_ids"] == greedy(prompt_ids, tiny_model(), 6) and before["policy_versions"] == [[0, 0]]

        chunks: list = []
        started = threading.Event()
        held = threading.Thread(target=stream_versions, args=(url, prompt, started, chunks))
        held.start()
        assert started.wait(30)
        assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        assert http.get("/is_paused").json() == {"is_paused": True}
        update = http.post("/update_weights", json={"weight_dir": str(shared / "step-1")})
        assert update.status_code == 200, update.text
        assert update.json()["message"] == "Weights updated" and update.json()["policy_version"] == 1
        assert http.post("/resume").json() == {"status": "resumed"}
        after = http.post("/v1/completions", json=body).json()["choices"][0]
        held.join(60)

    assert after["token_ids"] == greedy(prompt_ids, new_model, 6)
    assert after["policy_versions"] == [[1, 0]]
    # The sample held across the update: its first tokens from version 0, the rest from version 1, each tagged.
    versions = [version for _, runs in chunks for version, _ in runs]
    assert versions[0] == 0 and versions[-1] == 1 and sorted(versions) == versions
    assert sum(len(ids) for ids, _ in chunks) == 128
    # Logged and counted as a ZeroMQ update is (it was not logged at all, then not counted).
    assert f"weight update from {str(shared / 'step-1')!r} committed: version 1, pause" in server.output()
    assert metric("rollout_weight_update_bytes_total") == bytes_before + checkpoint_bytes
    paused = metric("rollout_weight_update_pause_seconds_total") - pause_before
    assert paused == pytest.approx(update.json()["pause_ms"] / 1e3, abs=1e-6) and paused > 0


def test_a_bad_checkpoint_is_refused_by_name_and_the_old_weights_serve_on(url, shared):
    with httpx.Client(base_url=url, headers=CONTROL, timeout=60) as http:
        version = http.get("/server_info", params={"config_format": "json"}).json()["policy_version"]
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        served = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]

        broken = shared / "broken"
        broken.mkdir()
        (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
        answer = http.post("/update_weights", json={"weight_dir": str(broken)})
        assert answer.status_code == 400 and "model.safetensors" in answer.json()["error"]["message"]

        wrong = shared / "wrong-shape"
        wrong.mkdir()
        tensors = {name: t.clone() for name, t in tiny_model(seed=3).state_dict().items()}
        tensors["model.norm.weight"] = torch.ones(3)
        save_file(tensors, str(wrong / "model.safetensors"))
        answer = http.post("/update_weights", json={"weight_dir": str(wrong)})
        assert answer.status_code == 400 and "model.norm.weight" in answer.json()["error"]["message"]

        diverged = shared / "diverged"  # --check-finite: refused as the ZeroMQ path refuses it
        diverged.mkdir()
        tensors = {name: t.clone() for name, t in tiny_model(seed=3).state_dict().items()}
        tensors["model.norm.weight"][5] = float("nan")
        save_file(tensors, str(diverged / "model.safetensors"))
        answer = http.post("/update_weights", json={"weight_dir": str(diverged)})
        message = answer.json()["error"]["message"]
        assert answer.status_code == 400 and "model.norm.weight" in message and "NaN or Inf" in message, message

        assert http.post("/update_weights", json={"weight_dir": "/etc"}).status_code == 403
        assert http.post("/update_weights", json={"weight_dir": str(shared / "none")}).status_code == 404
        assert http.post("/update_weights", json={"weight_dir": str(shared), "when": 1}).status_code == 400

        assert http.get("/server_info", params={"config_format": "json"}).json()["policy_version"] == version
        assert http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == served


def post_beside_an_open_push(server, path: str, body: dict, update_id: str) -> tuple[httpx.Response, int]:
    """POST `body` to the control route `path` while a ZeroMQ trainer's update is open: it must answer 409
    update_in_progress naming the push, the version put; then the push is aborted. Returns the same POST's answer
    then, and the version before."""
    from rollout import protocol as p
    from service_helpers import Client

    spec = [p.TensorSpec("model.norm.weight", "float32", [256])]  # the worker's preset
    trainer = Client(server.address)
    try:
        with httpx.Client(base_url=server.url, headers=CONTROL, timeout=60) as http:
            version = http.get("/server_info", params={"config_format": "json"}).json()["policy_version"]
            assert isinstance(trainer.ask(p.WeightsBegin(update_id, spec, partial=True, timeout_s=20)), p.WeightsReady)
            answer = http.post(path, json=body)
            assert answer.status_code == 409, answer.text
            error = answer.json()["error"]
            assert error["code"] == "update_in_progress" and repr(update_id) in error["message"], error
            assert http.get("/server_info", params={"config_format": "json"}).json()["policy_version"] == version
            assert isinstance(trainer.ask(p.WeightsAbort(update_id)), p.WeightsAck)
            return http.post(path, json=body), version
    finally:
        trainer.close()


def test_one_weight_update_at_a_time_whichever_way_it_comes(server, url, shared):
    """A ZeroMQ trainer's update is open: /update_weights is refused (409, update_in_progress) and the version stays
    put (it committed beside the open push); once the push ends, it commits. And the other way: while
    /update_weights holds the slot, a ZeroMQ begin is refused naming its directory, preempt or not (`UpdateSlot` in
    process)."""
    from slot_helpers import open_slot, replies

    from rollout import protocol as p

    tiny_model(seed=11).save_pretrained(shared / "turns")
    answer, before = post_beside_an_open_push(server, "/update_weights", {"weight_dir": str(shared / "turns")}, "open")
    assert answer.status_code == 200 and answer.json()["policy_version"] > before, answer.text
    spec = [p.TensorSpec("model.norm.weight", "float32", [64])]  # the slot's test model
    with open_slot() as slot:
        assert slot.turn.take_outside("/ckpt/step-9", lambda: slot.update) is None
        for preempt in (False, True):
            slot.handle(b"trainer", p.WeightsBegin(f"z{preempt}", spec, partial=True, preempt=preempt), [], None)
            error = replies(slot, 1 + preempt)[-1]
            assert isinstance(error, p.Error) and error.code == "update_in_progress", error
            assert "'/ckpt/step-9'" in error.message and slot.update is None
        slot.turn.end_outside()
        slot.handle(b"trainer", p.WeightsBegin("after", spec, partial=True), [], None)
        assert isinstance(replies(slot, 3)[-1], p.WeightsReady)
        held = slot.turn.take_outside("/ckpt/step-10", lambda: slot.update)
        assert held is not None  # the ZeroMQ update holds it now


def test_queued_weight_updates_hold_no_thread_the_other_routes_need(url, shared):
    """Updates that wait for a long sample to drain read and hold one checkpoint at a time: the worker's threads
    stay free, so /tokenize answers while the sample still runs, and every update then commits, in turn."""
    tiny_model(seed=7).save_pretrained(shared / "queued")  # the weights the later tests expect once updated
    inflight = Stream(url, 1500)  # long enough to outlast the updates' arrival on a loaded machine
    answers: list[httpx.Response] = []

    def update() -> None:
        body = {"weight_dir": str(shared / "queued"), "mode": "wait"}
        answers.append(httpx.post(f"{url}/update_weights", json=body, headers=CONTROL, timeout=120))

    waiting = [threading.Thread(target=update) for _ in range(12)]  # twice a 2-core machine's thread pool (6)
    for thread in waiting:
        thread.start()
    time.sleep(0.5)  # the updates reach the worker (each queued, waiting for the sample)
    tokenized = httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, timeout=60)  # parsed on a worker thread
    assert tokenized.status_code == 200 and not inflight.done.is_set(), "/tokenize waited for the updates' drain"
    inflight.thread.join(60)
    for thread in waiting:
        thread.join(120)
    assert inflight.finish_reason == "length" and len(answers) == 12
    assert all(answer.status_code == 200 for answer in answers), [answer.text for answer in answers]
    assert sorted(answer.json()["policy_version"] for answer in answers) == sorted(
        {answer.json()["policy_version"] for answer in answers}
    )  # twelve commits, twelve versions


def test_lm_eval_remote_tokenizer_loglikelihoods_match_a_teacher_forced_forward(url, shared):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # The worker serves whatever weights the other tests left: read them back as they are served.
    served = tiny_model()
    with httpx.Client(base_url=url, headers=CONTROL, timeout=60) as http:
        if http.get("/server_info", params={"config_format": "json"}).json()["policy_version"] > 0:
            served = tiny_model(seed=7)
    lm = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions", model="tiny", tokenizer_backend="remote", max_length=256, max_retries=1
    )
    pairs = [("the capital of france is", " paris"), ("two plus two is", " four")]
    requests = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests, disable_tqdm=True)
    for (context, continuation), (logprob, is_greedy) in zip(pairs, results):
        context_ids = TOKENIZER(context, add_special_tokens=False)["input_ids"]
        ids = context_ids + TOKENIZER(continuation, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            expected = torch.log_softmax(served(torch.tensor([ids])).logits[0, :-1].float(), -1)
        targets = torch.tensor(ids[len(context_ids) :])
        chosen = expected[len(context_ids) - 1 :].gather(1, targets[:, None])[:, 0]
        assert logprob == pytest.approx(float(chosen.sum()), abs=1e-4)
        assert is_greedy == bool((expected[len(context_ids) - 1 :].argmax(-1) == targets).all())


def test_a_zeromq_trainers_group_waits_out_an_http_pause_and_completes(server):
    """A pause over HTTP holds the ZeroMQ clients' groups too (one engine); they complete once resumed."""
    from rollout import SamplingParams
    from trainer_bridge import PromptGroup, RolloutClient

    with (
        RolloutClient(server.address, timeout=60) as client,
        httpx.Client(base_url=server.url, headers=CONTROL) as http,
    ):
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        results: list = []
        sampling = SamplingParams(max_new_tokens=5, temperature=0)
        waiting = threading.Thread(
            target=lambda: results.append(client.generate(PromptGroup([3, 4, 5], n=2, sampling=sampling)))
        )
        waiting.start()
        waiting.join(3)
        assert waiting.is_alive() and not results  # held while paused: not run, not refused
        assert http.post("/resume").status_code == 200
        waiting.join(60)
    assert [len(c.token_ids) for c in results[0].completions] == [5, 5]


def test_reset_running_requests_has_held_samples_compute_their_kv_again(url):
    """vLLM's reset_running_requests=true preempts the running samples, whose KV is then computed again (after a live
    weight update, with the new weights; `tests/test_reset_running.py` checks those tokens against transformers).
    It had been read and ignored: the held sample's context counts in the prefill tokens again once resumed."""
    stream = Stream(url, max_tokens=60)
    try:
        assert httpx.post(f"{url}/pause", params={"mode": "keep"}, headers=CONTROL).status_code == 200  # held
        held = len(stream.chunks)
        prefill_before = metric("rollout_prefill_tokens_total")
        reset = httpx.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"}, headers=CONTROL)
        assert reset.status_code == 200 and reset.json() == {"success": True}
    finally:
        httpx.post(f"{url}/resume", headers=CONTROL)
        assert stream.done.wait(60)
    assert stream.finish_reason == "length" and not stream.errors
    assert metric("rollout_prefill_tokens_total") - prefill_before >= held  # the prompt and the tokens so far


def test_an_adapter_loaded_over_http_waits_for_its_turn_too(server, shared):
    """/v1/load_lora_adapter is a weight update of its own (a new policy version): while a ZeroMQ push is open it
    answers 409 update_in_progress as /update_weights does, the version put; once the push ends, it loads."""
    from control_helpers import saved_adapter

    path = saved_adapter(shared / "turn-adapter", seed=3)
    answer, _ = post_beside_an_open_push(server, "/v1/load_lora_adapter", {"lora_name": "turn", "lora_path": path}, "a")
    assert answer.status_code == 200, answer.text


def test_an_adapter_load_sent_beside_a_checkpoint_update_waits_its_turn(url, shared):
    """/update_weights and /v1/load_lora_adapter sent together (a vLLM orchestrator's) commit one after the other, in
    the order they came, as two /update_weights do: the load, sent while the checkpoint waits for a sample to drain,
    is not refused (409) for the update it would only have to wait for."""
    from control_helpers import saved_adapter

    tiny_model(seed=7).save_pretrained(shared / "queued")  # the weights the tests before end with
    path = saved_adapter(shared / "beside-adapter", seed=4)
    inflight = Stream(url, 1500)  # holds the `wait` update's drain while the load arrives
    answers: list[httpx.Response] = []

    def update() -> None:
        body = {"weight_dir": str(shared / "queued"), "mode": "wait"}
        answers.append(httpx.post(f"{url}/update_weights", json=body, headers=CONTROL, timeout=120))

    waiting = threading.Thread(target=update)
    waiting.start()
    time.sleep(0.5)  # the update reached the worker, and waits for the sample
    body = {"lora_name": "beside", "lora_path": path}
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=CONTROL, timeout=120)
    inflight.thread.join(60)
    waiting.join(120)
    assert loaded.status_code == 200, loaded.text
    assert len(answers) == 1 and answers[0].status_code == 200, [answer.text for answer in answers]
