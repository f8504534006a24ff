"""Two controllers at once, found by a review of vLLM's control routes: an adapter unloaded while a request for it
waited in the manager's queue (it ran on the freed slot, then on the next adapter loaded there), weight updates sent
together (the second was refused with a bare 500), two "wait" pauses asking different things of the prefix cache,
a resume that overtakes a draining pause; and, on a worker's HTTP routes, what a caller must not be able to do by
mistake or from a web page: a body or query parameter a route ignores, an abort of everyone by a malformed call, a
cross-site POST to a keyless worker."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch
from control_helpers import Stream, saved_adapter

from conftest import reference_copy
from rollout import ContinuousBatchingConfig, SamplingParams, init_continuous_batching
from rollout.config import FieldError
from rollout.engine.manager.generation_pause import PauseOvertaken
from rollout.presets import tiny_model
from rollout.service.http.control.adapter_routes import AdapterRoutes
from rollout.service.http.control.allowed_dirs import AllowedDirs
from service_helpers import Worker, free_port

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 30
GREEDY = SamplingParams(do_sample=False, stop_token_ids=())


@pytest.fixture
def manager():
    built = init_continuous_batching(tiny_model(), None, ContinuousBatchingConfig(num_blocks=256, block_size=4))
    built.start()
    yield built
    built.stop(block=True, timeout=TIMEOUT)
    built.engine.block_manager.check_all_free()


def final(manager, request_id: str):
    output = manager.get_result(request_id, timeout=TIMEOUT)
    assert output is not None and output.is_finished, f"no final output for {request_id!r}"
    return output


def test_a_request_queued_for_an_adapter_unloaded_meanwhile_never_runs(manager, tmp_path, monkeypatch):
    """The request passed intake (its adapter served), then the adapter was unloaded and another loaded into its
    slot before the engine thread took it: it ends "abort" with no token, as the unload's other requests; before,
    it sampled from the freed slot and then from the new adapter, tagged with that adapter's version."""
    manager.load_adapter("alice", saved_adapter(tmp_path / "alice", seed=1))
    prepare = manager._requests.intake.prepare

    def prepare_then_swap(spec):
        request = prepare(spec)
        if spec.adapter == "alice":
            manager.control.unload_adapter("alice", timeout=TIMEOUT)
            manager.load_adapter("bob", saved_adapter(tmp_path / "bob", seed=2))
        return request

    monkeypatch.setattr(manager._requests.intake, "prepare", prepare_then_swap)
    manager.add_request([5, 6, 7, 8], request_id="late", max_new_tokens=6, sampling=GREEDY, adapter="alice")
    late = final(manager, "late")
    assert late.finish_reason == "abort" and late.generated_tokens == []
    assert "unloaded" in late.error
    manager.add_request([5, 6, 7, 8], request_id="bob", max_new_tokens=6, sampling=GREEDY, adapter="bob")
    assert len(final(manager, "bob").generated_tokens) == 6


def test_an_unload_nobody_waits_for_answers_once_on_every_path(manager, tmp_path):
    """`submit_unload_adapter` (the ZeroMQ worker's: its serving thread never waits): the count of samples it ended,
    from the engine thread; an unknown name's FieldError; before the engine thread starts, carried out at once; after
    the manager stopped, refused."""
    manager.load_adapter("alice", saved_adapter(tmp_path / "alice", seed=1))
    manager.add_request([5, 6, 7, 8], request_id="long", max_new_tokens=500, sampling=GREEDY, adapter="alice", n=2)
    answers: list = []
    answered = threading.Event()
    manager.control.submit_unload_adapter("alice", lambda outcome: (answers.append(outcome), answered.set()))
    assert answered.wait(TIMEOUT) and answers == [2]
    assert [final(manager, f"long#{index}").finish_reason for index in range(2)] == ["abort", "abort"]
    manager.control.submit_unload_adapter("alice", answers.append)  # served no more
    deadline = time.monotonic() + TIMEOUT
    while len(answers) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(answers[1], FieldError) and answers[1].field == "adapter"
    idle = init_continuous_batching(tiny_model(), None, ContinuousBatchingConfig(num_blocks=64, block_size=4))
    idle.load_adapter("bob", saved_adapter(tmp_path / "bob", seed=2))
    here: list = []
    idle.control.submit_unload_adapter("bob", here.append)  # not started: done before the call returns
    assert here == [0] and not idle.engine.runner.adapters.refs
    idle.stop(block=True, timeout=TIMEOUT)
    with pytest.raises(RuntimeError, match="stopped"):
        idle.control.submit_unload_adapter("bob", here.append)
    assert here == [0]


def test_models_name_a_path_only_for_the_adapter_loaded_from_it(manager, tmp_path):
    """/v1/models' `root` is the directory /v1/load_lora_adapter read an adapter from, while that adapter is served:
    once replaced under its name (a push, or a load in process) or unloaded another way (ZeroMQ's adapter_unload),
    it is not from there, and its root is its name again (it had kept the old path)."""
    routes = AdapterRoutes(manager, AllowedDirs([str(tmp_path)]))
    path = saved_adapter(tmp_path / "alice", seed=1)
    asyncio.run(routes.load({"lora_name": "alice", "lora_path": path}))
    assert routes.roots() == {"alice": path}
    manager.load_adapter("alice", saved_adapter(tmp_path / "other", seed=2))  # replaced under its name
    assert routes.roots() == {}
    asyncio.run(routes.load({"lora_name": "alice", "lora_path": path, "load_inplace": True}))
    assert routes.roots() == {"alice": path}
    manager.control.unload_adapter("alice", timeout=TIMEOUT)  # as adapter_unload does
    assert routes.roots() == {}


def shifted(model: torch.nn.Module, shift: float) -> dict[str, torch.Tensor]:
    return {name: tensor + shift for name, tensor in model.state_dict().items()}


def test_weight_updates_sent_together_apply_one_after_another(manager):
    """Two updates reach the engine thread in one batch of commands (posted while its loop was held): both apply,
    in the order sent; before, the second was refused ("another weight update is still waiting")."""
    model = reference_copy(manager.engine.model)
    results: dict[str, object] = {}

    def send(name: str, shift: float) -> None:
        try:
            results[name] = manager.update_weights(shifted(model, shift), timeout=TIMEOUT)
        except Exception as error:  # noqa: BLE001 - the test reads it
            results[name] = error

    first = threading.Thread(target=send, args=("first", 0.01))
    second = threading.Thread(target=send, args=("second", 0.02))
    with manager.pause(timeout=TIMEOUT):
        first.start()
        while manager._loop.commands.qsize() < 1:
            time.sleep(0.001)
        second.start()
        while manager._loop.commands.qsize() < 2:
            time.sleep(0.001)
    first.join(TIMEOUT)
    second.join(TIMEOUT)
    assert [results["first"].version, results["second"].version] == [1, 2], results
    served = manager.engine.model.state_dict()
    assert all(torch.equal(served[name], tensor) for name, tensor in shifted(model, 0.02).items())


def test_an_update_sent_behind_a_draining_wait_update_applies_after_it(manager):
    model = reference_copy(manager.engine.model)
    manager.add_request([5, 6, 7], request_id="long", max_new_tokens=60, sampling=GREEDY)
    while not manager.engine.num_in_flight():
        time.sleep(0.001)
    results: dict[str, object] = {}
    waiting = threading.Thread(
        target=lambda: results.update(wait=manager.update_weights(shifted(model, 0.01), mode="wait", timeout=60))
    )
    waiting.start()
    while manager.weight_updates.pending is None:
        time.sleep(0.001)
    results["keep"] = manager.update_weights(shifted(model, 0.02), timeout=60)
    waiting.join(TIMEOUT)
    long = final(manager, "long")
    assert len(long.generated_tokens) == 60
    assert [list(run) for run in long.policy_versions] == [[0, 0]]  # drained under the weights it started with
    assert (results["wait"].version, results["keep"].version) == (1, 2)


def test_two_wait_pauses_clear_the_cache_when_either_asks(manager):
    """Both pauses are answered when the drain ends; the prefix cache is cleared since one of them asked."""
    manager.add_request(list(range(5, 21)), request_id="cached", max_new_tokens=2, sampling=GREEDY)
    final(manager, "cached")
    assert manager.engine.block_manager.cached_blocks
    manager.add_request([5, 6, 7], request_id="long", max_new_tokens=60, sampling=GREEDY)
    while not manager.engine.num_in_flight():
        time.sleep(0.001)
    answers: list = []
    pauses = [
        threading.Thread(target=lambda c=clear: answers.append(manager.control.pause_generation("wait", c, TIMEOUT)))
        for clear in (False, True)
    ]
    for pause in pauses:
        pause.start()
        time.sleep(0.05)
    for pause in pauses:
        pause.join(TIMEOUT)
    assert len(answers) == 2 and manager.control.is_paused
    assert not manager.engine.block_manager.cached_blocks
    manager.control.resume_generation()
    assert len(final(manager, "long").generated_tokens) == 60


def test_a_resume_that_overtakes_a_draining_pause_is_named(manager):
    manager.add_request([5, 6, 7], request_id="long", max_new_tokens=200, sampling=GREEDY)
    while not manager.engine.num_in_flight():
        time.sleep(0.001)
    errors: list = []

    def pause() -> None:
        try:
            manager.control.pause_generation("wait", True, TIMEOUT)
        except PauseOvertaken as error:
            errors.append(error)

    draining = threading.Thread(target=pause)
    draining.start()
    while not manager.control.is_paused:
        time.sleep(0.001)
    manager.control.resume_generation()
    draining.join(TIMEOUT)
    assert len(errors) == 1 and "resumed" in str(errors[0])
    assert len(final(manager, "long").generated_tokens) == 200


# ---- over HTTP: a keyless loopback worker with its control routes --------------------------------------------
@pytest.fixture(scope="module")
def keyless_url():
    port = free_port()
    server = Worker("--http", f"127.0.0.1:{port}", "--enable-control-routes")
    yield f"http://127.0.0.1:{port}"
    server.close()


def paused(url: str) -> bool:
    return httpx.get(f"{url}/is_paused", timeout=5).json()["is_paused"]


def test_cross_site_posts_from_a_web_page_are_refused(keyless_url):
    """A page any browser opens may POST to a loopback worker without a CORS preflight (no body, or a form's):
    refused by its Origin or Sec-Fetch-Site, before anything pauses or ends."""
    stream = Stream(keyless_url, 256)
    form = {"content-type": "application/x-www-form-urlencoded"}
    for headers in ({"origin": "https://evil.example", **form}, {"sec-fetch-site": "cross-site"}, {"origin": "null"}):
        for path in ("/pause", "/abort_requests", "/reset_prefix_cache"):
            response = httpx.post(f"{keyless_url}{path}", headers=headers, timeout=5)
            assert response.status_code == 403, (path, headers)
    assert not paused(keyless_url) and not stream.done.is_set()
    stream.thread.join(TIMEOUT)
    assert stream.finish_reason == "length"
    host = keyless_url.removeprefix("http://")
    for same_origin in (
        {"origin": keyless_url, "sec-fetch-site": "same-origin"},
        {"origin": "https://chat.example", "sec-fetch-site": "same-origin"},  # behind a proxy rewriting Host
        {"origin": "https://chat.example", "x-forwarded-host": "chat.example"},  # an older browser, same proxy
        {"origin": "http://localhost", "host": "localhost:80"},  # a default port spelt out
    ):
        response = httpx.post(f"{keyless_url}/pause", params={"mode": "keep"}, headers=same_origin)
        assert response.status_code == 200, (same_origin, response.text)
        assert httpx.post(f"{keyless_url}/resume", headers={"host": host}).status_code == 200


def test_what_a_control_route_does_not_read_is_refused_by_name(keyless_url):
    """A body or a query parameter a route would ignore: a pause with {"mode": "keep"} as its body would run the
    default, "abort"; a misspelt parameter would leave its default in force; one given twice would be a guess."""
    stream = Stream(keyless_url, 256)
    cases = [
        ("/pause", {"json": {"mode": "keep"}}, None),
        ("/pause", {"params": {"mode": "keep", "bogus": "1"}}, "query.bogus"),
        # Given twice, or twice over (the older spelling of mode=wait beside another mode): the last one had won.
        ("/pause", {"params": [("mode", "abort"), ("mode", "keep")]}, "query.mode"),
        (
            "/pause",
            {"params": {"mode": "keep", "wait_for_inflight_requests": "true"}},
            "query.wait_for_inflight_requests",
        ),
        ("/resume", {"json": {"mode": "keep"}}, None),
        ("/reset_prefix_cache", {"params": {"reset_running_request": "true"}}, "query.reset_running_request"),
        ("/abort_requests", {"params": {"request_ids": "cmpl-1"}}, "query.request_ids"),
        ("/abort_requests", {}, None),
    ]
    for path, sent, param in cases:
        response = httpx.post(f"{keyless_url}{path}", timeout=5, **sent)
        assert response.status_code == 400, (path, sent)
        assert response.json()["error"]["param"] == param, (path, response.json())
    assert not paused(keyless_url) and not stream.done.is_set()
    # A body that says nothing passes (some vLLM clients send `{}`), chunked and empty too.
    assert httpx.post(f"{keyless_url}/reset_prefix_cache", json={}).json() == {"success": True}
    assert httpx.post(f"{keyless_url}/resume", content=iter([b""])).status_code == 200
    assert httpx.post(f"{keyless_url}/abort_requests", json={}).json()["aborted"] >= 1
    stream.thread.join(TIMEOUT)
    assert stream.finish_reason == "abort"
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        response = httpx.request(method, f"{keyless_url}{path}")
        assert response.status_code == 501 and "colocate" in response.json()["error"]["message"]


def test_a_draining_pause_overtaken_by_a_resume_answers_409(keyless_url):
    stream = Stream(keyless_url, 256)
    answers: list = []
    waiting = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{keyless_url}/pause", params={"mode": "wait"}, timeout=TIMEOUT))
    )
    waiting.start()
    while not paused(keyless_url):
        time.sleep(0.005)
    assert httpx.post(f"{keyless_url}/resume").status_code == 200
    waiting.join(TIMEOUT)
    assert answers[0].status_code == 409 and "resumed" in answers[0].json()["error"]
    stream.thread.join(TIMEOUT)
    assert stream.finish_reason == "length"


def test_a_body_less_routes_body_is_read_within_the_body_time_limit(monkeypatch):
    """A body-less route reads at most a few bytes of a body, within the limit a whole body gets (a lying
    Content-Length held `/pause` open for ever), and a client that leaves mid-body is a client gone (it logged an
    error traceback per request)."""
    import asyncio

    from starlette.requests import Request

    from rollout.service.http.api.bridge import ClientGone
    from rollout.service.http.errors import APIError
    from rollout.service.http.serving import bodies as bodies_module

    monkeypatch.setattr(bodies_module, "BODY_TIMEOUT_S", 0.2)
    intake = bodies_module.BodyIntake(1024, None)

    def request(messages: list[dict]) -> Request:
        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await asyncio.sleep(3600)  # the rest of a body that never comes

        return Request({"type": "http", "method": "POST", "path": "/pause", "headers": []}, receive)

    more = {"type": "http.request", "body": b" " * 40, "more_body": True}
    assert asyncio.run(intake.first_bytes(request([more, more, more]), 64)) == b" " * 80  # stops past 64
    with pytest.raises(APIError) as error:
        asyncio.run(intake.first_bytes(request([{"type": "http.request", "body": b"{}", "more_body": True}]), 64))
    assert error.value.status == 408
    with pytest.raises(ClientGone):
        asyncio.run(intake.first_bytes(request([more, {"type": "http.disconnect"}]), 64))
    intake.close()


def test_a_directory_swapped_for_a_link_while_its_read_waited_is_refused(manager, tmp_path):
    """A load or a weight update checks its directory, then waits for the one before it to finish: a directory
    replaced meanwhile by a link to one outside the allowed directories was read from there (an adapter served, a
    checkpoint committed). Each checks again right before it reads, and a checkpoint each file as it opens it."""
    import shutil

    from safetensors.torch import save_file

    from rollout.service.http.control import routes as control_routes
    from rollout.service.http.control.checkpoint_dir import read_checkpoint
    from rollout.service.http.errors import APIError

    root, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed = AllowedDirs([str(root)])
    swapped = root / "adapter"
    saved_adapter(outside / "adapter", seed=3)
    saved_adapter(swapped, seed=4)

    class SwappedMeanwhile:  # the wait for the load before: the directory is replaced by a link meanwhile
        async def __aenter__(self):
            shutil.rmtree(swapped)
            swapped.symlink_to(outside / "adapter")

        async def __aexit__(self, *exc_info):
            return False

    routes = AdapterRoutes(manager, allowed)
    routes.lock = SwappedMeanwhile()
    with pytest.raises(APIError) as refused:
        asyncio.run(routes.load({"lora_name": "swapped", "lora_path": str(swapped)}))
    assert (refused.value.status, refused.value.param) == (403, "lora_path"), refused.value
    assert "swapped" not in manager.engine.runner.adapters.refs

    state = {name: tensor.contiguous() for name, tensor in tiny_model(seed=5).state_dict().items()}
    for directory in (root / "checkpoint", outside / "checkpoint"):
        directory.mkdir(parents=True)
        save_file(state, str(directory / "model.safetensors"))
    version = manager.engine.policy_version
    checked = allowed.directory(str(root / "checkpoint"), "weight_dir")  # the route's check, before its wait
    shutil.rmtree(root / "checkpoint")
    (root / "checkpoint").symlink_to(outside / "checkpoint")
    with pytest.raises(APIError) as refused:
        control_routes._update_from(manager, allowed, str(root / "checkpoint"), None, "keep", False)
    assert (refused.value.status, refused.value.param) == (403, "weight_dir"), refused.value
    assert manager.engine.policy_version == version
    (root / "checkpoint").unlink()  # a file of the checked directory replaced by a link as it is read
    (root / "checkpoint").mkdir()
    (root / "checkpoint" / "model.safetensors").symlink_to(outside / "checkpoint" / "model.safetensors")
    with pytest.raises(APIError) as refused:
        read_checkpoint(checked, manager.engine.weight_table.specs())
    assert refused.value.status == 403 and "now a link to a file outside it" in refused.value.message
