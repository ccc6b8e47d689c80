"""Reading ``GET /metrics`` in tests: every sample by name and labels, and the change between two scrapes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float]
    families: Mapping[str, str]  # family name → type

    def value(self, name: str, **labels: str) -> float:
        """The sample with exactly these labels; 0 when absent (a labelled series appears at its first event)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def has(self, name: str, **labels: str) -> bool:
        return (name, frozenset(labels.items())) in self.samples

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}

    def matching(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        return {labels: value for (n, labels), value in self.samples.items() if n == name}

    def delta(self, before: Scrape, name: str, **labels: str) -> float:
        return self.value(name, **labels) - before.value(name, **labels)


def parse(text: str) -> Scrape:
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    families: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return Scrape(samples, families)


def scrape(client: httpx.Client | object, base: str = "") -> Scrape:
    response = client.get(f"{base}/metrics")  # type: ignore[attr-defined]
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)
