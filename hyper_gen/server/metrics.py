"""``GET /metrics``: the engine's ``stats()`` in Prometheus' text format, read at scrape time.

Names are vLLM's where vLLM has one (dashboards and autoscalers written for vLLM read them as
they are), ``hyper_gen:`` where it has none; every sample carries ``model_name`` (the served
name), as vLLM's do. A key ``engine.stats()`` does not return is a metric left out, not a zero.
Each app has its own ``CollectorRegistry`` (several servers in one process never share one).

The answer is always the classic text format (``text/plain; version=0.0.4``), which every
Prometheus reads and in which the names' colons are legal: prometheus_client's OpenMetrics
encoder, chosen by the ``Accept`` header Prometheus 2 sends, rewrites the colons of the samples'
names to underscores but not those of their ``# TYPE`` lines.
"""

from __future__ import annotations

from typing import Iterator, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# (engine.stats() key, metric name, kind, help); a counter's samples are exposed as <name>_total
METRICS = (
    ("running", "vllm:num_requests_running", "gauge", "Requests admitted to the running batch and not finished."),
    ("waiting", "vllm:num_requests_waiting", "gauge", "Requests queued for a slot in the running batch."),
    ("kv_cache_usage", "vllm:kv_cache_usage_perc", "gauge", "KV cache usage: blocks in use / all blocks (0 to 1)."),
    ("prefix_cache_queries", "vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."),
    ("preemptions", "vllm:num_preemptions", "counter", "Requests preempted (their KV cache blocks taken back)."),
    ("blocks_total", "hyper_gen:kv_cache_blocks_total", "gauge", "KV cache blocks in the pool."),
    ("blocks_used", "hyper_gen:kv_cache_blocks_used", "gauge", "KV cache blocks held by running requests."),
    ("blocks_cached", "hyper_gen:kv_cache_blocks_cached", "gauge", "KV cache blocks kept for the prefix cache."),
    ("cache_memory_bytes", "hyper_gen:kv_cache_memory_bytes", "gauge", "Bytes of the KV cache pool (its budget)."),
)

_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


class EngineCollector:
    """A Prometheus collector reading ``engine.stats()`` once per scrape."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def describe(self) -> list:
        return []  # nothing to check at registration: no stats() call before the first scrape

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        for key, name, kind, doc in METRICS:
            value = stats.get(key)
            if value is None:
                continue
            family = _FAMILIES[kind](name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family


def registry_for(engine, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def kv_cache_line(stats: dict) -> Optional[str]:
    """``KV cache: 1234 blocks of 16 tokens, 12.3 MiB`` from ``engine.stats()``; None when the
    engine reports no ``cache_memory_bytes`` (the blocks are left out when it reports none)."""
    budget = stats.get("cache_memory_bytes")
    if budget is None:
        return None
    blocks, size = stats.get("blocks_total"), stats.get("block_size")
    shape = ""
    if blocks is not None:
        shape = f"{blocks} blocks" + (f" of {size} tokens" if size is not None else "") + ", "
    return f"KV cache: {shape}{_size(float(budget))}"
