"""The reference model: a byte-level tokenizer and a tiny decoder-only transformer in numpy.

Its weights are random but deterministic (seeded from the model name and revision), adapters are
seeded low-rank deltas that really change the outputs, and attention reads K/V from the *paged* pool
through block tables, as a real paged-attention kernel does.

Bit-exact reuse
---------------
The isolation tests compare the output of a warm prefix cache with a cold computation bit for bit, so
every row of every step must be computed identically whatever else is in the batch, however the
prompt was chunked, and whether its prefix K/V came from the cache. BLAS matrix products do not
promise that (their summation order depends on the matrix shapes), so every reduction here is an
explicit ``np.add.reduce(..., axis=0)`` over a fresh C-contiguous array: numpy accumulates such a
reduction slice by slice in index order, so each output element is summed in the same order whatever
the other dimensions are, and masked keys contribute exact zeros. Everything else is elementwise.
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

BOS = 256
EOS = 257
VOCAB = 258

FloatArray = npt.NDArray[np.floating]
IntArray = npt.NDArray[np.int32]

#: Tokens greedy decoding may produce: printable ASCII, newline and EOS, so that the text of a
#: completion maps back to its tokens one to one.
_ALLOWED = np.zeros(VOCAB, dtype=bool)
_ALLOWED[32:127] = True
_ALLOWED[10] = True
_ALLOWED[EOS] = True


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; 256 is BOS, 257 is EOS."""

    vocab_size = VOCAB

    def encode(self, text: str, *, bos: bool = True) -> IntArray:
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        if bos:
            return np.concatenate((np.array([BOS], dtype=np.int32), raw))
        return raw

    def decode(self, ids: Sequence[int] | IntArray) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str:
        return self.chat_messages(messages) + "<|assistant|>\n"

    @staticmethod
    def chat_messages(messages: Sequence[tuple[str, str]]) -> str:
        """The chat template's rendering of ``messages``, without the assistant cue: what every chat
        prompt that starts with these messages starts with."""
        return "".join(f"<|{role}|>\n{content}\n" for role, content in messages)

    @staticmethod
    def incremental_decoder() -> codecs.IncrementalDecoder:
        return codecs.getincrementaldecoder("utf-8")(errors="replace")


@dataclass(frozen=True, slots=True)
class ModelDims:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128
    adapter_rank: int = 4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _seed(*parts: str) -> int:
    h = hashlib.sha256("\x00".join(("kvfence-reference-model-v1", *parts)).encode()).digest()
    return int.from_bytes(h[:8], "little")


def rsum0(a: FloatArray) -> FloatArray:
    """Sum over axis 0 in index order (see the module docstring).

    numpy reduces a C-contiguous array over axis 0 one slice at a time, but only while there is a
    second dimension left to loop over: an array whose other dimensions hold a single element is
    summed pairwise. So such an array gets a zero column, which keeps the order the same.
    """
    a = np.ascontiguousarray(a)
    if a.size == a.shape[0]:
        padded = np.zeros((a.shape[0], 2), dtype=a.dtype)
        padded[:, 0] = a.reshape(-1)
        return np.add.reduce(padded, axis=0)[:1].reshape(a.shape[1:])  # type: ignore[no-any-return]
    return np.add.reduce(a, axis=0)  # type: ignore[no-any-return]


def psum0(a: FloatArray, b: FloatArray) -> FloatArray:
    """``(a * b).sum(axis=0)`` in index order, the product laid out C-contiguous."""
    return rsum0(np.multiply(a, b, order="C"))


def matmul(x: FloatArray, w: FloatArray, rows: int = 64) -> FloatArray:
    """``x @ w`` with a per-row summation order that does not depend on the number of rows
    (computed ``rows`` rows at a time to bound the temporary)."""
    xt = np.ascontiguousarray(x.T)
    wb = w[:, None, :]
    if len(x) <= rows:
        return psum0(xt[:, :, None], wb)
    out = np.empty((len(x), w.shape[1]), dtype=np.result_type(x, w))
    for i in range(0, len(x), rows):
        out[i : i + rows] = psum0(xt[:, i : i + rows, None], wb)
    return out


def _quantize(w: FloatArray, quantization: str) -> FloatArray:
    if quantization == "none":
        return w
    if quantization == "int8":  # symmetric per-output-column fake quantization
        scale = np.maximum(np.abs(w).max(axis=0, keepdims=True), 1e-12) / 127.0
        return (np.round(w / scale) * scale).astype(w.dtype)  # type: ignore[no-any-return]
    raise ValueError(f"the reference engine supports quantization 'none' or 'int8', not {quantization!r}")


def _low_rank(rng: np.random.Generator, rows: int, cols: int, rank: int, dtype: np.dtype[Any]) -> FloatArray:
    a = rng.standard_normal((rows, rank)) * rows**-0.5
    b = rng.standard_normal((rank, cols)) * rank**-0.5
    out: FloatArray = (a @ b).astype(dtype)
    return out


@dataclass(slots=True)
class _Layer:
    g1: FloatArray
    wqkv: FloatArray
    wo: FloatArray
    g2: FloatArray
    w1: FloatArray
    w2: FloatArray


@dataclass(slots=True)
class Chunk:
    """One sequence's share of a step: ``tokens`` at positions ``start..start+len-1``, attending to
    every earlier position of the sequence through ``table`` (block ids)."""

    table: IntArray
    start: int
    tokens: IntArray


class TinyTransformer:
    """A deterministic decoder-only transformer whose KV cache is a paged block pool."""

    def __init__(
        self,
        name: str,
        revision: str,
        *,
        max_len: int,
        adapters: Sequence[str] = (),
        quantization: str = "none",
        dtype: str = "float32",
        dims: ModelDims | None = None,
    ) -> None:
        if dtype not in ("float32", "float64"):
            raise ValueError(f"the reference engine supports dtype float32 or float64, not {dtype!r}")
        self.dims = d = dims or ModelDims()
        self.dtype = np.dtype(dtype)
        self.max_len = max_len
        rng = np.random.default_rng(_seed(name, revision))
        D, F = d.d_model, d.d_ff

        def mat(rows: int, cols: int, std: float) -> FloatArray:
            return _quantize((rng.standard_normal((rows, cols)) * std).astype(self.dtype), quantization)

        self.emb = (rng.standard_normal((VOCAB, D)) * 0.5).astype(self.dtype)
        self.pos = (rng.standard_normal((max_len, D)) * 0.5).astype(self.dtype)
        base = [
            _Layer(
                g1=np.ones(D, dtype=self.dtype),
                wqkv=mat(D, 3 * D, D**-0.5),
                wo=mat(D, D, D**-0.5),
                g2=np.ones(D, dtype=self.dtype),
                w1=mat(D, F, D**-0.5),
                w2=mat(F, D, F**-0.5),
            )
            for _ in range(d.n_layers)
        ]
        self.lm_head = mat(D, VOCAB, 2.0 * D**-0.5)
        self.layers: dict[str, list[_Layer]] = {"": base}
        for adapter in adapters:
            arng = np.random.default_rng(_seed(name, revision, "adapter", adapter))

            def delta(rows: int, cols: int, arng: np.random.Generator = arng) -> FloatArray:
                return _low_rank(arng, rows, cols, d.adapter_rank, self.dtype)

            self.layers[adapter] = [
                _Layer(
                    g1=lay.g1,
                    wqkv=_quantize(lay.wqkv + delta(D, 3 * D) * D**-0.5, quantization),
                    wo=lay.wo,
                    g2=lay.g2,
                    w1=_quantize(lay.w1 + delta(D, F) * D**-0.5, quantization),
                    w2=lay.w2,
                )
                for lay in base
            ]

    def new_kv_pool(self, num_blocks: int, block_size: int) -> FloatArray:
        d = self.dims
        return np.zeros((num_blocks, d.n_layers, 2, block_size, d.n_heads, d.head_dim), dtype=self.dtype)

    def _norm(self, x: FloatArray, g: FloatArray) -> FloatArray:
        ms = rsum0((x * x).T) / np.asarray(x.shape[1], dtype=self.dtype)
        inv = (1.0 / np.sqrt(ms + np.asarray(1e-5, dtype=self.dtype))).astype(self.dtype)
        out: FloatArray = x * inv[:, None] * g
        return out

    def forward(self, kv: FloatArray, chunks: Sequence[Chunk], adapter: str = "") -> FloatArray:
        """Run one step for ``chunks`` (all with the same adapter), writing their K/V into ``kv``.

        Returns the logits of each chunk's last position, shape ``[len(chunks), VOCAB]``.
        """
        layers = self.layers[adapter]
        d = self.dims
        H, Dh, D = d.n_heads, d.head_dim, d.d_model
        bs = kv.shape[3]
        tokens = np.concatenate([c.tokens for c in chunks])
        positions = np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks])
        if positions.size and int(positions.max()) >= self.max_len:
            raise ValueError("position beyond the model's maximum length")
        slot_blocks = np.concatenate(
            [c.table[np.arange(c.start, c.start + len(c.tokens)) // bs] for c in chunks]
        )
        slot_offsets = positions % bs
        bounds = np.cumsum([0] + [len(c.tokens) for c in chunks])
        x = self.emb[tokens] + self.pos[positions]
        scale = np.asarray(Dh**-0.5, dtype=self.dtype)
        for li, lay in enumerate(layers):
            h = self._norm(x, lay.g1)
            qkv = matmul(h, lay.wqkv)
            q = (qkv[:, :D] * scale).reshape(-1, H, Dh)
            k = qkv[:, D : 2 * D].reshape(-1, H, Dh)
            v = qkv[:, 2 * D :].reshape(-1, H, Dh)
            kv[slot_blocks, li, 0, slot_offsets] = k
            kv[slot_blocks, li, 1, slot_offsets] = v
            att = np.empty_like(q)
            for ci, c in enumerate(chunks):
                lo, hi = int(bounds[ci]), int(bounds[ci + 1])
                ctx_len = c.start + len(c.tokens)
                nblk = -(-ctx_len // bs)
                ids = c.table[:nblk]
                keys = kv[ids, li, 0].reshape(-1, H, Dh)[:ctx_len]  # gathered through the block table
                vals = kv[ids, li, 1].reshape(-1, H, Dh)[:ctx_len]
                qc = q[lo:hi]  # (n, H, Dh)
                # scores[j, i, h] = sum_e q[i, h, e] * k[j, h, e]
                scores = psum0(keys.transpose(2, 0, 1)[:, :, None, :], qc.transpose(2, 0, 1)[:, None, :, :])
                qpos = np.arange(c.start, ctx_len)
                masked = np.arange(ctx_len)[:, None] > qpos[None, :]
                scores[masked] = -np.inf
                p = np.exp(scores - scores.max(axis=0, keepdims=True))
                vaug = np.concatenate((vals, np.ones((ctx_len, H, 1), dtype=self.dtype)), axis=2)
                num = psum0(p[:, :, :, None], vaug[:, None, :, :])  # (n, H, Dh+1)
                att[lo:hi] = num[:, :, :Dh] / num[:, :, Dh:]
            x = x + matmul(att.reshape(-1, D), lay.wo)
            h2 = self._norm(x, lay.g2)
            f = matmul(h2, lay.w1)
            f = f / (1.0 + np.exp(-f))  # SiLU
            x = x + matmul(f, lay.w2)
        last = x[bounds[1:] - 1]
        return matmul(self._norm(last, np.ones(D, dtype=self.dtype)), self.lm_head)

    @staticmethod
    def greedy(logits: FloatArray) -> IntArray:
        """The allowed token with the highest logit (first on ties)."""
        masked = np.where(_ALLOWED[None, :], logits, -np.inf)
        return masked.argmax(axis=1).astype(np.int32)  # type: ignore[no-any-return]
