"""Usage: mkdir runs_b64 && tar xzf runs_b64.tar.gz -C runs_b64 && python online_adaptation_sim.py runs_b64"""
import copy, glob, sys
from pathlib import Path
import numpy as np
from cwm.data.dataset import load_dataset
from cwm.model.world_model import WorldModel
from cwm.model.metrics import pairwise_accuracy
model = WorldModel.load()
rows = {}
for run_json in sorted(glob.glob(sys.argv[1] + '/**/b64/cwm/seed*/run.json', recursive=True)):
    ds = load_dataset(Path(run_json).parent).valid()
    for tid, trajs in ds.by_task.items():
        trajs = sorted(trajs, key=lambda t: t.record_index)
        X = model.features(ds.initial_states[tid], [t.actions for t in trajs], ds.hardware)
        lat = np.array([t.latency for t in trajs])
        for K in (16, 32, 48):
            if len(trajs) < K + 8: continue
            tr, te = slice(0, K), slice(K, K + 16)
            for rounds in (0, 20, 60, 120, 200):
                r = copy.deepcopy(model.ranker)
                if rounds: r.update(X[tr], lat[tr], np.zeros(K), num_boost_round=rounds)
                s = r.predict(X[te])
                pa = pairwise_accuracy(s, lat[te], np.zeros(len(s)))
                top = lat[te].min() / lat[te][np.argsort(-s)[:2]].min()
                rows.setdefault((K, rounds), []).append((pa, top))
for k, v in sorted(rows.items()):
    v = np.array(v); print(f"K={k[0]} rounds={k[1]} n={len(v)} pairwise {v[:,0].mean():.3f} top2 {v[:,1].mean():.3f}")
