"""Sharded capture and calibration (oal.distributed): P "processes" simulated by threads that share a barrier, so
the protocol (who captures which block, who calibrates which layer, who writes the combined files) is tested in
seconds; the real multi-process runs are in test_distributed.py."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

import pytest
import torch
from reliability_world import small_llama
from safetensors.torch import load_file

from oal.calibration import QKV, CalibrationConfig, calibrate_layers
from oal.distributed import Processes, current_processes, launched_rank, launched_world_size
from oal.fidelity.capture import CacheKey, QKVCache
from oal.kernels import OALKernel


@dataclass(frozen=True)
class ThreadProcesses(Processes):
    sync: threading.Barrier = field(default=None, compare=False)

    def barrier(self) -> None:
        self.sync.wait(timeout=120)


def run_threads(world: int, fn) -> list:
    """``fn(processes)`` on ``world`` threads; returns their results in rank order (re-raising a failure)."""
    sync = threading.Barrier(world)
    results, errors = [None] * world, []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(ThreadProcesses(rank, world, sync))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            sync.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def test_processes_and_launcher_environment(monkeypatch):
    assert Processes().shard(range(7)) == list(range(7))
    assert Processes(1, 3).shard(range(7)) == [1, 4]
    for bad in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="rank|world"):
            Processes(*bad)
    for name in ("WORLD_SIZE", "RANK", "PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert (launched_world_size(), launched_rank()) == (1, 0) and current_processes() == Processes()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert (launched_world_size(), launched_rank()) == (4, 3)


def test_capture_is_sharded_without_duplicates(tmp_path, monkeypatch):
    import oal.fidelity.capture as capture

    model = small_llama()
    ids = torch.randint(0, 64, (7, 16), generator=torch.Generator().manual_seed(1))
    key = CacheKey("tiny", "local:tiny", "random", "valid", 16, None)
    QKVCache(tmp_path, key, ids).ensure(model, [0, 1], [0, 1], progress=False)  # two blocks already there
    calls: list[tuple[int, int]] = []
    real = capture.capture_sequence

    def counting(model, block_ids, layers):
        calls.append((threading.current_thread().name, int(block_ids[0, 0])))
        return real(model, block_ids, layers)

    monkeypatch.setattr(capture, "capture_sequence", counting)
    models = [copy.deepcopy(model) for _ in range(3)]  # one per "process": capture hooks are per module
    stats = run_threads(3, lambda p: QKVCache(tmp_path, key, ids).ensure(models[p.rank], range(7), [0, 1], processes=p))
    captured_first_tokens = sorted(t for _, t in calls)
    assert captured_first_tokens == sorted(int(ids[b, 0]) for b in range(2, 7))  # each missing block once
    assert len({name for name, _ in calls}) == 3  # shared out: every process captured some
    assert all(s.captured == [2, 3, 4, 5, 6] and s.reused == [0, 1] for s in stats)
    cache = QKVCache(tmp_path, key, ids)
    assert cache.missing(range(7), [0, 1]) == []
    one = cache.layer(1, [3])
    solo = real(model, ids[3][None], [0, 1])[1]
    assert torch.equal(one.q, solo.q) and torch.equal(one.o if one.o is not None else solo.o, solo.o)


CFG = CalibrationConfig(
    max_updates=30, val_every=10, patience=20, train_pool=24, positions_per_update=8, val_positions=16
)
Hq, Hkv, N, d, G = 3, 1, 24, 8, 2


def _layer_data():
    gen = torch.Generator().manual_seed(1)

    def qkv(S):
        return QKV(torch.randn(S, Hq, N, d, generator=gen) * 1.5, torch.randn(S, Hkv, N, d, generator=gen),
                   torch.randn(S, Hkv, N, d, generator=gen))  # fmt: skip

    data = {i: (qkv(2), qkv(1)) for i in range(5)}
    groups = {i: torch.randint(0, G, (Hq, d), generator=gen) for i in range(5)}
    return data, groups


def test_calibration_shards_layers_and_gathers_on_process_zero(tmp_path):
    data, groups = _layer_data()
    layers = [0, 1, 2, 3, 4]

    def run(out, processes=None, only=None, seen=None):
        def get(i):
            if seen is not None:
                seen.append((processes.rank if processes else 0, i))
            return data[i]

        return calibrate_layers(
            lambda i: OALKernel(groups[i], Hkv, num_groups=G), get, only or layers, out, config=CFG,
            progress=False, processes=processes,
        )  # fmt: skip

    ref = run(tmp_path / "one")
    # a run interrupted after layer 0, resumed by 3 processes: layers 1-4 are shared out, layer 0 is not redone
    run(tmp_path / "three", only=[0])
    seen: list[tuple[int, int]] = []
    summaries = run_threads(3, lambda p: run(tmp_path / "three", p, seen=seen))
    assert sorted(i for _, i in seen) == [1, 2, 3, 4]
    assert sorted(seen) == [(0, 1), (0, 4), (1, 2), (2, 3)]  # round robin over the layers not done
    a, b = load_file(tmp_path / "one" / "params.safetensors"), load_file(tmp_path / "three" / "params.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # identical, not just close
    g1, g3 = (load_file(tmp_path / x / "global" / "params.safetensors") for x in ("one", "three"))
    assert g1.keys() == g3.keys() and all(torch.equal(g1[k], g3[k]) for k in g1)
    for s in summaries:  # every process returns the gathered summary
        assert sorted(s["layers"]) == ["0", "1", "2", "3", "4"]
        assert [h["val_mse"] for h in s["layers"]["3"]["heads"]] == [h["val_mse"] for h in ref["layers"]["3"]["heads"]]
