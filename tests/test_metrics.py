"""Observability: a real worker's /metrics parses with prometheus_client's own parser and its counters move by
exactly what a workload did (tokens, groups, a weight update), in agreement with the stats message; with the
OpenTelemetry SDK's in-memory exporter a group produces one span with the documented attributes, and a weight
update one span."""

from __future__ import annotations

import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout.presets import tiny_model
from service_helpers import Worker, free_port
from trainer_bridge import PromptGroup, RolloutClient, push_weights

pytestmark = pytest.mark.timeout(120)

GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 9}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_move_with_a_workload_and_agree_with_stats():
    port = free_port()
    worker = Worker("--metrics-port", str(port))
    try:
        before = scrape(port)
        with RolloutClient(worker.address, timeout=60) as client:
            results = [client.generate(PromptGroup([i, 2, 3], n=3, sampling=GREEDY)) for i in range(4)]
            push_weights(client, tiny_model(5))
            stats = client.stats()[0]
        after = scrape(port)
    finally:
        worker.close()

    def moved(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    tokens = sum(len(c.token_ids) for r in results for c in r.completions)
    assert tokens == 4 * 3 * 9
    assert moved("rollout_generated_tokens_total") == tokens
    assert moved("rollout_groups_finished_total") == 4 and moved("rollout_groups_received_total") == 4
    assert moved("rollout_samples_finished_total", (("reason", "length"),)) == 12
    assert moved("rollout_prefill_tokens_total") > 0
    assert moved("rollout_weight_updates_total") == 1 and moved("rollout_weight_update_bytes_total") > 1e5
    assert after[("rollout_policy_version", ())] == 1
    assert after[("rollout_kv_blocks", (("state", "used"),))] == 0
    assert moved("rollout_step_seconds_count") >= 9
    # The stats message carries the same counters.
    assert after[("rollout_generated_tokens_total", ())] == stats["generated_tokens"]
    assert after[("rollout_groups_finished_total", ())] == stats["groups_finished"]
    assert after[("rollout_weight_update_bytes_total", ())] == stats["weight_update_bytes"]


def test_a_group_and_a_weight_update_each_make_one_span():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rollout import ContinuousBatchingConfig
    from rollout.engine.manager.continuous_batching import init_continuous_batching
    from rollout.service.observability.tracing import Tracer
    from rollout.service.zmq.worker import RolloutWorker

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    manager = init_continuous_batching(tiny_model(), continuous_batching_config=ContinuousBatchingConfig(num_blocks=64))
    worker = RolloutWorker(manager, "tcp://127.0.0.1:*", "tiny", tracer=Tracer(provider))
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        with RolloutClient(worker.address, timeout=60) as client:
            result = client.generate(PromptGroup([5, 6, 7, 8], n=2, sampling=GREEDY, group_id="traced"))
            push_weights(client, tiny_model(3))
    finally:
        worker.shutdown()
        thread.join(30)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    group = spans["rollout.group"]
    assert [s.name for s in exporter.get_finished_spans()].count("rollout.group") == 1
    attributes = dict(group.attributes)
    assert attributes["rollout.group_id"] == "traced" and attributes["rollout.n"] == 2
    assert attributes["rollout.prompt_tokens"] == 4
    assert attributes["rollout.completion_tokens"] == sum(len(c.token_ids) for c in result.completions) == 18
    assert list(attributes["rollout.finish_reasons"]) == ["length", "length"]
    assert list(attributes["rollout.policy_versions"]) == [0] and attributes["rollout.kv_version_min"] == 0
    assert [event.name for event in group.events] == ["first_token"]
    update = dict(spans["rollout.weight_update"].attributes)
    assert update["rollout.outcome"] == "committed" and update["rollout.version"] == 1 and update["rollout.bytes"] > 0


def test_an_http_request_makes_one_group_span_per_prompt(monkeypatch):
    """/v1/completions groups get the rollout.group span ZeroMQ groups get (they had none), with their totals."""
    import httpx2 as httpx
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rollout import ContinuousBatchingConfig
    from rollout.engine.manager.continuous_batching import init_continuous_batching
    from rollout.presets import tiny_tokenizer
    from rollout.service.http.api import endpoints
    from rollout.service.http.serving.server import HttpServer
    from rollout.service.http.serving.settings import HttpSettings
    from rollout.service.observability.tracing import Tracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(endpoints, "Tracer", lambda: Tracer(provider))
    config = ContinuousBatchingConfig(num_blocks=64)
    manager = init_continuous_batching(tiny_model(), continuous_batching_config=config, tokenizer=tiny_tokenizer())
    manager.start()
    http = HttpServer(manager, tiny_tokenizer(), HttpSettings(max_n=8, max_prompt_len=1024)).start()
    try:
        body = {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "n": 2, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{http.url}/v1/completions", json=body, timeout=60).json()
        assert len(answer["choices"]) == 4
    finally:
        http.stop()
        manager.stop()
    groups = [dict(span.attributes) for span in exporter.get_finished_spans() if span.name == "rollout.group"]
    assert sorted(group["rollout.prompt_tokens"] for group in groups) == [2, 3]
    for group in groups:
        assert group["rollout.client"] == "http" and group["rollout.n"] == 2
        assert group["rollout.completion_tokens"] == 8 and list(group["rollout.finish_reasons"]) == ["length"] * 2
        assert list(group["rollout.policy_versions"]) == [0]


def test_scrapes_that_trickle_free_their_slot_at_the_deadline_and_end_quietly(monkeypatch, capfd):
    """Connections that send a byte now and then (each read within the per-read timeout) held every scrape slot for
    ever, and a silent one printed a traceback: each now ends at SCRAPE_TIMEOUT_S, quietly, and a scrape gets in."""
    import socket
    import time

    from prometheus_client import CollectorRegistry

    from rollout.service.observability import metrics_server

    monkeypatch.setattr(metrics_server, "SCRAPE_TIMEOUT_S", 0.6)
    monkeypatch.setattr(metrics_server._QuietHandler, "timeout", 0.4)
    server = metrics_server.MetricsServer(CollectorRegistry(), 0)
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(metrics_server.MAX_CONCURRENT_SCRAPES)]
    try:
        for _ in range(6):  # 1.2 s of a byte every 0.2 s: within the per-read timeout, past the whole deadline
            for connection in slow:
                try:
                    connection.sendall(b"G")
                except OSError:  # shut down at the deadline
                    pass
            time.sleep(0.2)
        assert urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).status == 200
    finally:
        for connection in slow:
            connection.close()
        server.close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_port_in_use_is_an_os_error_naming_it_not_an_attribute_error():
    """A metrics port another socket holds (the worker's own --bind, a race after the probe) raised AttributeError
    from server_close, which socketserver calls when its bind fails: rollout-worker printed a traceback instead of
    its usage error. The OSError now reaches the caller, and nothing is left listening."""
    import errno
    import socket

    from prometheus_client import CollectorRegistry

    from rollout.service.observability.metrics_server import MetricsServer

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(OSError) as raised:
            MetricsServer(CollectorRegistry(), port)
        assert raised.value.errno == errno.EADDRINUSE
    finally:
        holder.close()
    assert not [t for t in threading.enumerate() if t.name in ("rollout-metrics", "rollout-metrics-deadlines")]


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
@pytest.mark.parametrize("api_installed", [True, False])
def test_an_otlp_endpoint_without_the_extra_is_warned_about_by_its_name(monkeypatch, caplog, variable, api_installed):
    """An operator who sets an OTLP endpoint on a worker without rollout[otel] is told that no traces leave: without
    opentelemetry-api the endpoint was ignored silently, and a traces endpoint was reported as the general one."""
    import builtins
    import logging

    from rollout.service.observability import tracing

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "http://127.0.0.1:48099")
    if not api_installed:
        monkeypatch.setattr(tracing, "_trace", None)
    real_import = builtins.__import__

    def no_exporter(name, *args, **kwargs):
        if name.startswith("opentelemetry.exporter"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_exporter)
    with caplog.at_level(logging.WARNING, logger=tracing.__name__):
        assert tracing.configure_tracing() is False
    assert [r.getMessage() for r in caplog.records] == [
        f'{variable} is set but rollout[otel] is not installed (pip install "rollout[otel]"): no traces'
    ]


def test_silent_connections_in_every_slot_do_not_keep_a_scrape_out():
    """Sixteen connections that send nothing held every slot, so each scrape was closed for up to 10 s, again and
    again for anyone who reconnects them: the connection open longest now makes way for a new one."""
    import socket

    from prometheus_client import CollectorRegistry

    from rollout.service.observability import metrics_server

    server = metrics_server.MetricsServer(CollectorRegistry(), 0)
    silent = [
        socket.create_connection(("127.0.0.1", server.port)) for _ in range(metrics_server.MAX_CONCURRENT_SCRAPES)
    ]
    try:
        for _ in range(3):
            assert urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).status == 200
    finally:
        for connection in silent:
            connection.close()
        server.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_tokens_are_every_prompt_token_one_token_chunks_too(overlap):
    """prefill_tokens counts prompt tokens however they are chunked: a one-token prompt, and a prompt whose chunked
    prefill ends with one token, had been counted as decodes (every one-token chunk was), 3 of 13 here."""
    from conftest import make_engine, tiny_model

    engine = make_engine(tiny_model(), max_batch_tokens=4, overlap_scheduling=overlap, allow_block_sharing=False)
    try:
        for group_id, prompt in (("one", [7]), ("nine", list(range(3, 12))), ("three", [5, 6, 9])):
            engine.add_request(group_id, prompt, {"do_sample": False, "stop_token_ids": []}, max_new_tokens=5)
        while engine.has_unfinished():
            engine.step()
        assert engine.stats()["prefill_tokens"] == 1 + 9 + 3
    finally:
        engine.close()


def test_a_scrape_being_answered_is_never_the_one_that_makes_way():
    """A slow scrape (a collector that takes a second) is the oldest connection when twenty silent ones follow it:
    the silent ones make way for each other, the scrape is answered whole (it had been cut)."""
    import socket
    import time

    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily

    from rollout.service.observability import metrics_server

    class Slow:
        def collect(self):
            time.sleep(1.0)
            yield GaugeMetricFamily("slow", "a slow collector", value=1.0)

    registry = CollectorRegistry()
    registry.register(Slow())
    server = metrics_server.MetricsServer(registry, 0)
    answered: list[str] = []
    scrape = threading.Thread(
        target=lambda: answered.append(
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
        )
    )
    silent = []
    try:
        scrape.start()
        time.sleep(0.3)  # its head was read; it is being answered
        silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
        scrape.join(10)
        assert answered and "slow 1.0" in answered[0]
    finally:
        for connection in silent:
            connection.close()
        server.close()
