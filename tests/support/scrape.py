"""Scrape a Prometheus endpoint over HTTP and parse it with `prometheus_client.parser`."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    """`{(sample name, sorted labels): value}` of one scrape of `http://host:port/metrics`."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: Samples, name: str,
          default: float | None = None, **labels: str) -> float:
    """One sample's value; `default` for a labelled child not created yet."""
    key = (name, tuple(sorted(labels.items())))
    if default is not None:
        return samples.get(key, default)
    return samples[key]
