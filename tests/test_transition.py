"""Action features and the latent TransH transition model (tiny sizes: runs in seconds)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cwm.action_features import (
    ANNOTATION_KEYS,
    ARG_NAMES,
    KIND_TO_ID,
    KNOWN_KINDS,
    NUM_ARGS,
    NUM_STRUCT,
    STRUCT_NAMES,
    UNK_ID,
    encode_actions,
    structured_features,
)
from cwm.errors import CwmError
from cwm.transition import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ActionEmbedding,
    Transition,
    TransitionConfig,
    TransitionModel,
    TransH,
    encode_batch,
    pad_batch,
    rollout,
    rollout_loss,
)

EXAMPLE = r"""
{"kind": "GetSBlock", "inputs": [], "attrs": ["C", "main"], "outputs": ["b0"], "decision": null}
{"kind": "GetSBlock", "inputs": [], "attrs": ["root", "main"], "outputs": ["b1"], "decision": null}
{"kind": "Annotate", "inputs": ["b0", "\"SSRSRS\""], "attrs": ["meta_schedule.tiling_structure"], "outputs": [], "decision": null}
{"kind": "GetLoops", "inputs": ["b0"], "attrs": [], "outputs": ["l2", "l3", "l4"], "decision": null}
{"kind": "SamplePerfectTile", "inputs": ["l2"], "attrs": [4, 64], "outputs": ["v5", "v6", "v7", "v8"], "decision": [2, 4, 1, 8]}
{"kind": "Split", "inputs": ["l2", "v5", "v6", "v7", "v8"], "attrs": [1, 0], "outputs": ["l9", "l10", "l11", "l12"], "decision": null}
{"kind": "SamplePerfectTile", "inputs": ["l3"], "attrs": [4, 64], "outputs": ["v13", "v14", "v15", "v16"], "decision": [2, 4, 2, 4]}
{"kind": "Split", "inputs": ["l3", "v13", "v14", "v15", "v16"], "attrs": [1, 0], "outputs": ["l17", "l18", "l19", "l20"], "decision": null}
{"kind": "SamplePerfectTile", "inputs": ["l4"], "attrs": [2, 64], "outputs": ["v21", "v22"], "decision": [4, 16]}
{"kind": "Split", "inputs": ["l4", "v21", "v22"], "attrs": [1, 0], "outputs": ["l23", "l24"], "decision": null}
{"kind": "Reorder", "inputs": ["l9", "l17", "l10", "l18", "l23", "l11", "l19", "l24", "l12", "l20"], "attrs": [], "outputs": [], "decision": null}
{"kind": "CacheWrite", "inputs": ["b0", []], "attrs": [0, "global"], "outputs": ["b25"], "decision": null}
{"kind": "ReverseComputeAt", "inputs": ["b25", "l17"], "attrs": [1, -1], "outputs": [], "decision": null}
{"kind": "Annotate", "inputs": ["b1", 32], "attrs": ["meta_schedule.parallel"], "outputs": [], "decision": null}
{"kind": "Annotate", "inputs": ["b1", 64], "attrs": ["meta_schedule.vectorize"], "outputs": [], "decision": null}
{"kind": "SampleCategorical", "inputs": [], "attrs": [[0, 16, 64, 512], [0.25, 0.25, 0.25, 0.25]], "outputs": ["v26"], "decision": 2}
{"kind": "Annotate", "inputs": ["b1", "v26"], "attrs": ["meta_schedule.unroll_explicit"], "outputs": [], "decision": null}
{"kind": "EnterPostproc", "inputs": [], "attrs": [], "outputs": [], "decision": null}
{"kind": "GetSBlock", "inputs": [], "attrs": ["root", "main"], "outputs": ["b27"], "decision": null}
{"kind": "Unannotate", "inputs": ["b27"], "attrs": ["meta_schedule.parallel"], "outputs": [], "decision": null}
{"kind": "GetChildBlocks", "inputs": ["b27"], "attrs": [], "outputs": ["b28", "b29"], "decision": null}
{"kind": "GetLoops", "inputs": ["b28"], "attrs": [], "outputs": ["l30", "l31", "l32", "l33", "l34", "l35", "l36", "l37", "l38", "l39"], "decision": null}
{"kind": "Fuse", "inputs": ["l30", "l31"], "attrs": [1], "outputs": ["l40"], "decision": null}
{"kind": "Parallel", "inputs": ["l40"], "attrs": [], "outputs": [], "decision": null}
{"kind": "Fuse", "inputs": ["l39"], "attrs": [1], "outputs": ["l41"], "decision": null}
{"kind": "Vectorize", "inputs": ["l41"], "attrs": [], "outputs": [], "decision": null}
{"kind": "Annotate", "inputs": ["l40", 64], "attrs": ["pragma_auto_unroll_max_step"], "outputs": [], "decision": null}
{"kind": "DecomposeReduction", "inputs": ["b46", "l50"], "attrs": [], "outputs": ["b56"], "decision": null}
"""


def example_actions() -> list[dict]:
    return [json.loads(line) for line in EXAMPLE.strip().splitlines()]


def synthetic_trajectories(n: int, seed: int = 0) -> list[list[dict]]:
    """Small MetaSchedule-like trajectories of varying lengths (about 6 to 20 actions)."""
    rng = np.random.default_rng(seed)
    base = example_actions()
    trajs = []
    for _ in range(n):
        length = int(rng.integers(6, 21))
        acts = json.loads(json.dumps(base[:length]))
        for a in acts:
            if a["kind"] == "SamplePerfectTile":
                a["decision"] = [int(x) for x in rng.choice([1, 2, 4, 8], size=len(a["outputs"]))]
            elif a["kind"] == "SampleCategorical":
                a["decision"] = int(rng.integers(0, 4))
            elif a["kind"] == "Annotate" and isinstance(a["inputs"][1], int):
                a["inputs"][1] = int(rng.choice([16, 32, 64]))
        trajs.append(acts)
    return trajs


def kind_rule_targets(z0: np.ndarray, trajs: list[list[dict]], seed: int = 1):
    """Target after each action = z0 + cumulative sum of a fixed vector per kind."""
    d = z0.shape[1]
    vec = np.random.default_rng(seed).normal(size=(len(KNOWN_KINDS), d)).astype(np.float32) * 0.3
    targets = []
    for z, acts in zip(z0, trajs):
        cur = z.copy()
        tg = {}
        for t, a in enumerate(acts, start=1):
            cur = cur + vec[KIND_TO_ID.get(a["kind"], UNK_ID)]
            tg[t] = cur.copy()
        targets.append(tg)
    return targets


TINY = dict(state_dim=8, action_dim=16, hidden=32, batch_size=8, lr=5e-3)


@pytest.fixture(autouse=True)
def _few_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def fitted():
    trajs = synthetic_trajectories(24)
    z0 = np.random.default_rng(0).normal(size=(24, 8)).astype(np.float32)
    targets = kind_rule_targets(z0, trajs)
    est = Transition(TransitionConfig(epochs=3, **TINY)).fit(z0, trajs, targets, progress=False)
    return est, z0, trajs


# ------------------------------------------------------------------------ action features


def test_arg_names_and_vocabularies():
    assert len(ARG_NAMES) == NUM_ARGS == len(set(ARG_NAMES))
    assert KNOWN_KINDS[0] == "<pad>" and KNOWN_KINDS[1] == "<unk>"
    assert len(set(KNOWN_KINDS)) == len(KNOWN_KINDS)
    assert "meta_schedule.parallel" in ANNOTATION_KEYS
    assert len(STRUCT_NAMES) == NUM_STRUCT == len(set(STRUCT_NAMES))


def test_encode_actions_shapes_and_values():
    acts = example_actions()
    enc = encode_actions(acts)
    T = len(acts)
    assert enc["kind"].dtype == np.int64 and enc["kind"].shape == (T,)
    assert enc["args"].dtype == np.float32 and enc["args"].shape == (T, NUM_ARGS)
    assert np.isfinite(enc["args"]).all()
    assert enc["kind"][4] == KIND_TO_ID["SamplePerfectTile"]
    col = {n: i for i, n in enumerate(ARG_NAMES)}
    row = enc["args"][4]  # SamplePerfectTile decision [2, 4, 1, 8]
    assert row[col["tile_0"] : col["tile_0"] + 5] == pytest.approx(
        [math.log2(3), math.log2(5), 1.0, math.log2(9), 0.0]
    )
    split = enc["args"][5]  # Split resolves its factors through v5..v8
    assert split[col["tile_3"]] == pytest.approx(math.log2(9))
    assert split[col["ir_changing"]] == 1.0 and row[col["ir_changing"]] == 0.0
    cat = enc["args"][15]
    assert cat[col["cat_index"]] == 2 and cat[col["cat_value"]] == pytest.approx(math.log2(65))
    unroll = enc["args"][16]  # Annotate(b1, v26) resolved to candidate 64
    assert unroll[col["ann_value"]] == pytest.approx(math.log2(65))
    assert unroll[col["ann_key=meta_schedule.unroll_explicit"]] == 1.0
    rca = enc["args"][12]  # ReverseComputeAt(b25, l17): b25 from action 11, l17 from action 7
    assert rca[col["ref0_age"]] == pytest.approx(1 / T)
    assert rca[col["ref1_age"]] == pytest.approx(5 / T)
    assert rca[col["ref1_pos"]] == 0.0 and rca[col["ref1_is_loop"]] == 1.0
    vec = enc["args"][25]  # Vectorize(l41): single output of a Fuse
    assert vec[col["ref0_age"]] == pytest.approx(1 / T)
    dec = enc["args"][27]  # DecomposeReduction on variables produced outside the trajectory
    assert dec[col["ref0_unresolved"]] == 1.0 and dec[col["ref1_unresolved"]] == 1.0
    # deterministic
    again = encode_actions(acts)
    assert np.array_equal(enc["args"], again["args"]) and np.array_equal(enc["kind"], again["kind"])


def test_unknown_kinds_and_weird_values_do_not_crash():
    weird = [
        {"kind": "TotallyNewInstruction", "inputs": ["b0"], "attrs": [], "outputs": ["b9"], "decision": None},
        {"kind": None, "inputs": None, "attrs": None, "outputs": None, "decision": None},
        {"kind": "SamplePerfectTile", "inputs": ["l1"], "attrs": [[1, [2]], "x"], "outputs": ["v1", "v2"], "decision": ["4", None]},
        {"kind": "SampleCategorical", "inputs": [], "attrs": ["oops"], "outputs": ["v3"], "decision": "1"},
        {"kind": "SampleCategorical", "inputs": [], "attrs": [[1, 2], [0.5, 0.5]], "outputs": ["v4"], "decision": 7},
        {"kind": "Annotate", "inputs": ["b0", [1, [2, 3]]], "attrs": [None], "outputs": [], "decision": {"a": 1}},
        {"kind": "Annotate", "inputs": ["b0", "v4"], "attrs": [{"k": "v"}], "outputs": [], "decision": None},
        {"kind": "Annotate", "inputs": ["b0", float("nan")], "attrs": ["meta_schedule.parallel"], "outputs": [], "decision": None},
        {"kind": "Split", "inputs": ["l1", None, "v2", 10**400], "attrs": [True, "1"], "outputs": ["l5"], "decision": None},
        {"kind": "SampleComputeLocation", "inputs": ["b0"], "attrs": [], "outputs": ["l7"], "decision": -2},
        {"kind": "Bind", "inputs": ["l7"], "attrs": ["threadIdx.x"], "outputs": [], "decision": None},
        {"kind": "Fuse", "inputs": "l1", "attrs": 3, "outputs": "l8", "decision": float("inf")},
        {"kind": "<pad>", "inputs": [], "attrs": [], "outputs": [], "decision": None},
        {},
        "not even a dict",
    ]
    enc = encode_actions(weird)
    assert enc["args"].shape == (len(weird), NUM_ARGS)
    assert np.isfinite(enc["args"]).all()
    assert enc["kind"][0] == UNK_ID and enc["kind"][1] == UNK_ID
    assert enc["kind"][-3] == UNK_ID  # "<pad>" as a kind name is not padding
    assert (enc["kind"] != 0).all()
    s = structured_features(weird)
    assert s.shape == (NUM_STRUCT,) and np.isfinite(s).all()
    assert s[STRUCT_NAMES.index("count=<unk>")] == 5
    empty = encode_actions([])
    assert empty["kind"].shape == (0,) and empty["args"].shape == (0, NUM_ARGS)
    assert structured_features([]).shape == (NUM_STRUCT,)
    # batch path with weird / empty trajectories
    kind, args, mask = encode_batch([weird, [], example_actions()])
    assert kind.shape == mask.shape == (3, len(example_actions()))


def test_structured_features_counts():
    acts = example_actions()
    s = structured_features(acts)
    assert s.dtype == np.float32 and s.shape == (len(STRUCT_NAMES),)
    f = dict(zip(STRUCT_NAMES, s.tolist()))
    assert f["traj_len"] == len(acts)
    expected = {
        "GetSBlock": 3, "GetLoops": 2, "GetChildBlocks": 1, "SamplePerfectTile": 3,
        "Split": 3, "Reorder": 1, "CacheWrite": 1, "ReverseComputeAt": 1, "Annotate": 5,
        "SampleCategorical": 1, "EnterPostproc": 1, "Unannotate": 1, "Fuse": 2, "Parallel": 1,
        "Vectorize": 1, "DecomposeReduction": 1,
    }
    for k in KNOWN_KINDS[1:]:
        assert f[f"count={k}"] == expected.get(k, 0), k
    assert sum(f[f"count={k}"] for k in KNOWN_KINDS[1:]) == len(acts)
    assert f["n_ir_changing"] == 17
    assert f["tile_log2_max"] == pytest.approx(4.0) and f["tile_log2_min"] == 0.0
    assert f["tile_inner_prod_log2"] == pytest.approx(3 + 2 + 4)  # 8 * 4 * 16
    assert f["parallel_extent_log2"] == pytest.approx(math.log2(33))
    assert f["vectorize_extent_log2"] == pytest.approx(math.log2(65))
    assert f["unroll_max_step_log2"] == pytest.approx(math.log2(65))
    assert f["n_cache_write"] == 1 and f["n_cache_read"] == 0
    assert f["n_reverse_compute_at"] == 1 and f["n_compute_at"] == 0 and f["n_inline"] == 0
    assert f["max_fused_parallel"] == 2


# ------------------------------------------------------------------------------- model


def test_pad_batch_and_rollout_shapes():
    trajs = [example_actions()[:5], example_actions()[:9], []]
    kind, args, mask = pad_batch([encode_actions(t) for t in trajs])
    assert kind.shape == (3, 9) and kind.dtype == torch.int64
    assert args.shape == (3, 9, NUM_ARGS) and args.dtype == torch.float32
    assert mask.shape == (3, 9) and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [5, 9, 0]
    assert (kind[~mask] == 0).all() and (args[~mask] == 0).all()
    torch.manual_seed(0)
    model = TransitionModel(TransitionConfig(**TINY))
    z0 = torch.randn(3, 8)
    z_all, z_T = rollout(model, z0, kind, args, mask)
    assert z_all.shape == (3, 10, 8) and z_T.shape == (3, 8)
    assert torch.equal(z_all[:, 0], z0)
    assert torch.equal(z_T[2], z0[2])  # empty trajectory
    emb = ActionEmbedding(TransitionConfig(**TINY))(kind, args)
    assert emb.shape == (3, 9, 16)


@pytest.mark.parametrize("residual", [False, True])
def test_batched_rollout_matches_single(residual):
    torch.manual_seed(0)
    model = TransitionModel(TransitionConfig(residual_mlp=residual, **TINY)).eval()
    trajs = synthetic_trajectories(5, seed=3)
    encoded = [encode_actions(t) for t in trajs]
    z0 = torch.randn(5, 8)
    with torch.no_grad():
        z_all, z_T = model.rollout(z0, *pad_batch(encoded))
        for i, e in enumerate(encoded):
            T = len(e["kind"])
            # one action at a time, no padding
            z = z0[i : i + 1]
            steps = [z]
            for t in range(T):
                k, a, m = pad_batch([{"kind": e["kind"][t : t + 1], "args": e["args"][t : t + 1]}])
                _, z = model.rollout(z, k, a, m)
                steps.append(z)
            alone = torch.cat(steps)
            assert torch.allclose(z_all[i, : T + 1], alone, atol=1e-6)
            assert torch.allclose(z_T[i], alone[-1], atol=1e-6)
            # padded steps leave the state unchanged
            assert torch.equal(z_all[i, T:], z_T[i].expand(z_all.shape[1] - T, -1))


def test_transh_step_projects_onto_hyperplane():
    torch.manual_seed(0)
    step = TransH(TransitionConfig(**TINY))
    a = torch.randn(10, 16)
    z = torch.randn(10, 8) * 3
    w, d = step.params(a)
    assert torch.allclose(w.norm(dim=-1), torch.ones(10), atol=1e-6)
    z1 = step.project_translate(z, w, torch.zeros_like(d))
    assert torch.allclose((z1 * w).sum(-1), torch.zeros(10), atol=1e-5)
    # the module itself with a zero translation
    with torch.no_grad():
        step.translation.weight.zero_()
        step.translation.bias.zero_()
    z2 = step(z, a)
    assert torch.allclose((z2 * w).sum(-1), torch.zeros(10), atol=1e-5)
    assert torch.allclose(z2, z1, atol=1e-6)


def test_rollout_loss_parts():
    torch.manual_seed(0)
    B, S, d = 3, 4, 5
    targets = torch.randn(B, S, d)
    tmask = torch.zeros(B, S, dtype=torch.bool)
    tmask[:, 2] = True
    tmask[0, 3] = True
    total, parts = rollout_loss(targets.clone(), targets, tmask, margin=0.5)
    assert parts["match"].item() == pytest.approx(0.0, abs=1e-3)
    z_far = targets + 10.0
    total2, parts2 = rollout_loss(z_far, targets, tmask, margin=0.5)
    assert parts2["match"].item() == pytest.approx(10.0 * math.sqrt(d), rel=1e-4)
    assert total2.item() > total.item()
    # identical rows are not negatives of each other
    same = targets[:1].expand(B, S, d).clone()
    _, parts3 = rollout_loss(same, same, tmask, margin=0.5)
    assert parts3["rank"].item() == 0.0
    none = torch.zeros(B, S, dtype=torch.bool)
    total4, _ = rollout_loss(targets, targets, none)
    assert total4.item() == 0.0


def test_fit_loss_decreases():
    trajs = synthetic_trajectories(32, seed=1)
    z0 = np.random.default_rng(2).normal(size=(32, 8)).astype(np.float32)
    targets = kind_rule_targets(z0, trajs)
    for t in targets:  # only some steps supervised, as with IR-changing steps in real data
        for k in [k for k in t if k % 3 == 1 and k != max(t)]:
            del t[k]
    est = Transition(TransitionConfig(epochs=12, **TINY))
    assert est.fit(z0, trajs, targets, progress=False) is est
    h = est.history_
    assert len(h) == 12 and {"loss", "match", "rank"} <= set(h[0])
    assert h[-1]["loss"] < h[0]["loss"]
    assert h[-1]["match"] < h[0]["match"]
    pred = est.predict(z0, trajs)
    assert pred.shape == (32, 8) and pred.dtype == np.float32
    # fast path on precomputed features gives the same predictions
    assert np.allclose(est.predict_encoded(z0, encode_batch(trajs)), pred, atol=1e-6)
    # explicit seed: same result twice
    est2 = Transition(TransitionConfig(epochs=12, **TINY)).fit(z0, trajs, targets, progress=False)
    assert np.array_equal(est2.predict(z0, trajs), pred)


def test_fit_respects_max_seconds():
    trajs = synthetic_trajectories(16, seed=4)
    z0 = np.zeros((16, 8), np.float32)
    est = Transition(TransitionConfig(epochs=1000, **TINY))
    est.fit(z0, trajs, kind_rule_targets(z0, trajs), progress=False, max_seconds=0.0)
    assert len(est.history_) == 1 and est.history_[0].get("partial")


def test_save_load_round_trip(tmp_path, fitted):
    est, z0, trajs = fitted
    est.save(tmp_path / "m")
    assert (tmp_path / "m" / CONFIG_FILE).is_file() and (tmp_path / "m" / WEIGHTS_FILE).is_file()
    loaded = Transition.load(tmp_path / "m")
    assert loaded.config == est.config
    assert np.array_equal(loaded.predict(z0, trajs), est.predict(z0, trajs))
    assert loaded.history_ == est.history_


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_missing_file_raises(tmp_path, fitted, name):
    est, _, _ = fitted
    est.save(tmp_path)
    (tmp_path / name).unlink()
    with pytest.raises(CwmError, match=name):
        Transition.load(tmp_path)


def test_mismatched_config_raises(tmp_path, fitted):
    est, _, _ = fitted
    est.save(tmp_path)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    meta["config"]["hidden"] = 17  # weights were saved with hidden=32
    (tmp_path / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(CwmError, match=WEIGHTS_FILE):
        Transition.load(tmp_path)
    meta["config"]["hidden"] = 32
    meta["arg_names"] = meta["arg_names"][:-1]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(CwmError, match=CONFIG_FILE):
        Transition.load(tmp_path)
    with pytest.raises(CwmError):
        TransitionConfig.from_dict({"state_dim": 8, "bogus": 1})
    assert TransitionConfig.from_dict(est.config.to_dict()) == est.config


def test_unfitted_and_bad_shapes_raise():
    with pytest.raises(CwmError):
        Transition(TransitionConfig(**TINY)).predict(np.zeros((1, 8), np.float32), [[]])
    with pytest.raises(CwmError):
        Transition(TransitionConfig(**TINY)).fit(np.zeros((2, 5), np.float32), [[], []], [{}, {}])
