"""``deepinfer serve --num-workers N``: each worker its own id and metrics port, a bad N is a config
error naming its key, and every worker process runs the worker command."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from deepinfer import cli, serve
from deepinfer.supervisor import ServiceChild
from services.kvcache.config import Config as KVCacheConfig
from services.scheduler.config import Config as SchedulerConfig
from services.worker.config import Config as WorkerConfig


def test_extra_workers_get_ids_of_their_own_after_the_first() -> None:
    first = WorkerConfig(worker_id="worker-ab12", metrics_port=9000)
    extra = serve.extra_workers(first, 3)
    assert list(extra) == ["worker-1", "worker-2"]
    assert [c.worker_id for c in extra.values()] == ["worker-ab12-1", "worker-ab12-2"]
    assert all(dataclasses.replace(c, worker_id=first.worker_id) == first for c in extra.values())
    assert serve.extra_workers(first, 1) == {}


def stack_configs(port: int, num_workers: int) -> dict[str, Any]:
    worker = WorkerConfig(worker_id="w", metrics_port=port)
    configs: dict[str, Any] = {
        "worker": worker,
        "scheduler": SchedulerConfig(metrics_port=port),
        "kvcache": KVCacheConfig(metrics_port=port),
        "serve": serve.Config(metrics_port=port, num_workers=num_workers),
    }
    return {**configs, **serve.extra_workers(worker, num_workers)}


def test_extra_workers_take_the_ports_after_serves_own() -> None:
    spread = serve._spread_metrics_ports(stack_configs(9000, 3))
    ports = {name: c.metrics_port for name, c in spread.items()}
    assert ports == {
        "worker": 9000,
        "scheduler": 9001,
        "kvcache": 9002,
        "serve": 9003,
        "worker-1": 9004,
        "worker-2": 9005,
    }


def test_the_ports_check_counts_the_extra_workers() -> None:
    serve._spread_metrics_ports(stack_configs(65531, 2))  # P..P+4 fit
    with pytest.raises(ValueError, match="metrics_port: no room for 5 ports from 65532"):
        serve._spread_metrics_ports(stack_configs(65532, 2))  # worker-1's P+4 would not


def test_num_workers_below_1_is_a_config_error_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        serve.Config(num_workers=0)
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--num-workers", "0"])  # fails before anything starts
    assert exited.value.code == 2
    assert "num_workers must be >= 1, got 0" in capsys.readouterr().err


def test_a_named_worker_child_runs_the_worker_command() -> None:
    child = ServiceChild("worker-1", WorkerConfig(worker_id="w-1"), "worker")
    assert child.name == "worker-1" and child.command == "worker"
    assert ServiceChild("scheduler", SchedulerConfig()).command == "scheduler"


def test_a_pd_topology_gives_prefill_workers_then_decode_workers_their_roles() -> None:
    config = serve.Config(prefill_workers=1, decode_workers=2)
    roles = config.worker_roles("both")
    assert roles == ["prefill", "decode", "decode"]
    extra = serve.extra_workers(WorkerConfig(worker_id="w", role=roles[0]), len(roles), roles)
    assert [(c.worker_id, c.role) for c in extra.values()] == [("w-1", "decode"), ("w-2", "decode")]
    assert serve.Config(num_workers=2).worker_roles("both") == ["both", "both"]


def test_a_pd_stack_puts_its_handoff_area_in_host_shared_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve, "SHARED_MEMORY", str(tmp_path))
    area = serve.shared_memory_handoff(WorkerConfig(), ["prefill", "decode"])
    assert area is not None and Path(area.name).parent == tmp_path and Path(area.name).is_dir()
    area.cleanup()
    assert not Path(area.name).exists()
    assert serve.shared_memory_handoff(WorkerConfig(), ["both", "both"]) is None  # no handoffs
    assert serve.shared_memory_handoff(WorkerConfig(handoff_dir="/x"), ["prefill", "decode"]) is None
    monkeypatch.setattr(serve, "SHARED_MEMORY", str(tmp_path / "none"))
    assert serve.shared_memory_handoff(WorkerConfig(), ["prefill", "decode"]) is None


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"prefill_workers": 1}, "decode_workers"),
        ({"prefill_workers": 1, "decode_workers": 1, "num_workers": 2}, "num_workers"),
        ({"decode_workers": -1}, "decode_workers"),
    ],
)
def test_a_bad_pd_topology_is_a_config_error_naming_its_key(fields: dict[str, int], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        serve.Config(**fields)


def test_a_worker_role_outside_prefill_decode_both_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="role"):
        WorkerConfig(role="verify")


def test_scheduler_replicas_get_ids_of_their_own_and_bad_counts_are_config_errors() -> None:
    first = SchedulerConfig(scheduler_id="sched-ab12", metrics_port=9001)
    replicas = serve.extra_schedulers(first, 3)
    assert list(replicas) == ["scheduler-1", "scheduler-2"]
    assert [c.scheduler_id for c in replicas.values()] == ["sched-ab12-1", "sched-ab12-2"]
    assert all(dataclasses.replace(c, scheduler_id=first.scheduler_id) == first for c in replicas.values())
    assert serve.extra_schedulers(first, 1) == {}
    with pytest.raises(ValueError, match="num_schedulers must be >= 1, got 0"):
        serve.Config(num_schedulers=0)


def test_one_dist_init_addr_is_not_shared_by_several_workers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--num-workers", "2", "--tensor-parallel-size", "2"]
    argv += ["--dist-init-addr", "127.0.0.1:29500"]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)  # fails before anything starts
    assert exited.value.code == 2
    assert "dist_init_addr names one tensor-parallel group's address" in capsys.readouterr().err
