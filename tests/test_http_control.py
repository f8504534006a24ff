"""vLLM's control routes on `rollout-worker --http --enable-control-routes`, against a real worker.

The first tests are ported from vLLM's own tests of these routes (tests/entrypoints/serve/dev/rlhf/state_transitions/
test_pause_resume.py, dev/test_cache.py, serve/tokenize/test_tokenization.py, serve/lora/test_lora_adapters.py,
test_dora_adapters.py, dev/rlhf/test_weight_update.py); every change is marked `CHANGED:`. Shared changes: the server
is a tiny random model on the CPU (not Qwen3-0.6B on a GPU), and every call carries a key (vLLM's dev routes take
none; here --control-api-key guards them and --api-key the rest).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from control_helpers import (
    CONTROL,
    GENERATE,
    Stream,
    cached_tokens,
    gen,
    golden_output,
    is_paused,
    load,
    ok,
    pause,
    resume,
    saved_adapter,
)

from rollout.presets import tiny_tokenizer
from service_helpers import Worker, free_port


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def server_url(shared):
    port = free_port()
    flags = ["--http", f"127.0.0.1:{port}", "--enable-control-routes", "--enable-tokenizer-info-endpoint"]
    flags += ["--metrics-port", str(METRICS_PORT)]
    flags += ["--api-key", "generation-key", "--control-api-key", "control-key", "--control-allowed-dirs", str(shared)]
    server = Worker(*flags)
    yield f"http://127.0.0.1:{port}"
    server.close()


@pytest.fixture(autouse=True)
def _resumed(request):
    """As vLLM's autouse fixture: every test starts and ends with generation resumed."""
    if "server_url" not in request.fixturenames:
        yield
        return
    url = request.getfixturevalue("server_url")
    assert resume(url) == 200
    yield
    assert resume(url) == 200


# ---- ported: test_pause_resume.py ----------------------------------------------------------------------------
def test_state_and_idempotency_across_cycles(server_url):
    assert not is_paused(server_url)
    assert resume(server_url) == 200
    assert resume(server_url) == 200
    assert not is_paused(server_url)
    for _ in range(2):
        for mode in ("abort", "wait", "keep"):
            assert pause(server_url, mode=mode) == 200
            assert pause(server_url, mode=mode) == 200
            assert is_paused(server_url)
            assert resume(server_url) == 200
            assert resume(server_url) == 200
            assert not is_paused(server_url)


def test_invalid_mode_preserves_state(server_url):
    for paused in (False, True):
        if paused:
            assert pause(server_url) == 200
        assert is_paused(server_url) is paused
        response = httpx.post(f"{server_url}/pause", params={"mode": "invalid"}, headers=CONTROL, timeout=10)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "query.mode"
        assert is_paused(server_url) is paused
        assert resume(server_url) == 200


@pytest.mark.parametrize(
    ("mode", "max_tokens", "inflight_finish_reason"),
    [("abort", 256, "abort"), ("wait", 64, "length"), ("keep", 256, "length")],  # CHANGED: "wait" drains 64 tokens
)
def test_mode_request_lifecycle(server_url, mode, max_tokens, inflight_finish_reason):
    inflight = Stream(server_url, max_tokens)
    new_result: dict[str, Any] = {}
    new_done = threading.Event()

    def _new_request():
        new_result["response"] = gen(server_url, max_tokens=4, timeout=60)
        new_done.set()

    new_thread = threading.Thread(target=_new_request)
    try:
        assert pause(server_url, mode=mode) == 200
        assert is_paused(server_url)
        if mode in ("abort", "wait"):
            assert inflight.done.wait(5)  # CHANGED: the last event may trail /pause's answer by a moment
        else:
            chunks_after_pause = len(inflight.chunks)
            assert not inflight.done.wait(timeout=2)  # CHANGED: 2 s instead of 5
            assert len(inflight.chunks) == chunks_after_pause, "in-flight request continued generating in keep mode"
        new_thread.start()
        assert not new_done.wait(timeout=0.3), "new request completed while generation was paused"
    finally:
        assert resume(server_url) == 200
        inflight.thread.join(timeout=30)
        if new_thread.ident is not None:
            new_thread.join(timeout=30)
    assert not inflight.thread.is_alive()
    assert inflight.error is None
    assert inflight.finish_reason == inflight_finish_reason and not inflight.errors
    assert not new_thread.is_alive()
    assert ok(new_result.get("response"))


@pytest.mark.parametrize("mode", ["abort", "keep"])  # CHANGED: "keep" too (vLLM's code honours it there as well)
def test_clear_cache_preserves_output_and_controls_prefix_cache(server_url, mode):
    prompt = "Paris is the capital of France. Berlin is the capital of Germany. " * 4  # CHANGED: * 4, not * 20
    prompt = f"{mode}: {prompt}"  # CHANGED: a prompt per mode (one shared worker)
    assert pause(server_url, mode=mode, clear_cache=True) == 200
    assert resume(server_url) == 200
    baseline = gen(server_url, prompt)
    warmed = gen(server_url, prompt)
    assert cached_tokens(baseline) == 0
    assert cached_tokens(warmed) > 0
    assert pause(server_url, mode=mode, clear_cache=False) == 200
    assert resume(server_url) == 200
    preserved = gen(server_url, prompt)
    assert golden_output(preserved) == golden_output(baseline)
    assert cached_tokens(preserved) > 0
    assert pause(server_url, mode=mode, clear_cache=True) == 200
    assert resume(server_url) == 200
    cleared = gen(server_url, prompt)
    assert golden_output(cleared) == golden_output(baseline)
    assert cached_tokens(cleared) == 0


# ---- ported: dev/test_cache.py (CHANGED: a real worker, not a mocked engine) --------------------------------------
@pytest.mark.parametrize("params", [{}, {"reset_running_requests": "true"}])
def test_reset_prefix_cache_route(server_url, params):
    prompt = "a prefix long enough to fill whole KV blocks of sixteen tokens, twice over and more " * 2
    gen(server_url, prompt)
    assert cached_tokens(gen(server_url, prompt)) > 0
    response = httpx.post(f"{server_url}/reset_prefix_cache", params=params, headers=CONTROL, timeout=10)
    assert response.status_code == 200
    assert response.json() == {"success": True}
    assert cached_tokens(gen(server_url, prompt)) == 0


def test_reset_external_is_refused_by_name(server_url):
    # CHANGED: vLLM answers {"success": false} without a KV connector; rollout has none and says so.
    response = httpx.post(f"{server_url}/reset_prefix_cache", params={"reset_external": "true"}, headers=CONTROL)
    assert response.status_code == 400 and response.json()["error"]["param"] == "query.reset_external"


# ---- ported: serve/tokenize/test_tokenization.py -----------------------------------------------------------------
def test_tokenizer_info_basic_schema_and_consistency(server_url):
    result = httpx.get(f"{server_url}/tokenizer_info", headers=GENERATE).raise_for_status().json()
    assert isinstance(result["tokenizer_class"], str) and result["tokenizer_class"]
    field_types = {
        "add_bos_token": bool,
        "add_prefix_space": bool,
        "clean_up_tokenization_spaces": bool,
        "split_special_tokens": bool,
        "bos_token": str,
        "eos_token": str,
        "pad_token": str,
        "unk_token": str,
        "chat_template": str,
        "errors": str,
        "model_max_length": int,
        "additional_special_tokens": list,
        "added_tokens_decoder": dict,
    }
    for field, expected_type in field_types.items():
        if field in result and result[field] is not None:
            assert isinstance(result[field], expected_type), f"{field} should be {expected_type.__name__}"
    tokens = httpx.post(f"{server_url}/tokenize", json={"model": "tiny", "prompt": "Hello world!"}, headers=GENERATE)
    if result.get("model_max_length") and tokens.json()["max_model_len"]:
        assert result["model_max_length"] >= tokens.json()["max_model_len"]
    assert isinstance(result["chat_template"], str) and result["chat_template"].strip()
    # CHANGED (added): the settings are the worker's tokenizer's own.
    tokenizer = tiny_tokenizer()
    assert (result["eos_token"], result["chat_template"]) == (tokenizer.eos_token, tokenizer.chat_template)


# ---- ported: serve/lora/test_lora_adapters.py and test_dora_adapters.py --------------------------------------------
def test_dynamic_lora_load_unload_reload_and_lineage(server_url, shared):
    path = saved_adapter(shared / "alice", seed=1)
    response = load(server_url, {"lora_name": "alice", "lora_path": path})
    assert response.status_code == 200 and "success" in response.text.lower()
    models = httpx.get(f"{server_url}/v1/models", headers=GENERATE).json()["data"]
    assert models[-1]["id"] == "alice" and models[-1]["root"] == path and models[-1]["parent"] == "tiny"
    with_adapter = gen(server_url, max_tokens=4) | {}
    body = {"model": "alice", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{server_url}/v1/completions", json=body, headers=GENERATE).status_code == 200
    again = load(server_url, {"lora_name": "alice", "lora_path": path})
    assert again.status_code == 400 and "already been loaded" in again.text
    in_place = load(server_url, {"lora_name": "alice", "lora_path": path, "load_inplace": True})
    assert in_place.status_code == 200
    unloaded = httpx.post(f"{server_url}/v1/unload_lora_adapter", json={"lora_name": "alice"}, headers=CONTROL)
    assert unloaded.status_code == 200 and "success" in unloaded.text.lower()
    assert [m["id"] for m in httpx.get(f"{server_url}/v1/models", headers=GENERATE).json()["data"]] == ["tiny"]
    assert httpx.post(f"{server_url}/v1/completions", json=body, headers=GENERATE).status_code == 404
    assert ok(with_adapter)


def test_lora_errors(server_url, shared, tmp_path):
    assert load(server_url, {"lora_name": "notfound", "lora_path": str(shared / "not-an-adapter")}).status_code == 404
    invalid = shared / "invalid_files"
    invalid.mkdir(exist_ok=True)
    (invalid / "adapter_config.json").write_text("this is not json")
    # CHANGED: vLLM answers 500 for unreadable adapter files; rollout answers 400 naming lora_path.
    response = load(server_url, {"lora_name": "invalid-json", "lora_path": str(invalid)})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path"
    # Added: nothing outside --control-allowed-dirs is read, symbolic links included.
    outside = saved_adapter(tmp_path / "outside", seed=2)
    (shared / "link").symlink_to(outside)
    linked = shared / "linked"  # a directory inside whose adapter file is a link to one outside
    linked.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (linked / name).symlink_to(tmp_path / "outside" / name)
    for path in (outside, str(shared / "link"), str(shared / ".." / "outside"), str(linked)):
        assert load(server_url, {"lora_name": "evil", "lora_path": path}).status_code == 403
    for path in (str(shared) + "\x00x", str(shared / ("a" * 300))):  # a NUL byte, a name too long: 400, not 500
        response = load(server_url, {"lora_name": "odd", "lora_path": path})
        assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path"
    missing = httpx.post(f"{server_url}/v1/unload_lora_adapter", json={"lora_name": "nonexistent"}, headers=CONTROL)
    assert missing.status_code == 404
    # Added: a name the engine refuses (the served model's own) is named as the route's field, lora_name.
    good = saved_adapter(shared / "named", seed=3)
    response = load(server_url, {"lora_name": "tiny", "lora_path": good})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_name", response.text


# ---- ported: dev/rlhf/test_weight_update.py --------------------------------------------------------------------
def test_get_world_size_positive(server_url):
    response = httpx.get(f"{server_url}/get_world_size", params={"include_dp": True}, headers=CONTROL)
    assert response.status_code == 200
    world_size = response.json()["world_size"]
    assert isinstance(world_size, int) and world_size >= 1


@pytest.mark.parametrize("path", ["/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update"])
def test_nccl_weight_transfer_is_refused_at_once(server_url, path):
    # CHANGED: vLLM without --weight-transfer-config answers 400/409/500; rollout answers 501 naming what it supports.
    response = httpx.post(f"{server_url}{path}", json={}, headers=CONTROL, timeout=10)
    assert response.status_code == 501 and "weight_dir" in response.json()["error"]["message"]
    update = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
    response = httpx.post(f"{server_url}/update_weights", json=update, headers=CONTROL, timeout=10)
    assert response.status_code == 501 and response.json()["error"]["param"] == "update_info"
    assert ok(gen(server_url))  # the engine stays healthy and still generates


# ---- rollout's own -------------------------------------------------------------------------------------------
def test_server_info_in_vllms_shape(server_url):
    info = httpx.get(f"{server_url}/server_info", params={"config_format": "json"}, headers=CONTROL).json()
    config = info["vllm_config"]
    assert config["model_config"]["model"] == "tiny" and config["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert config["parallel_config"]["data_parallel_size"] == 1
    assert config["lora_config"]["max_loras"] >= 1 and isinstance(info["policy_version"], int)
    text = httpx.get(f"{server_url}/server_info", headers=CONTROL).json()
    assert isinstance(text["vllm_config"], str)
    bad = httpx.get(f"{server_url}/server_info", params={"config_format": "yaml"}, headers=CONTROL)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.config_format"


def test_the_generation_key_opens_no_control_route(server_url):
    for method, path in (("POST", "/pause"), ("POST", "/abort_requests"), ("POST", "/update_weights")):
        assert httpx.request(method, f"{server_url}{path}", headers=GENERATE).status_code == 401
    assert not is_paused(server_url)
    refused = httpx.get(f"{server_url}/is_paused")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"  # RFC 9110's challenge
    assert refused.headers["connection"] == "close"  # its body, if any, is never read
    # The control key opens the generation routes too (the operator's), its scheme in any case (RFC 9110 11.1).
    assert httpx.get(f"{server_url}/v1/models", headers=CONTROL).status_code == 200
    for spelled in ("bearer ", "BEARER   "):
        key = {"Authorization": CONTROL["Authorization"].replace("Bearer ", spelled)}
        assert httpx.get(f"{server_url}/is_paused", headers=key).status_code == 200


def test_abort_requests_by_id_and_all(server_url):
    inflight = Stream(server_url, 256)
    request_id = inflight.chunks[0]["id"]
    response = httpx.post(f"{server_url}/abort_requests", json={"request_ids": [request_id, "cmpl-x"]}, headers=CONTROL)
    assert response.json() == {"status": "aborted", "aborted": 1, "not_found": ["cmpl-x"]}
    inflight.thread.join(30)
    assert inflight.finish_reason == "abort" and not inflight.errors and len(inflight.chunks) < 256
    inflight = Stream(server_url, 256)
    # CHANGED (vLLM's dev server: no body is a 400 too): a body is needed; {} aborts every request.
    for refused in (
        httpx.post(f"{server_url}/abort_requests", headers=CONTROL),
        httpx.post(f"{server_url}/abort_requests", params={"request_ids": request_id}, headers=CONTROL),
    ):
        assert refused.status_code == 400 and not inflight.done.is_set()
    response = httpx.post(f"{server_url}/abort_requests", json={}, headers=CONTROL)
    assert response.status_code == 200 and response.json()["aborted"] >= 1
    inflight.thread.join(30)
    assert inflight.finish_reason == "abort"
    # A whole (not streamed) answer ended by an abort is an answer too, as vLLM's: what was sampled, "abort".
    answers: list = []
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "return_token_ids": True}
    waiting = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{server_url}/v1/completions", json=body, headers=GENERATE, timeout=60)
        )
    )
    waiting.start()
    time.sleep(0.3)
    assert pause(server_url, mode="abort") == 200
    waiting.join(30)
    choice = answers[0].json()["choices"][0]
    assert answers[0].status_code == 200 and choice["finish_reason"] == "abort"
    assert 0 < len(choice["token_ids"]) < 400 and choice["policy_versions"][0][1] == 0
    nothing = httpx.post(f"{server_url}/abort_requests", json={"request_ids": []}, headers=CONTROL)
    assert nothing.json() == {"status": "aborted", "aborted": 0, "not_found": []}  # [] is every request: none runs
    bad = httpx.post(f"{server_url}/abort_requests", json={"ids": []}, headers=CONTROL)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ids"


def metric(line_start: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def test_every_control_route_is_counted_by_name_in_the_http_metrics(server_url):
    from rollout.service.http.control.routes import CONTROL_PATHS
    from rollout.service.http.serving.app import ENDPOINTS

    assert CONTROL_PATHS | {"/tokenizer_info"} <= ENDPOINTS
    counted = metric('rollout_http_requests_total{endpoint="/pause",status="200"}')
    refused = metric('rollout_http_requests_total{endpoint="/pause",status="401"}')
    assert pause(server_url, mode="keep") == 200 and metric("rollout_generation_paused ") == 1
    assert httpx.post(f"{server_url}/pause", headers=GENERATE).status_code == 401
    assert resume(server_url) == 200 and metric("rollout_generation_paused ") == 0
    assert metric('rollout_http_requests_total{endpoint="/pause",status="200"}') == counted + 1
    assert metric('rollout_http_requests_total{endpoint="/pause",status="401"}') == refused + 1


def test_waiting_pauses_hold_no_thread_the_other_routes_need(server_url):
    """Pauses that wait for a long sample hold no worker thread: /resume and completions still answer at once."""
    inflight = Stream(server_url, 400)
    waiting = [
        threading.Thread(target=lambda: httpx.post(f"{server_url}/pause?mode=wait", headers=CONTROL, timeout=60))
        for _ in range(12)  # more than the default thread pool of a 2-core machine (6)
    ]
    for thread in waiting:
        thread.start()
    time.sleep(0.5)
    started = time.monotonic()
    tokenized = httpx.post(f"{server_url}/tokenize", json={"prompt": "hi"}, headers=GENERATE, timeout=10)
    assert tokenized.status_code == 200 and time.monotonic() - started < 5  # parsed on a worker thread
    assert resume(server_url) == 200 and time.monotonic() - started < 5
    for thread in waiting:
        thread.join(30)
    inflight.thread.join(60)
    assert inflight.finish_reason == "length"


def test_a_refused_update_weights_is_counted_with_the_refused_updates(server_url, shared):
    """A checkpoint refused by /update_weights adds to rollout_weight_updates_rejected_total, as a refused ZeroMQ
    push does (it had been answered 400 and counted nowhere)."""
    checkpoint = shared / "checkpoint"  # a directory of its own: other tests leave links in `shared`
    checkpoint.mkdir(exist_ok=True)
    before = metric("rollout_weight_updates_rejected_total ")
    response = httpx.post(
        f"{server_url}/update_weights", json={"weight_dir": str(checkpoint), "mode": "sometimes"}, headers=CONTROL
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "mode"
    assert metric("rollout_weight_updates_rejected_total ") == before + 1
