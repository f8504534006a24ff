"""Resources are released when their owner closes, never left to a garbage collection: each test runs its owner with
the collector off and checks that what it held (the manager behind an HTTP app, a worker with metrics, the rendezvous
store of a refused torch.distributed push) is gone once the owner stopped. Engines and models are mostly not checked:
this suite's conftest keeps every engine a test builds (`no_leaked_blocks`); the manager is what holds them. The one
owner that is the model itself (the engine `generate_batch(..., persistent_manager=True)` keeps) lets them go with it,
to a collection: it is released at once only by `release_cached_engine`."""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator

import pytest

from conftest import tiny_model
from rollout import ContinuousBatchingConfig, init_continuous_batching
from rollout.presets import tiny_model as preset_model
from rollout.presets import tiny_tokenizer
from rollout.service.launch.cli import build_parser
from rollout.service.launch.startup import start_worker
from trainer_bridge import RolloutClient, RolloutError
from trainer_bridge.weights.weight_sync import push_weights


@pytest.fixture
def collector_off() -> Iterator[None]:
    """No garbage collection while the test runs: what a reference cycle holds stays held."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def open_sockets() -> int:
    """This process's open socket descriptors."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith("socket:")
        except OSError:  # closed while listed
            pass
    return count


def serve_in_process(*flags: str):
    """An in-process rollout-worker on the tiny model (a free loopback port) serving on a thread: (its
    `RunningWorker`, the thread)."""
    parser = build_parser()
    argv = ["--bind", "tcp://127.0.0.1:*", "--num-blocks", "32", "--device", "cpu", "--log-level", "ERROR", *flags]
    running = start_worker(parser, parser.parse_args(argv))
    serving = threading.Thread(target=running.serve)
    serving.start()
    return running, serving


def stop_serving(running, serving: threading.Thread) -> None:
    running.worker.shutdown()
    serving.join(60)
    assert not serving.is_alive()


def test_a_stopped_http_server_lets_its_manager_go(collector_off):
    """FastAPI keeps every endpoint callable in process-wide caches, and its app and router refer to each other:
    the routes' closures (the manager, its engine, the model) must be let go by `stop`, not by a collection."""
    pytest.importorskip("fastapi")
    import httpx

    from rollout.service.http.serving.server import HttpServer
    from rollout.service.http.serving.settings import HttpSettings

    config = ContinuousBatchingConfig(num_blocks=16)
    manager = init_continuous_batching(preset_model(0), continuous_batching_config=config, tokenizer=tiny_tokenizer())
    manager.start()
    settings = HttpSettings(host="127.0.0.1", port=0, model_name="tiny")
    server = HttpServer(manager, manager.engine.intake.tokenizer, settings).start()
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 2, "ignore_eos": True, "return_token_ids": True}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) == 2
    server.stop()
    server.stop()  # twice: nothing more to do
    manager.stop()
    held = weakref.ref(manager)
    del server, manager
    assert held() is None


# uvicorn ends its thread with SystemExit when it cannot listen (what `start` reports as a RuntimeError).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_http_server_that_cannot_listen_leaves_nothing(collector_off):
    """A taken port: `start` raises, and neither its thread nor the app (holding the manager) stays behind."""
    pytest.importorskip("fastapi")
    from rollout.service.http.serving.server import HttpServer
    from rollout.service.http.serving.settings import HttpSettings

    manager = init_continuous_batching(tiny_model(), continuous_batching_config=ContinuousBatchingConfig(num_blocks=16))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = HttpSettings(host="127.0.0.1", port=taken.getsockname()[1], model_name="tiny")
        with pytest.raises(RuntimeError, match="did not start"):
            HttpServer(manager, None, settings).start()
    assert not [thread for thread in threading.enumerate() if thread.name == "rollout-http"]
    manager.destroy()
    held = weakref.ref(manager)
    del manager
    assert held() is None


def test_a_manager_whose_weight_update_failed_goes_once_destroyed(collector_off):
    """A refused weight update raises on the caller's thread: the error's traceback (the caller may keep it) holds
    the frames that raised it, and must not hold itself in one of them (a cycle keeping the manager, its engine and
    model until a collection)."""
    manager = init_continuous_batching(tiny_model(), continuous_batching_config=ContinuousBatchingConfig(num_blocks=16))
    manager.start()
    name, tensor = next(iter(manager.engine.model.state_dict().items()))
    with pytest.raises(ValueError, match="shape"):
        manager.update_weights({name: tensor.new_zeros(3)}, partial=True)
    manager.destroy()
    held = weakref.ref(manager)
    del manager
    assert held() is None


def test_a_manager_whose_step_or_control_call_failed_goes_once_destroyed(collector_off, monkeypatch):
    """A forward that raises once (its step's requests end with the error, the engine goes on) and refused control
    calls (on the engine thread, and before it started): the errors reach callers and outputs, and none holds itself
    in a frame its traceback keeps (each frame keeps its callers: the engine thread's loop, the manager)."""
    import logging

    # The step's logged traceback would be kept by pytest's log capture (a handler that stores its records).
    monkeypatch.setattr(logging.getLogger("rollout.engine.engine"), "propagate", False)

    def failed_step(manager) -> None:
        model, calls = manager.engine.model, []
        forward = model.forward

        def once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("forward failed once")
            return forward(*args, **kwargs)

        model.forward = once
        first = manager.get_result(manager.add_request([5, 9, 14], max_new_tokens=3), timeout=60)
        assert "forward failed once" in (first.error or "")
        assert manager.get_result(manager.add_request([5, 9, 14], max_new_tokens=3), timeout=60).error is None
        del model.forward

    def refused_calls(manager) -> None:
        with pytest.raises(ValueError):
            manager.control.pause_generation(mode="bogus")
        with pytest.raises(Exception, match="nope"):
            manager.control.unload_adapter("nope", timeout=30)

    for start, drive in ((True, failed_step), (True, refused_calls), (False, refused_calls)):
        config = ContinuousBatchingConfig(num_blocks=16)
        manager = init_continuous_batching(tiny_model(), continuous_batching_config=config)
        if start:
            manager.start()
        drive(manager)
        manager.destroy()
        held = weakref.ref(manager)  # (not its engine: this suite's conftest keeps every engine built)
        del manager
        assert held() is None, (start, drive.__name__)


def test_a_worker_with_metrics_leaves_no_cycle(collector_off):
    """`--metrics-port`: the manager holds the metrics (its step observer), which must not hold the worker back."""
    running, serving = serve_in_process("--metrics-port", "0")
    stop_serving(running, serving)
    held = weakref.ref(running.manager), weakref.ref(running.worker)
    del running
    assert [ref() is None for ref in held] == [True, True]


def test_a_worker_whose_http_front_fails_to_start_leaves_no_metrics_server(monkeypatch):
    """--http that cannot listen once the model loaded (its port taken meanwhile: a usage error, SystemExit), after
    --metrics-port started: the metrics server must not stay up, answering every scrape with a 500 (it reads the
    worker's stats through a weak proxy, and the worker is gone with the failed start)."""
    import rollout.service.launch.startup as startup

    def taken(parser, *args, **kwargs):
        parser.error("--http 127.0.0.1:1: the HTTP server did not start on 127.0.0.1:1")

    built = []
    worker_class = startup.RolloutWorker

    def recorded(*args, **kwargs):
        built.append(worker_class(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(startup, "start_http", taken)
    monkeypatch.setattr(startup, "RolloutWorker", recorded)
    sockets = open_sockets()
    with pytest.raises(SystemExit):
        serve_in_process("--metrics-port", "0", "--http", "127.0.0.1:0")
    assert not [thread for thread in threading.enumerate() if thread.name == "rollout-metrics"]
    # ... nor the worker's bound socket or its ZeroMQ context (its I/O threads' sockets)
    (worker,) = built
    assert worker._socket.closed and worker._context.closed
    assert open_sockets() <= sockets
    with pytest.raises(RuntimeError, match="it is closed"):
        worker.serve()


def test_a_worker_closed_before_serving_releases_its_socket():
    """`RolloutWorker.close()` on a worker that never served: its address is free again at once (bound anew)."""
    from rollout.service.zmq.worker import RolloutWorker

    manager = init_continuous_batching(tiny_model(), continuous_batching_config=ContinuousBatchingConfig(num_blocks=8))
    worker = RolloutWorker(manager, "tcp://127.0.0.1:*", "tiny")
    address = worker.address
    worker.close()
    worker.close()  # again: nothing left to do
    again = RolloutWorker(manager, address, "tiny")  # the same port: refused (EADDRINUSE) while the first held it
    again.close()
    assert again.address == address


def test_a_worker_bound_to_an_ipc_path_removes_its_socket_file(tmp_path):
    """libzmq leaves the file of an ipc:// address it bound (closing the socket does not unlink it): the worker that
    made it removes it when it stops serving, and when closed before serving. A file another worker took over since
    (libzmq replaces it on bind) is that worker's: left alone."""
    from rollout.service.zmq.worker import RolloutWorker

    path = tmp_path / "worker.sock"
    running, serving = serve_in_process("--bind", f"ipc://{path}")
    assert path.is_socket()
    stop_serving(running, serving)
    assert not path.exists()
    manager = init_continuous_batching(tiny_model(), continuous_batching_config=ContinuousBatchingConfig(num_blocks=8))
    try:
        first = RolloutWorker(manager, f"ipc://{path}", "tiny")
        second = RolloutWorker(manager, f"ipc://{path}", "tiny")  # takes the path over (a new file)
        first.close()
        assert path.is_socket()  # the second worker's
        second.close()
        assert not path.exists()
    finally:
        manager.destroy()


def test_a_bind_that_fails_once_the_model_loaded_is_a_usage_error_leaving_nothing(capsys):
    """--bind passes the checks made before the model loads (an ipc:// path in a missing directory; likewise a port
    taken since it was probed) but cannot bind after: a usage error naming --bind, not a ZMQError traceback, and
    the start leaves no engine thread and no socket."""
    sockets = open_sockets()
    with pytest.raises(SystemExit):
        serve_in_process("--bind", "ipc:///nonexistent-rollout-dir/worker.sock")
    assert "--bind ipc:///nonexistent-rollout-dir/worker.sock: cannot bind" in capsys.readouterr().err
    assert not [thread for thread in threading.enumerate() if thread.name == "rollout-engine"]
    assert open_sockets() <= sockets


def test_a_refused_torch_distributed_push_closes_its_store(collector_off):
    """A push refused at weights_begin (version not above the worker's): its rendezvous store (a listening socket,
    its connections, a thread) is closed once the abandoned join ends, not at a collection."""
    running, serving = serve_in_process()
    try:
        weights = {name: tensor.detach().clone() for name, tensor in running.model.state_dict().items()}
        with RolloutClient(running.worker.address, timeout=30) as client:
            push_weights(client, weights, version=5, transport="frames")
            client.wait_connected()
            before = open_sockets()
            for _ in range(3):
                with pytest.raises(RolloutError, match="must exceed the current version 5"):
                    push_weights(client, weights, version=5, transport="torch.distributed", timeout=1.0)
            deadline = time.monotonic() + 30
            while any(thread.name == "rollout-weights-join" for thread in threading.enumerate()):
                assert time.monotonic() < deadline, "the abandoned joins did not end at their timeout"
                time.sleep(0.05)
            # Each store held about 8 sockets; a few may differ for other reasons (the client's own connection).
            assert open_sockets() - before <= 3
    finally:
        stop_serving(running, serving)


def test_a_closed_client_is_freed_without_a_collection_after_calls_that_failed(collector_off):
    """A RolloutClient, once closed and dropped, is gone at once: after a generate answered, one that failed (no
    worker: its RolloutError's traceback held the frame that raised it, and so the client), an asyncio call that
    failed, and a stream cut by the close. Its I/O thread's liveness held the dispatcher's own send: a cycle too."""
    import asyncio

    from trainer_bridge import PromptGroup

    group = PromptGroup([5, 9, 14], sampling={"max_new_tokens": 3, "seed": 0})
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        nobody = f"tcp://127.0.0.1:{free.getsockname()[1]}"

    def dropped(client: RolloutClient) -> tuple[weakref.ref, weakref.ref]:
        client.close()
        return weakref.ref(client), weakref.ref(client._io)  # the client, and its I/O thread's sockets and state

    running, serving = serve_in_process()
    try:
        held = []
        with RolloutClient(running.worker.address, timeout=30) as client:
            assert client.generate(group).completions[0].finish_reason == "length"
            stream = client.stream(PromptGroup([5, 9, 14], sampling={"max_new_tokens": 200, "seed": 0}))
            next(stream)
        with pytest.raises(RolloutError, match="closed"):
            for _ in stream:
                pass
        del stream
        held.append(dropped(client))
        client = RolloutClient(nobody, connect_timeout=0.2, timeout=0.5)
        with pytest.raises(RolloutError):
            client.generate(group, timeout=0.5)
        held.append(dropped(client))
        client = RolloutClient(nobody, connect_timeout=0.2, timeout=0.5)

        async def failing(client: RolloutClient) -> None:  # caught in the task (asyncio's task and traceback
            with pytest.raises(RolloutError):  # hold each other)
                await client.agenerate(group, timeout=0.5)

        asyncio.run(failing(client))
        held.append(dropped(client))
        del client
        assert [(client() is None, io() is None) for client, io in held] == [(True, True)] * 3
    finally:
        stop_serving(running, serving)


def test_a_client_that_pushed_weights_is_freed_without_a_collection(collector_off):
    """A push (its senders held the push, which held them: the client, its channel and the pushed entries stayed
    until a collection), accepted or refused."""
    running, serving = serve_in_process()
    try:
        weights = {name: tensor.detach().clone() for name, tensor in running.model.state_dict().items()}
        held = []
        for version in (None, 1):  # accepted; refused (not above the version the first push set)
            client = RolloutClient(running.worker.address, timeout=30)
            if version is None:
                push_weights(client, weights, transport="frames")
            else:
                with pytest.raises(RolloutError, match="must exceed"):
                    push_weights(client, weights, version=version, transport="frames")
            client.close()
            held += [weakref.ref(client), weakref.ref(client._io)]
            del client
        assert [ref() is None for ref in held] == [True] * 4
    finally:
        stop_serving(running, serving)


def test_a_dropped_model_frees_the_engine_generate_batch_kept_for_it(no_leaked_blocks):
    """transformers keeps its manager on the model; ours is kept on it too, so a model the caller drops is freed with
    its engine (KV cache, graphs) by the next collection. It was never freed: a table keyed weakly by the model held
    the engine, and the engine held the model. A deep copy of the model carries no engine."""
    import copy

    from rollout import SamplingParams, generate_batch
    from rollout.engine.generate import cached_engine

    sampling = SamplingParams(max_new_tokens=2, stop_token_ids=())
    config = ContinuousBatchingConfig(num_blocks=64, block_size=16)
    models, engines = [], []
    for seed in range(3):
        model = tiny_model(seed=seed)
        generate_batch(model, [[1, 2, 3]], sampling=sampling, continuous_batching_config=config,
                       persistent_manager=True, progress_bar=False)  # fmt: skip
        engine = cached_engine(model)
        assert engine is not None
        duplicate = copy.deepcopy(model)
        assert cached_engine(duplicate) is None  # no engine copied with the model
        del duplicate
        models.append(weakref.ref(model))
        engines.append(weakref.ref(engine))
        del model, engine
    for built in no_leaked_blocks:  # the conftest's own check, then its hold on the engines let go
        built.block_manager.check_all_free()
    del built
    no_leaked_blocks.clear()
    gc.collect()
    assert [ref() for ref in models] == [None] * 3
    assert [ref() for ref in engines] == [None] * 3


def test_a_client_dropped_without_close_stops_its_thread_and_closes_its_sockets(collector_off):
    """A RolloutClient dropped unclosed (a trainer that forgot close()) once kept its I/O thread pinging its workers,
    its sockets open, until the process exited."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        nobody = f"tcp://127.0.0.1:{free.getsockname()[1]}"
    before = open_sockets()
    client = RolloutClient(nobody, connect_timeout=0.2, timeout=0.5)
    thread, io = client._io._thread, weakref.ref(client._io)
    del client
    thread.join(10)
    assert not thread.is_alive() and io() is None
    assert open_sockets() <= before


def test_a_progress_bar_leaves_no_thread_behind():
    """generate_batch(progress_bar=True) left tqdm's monitor thread running for the process's life (the bar is
    redrawn by the engine's steps; the monitor only redraws bars left waiting)."""
    import subprocess
    import sys

    script = (
        "import threading\n"
        "from rollout import generate_batch\n"
        "from rollout.presets import tiny_model\n"
        "generate_batch(tiny_model(), [[1, 2, 3]] * 2, max_new_tokens=2, progress_bar=True)\n"
        "print(sorted(thread.name for thread in threading.enumerate()))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['MainThread']"
