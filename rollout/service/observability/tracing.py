"""OpenTelemetry traces of a worker (the optional extra `rollout[otel]`): one span per group and one per weight
update. Without the `opentelemetry` packages every call here is a no-op that costs one attribute check.

`configure_tracing()` (called by `rollout-worker`) installs an OTLP exporter configured by the standard OTEL_*
environment variables (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SERVICE_NAME, ...)
when one of the endpoints is set; OTEL_SDK_DISABLED=true turns it off. A process that configured its own tracer
provider (tests, or an embedding application) gets its spans through it.

Group span "rollout.group": from the moment the worker accepted the group to its last sample, with the event
"first_token" and the attributes rollout.group_id, rollout.client, rollout.n, rollout.prompt_tokens,
rollout.completion_tokens, rollout.finish_reasons (one per sample), rollout.policy_versions (every version that
sampled a token) and rollout.kv_version_min. Weight-update span "rollout.weight_update": from weights_begin to its
commit or rejection, with rollout.update_id, rollout.tensors, rollout.bytes, rollout.transport, rollout.mode,
rollout.outcome ("committed" or the error code), and on commit rollout.version and rollout.pause_ms.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

try:  # the optional extra
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - exercised where the extra is absent
    _trace = None


def configure_tracing(service_name: str = "rollout-worker") -> bool:
    """Install an OTLP span exporter from the OTEL_* environment variables, when an endpoint is set and the extra
    is installed. Returns whether traces are exported."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    variable = next(
        (
            name
            for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            if os.environ.get(name)
        ),
        None,
    )
    if variable is None:
        return False
    try:  # (without opentelemetry-api too: an endpoint set must not be ignored silently)
        if _trace is None:
            raise ImportError("opentelemetry")
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning(
            '%s is set but rollout[otel] is not installed (pip install "rollout[otel]"): no traces', variable
        )
        return False
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # reads the OTEL_EXPORTER_OTLP_* variables
    _trace.set_tracer_provider(provider)
    return True


class Tracer:
    """Starts and ends the worker's spans; every method is a no-op without OpenTelemetry."""

    def __init__(self, provider: Any = None):
        """
        Args:
            provider: an OpenTelemetry TracerProvider (default: the global one, which `configure_tracing` sets).
        """
        if _trace is None:
            self._tracer = None
        else:
            self._tracer = (provider or _trace.get_tracer_provider()).get_tracer("rollout")

    def group_started(self, group_id: str, client: str, n: int, prompt_tokens: int) -> Any:
        """A span for an accepted group (None without OpenTelemetry)."""
        if self._tracer is None:
            return None
        return self._tracer.start_span(
            "rollout.group",
            attributes={
                "rollout.group_id": group_id,
                "rollout.client": client,
                "rollout.n": n,
                "rollout.prompt_tokens": prompt_tokens,
            },
        )

    @staticmethod
    def first_token(span: Any) -> None:
        if span is not None:
            span.add_event("first_token")

    @staticmethod
    def group_finished(span: Any, completions: Sequence[Any]) -> None:
        """End a group's span with what its samples produced (protocol Completions)."""
        versions = {version for c in completions for version, _ in c.policy_versions}
        Tracer.group_ended(
            span,
            sum(len(c.token_ids) for c in completions),
            [c.finish_reason for c in completions],
            versions,
            min((c.kv_version_min for c in completions), default=0),
        )

    @staticmethod
    def group_ended(
        span: Any, completion_tokens: int, finish_reasons: list[str], versions: set[int], kv_version_min: int
    ) -> None:
        """End a group's span with its totals (what `group_finished` reads from Completions; HTTP adds them up from
        its streamed outputs)."""
        if span is None:
            return
        span.set_attribute("rollout.completion_tokens", completion_tokens)
        span.set_attribute("rollout.finish_reasons", finish_reasons)
        span.set_attribute("rollout.policy_versions", sorted(versions))
        span.set_attribute("rollout.kv_version_min", kv_version_min)
        span.end()

    def update_started(self, update_id: str, tensors: int, nbytes: int, transport: str, mode: str) -> Any:
        """A span for an opened weight update (None without OpenTelemetry)."""
        if self._tracer is None:
            return None
        return self._tracer.start_span(
            "rollout.weight_update",
            attributes={
                "rollout.update_id": update_id,
                "rollout.tensors": tensors,
                "rollout.bytes": nbytes,
                "rollout.transport": transport,
                "rollout.mode": mode,
            },
        )

    @staticmethod
    def update_ended(span: Any, outcome: str, version: int | None = None, pause_ms: float | None = None) -> None:
        """End a weight update's span: outcome "committed", or the error code that ended it."""
        if span is None:
            return
        span.set_attribute("rollout.outcome", outcome)
        if version is not None:
            span.set_attribute("rollout.version", version)
        if pause_ms is not None:
            span.set_attribute("rollout.pause_ms", pause_ms)
        span.end()
