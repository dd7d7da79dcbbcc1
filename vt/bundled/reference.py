"""The float64 numpy model: the oracle the tests compare the backends' model with.

One token at a time, per sequence, from the same weights upcast to float64. It shares no
code with the kernels' run_numpy paths: attention is a plain softmax over the sequence's
contiguous K/V, the GDN update is written in the a S (I - b k k^T) + b v k^T form.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig
from .kernels._common import f64


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean() + eps) * w


def _silu(x):
    return x / (1 + np.exp(-x))


def _rope(x, pos, theta):  # x [H, D]
    d = x.shape[-1]
    ang = pos * theta ** (-2.0 * np.arange(d // 2) / d)
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[:, : d // 2], x[:, d // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@dataclass
class SeqState:
    """One sequence: K/V per attention layer ([L, kv_heads, D]) and M = S^T per GDN layer."""

    k: dict = field(default_factory=dict)
    v: dict = field(default_factory=dict)
    M: dict = field(default_factory=dict)
    length: int = 0


class ReferenceModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray]):
        self.cfg = cfg
        self.w = {k: f64(v) for k, v in weights.items()}

    def new_state(self) -> SeqState:
        c = self.cfg
        st = SeqState()
        for i in c.attn_layers:
            st.k[i] = np.zeros((0, c.kv_heads, c.head_dim))
            st.v[i] = np.zeros((0, c.kv_heads, c.head_dim))
        for i in c.gdn_layers:
            st.M[i] = np.zeros((c.gdn_heads, c.gdn_dv, c.gdn_dk))
        return st

    def step(self, st: SeqState, token: int) -> np.ndarray:
        """Feed one token at position st.length; returns its logits [vocab] (float64)."""
        c, w = self.cfg, self.w
        pos = st.length
        h = w["model.embed_tokens.weight"][token].copy()
        for i, kind in enumerate(c.kinds):
            p = f"model.layers.{i}."
            x = _rms(h, w[p + "input_layernorm.weight"], c.rms_eps)
            h += self._attn(st, i, p, x, pos) if kind == "A" else self._gdn(st, i, p, x)
            x = _rms(h, w[p + "post_attention_layernorm.weight"], c.rms_eps)
            h += self._moe(p, x) if c.moe else self._mlp(p + "mlp.", x)
        st.length += 1
        return w["lm_head.weight"] @ _rms(h, w["model.norm.weight"], c.rms_eps)

    def _attn(self, st, i, p, x, pos):
        c, w = self.cfg, self.w
        q = (w[p + "self_attn.q_proj.weight"] @ x).reshape(c.heads, c.head_dim)
        k = (w[p + "self_attn.k_proj.weight"] @ x).reshape(c.kv_heads, c.head_dim)
        v = (w[p + "self_attn.v_proj.weight"] @ x).reshape(c.kv_heads, c.head_dim)
        q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
        st.k[i] = np.concatenate([st.k[i], k[None]])
        st.v[i] = np.concatenate([st.v[i], v[None]])
        g = c.heads // c.kv_heads
        o = np.empty_like(q)
        for hh in range(c.heads):
            s = st.k[i][:, hh // g] @ q[hh] / np.sqrt(c.head_dim)
            pr = np.exp(s - s.max())
            o[hh] = pr @ st.v[i][:, hh // g] / pr.sum()
        return w[p + "self_attn.o_proj.weight"] @ o.ravel()

    def _gdn(self, st, i, p, x):
        c, w = self.cfg, self.w
        H, dk, dv = c.gdn_heads, c.gdn_dk, c.gdn_dv
        qkvz = w[p + "linear_attn.in_proj_qkvz.weight"] @ x
        a, b = np.split(w[p + "linear_attn.in_proj_ba.weight"] @ x, 2)
        q, k = qkvz[: H * dk].reshape(H, dk), qkvz[H * dk: 2 * H * dk].reshape(H, dk)
        v = qkvz[2 * H * dk: 2 * H * dk + H * dv].reshape(H, dv)
        z = qkvz[2 * H * dk + H * dv:].reshape(H, dv)
        out = np.empty((H, dv))
        for hh in range(H):
            qh = q[hh] / np.sqrt(q[hh] @ q[hh] + 1e-6) / np.sqrt(dk)
            kh = k[hh] / np.sqrt(k[hh] @ k[hh] + 1e-6)
            al = np.exp(-np.exp(w[p + "linear_attn.A_log"][hh]) *
                        np.logaddexp(0.0, a[hh] + w[p + "linear_attn.dt_bias"][hh]))
            be = 1 / (1 + np.exp(-b[hh]))
            M = st.M[i][hh]
            M = al * M @ (np.eye(dk) - be * np.outer(kh, kh)) + be * np.outer(v[hh], kh)
            st.M[i][hh] = M
            out[hh] = _rms(M @ qh, w[p + "linear_attn.norm.weight"], c.rms_eps) * _silu(z[hh])
        return w[p + "linear_attn.out_proj.weight"] @ out.ravel()

    def _mlp(self, p, x):
        w = self.w
        return w[p + "down_proj.weight"] @ (_silu(w[p + "gate_proj.weight"] @ x) * (w[p + "up_proj.weight"] @ x))

    def _moe(self, p, x):
        c = self.cfg
        r = self.w[p + "mlp.gate.weight"] @ x
        pr = np.exp(r - r.max())
        pr /= pr.sum()
        sel = sorted(range(c.experts), key=lambda e: (-r[e], e))[: c.top_k]
        tot = sum(pr[e] for e in sel)
        y = sum(pr[e] / tot * self._mlp(p + f"mlp.experts.{e}.", x) for e in sel)
        if c.shared_ffn:
            y = y + self._mlp(p + "mlp.shared_expert.", x)
        return y

    def prefill(self, tokens) -> tuple[SeqState, np.ndarray]:
        """A fresh sequence fed `tokens`; returns (state, logits of the last token)."""
        st = self.new_state()
        for t in tokens:
            logits = self.step(st, int(t))
        return st, logits

    def generate_greedy(self, prompt, n: int) -> tuple[list[int], list[float]]:
        """n greedy tokens after `prompt`, and each step's top-1 minus top-2 logit margin."""
        st, logits = self.prefill(prompt)
        toks, margins = [], []
        for _ in range(n):
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
            toks.append(int(np.argmax(logits)))
            logits = self.step(st, toks[-1])
        return toks, margins
