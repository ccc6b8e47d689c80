from __future__ import annotations

import os
from pathlib import Path

import pytest

from ttft_sse import settings as settings_module
from ttft_sse.settings import Settings, SettingsError, auto_threads, usable_cores


def test_environment_values_are_parsed_by_type() -> None:
    env = {
        "TTFT_PORT": "9001",
        "TTFT_MODEL": "/models/x.gguf",
        "TTFT_WARMUP": "false",
        "TTFT_QUEUE_TIMEOUT_SECONDS": "2.5",
        "TTFT_CACHE_DIR": "/tmp/c",
        "TTFT_REDIS_URL": "",
        "TTFT_GROUPED_ATTENTION": "off",
        "TTFT_PAGED_ATTENTION": "no",
        "TTFT_GGUF_KERNEL": "0",
        "TTFT_GGUF_ACTIVATIONS": "int8",
        "TTFT_FUSED_LAYERS": "false",
        "TTFT_DEGRADE": "off",
    }
    s = Settings.from_env(env)
    assert (s.port, s.model, s.warmup, s.queue_timeout_seconds) == (9001, "/models/x.gguf", False, 2.5)
    assert s.cache_dir == Path("/tmp/c")
    assert s.redis_url is None
    assert s.grouped_attention is False and Settings().grouped_attention is True
    assert s.paged_attention is False and Settings().paged_attention is True
    assert s.gguf_kernel is False and Settings().gguf_kernel is True
    assert s.gguf_activations == "int8" and Settings().gguf_activations == "auto"
    assert s.fused_layers is False and Settings().fused_layers is True
    assert s.degrade == "off" and Settings.from_env({"TTFT_DEGRADE": "int8"}).degrade == "int8"


def test_cli_overrides_win_over_the_environment_and_none_means_not_given() -> None:
    s = Settings.from_env({"TTFT_PORT": "9001", "TTFT_HOST": "0.0.0.0"}, port=9002, host=None)
    assert (s.host, s.port) == ("0.0.0.0", 9002)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TTFT_PORT": "eighty"}, "TTFT_PORT must be an integer"),
        ({"TTFT_WARMUP": "maybe"}, "TTFT_WARMUP must be true or false"),
        ({"TTFT_MAX_CONCURRENCY": "0"}, "max_concurrency must be at least 1"),
        ({"TTFT_DEVICE": "tpu"}, "device must be auto, cpu"),
        ({"TTFT_ENGINE": "vllm"}, "engine must be batched, single, llamacpp or auto"),
        ({"TTFT_GGUF_ACTIVATIONS": "int4"}, "gguf_activations must be auto, int8 or fp32, got 'int4'"),
        ({"TTFT_DEGRADE": "int4"}, "degrade must be off or int8, got 'int4'"),
        (
            {"TTFT_DEGRADE": "int8", "TTFT_GGUF_ACTIVATIONS": "int8"},
            "degrade=int8 switches fp32 rows to int8 ones at run time, and gguf_activations=int8 makes them int8",
        ),
        ({"TTFT_KV_CACHE_TOKENS": "0"}, "kv_cache_tokens must be at least 1"),
        ({"TTFT_MAX_TOKEN": "5"}, "unknown setting(s) TTFT_MAX_TOKEN"),
        ({"TTFT_DEFAULT_MAX_TOKENS": "9000"}, "default_max_tokens (9000) is above max_tokens_cap"),
        ({"TTFT_KERNEL_HELPERS": "9"}, "kernel_helpers must be -1 (auto) or 0 to 8, got 9"),
        ({"TTFT_KERNEL_HELPERS": "-2"}, "kernel_helpers must be -1 (auto) or 0 to 8, got -2"),
    ],
)
def test_bad_settings_are_refused_with_a_sentence_naming_them(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env(env)


def test_auto_kernel_helpers_are_one_where_the_process_may_use_two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_module, "CGROUP_CPU_MAX", Path("/nonexistent/cpu.max"))
    for cores, helpers in ((1, 0), (2, 1), (16, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert Settings().helper_threads == helpers, cores
    assert Settings(kernel_helpers=0).helper_threads == 0
    assert Settings(kernel_helpers=3).helper_threads == 3


def test_usable_cores_are_the_affinity_at_most_the_cgroups_whole_cpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(4)))
    cpu_max = tmp_path / "cpu.max"
    for text, cores in (("max 100000\n", 4), ("100000 100000\n", 1), ("150000 100000\n", 1), ("250000 100000\n", 2)):
        cpu_max.write_text(text)
        assert usable_cores(cpu_max) == cores, text
    assert usable_cores(tmp_path / "absent") == 4
    cpu_max.write_text("garbled")
    assert usable_cores(cpu_max) == 4


def test_auto_threads_leave_half_the_cores() -> None:
    assert [auto_threads(n) for n in (1, 2, 3, 8, 16)] == [1, 1, 1, 4, 8]


def test_defaults_count_the_cores_the_process_may_use_not_the_machines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A container limited to 2 CPUs on a 16-core node: torch threads and helpers as on 2 cores, not on 16.
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(settings_module, "CGROUP_CPU_MAX", cpu_max)
    for text, cores, threads, helpers in (
        ("max 100000\n", 16, 8, 1),
        ("200000 100000\n", 2, 1, 1),
        ("100000 100000\n", 1, 1, 0),
    ):
        cpu_max.write_text(text)
        assert (Settings().cores, Settings().torch_threads, Settings().helper_threads) == (cores, threads, helpers), (
            text
        )
    assert Settings(threads=3).torch_threads == 3


def test_the_cores_are_read_once_a_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Settings are read once, at the edge: the affinity and the cgroup's quota too, however many defaults ask."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("200000 100000\n")
    monkeypatch.setattr(settings_module, "CGROUP_CPU_MAX", cpu_max)
    settings = Settings()
    assert (settings.cores, settings.torch_threads, settings.helper_threads) == (2, 1, 1)
    cpu_max.write_text("100000 100000\n")  # a quota changed under a running server does not move its settings
    assert (settings.cores, settings.torch_threads, settings.helper_threads) == (2, 1, 1)
    assert (Settings().cores, Settings().helper_threads) == (1, 0)
