"""Which GPUs each process of an embedded run sees: the placement rule, the GPU count, and the
CUDA_VISIBLE_DEVICES the launcher really gives its children (read from /proc/<pid>/environ of
the processes it started; ANCE_GPU_COUNT stands in for GPUs this machine lacks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ance_train.config import load_config
from ance_train.launcher.embedded import EmbeddedRun
from ance_train.launcher.placement import place, visible_gpus

from ance_train_dev.helpers import write_config
from ance_train_dev.synthetic import write_beir

INFERENCERS = ["inferencer-0", "inferencer-1"]


def devices(placement) -> dict[str, str]:
    return {name: placement.env(name)["CUDA_VISIBLE_DEVICES"] for name in placement.devices}


def test_trainer_first_inferencers_round_robin_indexer_on_a_free_gpu() -> None:
    eight = [str(i) for i in range(8)]
    assert devices(place(eight, 4, ["inferencer-0", "inferencer-1", "inferencer-2"],
                         ["indexer-0", "indexer-1"])) == {
        "trainer": "0,1,2,3", "inferencer-0": "4", "inferencer-1": "5", "inferencer-2": "6",
        "indexer-0": "7", "indexer-1": "7"}
    four = place(["0", "1", "2", "3"], 2, INFERENCERS, ["indexer"])
    assert devices(four) == {"trainer": "0,1", "inferencer-0": "2", "inferencer-1": "3",
                             "indexer": "3"}  # no GPU left: shares the last
    assert "  indexer → 3 (shared with inferencer-1)" in four.describe()
    three = place(["0", "1", "2"], 1, ["inferencer-0", "inferencer-1", "inferencer-2"],
                  ["indexer"])
    assert devices(three) == {"trainer": "0", "inferencer-0": "1", "inferencer-1": "2",
                              "inferencer-2": "1", "indexer": "2"}


def test_fewer_gpus_than_roles_share_and_cpu_index_sees_none() -> None:
    one = place(["5"], 1, INFERENCERS, ["indexer"])
    assert devices(one) == {"trainer": "5", "inferencer-0": "5", "inferencer-1": "5",
                            "indexer": "5"}
    assert any("share the trainer's" in note for note in one.notes)
    two = place(["0", "1"], 4, INFERENCERS, ["indexer"], index_on_gpu=False)
    assert devices(two) == {"trainer": "0,1", "inferencer-0": "0", "inferencer-1": "1",
                            "indexer": ""}
    assert any("ranks 2 and above have none" in note for note in two.notes)
    none = place([], 2, INFERENCERS, ["indexer"])
    assert none.env("trainer") == {} and none.env("indexer") == {}  # nothing set on a CPU
    assert "every service runs on the CPU" in none.describe()[0]


def test_visible_gpus_from_the_environment() -> None:
    assert visible_gpus({"ANCE_GPU_COUNT": "3"}) == ["0", "1", "2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4, 6,7"}) == ["4", "6", "7"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,6,7", "ANCE_GPU_COUNT": "2"}) == ["4", "6"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"ANCE_GPU_COUNT": "0"}) == []
    with pytest.raises(ValueError, match="ANCE_GPU_COUNT"):
        visible_gpus({"ANCE_GPU_COUNT": "two"})
    # this machine: whatever nvidia-smi says (none here), without importing torch
    assert visible_gpus({}) == [str(i) for i in range(len(visible_gpus({})))]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)


def test_launched_children_carry_their_devices(tmp_path: Path, tiny_model, monkeypatch,
                                               capsys) -> None:
    monkeypatch.setenv("ANCE_GPU_COUNT", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    data = write_beir(tmp_path / "data", num_docs=40, num_train=12, num_test=4)
    config_path = write_config(
        tmp_path / "c.yaml", run_id="gpus", output_dir=str(tmp_path / "runs"),
        data={"path": str(data)}, model={"path": str(tiny_model)},
        training={"steps": 1000, "batch_size": 4, "refresh_every": 500, "torch_threads": 1},
        negatives={"warmup": "none"}, inference={"replicas": 2, "torch_threads": 1})
    run = EmbeddedRun(load_config(config_path), config_path)
    run.prepare()
    try:
        run.start_services()
        seen = {child.name: _environ(child.process.pid).get("CUDA_VISIBLE_DEVICES")
                for child in run.children}
    finally:
        run.stop(timeout_s=5)
    assert seen == {"trainer": "0", "inferencer-0": "1", "inferencer-1": "2", "indexer": "2"}
    printed = capsys.readouterr().out
    assert "GPU placement (3 GPU(s) 0,1,2; CUDA_VISIBLE_DEVICES per process):" in printed
    assert "inferencer-0 → 1" in printed
