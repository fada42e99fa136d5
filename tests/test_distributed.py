"""Data-parallel training: rank sharding, and torchrun with 2 gloo ranks on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cwm.model import distributed

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- sharding (no process group)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 11])
def test_shard_covers_every_batch_exactly_once(n, world):
    items = [f"batch{i}" for i in range(n)]
    plans = [distributed.shard(items, r, world) for r in range(world)]
    steps = -(-n // world)
    assert all(len(p) == steps for p in plans)  # equal step counts: all-reduces pair up
    real = [item for p in plans for item, weight in p if weight > 0]
    assert sorted(real) == sorted(items)  # every batch once, none twice
    for s in range(steps):
        weights = [p[s][1] for p in plans]
        # DDP averages over `world` ranks; weights summing to `world` make that the mean of the real batches
        assert sum(weights) == pytest.approx(world)
        assert len({w for w in weights if w > 0}) == 1
    assert [item for item, _ in plans[0]] == items[::world]


def test_helpers_are_no_ops_in_one_process():
    assert not distributed.is_distributed()
    assert (distributed.rank(), distributed.world_size(), distributed.is_main()) == (0, 1, True)
    assert distributed.shard([1, 2, 3]) == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert distributed.all_reduce_sum([1, 2.5]) == [1.0, 2.5]
    assert distributed.any_rank(True) and not distributed.any_rank(False)
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    distributed.barrier()
    with distributed.process_group() as parallel:  # WORLD_SIZE unset under pytest
        assert parallel is False
    with pytest.raises(ValueError):
        distributed.shard([1], 2, 2)


# ---------------------------------------------------------------- torchrun, 2 gloo ranks


def _torchrun(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TVM_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


WORKER = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    from cwm.model import distributed
    from cwm.model.encoder import StateEncoder
    from cwm.model.transition import Transition, TransitionConfig
    from tests.test_encoder import corpus, tiny_config
    from tests.test_transition import kind_rule_targets, synthetic_trajectories

    def digest(*modules):
        h = hashlib.sha1()
        for m in modules:
            for k, v in sorted(m.state_dict().items()):
                h.update(k.encode()); h.update(v.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    with distributed.process_group() as parallel:
        texts, groups = corpus()  # 12 states in 3 groups; batch_size 4 -> 3 batches: 2 + 1 over 2 ranks
        enc = StateEncoder(tiny_config()).fit(texts, groups, epochs=2, batch_size=4, progress=False)
        trajs = synthetic_trajectories(10)
        z0 = np.random.default_rng(0).normal(size=(10, 8)).astype(np.float32)
        tr = Transition(TransitionConfig(state_dim=8, action_dim=8, hidden=16, epochs=3, batch_size=4))
        tr.fit(z0, trajs, kind_rule_targets(z0, trajs), progress=False)
        rec = {"parallel": parallel, "rank": distributed.rank(), "world": distributed.world_size(),
               "encoder": digest(enc.model, enc.head), "tokenizer": enc.tokenizer.to_json(),
               "transition": digest(tr.model_), "encoder_history": enc.history_,
               "transition_history": [{k: v for k, v in h.items() if k != "seconds"} for h in tr.history_]}
        with open(f"{sys.argv[1]}/rank{rec['rank']}.json", "w") as fh:
            json.dump(rec, fh)
""")


def test_torchrun_fits_keep_ranks_in_sync(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    _torchrun([str(script), str(tmp_path)], cwd=ROOT)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["parallel"] and (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    # Ranks train on different batches: equal weights mean the gradients were all-reduced.
    for key in ("encoder", "tokenizer", "transition", "encoder_history", "transition_history"):
        assert r0[key] == r1[key], key
    assert len(r0["encoder_history"]) == 2 and all(np.isfinite(r0["encoder_history"]))
    # 10 trajectories in batches of 4: the ranks together run all 3 batches of each epoch.
    assert [h["batches"] for h in r0["transition_history"]] == [3, 3, 3]


def _files(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*")
            if p.is_file() and not p.name.startswith(".")}


def test_torchrun_cli_train_matches_single_process_layout(tiny_model, multi_db, multi_split, tmp_path):
    from cwm.data.dataset import load_dataset
    from cwm.model.world_model import WorldModel

    out = tmp_path / "model"
    proc = _torchrun(["-m", "cwm.cli", "train", "--db", str(multi_db), "--split", str(multi_split),
                      "--out", str(out), "--tiny"], cwd=tmp_path)
    assert proc.stdout.count("model written to") == 1  # rank 0 alone prints the summary
    assert _files(out) == _files(Path(tiny_model))
    report = json.loads((out / "train_report.json").read_text())
    assert report["counts"]["ranks"] == 2 and report["transition_loss"]

    single, parallel = WorldModel.load(tiny_model), WorldModel.load(out)
    assert parallel.feature_names == single.feature_names
    ds = load_dataset(multi_db).valid()
    tid = sorted(ds.by_task)[0]
    actions = [t.actions for t in ds.by_task[tid]]
    for fn in ("features", "predict"):
        a = getattr(single, fn)(ds.initial_states[tid], actions, ds.hardware)
        b = getattr(parallel, fn)(ds.initial_states[tid], actions, ds.hardware)
        assert a.shape == b.shape and np.all(np.isfinite(b)), fn
