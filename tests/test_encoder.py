"""Tests of the TIR state encoder (tiny sizes: the suite runs on 2 busy CPU cores)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from cwm.model.encoder import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, EncoderConfig, StateEncoder, TIRTokenizer, canonicalize, split_windows
from cwm.errors import CwmError

SAMPLE = '''# from tvm.script import ir as I
# from tvm.script import tirx as T

@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def main(A: T.Buffer((128, 256), "float32"), B: T.Buffer((256, 128), "float32"), C: T.Buffer((128, 128), "float32")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        for i_0_j_0_fused in T.parallel(16):
            for i_1, j_1, k_0 in T.grid(4, 2, 16):
                for i_2, j_2, k_1 in T.grid(2, 32, 16):
                    with T.sblock("C"):
                        v_i = T.axis.spatial(128, i_0_j_0_fused // 4 * 8 + i_1 * 2 + i_2)
                        v_j = T.axis.spatial(128, i_0_j_0_fused % 4 * 32 + j_2)
                        v_k = T.axis.reduce(256, k_0 * 16 + k_1)
                        T.reads(A[v_i, v_k], B[v_k, v_j])
                        T.writes(C[v_i, v_j])
                        with T.init():
                            C[v_i, v_j] = T.float32(0.0)
                        C[v_i, v_j] = C[v_i, v_j] + A[v_i, v_k] * B[v_k, v_j]
'''

HEADER = '''# from tvm.script import ir as I
# from tvm.script import tirx as T

@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
'''


def matmul(t0: int, t1: int, name: str = "i") -> str:
    return HEADER + f'''    def main(A: T.Buffer((128, 128), "float32"), B: T.Buffer((128, 128), "float32"), C: T.Buffer((128, 128), "float32")):
        T.func_attr({{"tirx.noalias": True}})
        for {name}_0, j_0 in T.grid({128 // t0}, {128 // t1}):
            for {name}_1, j_1, k in T.grid({t0}, {t1}, 128):
                with T.sblock("C"):
                    v_i = T.axis.spatial(128, {name}_0 * {t0} + {name}_1)
                    v_j = T.axis.spatial(128, j_0 * {t1} + j_1)
                    v_k = T.axis.reduce(128, k)
                    T.reads(A[v_i, v_k], B[v_k, v_j])
                    T.writes(C[v_i, v_j])
                    with T.init():
                        C[v_i, v_j] = T.float32(0.0)
                    C[v_i, v_j] = C[v_i, v_j] + A[v_i, v_k] * B[v_k, v_j]
'''


def add(t0: int, vec: bool) -> str:
    ann = "T.vectorize" if vec else "T.serial"
    return HEADER + f'''    def main(p0: T.Buffer((4096,), "float16"), p1: T.Buffer((4096,), "float16"), T_add: T.Buffer((4096,), "float16")):
        T.func_attr({{"tirx.noalias": True}})
        for ax0_0 in T.parallel({4096 // t0}):
            for ax0_1 in {ann}({t0}):
                with T.sblock("T_add"):
                    v_ax0 = T.axis.spatial(4096, ax0_0 * {t0} + ax0_1)
                    T.reads(p0[v_ax0], p1[v_ax0])
                    T.writes(T_add[v_ax0])
                    T_add[v_ax0] = p0[v_ax0] + p1[v_ax0]
'''


def reduce_max(t0: int, unroll: int) -> str:
    return HEADER + f'''    def main(X: T.Buffer((64, 512), "int8"), Y: T.Buffer((64,), "int8")):
        T.func_attr({{"tirx.noalias": True}})
        Y_rf = T.alloc_buffer(({t0}, 64), "int8")
        for r_0 in T.unroll({unroll}):
            for b, r_1 in T.grid(64, {t0}):
                with T.sblock("Y_rf"):
                    vb, vr = T.axis.remap("SR", [b, r_1])
                    T.reads(X[vb, r_0 * {t0} + vr])
                    T.writes(Y_rf[vr, vb])
                    Y_rf[vr, vb] = T.max(Y_rf[vr, vb], X[vb, r_0 * {t0} + vr])
        for b, r in T.grid(64, {t0}):
            with T.sblock("Y"):
                vb, vr = T.axis.remap("SR", [b, r])
                Y[vb] = T.max(Y[vb], Y_rf[vr, vb])
'''


def corpus() -> tuple[list[str], list[str]]:
    texts = [matmul(t0, t1) for t0, t1 in [(4, 8), (8, 16), (16, 4), (32, 32)]]
    texts += [add(t0, vec) for t0, vec in [(4, True), (8, False), (16, True), (64, False)]]
    texts += [reduce_max(t0, u) for t0, u in [(2, 256), (4, 128), (8, 64), (16, 32)]]
    return texts, ["mm"] * 4 + ["add"] * 4 + ["max"] * 4


def tiny_config(**kw) -> EncoderConfig:
    base = dict(
        vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
        window=32, stride=24, max_windows=8, seed=0,
    )
    base.update(kw)
    return EncoderConfig(**base)


@pytest.fixture(scope="module")
def fitted() -> StateEncoder:
    texts, groups = corpus()
    return StateEncoder(tiny_config()).fit(texts, groups, epochs=6, batch_size=12, lr=3e-3, progress=False)


def cosine_stats(z: np.ndarray, groups: list[str]) -> tuple[float, float]:
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
    sim = z @ z.T
    g = np.asarray(groups)
    same = g[:, None] == g[None, :]
    off = ~np.eye(len(g), dtype=bool)
    return float(sim[same & off].mean()), float(sim[~same].mean())


# ---------------------------------------------------------------- canonicalize


def test_canonicalize_drops_comments_headers_and_renames_consistently():
    canon = canonicalize(SAMPLE)
    assert "#" not in canon and "@" not in canon and "class Module" not in canon
    for noise in ("i_0_j_0_fused", "v_i", "k_1", '"C"'):
        assert noise not in canon
    for kept in ("T.parallel(16)", "T.grid(4, 2, 16)", "T.axis.spatial(128,", "T.axis.reduce(256,", '"float32"',
                 "T.float32(0.0)", "T.sblock(", "T.reads(", "// 4 * 8"):
        assert kept in canon
    assert canon.splitlines()[0].startswith("def main(buf0: T.Buffer((128, 256)")
    assert "for i0 in T.parallel(16):" in canon

    renamed = (SAMPLE.replace("i_0_j_0_fused", "ax0_ax1_fused").replace("v_i", "vi").replace("k_0", "kk_o")
               .replace('"C"', '"matmul_out"').replace("A[", "lhs[").replace("A:", "lhs:"))
    renamed = renamed.replace("        # with", "        # some other comment\n        # with")
    assert renamed != SAMPLE
    assert canonicalize(renamed) == canon


def test_canonicalize_keeps_numbers_and_nesting():
    assert canonicalize(matmul(4, 8)) != canonicalize(matmul(8, 4))
    assert canonicalize(matmul(4, 8, "i")) == canonicalize(matmul(4, 8, "row"))
    lines = canonicalize(reduce_max(4, 128)).splitlines()
    depth = {line.strip(): len(line) - len(line.lstrip()) for line in lines}
    # The second loop nest is a sibling of the first, not nested inside it.
    assert depth["for i0 in T.unroll(128):"] == depth["for i1, i3 in T.grid(64, 4):"] == 1
    assert "vb" not in canonicalize(reduce_max(4, 128))


# ---------------------------------------------------------------- windows


def test_split_windows_overlap_and_cap():
    ids = list(range(100))
    wins = split_windows(ids, window=32, stride=24, max_windows=10)
    assert len(wins) == 4
    for a, b in zip(wins, wins[1:]):
        assert a[24:] == b[: 32 - 24]  # configured overlap of window - stride
    assert wins[0][0] == 0 and wins[-1][-1] == 99
    assert split_windows(ids[:20], 32, 24, 10) == [ids[:20]]
    capped = split_windows(list(range(1000)), 32, 24, 5)
    assert len(capped) == 5 and all(len(w) == 32 for w in capped)
    assert capped[0][0] == 0 and capped[-1][-1] == 999


def test_encoder_windows_long_and_short(fitted):
    enc = StateEncoder(tiny_config(max_windows=1000), tokenizer=fitted.tokenizer)
    c = enc.config
    n_tokens = len(fitted.tokenizer.encode(canonicalize(SAMPLE)))
    long_wins = enc.windows(SAMPLE)
    assert len(long_wins) > 1
    assert sum(len(w) for w in long_wins) - (len(long_wins) - 1) * (c.window - c.stride) == n_tokens
    for a, b in zip(long_wins, long_wins[1:]):
        assert a[c.stride :] == b[: c.window - c.stride]  # configured overlap
    assert len(enc.windows("T.grid(4)")) == 1
    capped = fitted.windows(SAMPLE * 20)
    assert len(capped) == fitted.config.max_windows


# ---------------------------------------------------------------- encode


def test_shape_and_batch_equals_single(fitted):
    texts, _ = corpus()
    texts = texts[:5] + [SAMPLE, "for i in T.grid(2):"]
    z = fitted.encode(texts, batch_size=4)
    assert z.shape == (len(texts), fitted.dim) and z.dtype == np.float32
    single = np.concatenate([fitted.encode([t]) for t in texts])
    np.testing.assert_allclose(z, single, atol=1e-5)
    assert np.allclose(np.linalg.norm(z, axis=1), 1.0, atol=1e-5)
    t = fitted.encode_tensor(texts[:2])
    assert tuple(t.shape) == (2, fitted.dim) and t.requires_grad


def test_contrastive_fit_lowers_loss_and_separates_groups(fitted):
    texts, groups = corpus()
    assert len(fitted.history_) == 6
    assert fitted.history_[-1] < fitted.history_[0]
    intra, inter = cosine_stats(fitted.encode(texts), groups)
    assert intra > inter


def test_fit_is_deterministic_and_respects_max_seconds():
    texts, groups = corpus()
    a = StateEncoder(tiny_config()).fit(texts, groups, epochs=2, batch_size=8, progress=False)
    b = StateEncoder(tiny_config()).fit(texts, groups, epochs=2, batch_size=8, progress=False)
    assert a.history_ == b.history_
    assert np.array_equal(a.encode(texts), b.encode(texts))
    c = StateEncoder(tiny_config()).fit(texts, groups, epochs=50, batch_size=8, progress=False, max_seconds=0.0)
    assert len(c.history_) == 1


def test_fit_rejects_bad_input():
    with pytest.raises(CwmError):
        StateEncoder(tiny_config()).fit(["a", "b"], ["x"], progress=False)
    with pytest.raises(CwmError):
        StateEncoder(tiny_config()).fit(["a", "b"], ["x", "y"], progress=False)
    with pytest.raises(CwmError):
        StateEncoder(tiny_config()).encode(["a"])  # untrained


def ranked_corpus() -> tuple[list[str], list[float], list[str]]:
    """Measured final states of two tasks: vectorized adds and wide matmul tiles are the fast ones."""
    texts, latencies, groups = [], [], []
    for t0 in (4, 8, 16, 32, 64, 128):
        for vec in (True, False):
            texts.append(add(t0, vec))
            latencies.append((0.25 if vec else 1.0) * (1 + 0.01 * t0))
            groups.append("add")
    for t0 in (4, 8, 16):
        for t1 in (4, 8, 16, 32):
            texts.append(matmul(t0, t1))
            latencies.append(1.0 / t1 + 0.001 * t0)
            groups.append("mm")
    return texts, latencies, groups


def within_group_pairwise(scores, latencies, groups) -> float:
    """Fraction of same-group pairs that the scores order like the latencies (higher score = faster)."""
    right = total = 0
    for i in range(len(scores)):
        for j in range(len(scores)):
            if groups[i] == groups[j] and latencies[i] < latencies[j]:
                total += 1
                right += scores[i] > scores[j]
    return right / total


def test_pairwise_speed_loss_by_hand():
    import torch

    from cwm.model.encoder import _pairwise_speed_loss

    scores = torch.tensor([2.0, 0.0, 5.0])
    # one pair: state 0 (faster) against state 1, same group; state 2 is alone in its group
    loss = _pairwise_speed_loss(scores, torch.tensor([1.0, 2.0, 0.5]), torch.tensor([0, 0, 1]))
    assert float(loss) == pytest.approx(float(np.log1p(np.exp(-2.0))))
    none = _pairwise_speed_loss(scores, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 1]))
    assert float(none) == 0.0


def test_latency_loss_teaches_e_the_within_task_order():
    texts, groups = corpus()
    ranked = ranked_corpus()
    # every window in each step: the one token that makes an add fast must be seen
    e = StateEncoder(tiny_config(latency_weight=5.0, train_windows=8)).fit(texts, groups, epochs=10, batch_size=12,
                                                                           lr=1e-2, progress=False, ranked=ranked)
    import torch

    with torch.no_grad():
        scores = e.speed_head_(torch.as_tensor(e.encode(ranked[0]))).squeeze(1).numpy()
    assert within_group_pairwise(scores, ranked[1], ranked[2]) > 0.8  # 0.92 when written; untrained ~0.5
    # without the loss there is no speed head, and the contrastive training is unchanged
    plain = StateEncoder(tiny_config()).fit(texts, groups, epochs=2, batch_size=12, progress=False)
    assert plain.speed_head_ is None
    again = StateEncoder(tiny_config(latency_weight=0.0)).fit(texts, groups, epochs=2, batch_size=12,
                                                              progress=False, ranked=ranked)
    assert again.history_ == plain.history_


def test_latency_loss_rejects_bad_input():
    texts, groups = corpus()
    r_texts, r_lat, r_groups = ranked_corpus()
    with pytest.raises(CwmError, match="needs ranked states"):
        StateEncoder(tiny_config(latency_weight=1.0)).fit(texts, groups, progress=False)
    with pytest.raises(CwmError, match="finite positive"):
        StateEncoder(tiny_config(latency_weight=1.0)).fit(texts, groups, progress=False,
                                                          ranked=(r_texts, [float("nan")] * len(r_texts), r_groups))
    with pytest.raises(CwmError, match="texts"):
        StateEncoder(tiny_config(latency_weight=1.0)).fit(texts, groups, progress=False,
                                                          ranked=(r_texts, r_lat[:-1], r_groups))
    with pytest.raises(CwmError, match="latency_weight"):
        tiny_config(latency_weight=-1.0)


# ---------------------------------------------------------------- persistence


def test_save_load_round_trip(fitted, tmp_path):
    texts, _ = corpus()
    fitted.save(tmp_path / "enc")
    for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE):
        assert (tmp_path / "enc" / name).is_file()
    loaded = StateEncoder.load(tmp_path / "enc")
    assert loaded.config == fitted.config
    assert np.array_equal(loaded.encode(texts), fitted.encode(texts))
    assert loaded.fingerprint() == fitted.fingerprint()
    tok = TIRTokenizer.load(tmp_path / "enc")
    assert tok.encode(canonicalize(SAMPLE)) == fitted.tokenizer.encode(canonicalize(SAMPLE))


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE])
def test_load_missing_file_names_it(fitted, tmp_path, name):
    fitted.save(tmp_path)
    os.remove(tmp_path / name)
    with pytest.raises(CwmError, match=name.replace(".", r"\.")):
        StateEncoder.load(tmp_path)


def test_load_config_weight_mismatch(fitted, tmp_path):
    fitted.save(tmp_path)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    meta["config"]["hidden_size"] = 64
    meta["model"]["hidden_size"] = 64
    (tmp_path / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(CwmError, match=WEIGHTS_FILE):
        StateEncoder.load(tmp_path)
    meta["model"]["hidden_size"] = 32
    (tmp_path / CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(CwmError, match=CONFIG_FILE):
        StateEncoder.load(tmp_path)


# ---------------------------------------------------------------- cache


def test_cache_hit_and_corrupt_file_recomputed(fitted, tmp_path):
    texts, _ = corpus()
    texts = texts[:4]
    fitted.save(tmp_path / "enc")
    enc = StateEncoder.load(tmp_path / "enc", cache_dir=tmp_path / "cache")
    first = enc.encode(texts)
    files = sorted((tmp_path / "cache").rglob("*.f32"))
    assert len(files) == len(texts)
    assert not list((tmp_path / "cache").rglob("*.tmp"))

    # A hit must come from disk: poison one entry with a valid (unit-norm) vector and see it returned.
    target = enc._cache_path(enc._prepare(texts[0]))
    poison = np.full(enc.dim, 1 / np.sqrt(enc.dim), dtype=np.float32)
    target.write_bytes(poison.tobytes())
    second = enc.encode(texts)
    assert np.array_equal(second[0], poison) and np.array_equal(second[1:], first[1:])

    target.write_bytes(b"garbage")  # wrong size: ignored, recomputed and rewritten
    third = enc.encode(texts)
    # Recomputed alone rather than in a batch of four: padding may change the last bits.
    assert np.allclose(third[0], first[0], atol=1e-5) and np.array_equal(third[1:], first[1:])
    assert target.stat().st_size == enc.dim * 4

    # A retrained model has another fingerprint, so it never reuses these vectors.
    other = StateEncoder.load(tmp_path / "enc", cache_dir=tmp_path / "cache")
    other.fit(*corpus(), epochs=1, batch_size=12, progress=False)
    assert other.fingerprint() != enc.fingerprint()
    other.encode(texts)
    assert len(list((tmp_path / "cache").rglob("*.f32"))) == 2 * len(texts)


# ---------------------------------------------------------------- pretrained checkpoints


def test_from_pretrained_checkpoint(tmp_path, fitted):
    from cwm.compat import import_transformers

    transformers = import_transformers()
    tok = fitted.tokenizer
    cfg = transformers.RobertaConfig(
        vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=40, type_vocab_size=1,
        pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
    )
    transformers.RobertaModel(cfg).save_pretrained(tmp_path / "ckpt")
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok._tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", mask_token="<mask>",
    )
    hf_tok.save_pretrained(tmp_path / "ckpt")

    enc = StateEncoder.from_pretrained_checkpoint(tmp_path / "ckpt", tiny_config(window=64, stride=48))
    assert enc.dim == 16
    assert enc.config.window == 40 - tok.pad_id - 3 and enc.config.stride <= enc.config.window
    texts, groups = corpus()
    z = enc.encode(texts[:3])
    assert z.shape == (3, 16) and np.all(np.isfinite(z))
    enc.save(tmp_path / "saved")
    assert np.array_equal(StateEncoder.load(tmp_path / "saved").encode(texts[:3]), z)

    with pytest.raises(CwmError, match="not found"):
        StateEncoder.from_pretrained_checkpoint(tmp_path / "does-not-exist")


def test_config_round_trip_and_validation():
    c = tiny_config()
    assert EncoderConfig.from_dict(c.to_dict()) == c
    with pytest.raises(CwmError):
        EncoderConfig.from_dict({**c.to_dict(), "bogus": 1})
    with pytest.raises(CwmError):
        EncoderConfig(window=32, stride=40)
