"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Small enough to write by hand: counters and gauges with optional labels, and cumulative
histograms. All updates happen on the event-loop thread, so no locks are needed.
"""

from __future__ import annotations

import math
from collections import defaultdict

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Counter:
    """A monotonically increasing count, optionally split by labels."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help, labels
        self.values: dict[tuple[str, ...], float] = defaultdict(float)

    def inc(self, amount: float = 1.0, labels: tuple[str, ...] = ()) -> None:
        self.values[labels] += amount

    def set_total(self, value: float) -> None:
        """Mirror a total that another part counts itself (e.g. the engine's preemptions)."""
        self.values[()] = float(value)

    def samples(self) -> list[str]:
        values = self.values or ({(): 0.0} if not self.label_names else {})
        return [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in values.items()]


class Gauge(Counter):
    """A value that goes up and down (set at scrape time or on change)."""

    kind = "gauge"

    def set(self, value: float) -> None:
        self.values[()] = float(value)


class Histogram:
    """Cumulative buckets, sum and count of observed values."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last slot is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> list[str]:
        out, running = [], 0
        for bound, c in zip((*self.buckets, math.inf), self.counts):
            running += c
            out.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {running}')
        out += [f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {self.count}"]
        return out


class ServerMetrics:
    """Every metric the server exports; `render()` gives the /metrics body."""

    def __init__(self) -> None:
        self.http_requests = Counter("reclaim_http_requests_total",
                                     "HTTP requests by route and status code.", ("route", "code"))
        self.requests_finished = Counter("reclaim_requests_finished_total",
                                         "Generation requests finished, by finish reason.",
                                         ("finish_reason",))
        self.connections_closed = Counter(
            "reclaim_connections_closed_total",
            "Connections the server closed or refused: over_limit (503), header_timeout, "
            "body_timeout.", ("reason",))
        self.preemptions = Counter("reclaim_num_preemptions_total",
                                   "Sequences preempted (blocks freed, recomputed later) when "
                                   "the KV cache ran out.")
        self.prompt_tokens = Counter("reclaim_prompt_tokens_total", "Prompt tokens admitted.")
        self.generation_tokens = Counter("reclaim_generation_tokens_total",
                                         "Tokens generated.")
        self.ttft = Histogram("reclaim_time_to_first_token_seconds",
                              "Time from admission to the first generated token.")
        self.tpot = Histogram("reclaim_time_per_output_token_seconds",
                              "Mean time between generated tokens after the first, per request.")
        self.e2e = Histogram("reclaim_e2e_request_latency_seconds",
                             "Time from admission to the last generated token.")
        self.running = Gauge("reclaim_num_requests_running", "Requests in the running batch.")
        self.waiting = Gauge("reclaim_num_requests_waiting", "Requests queued for admission.")
        self.kv_used = Gauge("reclaim_kv_cache_blocks_used", "KV-cache blocks in use.")
        self.kv_total = Gauge("reclaim_kv_cache_blocks_total", "KV-cache blocks in the pool.")
        self.weights_version = Gauge("reclaim_weights_version", "Version of the served weights.")
        self.online = Gauge("reclaim_online", "Online learning (serve --learn): training tokens/s, steps, "
                            "reuse rate, recompute fallbacks by reason, records, record bytes, pending feedback.",
                            ("name",))
        self.spec_verifies = Counter("reclaim_spec_decode_num_verifies_total",
                                     "Speculative verifications (one per sequence per verifying forward).")
        self.spec_drafted = Counter("reclaim_spec_decode_num_draft_tokens_total", "Draft tokens proposed.")
        self.spec_accepted = Counter("reclaim_spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
        self.spec_plain = Counter("reclaim_spec_decode_num_plain_decodes_total",
                                  "Decodes that dynamic depth ran plainly (the drafter kept missing).")
        self.spec_accept_rate = Gauge("reclaim_spec_decode_acceptance_rate",
                                      "Accepted / proposed draft tokens so far.")
        self.spec_tau = Gauge("reclaim_spec_decode_mean_accepted_length",
                              "Tokens committed per verification, the bonus token included (EAGLE's tau).")

    def render(self) -> str:
        lines = []
        for m in vars(self).values():
            lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}", *m.samples()]
        return "\n".join(lines) + "\n"
