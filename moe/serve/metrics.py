"""/metrics: the expert cache's and the scheduler's counters in Prometheus' text format.

    scheduler thread: snapshot(scheduler) ─► Snapshot (CacheStats + scheduler counters, one consistent read)
    HTTP side:        ServerMetrics.render(snapshot) ─► prometheus_client.generate_latest ─► text/plain

Metrics (every counter is since the server started; "token" = one decode step, as in the simulator):

| name                                             | kind    | what                                                   |
|--------------------------------------------------|---------|--------------------------------------------------------|
| expertcache_hit_rate                             | gauge   | 1 - misses / accesses, all decode steps and layers     |
| expertcache_misses_per_layer_per_token{layer}    | gauge   | misses of MoE layer `layer` / decode steps             |
| expertcache_cache_accesses_total{layer}          | counter | distinct experts asked of the cache                    |
| expertcache_cache_misses_total{layer}            | counter | experts copied in                                      |
| expertcache_bytes_copied_total                   | counter | misses x HostStore.bytes_per_expert                    |
| expertcache_slots_in_use / expertcache_slots     | gauge   | slots holding an expert / all slots                    |
| expertcache_decode_tokens_per_second             | gauge   | tokens of the last 64 decode steps / their wall time   |
| expertcache_decode_steps_total{batch}            | counter | decode steps, by batch size                            |
| expertcache_decode_tokens_total                  | counter | tokens produced by decode steps (steps x batch)        |
| expertcache_decode_seconds_total                 | counter | wall time of decode steps (with sampling)              |
| expertcache_prefill_tokens_total                 | counter | prompt tokens prefilled (computed)                     |
| expertcache_prefix_cached_tokens_total           | counter | prompt tokens restored from the prefix cache instead   |
| expertcache_prefix_blocks / _prefix_blocks_max   | gauge   | blocks kept by the prefix cache / its pool's blocks    |
| expertcache_prefix_evicted_blocks_total          | counter | blocks the prefix cache evicted                        |
| expertcache_prefix_states / _prefix_states_max   | gauge   | linear-attention state snapshots kept / the pool's     |
| expertcache_prefill_experts_total{source}        | counter | experts prefill used by source: store (streamed), slot |
| expertcache_active_sequences / _waiting_requests | gauge   | sequences in batch rows / requests queued for a row    |
| expertcache_requests_finished_total{reason}      | counter | stop, length, tool_calls, cancelled, error             |
| expertcache_requests_total{endpoint, status}     | counter | HTTP requests answered                                 |
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moe.engine.cachestats import CacheStats, cache_stats
from moe.serve.scheduler import Scheduler

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Snapshot:
    """One consistent read of the cache and scheduler counters (taken on the scheduler thread)."""

    cache: CacheStats
    tokens_per_second: float
    decode_tokens: int
    decode_seconds: float
    prefill_tokens: int
    cached_tokens: int
    prefix_blocks: int
    prefix_blocks_max: int
    prefix_evicted: int
    prefix_states: int
    prefix_states_max: int
    batch_steps: dict[int, int]
    finished: dict[str, int]
    active: int
    waiting: int


def snapshot(scheduler: Scheduler) -> Snapshot:
    """Read every counter; run it on the scheduler thread (Scheduler.call) or after stop()."""
    st, prefix = scheduler.stats, scheduler.engine.prefix
    kept = (0, 0, 0, 0, 0) if prefix is None else (len(prefix), prefix.num_blocks, prefix.stats.evicted,
                                                   prefix.snapshots, prefix.num_states)
    return Snapshot(cache_stats(scheduler.engine.moe), st.tokens_per_second(), st.decode_tokens,
                    st.decode_seconds, st.prefill_tokens, st.cached_tokens, *kept, dict(st.batch_steps),
                    dict(st.finished), scheduler.active, scheduler.waiting)


class _SnapshotCollector:
    """Yields the metric families of the snapshot set just before a scrape."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None

    def collect(self):
        s = self.snapshot
        if s is None:
            return
        c = s.cache
        yield _gauge("expertcache_hit_rate", "1 - misses / accesses of the expert cache (decode steps)", c.hit_rate)
        per_layer = GaugeMetricFamily("expertcache_misses_per_layer_per_token",
                                      "misses per decode step of each MoE layer", labels=["layer"])
        acc = CounterMetricFamily("expertcache_cache_accesses", "distinct experts asked of the cache",
                                  labels=["layer"])
        miss = CounterMetricFamily("expertcache_cache_misses", "experts copied into slots", labels=["layer"])
        for layer, value in enumerate(c.misses_per_layer_per_token):
            per_layer.add_metric([str(layer)], float(value))
            acc.add_metric([str(layer)], int(c.accesses[layer]))
            miss.add_metric([str(layer)], int(c.misses[layer]))
        yield from (per_layer, acc, miss)
        yield CounterMetricFamily("expertcache_bytes_copied", "bytes copied host -> slots by misses",
                                  value=c.bytes_copied)
        pre = CounterMetricFamily("expertcache_prefill_experts", "(layer, expert) uses of prefill, by where "
                                  "the weights were read: store (streamed from host) or slot", labels=["source"])
        pre.add_metric(["store"], c.prefill_streamed)
        pre.add_metric(["slot"], c.prefill_from_slots)
        yield pre
        yield _gauge("expertcache_slots_in_use", "slots holding an expert", c.slots_in_use)
        yield _gauge("expertcache_slots", "slots of the pool (--moe-slots)", c.num_slots)
        yield _gauge("expertcache_decode_tokens_per_second", "decode tokens per second, last 64 steps",
                     s.tokens_per_second)
        yield from self._scheduler_families(s)

    @staticmethod
    def _scheduler_families(s: Snapshot):
        steps = CounterMetricFamily("expertcache_decode_steps", "decode steps by batch size", labels=["batch"])
        for batch, n in sorted(s.batch_steps.items()):
            steps.add_metric([str(batch)], n)
        yield steps
        yield CounterMetricFamily("expertcache_decode_tokens", "tokens produced by decode steps",
                                  value=s.decode_tokens)
        yield CounterMetricFamily("expertcache_decode_seconds", "wall time of decode steps",
                                  value=s.decode_seconds)
        yield CounterMetricFamily("expertcache_prefill_tokens", "prompt tokens prefilled (computed)",
                                  value=s.prefill_tokens)
        yield CounterMetricFamily("expertcache_prefix_cached_tokens", "prompt tokens restored from the prefix "
                                  "cache instead of computed (--kv-cache-gb)", value=s.cached_tokens)
        yield _gauge("expertcache_prefix_blocks", "blocks kept by the prefix cache", s.prefix_blocks)
        yield _gauge("expertcache_prefix_blocks_max", "blocks the prefix cache's pool holds (0: no prefix cache)",
                     s.prefix_blocks_max)
        yield CounterMetricFamily("expertcache_prefix_evicted_blocks", "blocks the prefix cache evicted",
                                  value=s.prefix_evicted)
        yield _gauge("expertcache_prefix_states", "linear-attention state snapshots the prefix cache keeps",
                     s.prefix_states)
        yield _gauge("expertcache_prefix_states_max", "state snapshots the prefix cache's pool holds (0: none, or "
                     "no linear-attention layers)", s.prefix_states_max)
        yield _gauge("expertcache_active_sequences", "sequences in batch rows", s.active)
        yield _gauge("expertcache_waiting_requests", "requests waiting for a batch row", s.waiting)
        done = CounterMetricFamily("expertcache_requests_finished", "requests by outcome", labels=["reason"])
        for reason, n in sorted(s.finished.items()):
            done.add_metric([reason], n)
        yield done


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


class ServerMetrics:
    """The server's registry: the HTTP request counter, the snapshot collector, and histograms of the
    finished requests' timing (time to first token, queue, prefill and decode tokens per second,
    cached prompt tokens)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("expertcache_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=self.registry)
        self._collector = _SnapshotCollector()
        self.registry.register(self._collector)
        seconds = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        rates = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
        self.ttft = Histogram("expertcache_request_time_to_first_token_seconds",
                              "time from a request's arrival to its first token (queue + prefill)", buckets=seconds,
                              registry=self.registry)
        self.queue = Histogram("expertcache_request_queue_seconds", "time a request waited for a row",
                               buckets=seconds, registry=self.registry)
        self.prefill_rate = Histogram("expertcache_request_prefill_tokens_per_second",
                                      "prompt tokens per second of a request's prefill", buckets=rates,
                                      registry=self.registry)
        self.decode_rate = Histogram("expertcache_request_decode_tokens_per_second",
                                     "decode tokens per second of a request (its tokens after the first)",
                                     buckets=rates, registry=self.registry)
        self.cached = Histogram("expertcache_request_cached_prompt_tokens",
                                "prompt tokens a request took from a prefix cache", buckets=(0, 1, 16, 256, 4096),
                                registry=self.registry)

    def observe(self, timing) -> None:
        """Add one finished request's RequestTiming (moe.serve.scheduler) to the histograms; None
        (a request that ended with an error) adds nothing. A request that ended at its first token
        adds no decode rate."""
        if timing is None:
            return
        self.ttft.observe(timing.time_to_first_token_s)
        self.queue.observe(timing.queue_s)
        self.prefill_rate.observe(timing.prefill_tokens_per_s)
        if timing.decode_tokens:
            self.decode_rate.observe(timing.decode_tokens_per_s)
        self.cached.observe(timing.cached_prompt_tokens)

    def render(self, snap: Snapshot) -> bytes:
        """The exposition text of every metric, the cache and scheduler ones read from `snap`."""
        self._collector.snapshot = snap
        return generate_latest(self.registry)
