"""State encoder E: TensorIR text of a program state -> one dense vector z.

The text is canonicalized (comments, headers and naming noise removed), tokenized with a
BPE tokenizer trained on TIR, cut into overlapping windows, run through a small RoBERTa and
pooled. The backbone is trained contrastively: states of the same task are positives.

``torch`` and ``transformers`` are imported lazily so that ``import cwm.model.encoder`` stays cheap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import string
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..compat import import_transformers
from ..errors import CwmError
from ..io import atomic_file, atomic_write_bytes, read_config, write_config
from ..model import distributed

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

CONFIG_FILE = "encoder_config.json"
WEIGHTS_FILE = "encoder.safetensors"
TOKENIZER_FILE = "tokenizer.json"
_FORMAT = "cwm.encoder"

__all__ = [
    "EncoderConfig",
    "StateEncoder",
    "TIRTokenizer",
    "canonicalize",
    "split_windows",
]


# --------------------------------------------------------------------------- lazy imports

_threads_configured = False


def _torch():
    """Import torch, applying the thread policy once."""
    global _threads_configured
    import torch

    if not _threads_configured:
        _threads_configured = True
        # Respect a user's explicit choice (env vars); otherwise use every CPU we may run on.
        if not any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
            try:
                n = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                n = os.cpu_count() or 1
            torch.set_num_threads(max(1, n))
    return torch


def _transformers():
    _torch()
    return import_transformers()


# --------------------------------------------------------------------------- canonicalize

_STRING_RE = re.compile(r"\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*'")
# An identifier not glued to a preceding name, number or attribute dot (``T.grid`` keeps ``grid``).
_NAME_RE = re.compile(r"(?<![0-9A-Za-z_.])[A-Za-z_]\w*")
_FOR_RE = re.compile(r"\bfor\s+([A-Za-z_][\w\s,]*?)\s+in\b")
_ASSIGN_RE = re.compile(r"^([A-Za-z_][\w\s,]*?)\s*(?::[^=]*)?=(?!=)\s*(.*)$")
_AS_RE = re.compile(r"\bas\s+([A-Za-z_]\w*)")
_PARAM_RE = re.compile(r"[(,]\s*([A-Za-z_]\w*)\s*:\s*([A-Za-z_][\w.]*)")
_BLOCK_RE = re.compile(r"\bT\.s?block\(\s*$")
_BUFFER_CALL_RE = re.compile(r"^T\.(?:alloc_buffer|match_buffer|decl_buffer|Buffer|buffer)\b")
_HEADER_RE = re.compile(r"^(?:@|class\s+\w+.*:$|from\s+\S+\s+import\b|import\s)")
_IDENT_ONLY_RE = re.compile(r"^[A-Za-z_]\w*$")

# Prefixes of the canonical names, one counter per kind.
_LOOP, _AXIS, _BUFFER, _PARAM, _VAR, _BLOCK = "i", "v", "buf", "p", "x", "blk"


def _segments(line: str) -> list[tuple[bool, str]]:
    """Split a physical line into (is_string, text) parts, dropping a trailing comment."""
    parts: list[tuple[bool, str]] = []
    pos = 0
    for m in _STRING_RE.finditer(line):
        code = line[pos : m.start()]
        if "#" in code:
            parts.append((False, code[: code.index("#")]))
            return parts
        parts.append((False, code))
        parts.append((True, m.group()))
        pos = m.end()
    code = line[pos:]
    parts.append((False, code.split("#", 1)[0]))
    return parts


def _logical_lines(text: str) -> list[tuple[int, list[tuple[bool, str]]]]:
    """(indent width, segments) per logical line; bracketed continuations are joined."""
    out: list[tuple[int, list[tuple[bool, str]]]] = []
    pending: list[tuple[bool, str]] | None = None
    pending_width = 0
    balance = 0
    for raw in text.expandtabs(4).splitlines():
        segs = _segments(raw)
        segs = [(s, t if s else re.sub(r"\s+", " ", t)) for s, t in segs]
        if pending is None:
            if not "".join(t for _, t in segs).strip():
                continue
            pending, pending_width = segs, len(raw) - len(raw.lstrip())
        else:
            pending = pending + [(False, " ")] + segs
        for is_str, t in segs:
            if not is_str:
                balance += sum(t.count(c) for c in "([{") - sum(t.count(c) for c in ")]}")
        if balance <= 0:
            out.append((pending_width, pending))
            pending, balance = None, 0
    if pending is not None:
        out.append((pending_width, pending))
    return out


def _normalize_segments(segs: list[tuple[bool, str]]) -> list[tuple[bool, str]]:
    joined: list[tuple[bool, str]] = []
    for is_str, t in segs:
        if joined and not is_str and not joined[-1][0]:
            joined[-1] = (False, re.sub(r"\s+", " ", joined[-1][1] + t))
        else:
            joined.append((is_str, t))
    if joined and not joined[0][0]:
        joined[0] = (False, joined[0][1].lstrip())
    if joined and not joined[-1][0]:
        joined[-1] = (False, joined[-1][1].rstrip())
    return [(s, t) for s, t in joined if s or t]


def _collect_definitions(lines: list[list[tuple[bool, str]]]) -> tuple[dict[str, str], set[str]]:
    """Names bound in the program (name -> kind prefix) and the block names."""
    kinds: dict[str, str] = {}
    blocks: set[str] = set()

    def bind(names: str, kind: str) -> None:
        for name in names.split(","):
            name = name.strip()
            if _IDENT_ONLY_RE.match(name):
                kinds.setdefault(name, kind)

    for segs in lines:
        # Analyse code with string bodies blanked out so quoted text never looks like code.
        code = "".join('""' if s else t for s, t in segs)
        for i, (is_str, t) in enumerate(segs):
            if is_str and i > 0 and _BLOCK_RE.search(segs[i - 1][1]):
                blocks.add(t[1:-1])
        if code.startswith("def "):
            for name, annotation in _PARAM_RE.findall(code):
                bind(name, _BUFFER if annotation.startswith("T.Buffer") else _PARAM)
            continue
        for names in _FOR_RE.findall(code):
            bind(names, _LOOP)
        for name in _AS_RE.findall(code):
            bind(name, _VAR)
        m = _ASSIGN_RE.match(code)
        if m:
            rhs = m.group(2)
            kind = _AXIS if rhs.startswith("T.axis") else _BUFFER if _BUFFER_CALL_RE.match(rhs) else _VAR
            bind(m.group(1), kind)
    return kinds, blocks


def canonicalize(text: str) -> str:
    """Canonical form of a TVMScript program for the encoder.

    Drops comments, the module header and decorators, joins bracket continuations,
    collapses whitespace, re-indents with one space per nesting level, and renames bound
    names (loop vars ``i*``, block vars ``v*``, buffers ``buf*``, other params ``p*``,
    other vars ``x*``, block names ``"blk*"``) in order of first appearance. Numbers,
    strings such as dtypes, and ``T.*`` keywords are kept.
    """
    logical = [(w, _normalize_segments(segs)) for w, segs in _logical_lines(text)]
    logical = [
        (w, segs)
        for w, segs in logical
        if segs and not _HEADER_RE.match("".join('""' if s else t for s, t in segs))
    ]
    kinds, blocks = _collect_definitions([segs for _, segs in logical])
    counters: dict[str, int] = {}
    names: dict[str, str] = {}
    block_names: dict[str, str] = {}

    def fresh(kind: str) -> str:
        k = counters.get(kind, 0)
        counters[kind] = k + 1
        return f"{kind}{k}"

    def rename(m: re.Match) -> str:
        name = m.group()
        kind = kinds.get(name)
        if kind is None:
            return name
        if name not in names:
            names[name] = fresh(kind)
        return names[name]

    out: list[str] = []
    stack: list[int] = []
    for width, segs in logical:
        while stack and width < stack[-1]:
            stack.pop()
        if not stack or width > stack[-1]:
            stack.append(width)
        parts: list[str] = []
        for i, (is_str, t) in enumerate(segs):
            if not is_str:
                parts.append(_NAME_RE.sub(rename, t))
            elif t[1:-1] in blocks and i > 0 and _BLOCK_RE.search(segs[i - 1][1]):
                name = t[1:-1]
                if name not in block_names:
                    block_names[name] = fresh(_BLOCK)
                parts.append(f'"{block_names[name]}"')
            else:
                parts.append(t)
        out.append(" " * (len(stack) - 1) + "".join(parts))
    return "\n".join(out)


# --------------------------------------------------------------------------- windows


def split_windows(ids: Sequence[int], window: int, stride: int, max_windows: int) -> list[list[int]]:
    """Cut ``ids`` into windows of ``window`` tokens every ``stride`` tokens.

    Consecutive windows overlap by ``window - stride``; the last may be shorter. When more
    than ``max_windows`` would be needed, ``max_windows`` full windows with evenly spaced
    starts span the whole sequence instead.
    """
    ids = list(ids)
    n = len(ids)
    if n <= window:
        return [ids]
    count = math.ceil((n - window) / stride) + 1
    if count <= max_windows:
        starts = [i * stride for i in range(count)]
    elif max_windows == 1:
        starts = [0]
    else:
        starts = [round(i * (n - window) / (max_windows - 1)) for i in range(max_windows)]
    return [ids[s : s + window] for s in starts]


# --------------------------------------------------------------------------- tokenizer

_PRETOKEN_PATTERN = (
    r"\n *"  # a line break with its indentation: nesting depth in one token
    r"|[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"  # names, dotted: T.axis.spatial
    r"|[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"  # numbers stay whole before BPE merges
    r"|//|\*\*|==|!=|<=|>=|<<|>>|->"
    r"|[^\sA-Za-z0-9_]"
)
_SPECIALS = {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>", "mask": "<mask>"}
# Names of the same roles in BERT-style vocabularies, for wrapped foreign tokenizers.
_SPECIAL_FALLBACKS = {"bos": "[CLS]", "pad": "[PAD]", "eos": "[SEP]", "unk": "[UNK]", "mask": "[MASK]"}


class TIRTokenizer:
    """BPE tokenizer for canonical TIR text (RoBERTa-style special tokens).

    ``encode`` returns ids without special tokens; the encoder adds ``<s>``/``</s>`` per window.
    """

    SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # ids 0..4, as in RoBERTa

    def __init__(self, tokenizer: Any = None, special_ids: dict[str, int] | None = None):
        self._tok = tokenizer
        self._special_ids = dict(special_ids or {})

    @property
    def is_trained(self) -> bool:
        return self._tok is not None

    def train(self, texts: Iterable[str], vocab_size: int = 2048) -> TIRTokenizer:
        """Train a fresh BPE vocabulary of at most ``vocab_size`` tokens on ``texts``."""
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(_PRETOKEN_PATTERN), behavior="removed", invert=True)
        # Seed the alphabet with printable ASCII so unseen characters still get an id.
        alphabet = sorted(set(string.printable) - set(" \t\r\x0b\x0c"))
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(self.SPECIAL_TOKENS),
            initial_alphabet=alphabet,
            min_frequency=2,
            show_progress=False,
        )
        tok.train_from_iterator(list(texts), trainer=trainer)
        self._tok = tok
        self._special_ids = {}
        return self

    def _require(self):
        if self._tok is None:
            raise CwmError("the TIR tokenizer is not trained; call StateEncoder.fit or TIRTokenizer.train")
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self._require().encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._require().encode_batch(list(texts), add_special_tokens=False)]

    def special_id(self, role: str) -> int:
        """Id of a special token role: bos, eos, pad, unk or mask."""
        if role in self._special_ids:
            return self._special_ids[role]
        if self._tok is None:
            return self.SPECIAL_TOKENS.index(_SPECIALS[role])
        for name in (_SPECIALS[role], _SPECIAL_FALLBACKS[role]):
            idx = self._tok.token_to_id(name)
            if idx is not None:
                self._special_ids[role] = idx
                return idx
        raise CwmError(f"tokenizer has no {_SPECIALS[role]} token")

    @property
    def bos_id(self) -> int:
        return self.special_id("bos")

    @property
    def eos_id(self) -> int:
        return self.special_id("eos")

    @property
    def pad_id(self) -> int:
        return self.special_id("pad")

    @property
    def vocab_size(self) -> int:
        return self._require().get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        return self._require().to_str()

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``directory/tokenizer.json``; returns its path."""
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, self.to_json().encode("utf-8"))
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> TIRTokenizer:
        from tokenizers import Tokenizer

        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise CwmError(f"missing tokenizer file: {path}")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as err:  # the Rust side raises plain Exception subclasses
            raise CwmError(f"cannot read tokenizer file {path}: {err}") from err


# --------------------------------------------------------------------------- config


@dataclasses.dataclass
class EncoderConfig:
    """Hyper-parameters of the state encoder (defaults train on ~2k states in minutes on 2 CPUs)."""

    vocab_size: int = 2048
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    window: int = 128  # content tokens per window, without <s> and </s>
    stride: int = 96  # windows overlap by window - stride tokens
    max_windows: int = 24
    temperature: float = 0.1
    seed: int = 0
    canonicalize: bool = True
    dropout: float = 0.1
    train_windows: int = 4  # windows sampled per state at each training step; encode uses all
    # Weight of a within-group ranking loss on measured final states (fit's ``ranked``): a linear speed
    # head on the encoded vector, so that E keeps the differences between schedules of one task that
    # the contrastive loss (all states of a task are positives) averages away. 0: contrastive only.
    latency_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise CwmError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if not 1 <= self.stride <= self.window:
            raise CwmError(f"stride must be in [1, window={self.window}], got {self.stride}")
        if min(self.max_windows, self.train_windows) < 1 or self.vocab_size < 16 or self.temperature <= 0:
            raise CwmError("max_windows and train_windows must be >= 1, vocab_size >= 16 and temperature > 0")
        if not self.latency_weight >= 0:
            raise CwmError(f"latency_weight must be >= 0, got {self.latency_weight!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncoderConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CwmError(f"unknown encoder config keys: {', '.join(unknown)}")
        return cls(**data)


# --------------------------------------------------------------------------- helpers


def _contrastive_batches(labels: np.ndarray, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled batches holding whole chunks of >= 2 same-group members where possible."""
    per_group = max(2, min(4, batch_size // 2))
    chunks: list[np.ndarray] = []
    for g in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == g))
        parts = [members[i : i + per_group] for i in range(0, len(members), per_group)]
        if len(parts) > 1 and len(parts[-1]) == 1:  # a lone member would have no positive
            lone = parts.pop()
            parts[-1] = np.concatenate([parts[-1], lone])
        chunks.extend(parts)
    batches: list[list[np.ndarray]] = [[]]
    sizes = [0]
    for i in rng.permutation(len(chunks)):
        chunk = chunks[i]
        if sizes[-1] and sizes[-1] + len(chunk) > batch_size:
            batches.append([])
            sizes.append(0)
        batches[-1].append(chunk)
        sizes[-1] += len(chunk)
    return [np.concatenate(b) for b in batches if b]


def _sample(items: list, k: int, rng: np.random.Generator) -> list:
    """At most ``k`` of ``items`` in their order; a random subset is a cheap, augmenting view."""
    if len(items) <= k:
        return items
    return [items[i] for i in np.sort(rng.choice(len(items), size=k, replace=False))]


def _supcon_loss(z: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Supervised contrastive loss (Khosla et al., L_out) over L2-normalized ``z``."""
    torch = _torch()
    sim = z @ z.T / temperature
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(eye, float("-inf"))
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    pos = (labels[:, None] == labels[None, :]) & ~eye
    n_pos = pos.sum(1)
    valid = n_pos > 0
    if not bool(valid.any()):
        return z.sum() * 0.0
    per_anchor = log_prob.masked_fill(~pos, 0.0).sum(1)[valid] / n_pos[valid]
    return -per_anchor.mean()


def _pairwise_speed_loss(scores: torch.Tensor, latencies: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """RankNet loss over the pairs of one group: the faster state of each pair should score higher."""
    torch = _torch()
    same = labels[:, None] == labels[None, :]
    faster = latencies[:, None] < latencies[None, :]
    pairs = same & faster
    if not bool(pairs.any()):
        return scores.sum() * 0.0
    margin = scores[:, None] - scores[None, :]
    return torch.nn.functional.softplus(-margin[pairs]).mean()


RANKED_CHUNK = 8  # states of one group side by side in a batch of the latency loss: 28 pairs a chunk


def _ranked_batches(labels: np.ndarray, per_group: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Batches of whole within-group chunks (``per_group`` states of one group each), in random order."""
    chunks = []
    for g in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == g))
        chunks.extend(members[i : i + per_group] for i in range(0, len(members), per_group)
                      if len(members[i : i + per_group]) >= 2)
    order = rng.permutation(len(chunks))
    per_batch = max(1, batch_size // per_group)
    return [np.concatenate([chunks[j] for j in order[i : i + per_batch]]) for i in range(0, len(order), per_batch)]


# --------------------------------------------------------------------------- encoder


class StateEncoder:
    """Windowed RoBERTa encoder of TIR program states.

    ``encode``/``encode_tensor`` return the L2-normalized window-pooled backbone vector; the
    projection head is only used for the contrastive loss.
    """

    def __init__(
        self,
        config: EncoderConfig | None = None,
        tokenizer: TIRTokenizer | None = None,
        *,
        cache_dir: str | os.PathLike | None = None,
    ):
        self.config = config or EncoderConfig()
        self.tokenizer = tokenizer or TIRTokenizer()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.history_: list[float] = []
        self.speed_head_ = None  # fit's linear speed head on encoded vectors (latency_weight > 0); not saved
        self._fingerprint: str | None = None
        transformers = _transformers()
        c = self.config
        # Position ids start after padding_idx, so the table needs window + 2 specials + pad + 1.
        roberta_config = transformers.RobertaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            intermediate_size=c.intermediate_size,
            max_position_embeddings=c.window + self.tokenizer.pad_id + 3,
            type_vocab_size=1,
            layer_norm_eps=1e-5,
            hidden_dropout_prob=c.dropout,
            # Dropout on attention probabilities forces the slow math attention kernel on CPU.
            attention_probs_dropout_prob=0.0,
            pad_token_id=self.tokenizer.pad_id,
            bos_token_id=self.tokenizer.bos_id,
            eos_token_id=self.tokenizer.eos_id,
        )
        torch = _torch()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(c.seed)
            self.model = transformers.RobertaModel(roberta_config, add_pooling_layer=False)
            self.head = self._make_head(c.hidden_size)
        self._eval()

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _make_head(hidden: int):
        nn = _torch().nn
        return nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))

    @classmethod
    def _assemble(cls, config, tokenizer, model, head, cache_dir) -> StateEncoder:
        self = cls.__new__(cls)
        self.config = config
        self.tokenizer = tokenizer
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.history_ = []
        self.speed_head_ = None
        self._fingerprint = None
        self.model = model
        self.head = head
        self._eval()
        return self

    def _eval(self) -> None:
        self.model.eval()
        self.head.eval()

    @property
    def dim(self) -> int:
        """Length of the vectors ``encode`` returns."""
        return int(self.model.config.hidden_size)

    # ------------------------------------------------------------------ tokenization

    def _prepare(self, text: str) -> str:
        return canonicalize(text) if self.config.canonicalize else text

    def _check_tokenizer(self) -> None:
        if not self.tokenizer.is_trained:
            raise CwmError("the encoder is not trained: call fit() or load a saved encoder")
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise CwmError(
                f"tokenizer vocabulary ({self.tokenizer.vocab_size}) exceeds the model's "
                f"({self.model.config.vocab_size})"
            )

    def windows(self, text: str) -> list[list[int]]:
        """Token-id windows of one raw text (canonicalized first if configured)."""
        self._check_tokenizer()
        return self._windows_prepared([self._prepare(text)])[0]

    def _windows_prepared(self, prepared: Sequence[str]) -> list[list[list[int]]]:
        c = self.config
        return [split_windows(ids, c.window, c.stride, c.max_windows) for ids in self.tokenizer.encode_batch(prepared)]

    # ------------------------------------------------------------------ forward

    def _forward(self, windows_per_text: Sequence[Sequence[Sequence[int]]], chunk: int = 256):
        """Pooled backbone vectors [n, hidden] (not normalized) for pre-windowed texts."""
        torch = _torch()
        bos, eos, pad = self.tokenizer.bos_id, self.tokenizer.eos_id, self.tokenizer.pad_id
        flat = [w for ws in windows_per_text for w in ws]
        owners = [i for i, ws in enumerate(windows_per_text) for _ in ws]
        pooled = []
        for start in range(0, len(flat), chunk):
            part = flat[start : start + chunk]
            length = max(len(w) for w in part) + 2
            ids = np.full((len(part), length), pad, dtype=np.int64)
            mask = np.zeros((len(part), length), dtype=np.int64)
            for j, w in enumerate(part):
                ids[j, : len(w) + 2] = [bos, *w, eos]
                mask[j, : len(w) + 2] = 1
            ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled.append((hidden * m).sum(1) / m.sum(1))
        window_vecs = torch.cat(pooled)
        # Windows of one text are averaged weighted by their real token counts.
        counts = torch.tensor([max(len(w), 1) for w in flat], dtype=window_vecs.dtype)
        weights = torch.zeros((len(windows_per_text), len(flat)), dtype=window_vecs.dtype)
        weights[torch.tensor(owners), torch.arange(len(flat))] = counts
        weights = weights / weights.sum(1, keepdim=True)
        return weights @ window_vecs

    def encode_tensor(self, texts: Sequence[str], *, normalize: bool = True):
        """Differentiable vectors [n, hidden] for raw TIR texts (L2-normalized by default)."""
        self._check_tokenizer()
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            return _torch().zeros((0, self.dim))
        z = self._forward(self._windows_prepared([self._prepare(t) for t in texts]))
        return _torch().nn.functional.normalize(z, dim=1) if normalize else z

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """L2-normalized vectors, float32 [n, hidden], in eval mode; cached if ``cache_dir`` is set."""
        torch = _torch()
        self._check_tokenizer()
        texts = [texts] if isinstance(texts, str) else list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        prepared = [self._prepare(t) for t in texts]
        paths: list[Path | None] = [None] * len(texts)
        todo = list(range(len(texts)))
        if self.cache_dir is not None:
            todo = []
            for i, p in enumerate(prepared):
                paths[i] = self._cache_path(p)
                vec = self._cache_read(paths[i])
                if vec is None:
                    todo.append(i)
                else:
                    out[i] = vec
        self._eval()
        with torch.no_grad():
            for start in range(0, len(todo), batch_size):
                idx = todo[start : start + batch_size]
                z = self._forward(self._windows_prepared([prepared[i] for i in idx]))
                z = torch.nn.functional.normalize(z, dim=1).numpy().astype(np.float32)
                for row, i in enumerate(idx):
                    out[i] = z[row]
                    if paths[i] is not None:
                        self._cache_write(paths[i], z[row])
        return out

    # ------------------------------------------------------------------ cache

    def fingerprint(self) -> str:
        """Hash of config, tokenizer and weights; computed once per fit/load."""
        if self._fingerprint is None:
            h = hashlib.sha1()
            h.update(json.dumps(self.config.to_dict(), sort_keys=True).encode())
            h.update(self.model.config.to_json_string(use_diff=False).encode())
            h.update(self.tokenizer.to_json().encode())
            for name, tensor in sorted(self.model.state_dict().items()):
                h.update(name.encode())
                h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def _cache_path(self, prepared: str) -> Path:
        key = hashlib.sha1((self.fingerprint() + "\0" + prepared).encode("utf-8")).hexdigest()
        return self.cache_dir / key[:2] / f"{key}.f32"

    def _cache_read(self, path: Path) -> np.ndarray | None:
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if len(data) != self.dim * 4:
            logger.debug("ignoring corrupt cache file %s", path)
            return None
        vec = np.frombuffer(data, dtype=np.float32)
        # Cached vectors are L2-normalized: anything else (NaN, garbage of the right size) is rebuilt.
        if not np.all(np.isfinite(vec)) or abs(float(np.dot(vec, vec)) - 1.0) > 1e-3:
            logger.debug("ignoring corrupt cache file %s", path)
            return None
        return vec

    def _cache_write(self, path: Path, vec: np.ndarray) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, np.ascontiguousarray(vec, dtype=np.float32).tobytes())
        except (OSError, CwmError) as err:  # a cache that cannot be written must not fail encoding
            logger.warning("cannot write encoder cache %s: %s", path, err)

    # ------------------------------------------------------------------ training

    def fit(
        self,
        texts: Sequence[str],
        groups: Sequence[Any],
        *,
        epochs: int = 3,
        batch_size: int = 32,
        lr: float = 1e-3,
        progress: bool = True,
        max_seconds: float | None = None,
        ranked: tuple[Sequence[str], Sequence[float], Sequence[Any]] | None = None,
    ) -> StateEncoder:
        """Contrastive training: states with the same ``groups`` label (task) are positives.

        Trains the tokenizer first if it is untrained. Records the mean loss of each epoch
        in ``history_``; stops early once ``max_seconds`` have elapsed.

        With ``config.latency_weight`` > 0, ``ranked`` = (texts, latencies, groups) of measured final
        states adds that weight times a within-group ranking loss of a linear speed head on the encoded
        vectors; an epoch goes over the batches of both losses. The head (``speed_head_``) is not saved.

        Inside a torch.distributed process group (see :mod:`cwm.model.distributed`) the backbone and
        head train as one DistributedDataParallel module: each rank takes its share of every
        epoch's batches, so the contrastive loss sees the positives and negatives of its own
        batch only; the tokenizer is rank 0's, and ``history_`` is the mean over all ranks.
        """
        from tqdm.auto import tqdm

        torch = _torch()
        texts, groups = list(texts), list(groups)
        if len(texts) != len(groups):
            raise CwmError(f"fit got {len(texts)} texts but {len(groups)} group labels")
        if batch_size < 4:
            raise CwmError("batch_size must be at least 4 for contrastive training")
        _, labels = np.unique(np.asarray([str(g) for g in groups]), return_inverse=True)
        counts = np.bincount(labels) if len(labels) else np.zeros(0, dtype=int)
        if not np.any(counts >= 2):
            raise CwmError("contrastive training needs at least one group with two or more states")
        if len(counts) < 2:
            logger.warning("all states share one group: the contrastive loss has no negatives")
        weight = self.config.latency_weight
        parallel = distributed.is_distributed()
        if weight > 0:
            if ranked is None:
                raise CwmError("latency_weight > 0 needs ranked states: fit(..., ranked=(texts, latencies, groups))")
            if parallel:
                raise CwmError("the encoder's latency loss is not supported in distributed training")
            r_texts, r_lat, r_groups = (list(x) for x in ranked)
            if not len(r_texts) == len(r_lat) == len(r_groups):
                raise CwmError(f"ranked states: {len(r_texts)} texts, {len(r_lat)} latencies, {len(r_groups)} groups")
            r_lat = np.asarray(r_lat, dtype=float)
            if not np.all(np.isfinite(r_lat) & (r_lat > 0)):
                raise CwmError("ranked states need finite positive latencies")
            _, r_labels = np.unique(np.asarray([str(g) for g in r_groups]), return_inverse=True)
        elif ranked is not None:
            logger.warning("ranked states are ignored: the encoder's latency_weight is 0")

        start_time = time.monotonic()
        prepared = [self._prepare(t) for t in texts]
        if not self.tokenizer.is_trained:
            self.tokenizer.train(prepared, self.config.vocab_size)
            if parallel:  # every rank must tokenize the same way
                from tokenizers import Tokenizer

                self.tokenizer._tok = Tokenizer.from_str(distributed.broadcast_object(self.tokenizer.to_json()))
        self._check_tokenizer()
        windows = self._windows_prepared(prepared)
        self._fingerprint = None
        self.history_ = []

        params = list(self.model.parameters()) + list(self.head.parameters())
        if weight > 0:
            r_windows = self._windows_prepared([self._prepare(t) for t in r_texts])
            r_lat_t, r_labels_t = torch.as_tensor(r_lat), torch.as_tensor(r_labels)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.config.seed + 1)
                speed_head = torch.nn.Linear(self.dim, 1)
            params += list(speed_head.parameters())
        rng = np.random.default_rng(self.config.seed)
        # Ranks share ``rng`` for the batch order; window sampling draws from a per-rank stream.
        sample_rng = np.random.default_rng([self.config.seed, 1 + distributed.rank()]) if parallel else rng
        stopped = False
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
            self.model.train()
            self.head.train()
            project = lambda ws: self.head(self._forward(ws))  # noqa: E731
            if parallel:
                project = distributed.ddp(project, self.model, self.head)
            try:
                quiet = not progress or not distributed.is_main()
                bar = tqdm(range(epochs), desc="encoder fit", unit="epoch", disable=quiet)
                for epoch in bar:
                    total, seen = 0.0, 0
                    batches = _contrastive_batches(labels, batch_size, rng)
                    ranked_batches = _ranked_batches(r_labels, RANKED_CHUNK, batch_size, rng) if weight > 0 else []
                    shards = list(distributed.shard(batches)) if parallel else [(b, 1.0) for b in batches]
                    # an epoch goes over every batch of both losses; the shorter list starts over
                    for step in range(max(len(shards), len(ranked_batches))):
                        batch, share = shards[step % len(shards)]
                        z = project([_sample(windows[i], self.config.train_windows, sample_rng) for i in batch])
                        z = torch.nn.functional.normalize(z, dim=1)
                        loss = _supcon_loss(z, torch.as_tensor(labels[batch]), self.config.temperature)
                        if ranked_batches:
                            rb = ranked_batches[step % len(ranked_batches)]
                            v = self._forward([_sample(r_windows[i], self.config.train_windows, sample_rng)
                                               for i in rb])
                            # unit vectors: the temperature gives the margins the contrastive loss's scale
                            scores = speed_head(torch.nn.functional.normalize(v, dim=1)).squeeze(1) / \
                                self.config.temperature
                            loss = loss + weight * _pairwise_speed_loss(scores, r_lat_t[rb], r_labels_t[rb])
                        optimizer.zero_grad(set_to_none=True)
                        (loss * share if share != 1.0 else loss).backward()
                        torch.nn.utils.clip_grad_norm_(params, 1.0)
                        optimizer.step()
                        if share:
                            total += loss.item() * len(batch)
                            seen += len(batch)
                        if distributed.time_up(start_time, max_seconds):
                            stopped = True
                            break
                    if parallel:
                        total, seen = distributed.all_reduce_sum([total, seen])
                    self.history_.append(total / max(seen, 1))
                    bar.set_postfix(loss=f"{self.history_[-1]:.4f}")
                    logger.info("encoder epoch %d/%d loss %.4f", epoch + 1, epochs, self.history_[-1])
                    if stopped:
                        logger.info("encoder fit stopped after %.0f s (max_seconds)", time.monotonic() - start_time)
                        break
            finally:
                del project  # drops the DDP wrapper and its gradient hooks
                self._eval()
                self._fingerprint = None
        self.speed_head_ = speed_head.eval() if weight > 0 else None
        return self

    # ------------------------------------------------------------------ persistence

    def save(self, directory: str | os.PathLike) -> Path:
        """Write encoder_config.json, encoder.safetensors and tokenizer.json into ``directory``."""
        from safetensors.torch import save_file

        self._check_tokenizer()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_config(directory / CONFIG_FILE, _FORMAT, self.config.to_dict(),
                     model=json.loads(self.model.config.to_json_string(use_diff=False)))
        tensors = {f"backbone.{k}": v.detach().contiguous() for k, v in self.model.state_dict().items()}
        tensors.update({f"head.{k}": v.detach().contiguous() for k, v in self.head.state_dict().items()})
        with atomic_file(directory / WEIGHTS_FILE) as tmp:
            save_file(tensors, str(tmp), metadata={"format": _FORMAT})
        self.tokenizer.save(directory)
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> StateEncoder:
        """Restore an encoder written by ``save``; raises CwmError naming a missing or bad file."""
        from safetensors.torch import load_file

        directory = Path(directory)
        config_path = directory / CONFIG_FILE
        meta = read_config(directory, CONFIG_FILE, (WEIGHTS_FILE, TOKENIZER_FILE), _FORMAT, "encoder")
        try:
            config = EncoderConfig.from_dict(meta["config"])
            model_dict = meta["model"]
        except (ValueError, KeyError, TypeError, CwmError) as err:
            raise CwmError(f"invalid encoder config {config_path}: {err}") from err
        expected = {
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "intermediate_size": config.intermediate_size,
        }
        diff = [k for k, v in expected.items() if model_dict.get(k) != v]
        if diff:
            raise CwmError(f"{config_path}: encoder config disagrees with the model config on {', '.join(diff)}")
        tokenizer = TIRTokenizer.load(directory)

        transformers = _transformers()
        weights_path = directory / WEIGHTS_FILE
        try:
            tensors = load_file(str(weights_path))
        except Exception as err:  # safetensors raises its own error types
            raise CwmError(f"cannot read encoder weights {weights_path}: {err}") from err
        model = transformers.RobertaModel(transformers.RobertaConfig.from_dict(model_dict), add_pooling_layer=False)
        head = cls._make_head(config.hidden_size)
        try:
            model.load_state_dict({k[9:]: v for k, v in tensors.items() if k.startswith("backbone.")}, strict=True)
            head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")}, strict=True)
        except RuntimeError as err:
            raise CwmError(f"encoder weights {weights_path} do not match {CONFIG_FILE}: {err}") from err
        self = cls._assemble(config, tokenizer, model, head, cache_dir)
        self._check_tokenizer()
        return self

    @classmethod
    def from_pretrained_checkpoint(
        cls,
        path: str | os.PathLike,
        config: EncoderConfig | None = None,
        *,
        cache_dir: str | os.PathLike | None = None,
    ) -> StateEncoder:
        """Wrap a local Hugging Face RoBERTa checkpoint (e.g. codebert-base); never downloads.

        Model sizes come from the checkpoint; windowing and training settings from ``config``.
        """
        path = Path(path)
        if not path.is_dir():
            raise CwmError(f"checkpoint directory not found: {path}")
        transformers = _transformers()
        try:
            model = transformers.RobertaModel.from_pretrained(path, local_files_only=True, add_pooling_layer=False)
            hf_tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as err:
            raise CwmError(f"cannot load checkpoint {path}: {err}") from err
        model = model.float()  # CPU inference and training run in float32
        backend = getattr(hf_tok, "backend_tokenizer", None)
        if backend is None:
            raise CwmError(f"checkpoint {path} has no fast tokenizer (tokenizer.json)")
        ids = {
            "bos": hf_tok.bos_token_id if hf_tok.bos_token_id is not None else hf_tok.cls_token_id,
            "eos": hf_tok.eos_token_id if hf_tok.eos_token_id is not None else hf_tok.sep_token_id,
            "pad": hf_tok.pad_token_id,
            "unk": hf_tok.unk_token_id,
            "mask": hf_tok.mask_token_id,
        }
        if ids["bos"] is None or ids["eos"] is None or ids["pad"] is None:
            raise CwmError(f"checkpoint tokenizer in {path} lacks bos/eos/pad tokens")
        tokenizer = TIRTokenizer(backend, {k: int(v) for k, v in ids.items() if v is not None})

        mc = model.config
        base = config or EncoderConfig()
        # RoBERTa positions start after padding_idx; the window must fit the position table.
        max_window = mc.max_position_embeddings - mc.pad_token_id - 3
        window = min(base.window, max_window)
        config = dataclasses.replace(
            base,
            vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_hidden_layers,
            num_heads=mc.num_attention_heads,
            intermediate_size=mc.intermediate_size,
            window=window,
            stride=min(base.stride, window),
            dropout=mc.hidden_dropout_prob,
        )
        torch = _torch()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            head = cls._make_head(config.hidden_size)
        self = cls._assemble(config, tokenizer, model, head, cache_dir)
        self._check_tokenizer()
        return self
