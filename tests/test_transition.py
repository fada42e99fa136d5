"""Action features and the latent TransH transition model (tiny sizes: runs in seconds)."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from cwm.features.action_features import ANNOTATION_KEYS, ARG_NAMES, KIND_TO_ID, KNOWN_KINDS, NUM_ARGS, NUM_STRUCT, STRUCT_NAMES, UNK_ID, encode_actions, structured_features
from cwm.errors import CwmError
from cwm.model.transition import CONFIG_FILE, RELATIVE_TILE_NAMES, WEIGHTS_FILE, ActionEmbedding, Transition, TransitionConfig, TransitionModel, TransH, encode_batch, pad_batch, relative_tile_inputs, rollout, rollout_loss

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


def test_relative_tile_inputs_put_factors_against_their_loop_and_the_vector_widths():
    acts = example_actions()
    rel = relative_tile_inputs(torch.from_numpy(encode_actions(acts)["args"])).numpy()
    assert rel.shape == (len(acts), len(RELATIVE_TILE_NAMES))
    col = {n: i for i, n in enumerate(RELATIVE_TILE_NAMES)}
    shares = [col[f"tile_{i}_log_share"] for i in range(4)]
    # l2 (extent 64) sampled as [2, 4, 1, 8]: log2 shares 1/6, 2/6, 0, 3/6; innermost 8 fills one AVX2 vector
    first = rel[4]
    np.testing.assert_allclose(first[shares], [1 / 6, 2 / 6, 0, 3 / 6], atol=1e-6)
    assert [first[col[n]] for n in ("inner_div4", "inner_div8", "inner_div16", "inner_below8", "inner_below16",
                                    "spatial_tile")] == [1, 1, 0, 0, 1, 1]
    np.testing.assert_array_equal(rel[5], rel[4])  # the Split that applies those factors, resolved
    # the reduction loop l4 (extent 64) as [4, 16]: two levels, innermost a whole AVX-512 vector
    red = rel[8]
    np.testing.assert_allclose(red[shares[:2]], [2 / 6, 4 / 6], atol=1e-6)
    assert [red[col[n]] for n in ("inner_div16", "inner_below16", "spatial_tile")] == [1, 0, 0]
    # actions that are not tiles get zeros
    assert not rel[[0, 1, 2, 3, 10, 11]].any()
    # a Split whose factors cannot be resolved: zeros, not a guess
    unresolved = {"kind": "Split", "inputs": ["l0", "v99", 4], "attrs": [1, 0], "outputs": ["l1", "l2"],
                  "decision": None}
    assert not relative_tile_inputs(torch.from_numpy(encode_actions([unresolved])["args"])).any()


def test_a_transition_with_relative_tiles_reads_them_and_round_trips(tmp_path):
    trajs = synthetic_trajectories(16, seed=5)
    z0 = np.random.default_rng(5).normal(size=(16, 8)).astype(np.float32)
    est = Transition(TransitionConfig(epochs=2, relative_tiles=True, **TINY)).fit(
        z0, trajs, kind_rule_targets(z0, trajs), progress=False)
    assert est.model_.embed.arg_in.in_features == NUM_ARGS + len(RELATIVE_TILE_NAMES)
    est.save(tmp_path / "rel")
    loaded = Transition.load(tmp_path / "rel")
    assert loaded.config.relative_tiles
    np.testing.assert_array_equal(loaded.predict(z0, trajs), est.predict(z0, trajs))
    # the relative inputs reach the rollout: zeroing their weights changes the prediction
    with torch.no_grad():
        loaded.model_.embed.arg_in.weight[:, NUM_ARGS:] = 0
    assert not np.allclose(loaded.predict(z0, trajs), est.predict(z0, trajs))


@pytest.mark.parametrize("residual,relative", [(False, False), (True, False), (False, True), (True, True)])
def test_batched_rollout_matches_single(residual, relative):
    torch.manual_seed(0)
    model = TransitionModel(TransitionConfig(residual_mlp=residual, relative_tiles=relative, **TINY)).eval()
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


def test_warm_start_continues_from_the_fitted_weights():
    trajs = synthetic_trajectories(32, seed=1)
    z0 = np.random.default_rng(2).normal(size=(32, 8)).astype(np.float32)
    targets = kind_rule_targets(z0, trajs)
    est = Transition(TransitionConfig(epochs=4, **TINY)).fit(z0, trajs, targets, progress=False)
    before = est.predict(z0, trajs)
    first_loss = est.history_[0]["loss"]
    tuned = copy.deepcopy(est).fit(z0, trajs, targets, progress=False, warm_start=True, epochs=2)
    assert len(tuned.history_) == 2
    assert tuned.history_[0]["loss"] < first_loss  # it did not start again from scratch
    assert not np.array_equal(tuned.predict(z0, trajs), before)
    assert np.array_equal(est.predict(z0, trajs), before)  # the original is untouched
    cold = copy.deepcopy(est).fit(z0, trajs, targets, progress=False, epochs=2)
    assert cold.history_[0]["loss"] == pytest.approx(first_loss)


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


# ------------------------------------------------------------- fast featurization & cache
#
# The fast single-pass featurization and its caches must give bitwise the same arrays as the
# straightforward per-action definition, kept here as the reference (the pre-optimization
# implementation, on the module's value helpers).

import copy
import random

import cwm.features.action_features as af


def _ref_put_tiles(row, factors):
    prod = 0.0
    for i, f in enumerate(factors):
        if f is None:
            continue
        if i < af.MAX_TILE_FACTORS:
            row[af._C_TILE0 + i] = af._slog(f)
        if f > 0:
            prod += math.log2(min(f, af._BIG))
    row[af._C_TILE_COUNT] = af._slog(len(factors))
    row[af._C_TILE_PROD] = prod


def ref_encode_actions(actions):
    acts = list(actions) if isinstance(actions, (list, tuple)) else []
    T = len(acts)
    kinds = np.zeros(T, dtype=np.int64)
    rows = []
    producers, values = {}, {}
    in_postproc = 0.0
    inv_T = 1.0 / T if T else 0.0
    for t, act in enumerate(acts):
        kind = af._kind_name(act)
        kinds[t] = af.kind_id(kind)
        inputs, attrs, outputs = (af._field(act, f) for f in ("inputs", "attrs", "outputs"))
        row = [0.0] * NUM_ARGS
        if kind in af._TILE_KINDS:
            factors = af._tile_decision(act)
            _ref_put_tiles(row, factors)
            for name, f in zip(outputs, factors):
                if f is not None and af._rv(name) == "v":
                    values[name] = f
        elif kind == "Split":
            factors = [values.get(x) if af._rv(x) == "v" else af._num(x) for x in inputs[1:]]
            _ref_put_tiles(row, factors)
        elif kind == "SampleCategorical":
            idx, value, n_cand, prob = af._categorical_choice(act)
            if idx is not None:
                row[af._C_CAT_INDEX] = float(min(idx, 1e6))
            if value is not None:
                row[af._C_CAT_VALUE] = af._slog(value)
                if outputs and af._rv(outputs[0]) == "v":
                    values[outputs[0]] = value
            row[af._C_CAT_N] = af._slog(n_cand)
            if prob is not None:
                row[af._C_CAT_PROB] = max(-af._BIG, min(prob, af._BIG))
        elif kind == "SampleComputeLocation":
            d = af._num(af._decision(act))
            if d is not None:
                row[af._C_LOC] = af._slog(d)
        if kind in ("Annotate", "Unannotate"):
            key = af._first_str_attr(attrs)
            ki = af.ANN_KEY_TO_INDEX.get(key) if key is not None else None
            row[af._C_ANN_KEY0 + ki if ki is not None else af._C_ANN_OTHER] = 1.0
            if kind == "Annotate" and len(inputs) > 1:
                val = inputs[1]
                if af._rv(val) == "v":
                    v = values.get(val)
                elif af._is_quoted_str(val):
                    v = None
                    row[af._C_ANN_STR] = 1.0
                else:
                    v = af._num(val)
                if v is not None:
                    row[af._C_ANN_VALUE] = af._slog(v)
                    row[af._C_ANN_KNOWN] = 1.0
        row[af._C_NIN] = af._slog(len(inputs))
        row[af._C_NOUT] = af._slog(len(outputs))
        r = 0
        for x in inputs:
            if r >= af.NUM_REFS:
                break
            cls = af._rv(x)
            if cls is None or cls == "v":
                continue
            base = af._C_REF0 + r * af._REF_WIDTH
            row[base + (0 if cls == "b" else 1)] = 1.0
            prod = producers.get(x)
            if prod is None:
                row[base + 5] = 1.0
            else:
                p_idx, pos, n_out = prod
                row[base + 2] = (t - p_idx) * inv_T
                row[base + 3] = pos / (n_out - 1) if n_out > 1 else 0.0
                row[base + 4] = af._slog(n_out)
            r += 1
        a = 0
        for x in attrs:
            if a >= af.NUM_ATTR_INTS:
                break
            if isinstance(x, (list, tuple, dict, str)) or x is None:
                continue
            v = af._num(x)
            if v is not None:
                row[af._C_ATTR0 + a] = af._slog(v)
                a += 1
        if kind in af._CACHE_READ_KINDS or kind in af._CACHE_WRITE_KINDS or kind == "SetScope":
            scope = af._first_str_attr(attrs)
            if scope is not None:
                for si, s in enumerate(af._SCOPES):
                    if scope == s or scope.startswith(s + "."):
                        row[af._C_SCOPE0 + si] = 1.0
                        break
                else:
                    row[af._C_SCOPE_OTHER] = 1.0
        elif kind == "Bind":
            axis = af._first_str_attr(attrs)
            if axis is not None:
                for bi, p in enumerate(af._BIND_PREFIXES):
                    if axis.startswith(p):
                        row[af._C_BIND0 + bi] = 1.0
                        break
        row[af._C_IR] = 0.0 if kind in af.NON_IR_KINDS else 1.0
        if kind == "EnterPostproc":
            in_postproc = 1.0
        row[af._C_POST] = in_postproc
        row[af._C_STEP] = t * inv_T
        for pos, name in enumerate(outputs):
            if isinstance(name, str):
                producers[name] = (t, pos, len(outputs))
        rows.append(row)
    return {"kind": kinds, "args": np.asarray(rows, dtype=np.float32).reshape(T, NUM_ARGS)}


def ref_structured_features(actions):
    acts = list(actions) if isinstance(actions, (list, tuple)) else []
    col = af._SCOL
    out = np.zeros(NUM_STRUCT, dtype=np.float64)
    out[col["traj_len"]] = len(acts)
    counts = [0] * len(KNOWN_KINDS)
    values, fused = {}, {}
    tile_logs, inner_logs, locs = [], [], []
    n_tile_samples = n_ir = n_post = 0
    in_post = False
    par_ext = vec_ext = unroll = unroll_explicit = 0.0
    max_fused_par = max_fused_vec = 0
    n_par = n_vec = n_bind_thread = 0
    for act in acts:
        kind = af._kind_name(act)
        counts[af.kind_id(kind)] += 1
        if kind not in af.NON_IR_KINDS:
            n_ir += 1
        if in_post:
            n_post += 1
        if kind == "EnterPostproc":
            in_post = True
        inputs, attrs, outputs = (af._field(act, f) for f in ("inputs", "attrs", "outputs"))
        if kind in af._TILE_KINDS:
            factors = af._tile_decision(act)
            for name, f in zip(outputs, factors):
                if f is not None and af._rv(name) == "v":
                    values[name] = f
            if kind == "SamplePerfectTile":
                logs = [math.log2(min(f, af._BIG)) for f in factors if f is not None and f > 0]
                if logs:
                    n_tile_samples += 1
                    tile_logs.extend(logs)
                    last = factors[-1]
                    if last is not None and last > 0:
                        inner_logs.append(math.log2(min(last, af._BIG)))
        elif kind == "SampleCategorical":
            _, value, _, _ = af._categorical_choice(act)
            if value is not None and outputs and af._rv(outputs[0]) == "v":
                values[outputs[0]] = value
        elif kind == "SampleComputeLocation":
            d = af._num(af._decision(act))
            if d is not None:
                locs.append(max(-af._BIG, min(d, af._BIG)))
        elif kind == "Fuse":
            n = sum(fused.get(x, 1) for x in inputs if af._rv(x) == "l")
            if outputs and isinstance(outputs[0], str):
                fused[outputs[0]] = max(n, 1)
        elif kind == "Parallel":
            n_par += 1
            if inputs and isinstance(inputs[0], str):
                max_fused_par = max(max_fused_par, fused.get(inputs[0], 1))
        elif kind == "Vectorize":
            n_vec += 1
            if inputs and isinstance(inputs[0], str):
                max_fused_vec = max(max_fused_vec, fused.get(inputs[0], 1))
        elif kind == "Bind":
            axis = af._first_str_attr(attrs)
            if axis is not None and axis.startswith("threadIdx"):
                n_bind_thread += 1
        elif kind == "Annotate" and len(inputs) > 1:
            key = af._first_str_attr(attrs)
            val = inputs[1]
            v = values.get(val) if af._rv(val) == "v" else af._num(val)
            if key is not None and v is not None:
                lv = af._slog(v)
                if key == "meta_schedule.parallel":
                    par_ext = max(par_ext, lv)
                elif key == "meta_schedule.vectorize":
                    vec_ext = max(vec_ext, lv)
                elif key in af._UNROLL_KEYS:
                    unroll = max(unroll, lv)
                    if key == "meta_schedule.unroll_explicit":
                        unroll_explicit = 1.0
    for i, k in enumerate(KNOWN_KINDS[1:], start=1):
        out[col[f"count={k}"]] = counts[i]
    out[col["n_ir_changing"]] = n_ir
    out[col["n_postproc_actions"]] = n_post
    if tile_logs:
        out[col["tile_log2_mean"]] = sum(tile_logs) / len(tile_logs)
        out[col["tile_log2_max"]] = max(tile_logs)
        out[col["tile_log2_min"]] = min(tile_logs)
    out[col["tile_n_samples"]] = n_tile_samples
    if inner_logs:
        out[col["tile_inner_log2_mean"]] = sum(inner_logs) / len(inner_logs)
        out[col["tile_inner_log2_max"]] = max(inner_logs)
        out[col["tile_inner_prod_log2"]] = sum(inner_logs)
    out[col["parallel_extent_log2"]] = par_ext
    out[col["vectorize_extent_log2"]] = vec_ext
    out[col["unroll_max_step_log2"]] = unroll
    out[col["unroll_explicit"]] = unroll_explicit
    out[col["n_cache_read"]] = sum(counts[KIND_TO_ID[k]] for k in sorted(af._CACHE_READ_KINDS))
    out[col["n_cache_write"]] = sum(counts[KIND_TO_ID[k]] for k in sorted(af._CACHE_WRITE_KINDS))
    out[col["n_compute_at"]] = counts[KIND_TO_ID["ComputeAt"]]
    out[col["n_reverse_compute_at"]] = counts[KIND_TO_ID["ReverseComputeAt"]]
    out[col["n_inline"]] = counts[KIND_TO_ID["ComputeInline"]] + counts[KIND_TO_ID["ReverseComputeInline"]]
    out[col["max_fused_parallel"]] = max_fused_par
    out[col["max_fused_vectorize"]] = max_fused_vec
    out[col["n_parallel_loops"]] = n_par
    out[col["n_vectorize_loops"]] = n_vec
    out[col["n_thread_binds"]] = n_bind_thread
    if locs:
        out[col["compute_location_mean"]] = sum(locs) / len(locs)
    return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


WEIRD_VALUES = [
    None, float("nan"), float("inf"), -float("inf"), -0.0, 0.0, True, False, 0, 1, -1, -5, 3.5,
    1e300, 10**400, -10**400, 2**70, 1024, 1025, "12", "-3", "1e400", "nan", "abc", "", '"q"',
    '"', "v5", "v999", "l3", "b0", "b1\n", "x1", [], [1, [2]], (1, 2), {"a": 1}, {1, 2},
    np.int64(7), np.float32(0.1), np.float64(-0.0), np.float32("nan"), np.bool_(True),
    b"bytes", "+.5", "1_000", "\u0661\u0662", "meta_schedule.parallel",
    "meta_schedule.unroll_explicit", '"meta_schedule.vectorize"', "global.x", "shared",
    "threadIdx.y", "blockIdx.x", [0.25, -0.0, float("nan")], [2, 4, 1, 8, 2, 2, 2, 2, 2, 3],
    [None, 2], ["4", "8"], [True, 2.0], [-0.0, 0.0, 1.0],
]
FUZZ_KINDS = list(KNOWN_KINDS) + ["Nope", "", None, 3, ["Split"], "split"]


def fuzz_trajectories(n: int, seed: int) -> list:
    """Trajectories with random weird kinds / fields / values mixed into real-looking ones."""
    rng = random.Random(seed)
    base = example_actions()
    out = []
    for _ in range(n):
        acts = copy.deepcopy(base[: rng.randrange(0, len(base) + 1)])
        for i, a in enumerate(acts):
            if rng.random() < 0.35:
                field = rng.choice(["kind", "inputs", "attrs", "outputs", "decision"])
                m = rng.randrange(6)
                if m == 0:
                    a["kind"] = rng.choice(FUZZ_KINDS)
                elif m == 1:
                    a[field] = rng.choice(WEIRD_VALUES)
                elif m == 2:
                    a[field] = [rng.choice(WEIRD_VALUES) for _ in range(rng.randrange(6))]
                elif m == 3 and isinstance(a.get(field), list) and a[field]:
                    a[field][rng.randrange(len(a[field]))] = rng.choice(WEIRD_VALUES)
                elif m == 4:
                    a.pop(field, None)
                else:
                    acts[i] = rng.choice(["str", None, 5, [a], tuple(a.items())])
        if rng.random() < 0.1:
            acts = tuple(acts)
        out.append(acts)
    return out


@pytest.fixture
def fresh_cache():
    af.clear_feature_cache()
    yield
    af.clear_feature_cache()


def test_fast_featurization_matches_reference_bitwise(fresh_cache):
    trajs = [example_actions(), []] + synthetic_trajectories(40, seed=7) + fuzz_trajectories(300, 11)
    for _ in range(2):  # cold, then from the caches
        for acts in trajs:
            ref, ref_s = ref_encode_actions(acts), ref_structured_features(acts)
            enc, s = encode_actions(acts), structured_features(acts)
            assert _bits_equal(enc["kind"], ref["kind"]) and _bits_equal(enc["args"], ref["args"])
            assert _bits_equal(s, ref_s)
    for odd in (None, "abc", 5, {"kind": "Split"}):  # not a list of actions: empty trajectory
        assert encode_actions(odd)["args"].shape == (0, NUM_ARGS)
        assert _bits_equal(structured_features(odd), ref_structured_features(odd))


def test_batch_api_equals_per_trajectory_api(fresh_cache):
    trajs = [example_actions(), []] + synthetic_trajectories(20, seed=3) + fuzz_trajectories(60, 5)
    trajs.append(trajs[2])  # duplicate within the batch
    batch = af.encode_actions_batch(trajs)
    struct = af.structured_features_batch(trajs)
    B = len(trajs)
    T = max(len(af._as_actions(t)) for t in trajs)
    assert batch["kind"].shape == (B, T) and batch["kind"].dtype == np.int64
    assert batch["args"].shape == (B, T, NUM_ARGS) and batch["args"].dtype == np.float32
    assert batch["mask"].dtype == bool and struct.shape == (B, NUM_STRUCT)
    assert struct.dtype == np.float32
    for i, acts in enumerate(trajs):
        ref = ref_encode_actions(acts)
        n = len(ref["kind"])
        assert batch["lengths"][i] == n and batch["mask"][i, :n].all() and not batch["mask"][i, n:].any()
        assert _bits_equal(batch["kind"][i, :n], ref["kind"]) and not batch["kind"][i, n:].any()
        assert _bits_equal(batch["args"][i, :n], ref["args"])
        assert not batch["args"][i, n:].view(np.uint32).any()
        assert _bits_equal(struct[i], ref_structured_features(acts))
    # transition.encode_batch is the padded batch API, equal to pad_batch of the single API
    kind, args, mask = encode_batch(trajs)
    k2, a2, m2 = pad_batch([encode_actions(t) for t in trajs])
    assert torch.equal(kind, k2) and torch.equal(mask, m2)
    assert _bits_equal(args.numpy(), a2.numpy()) and _bits_equal(args.numpy(), batch["args"])
    # generators and empty batches
    assert af.structured_features_batch(iter(trajs[:3])).shape == (3, NUM_STRUCT)
    empty = af.encode_actions_batch([])
    assert empty["args"].shape == (0, 0, NUM_ARGS) and empty["mask"].shape == (0, 0)
    assert af.structured_features_batch([]).shape == (0, NUM_STRUCT)
    k0, a0, m0 = encode_batch([])
    assert k0.shape == m0.shape == (0, 0) and a0.shape == (0, 0, NUM_ARGS)


def test_cache_is_not_corrupted_by_mutation(fresh_cache):
    acts = example_actions()
    first = encode_actions(acts)
    s_first = structured_features(acts)
    assert af.feature_cache_info()["entries"] == 1
    # results are fresh arrays: modifying them does not touch the cache
    first["args"][:] = 7.0
    first["kind"][:] = 3
    s_first[:] = 7.0
    again = encode_actions(copy.deepcopy(acts))
    assert _bits_equal(again["args"], ref_encode_actions(acts)["args"])
    assert _bits_equal(structured_features(acts), ref_structured_features(acts))
    batch = af.encode_actions_batch([acts])
    batch["args"][:] = 5.0
    assert _bits_equal(encode_actions(acts)["args"], ref_encode_actions(acts)["args"])
    assert af.feature_cache_info()["hits"] >= 3
    # mutating the input (in place, deep inside) after a call gives the new result
    acts[4]["decision"][0] = 64
    acts[15]["decision"] = 3
    acts.append({"kind": "Parallel", "inputs": ["l9"], "attrs": [], "outputs": [], "decision": None})
    for _ in range(2):
        assert _bits_equal(encode_actions(acts)["args"], ref_encode_actions(acts)["args"])
        assert _bits_equal(structured_features(acts), ref_structured_features(acts))
        assert _bits_equal(af.structured_features_batch([acts])[0], ref_structured_features(acts))


def test_cache_keys_distinguish_equal_but_different_values(fresh_cache):
    def cat(prob, decision):
        return [{"kind": "SampleCategorical", "inputs": [], "attrs": [[1, 16, 64], [0.5, prob, 0.25]],
                 "outputs": ["v0"], "decision": decision}]

    # -0.0 and 0.0 compare equal but are different float32 bits; 1, 1.0 and True compare equal
    variants = [cat(0.0, 1), cat(-0.0, 1), cat(0.0, 1.0), cat(0.0, True), cat(-0.0, 1.0),
                [{"kind": "Annotate", "inputs": ["b0", 1], "attrs": ["meta_schedule.parallel"]}],
                [{"kind": "Annotate", "inputs": ["b0", True], "attrs": ["meta_schedule.parallel"]}],
                [{"kind": "Annotate", "inputs": ["b0", 1.0], "attrs": ["meta_schedule.parallel"]}],
                [{"kind": "Annotate", "inputs": ["b0", np.float64(1.0)], "attrs": [0]}]]
    for _ in range(2):
        for acts in variants:
            assert _bits_equal(encode_actions(acts)["args"], ref_encode_actions(acts)["args"])
            assert _bits_equal(structured_features(acts), ref_structured_features(acts))
    col = ARG_NAMES.index("cat_prob")
    assert np.signbit(encode_actions(cat(-0.0, 1))["args"][0, col])
    assert not np.signbit(encode_actions(cat(0.0, 1))["args"][0, col])
    # unpicklable / cyclic inputs are simply not cached
    cyclic = example_actions()[:3]
    cyclic[0]["attrs"].append(cyclic)
    assert _bits_equal(encode_actions(cyclic)["args"], ref_encode_actions(cyclic)["args"])


def test_cache_size_is_bounded(fresh_cache, monkeypatch):
    monkeypatch.setattr(af, "CACHE_MAX_ENTRIES", 5)
    trajs = synthetic_trajectories(30, seed=2)
    for t in trajs:
        encode_actions(t)
    assert af.feature_cache_info()["entries"] <= 5
    monkeypatch.setattr(af, "CACHE_MAX_ENTRIES", 1000)
    monkeypatch.setattr(af, "CACHE_MAX_BYTES", 60_000)
    af.encode_actions_batch(trajs)
    info = af.feature_cache_info()
    assert 0 < info["bytes"] <= 60_000 and info["entries"] < 30
    monkeypatch.setattr(af, "CACHE_MAX_ENTRIES", 0)  # disabled
    af.clear_feature_cache()
    batch = af.encode_actions_batch(trajs)
    assert af.feature_cache_info()["entries"] == 0
    for i, t in enumerate(trajs):
        assert _bits_equal(batch["args"][i, : len(t)], ref_encode_actions(t)["args"])


def test_per_action_memo_edge_cases(fresh_cache):
    base = example_actions()
    odd_strings = copy.deepcopy(base)
    odd_strings[0]["attrs"] = ["a}(b", "main"]  # '}(' inside a value: extra split point
    one_item = copy.deepcopy(base)
    one_item[1] = {"kind": "GetSBlock"}  # 1-item dict: no '}(' of its own ...
    one_item[2]["attrs"] = ["x}(y"]  # ... and one extra inside a value: the count still matches
    nested = copy.deepcopy(base)
    nested[3]["attrs"] = [{"k": 1, "j": 2}]
    byte_7d = copy.deepcopy(base)
    byte_7d[5]["attrs"] = [125, (1, 2, 3, 4)]  # BININT1 0x7d then MARK
    long = (base * 40)[:1100]  # more than one pickle batch of list items
    cases = [odd_strings, one_item, nested, byte_7d, long, base[:1], base[4:6], base[:5],
             base[:5] + base[:5], list(reversed(base))]
    for _ in range(2):
        for acts in cases:
            assert _bits_equal(encode_actions(acts)["args"], ref_encode_actions(acts)["args"])
            assert _bits_equal(structured_features(acts), ref_structured_features(acts))
        batch = af.encode_actions_batch(cases)
        for i, acts in enumerate(cases):
            assert _bits_equal(batch["args"][i, : len(acts)], ref_encode_actions(acts)["args"])
