"""How many generations the server runs at once (`serve --parallel`'s default): as many as the batched decode
gains from, as long as their states fit in memory; and what a batched decode step of B sequences costs on the CPU.

Each slot holds a state of its own for the whole context: the KV cache of every attention layer (f32, n_ctx rows of
n_head_kv × head_dim keys and values) and the conv and SSM states of every Gated DeltaNet layer (f32)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..format.footprint import Footprint
from ..format.gguf_model import Hparams
from .probe import Machine

# A batched decode step reads each weight once for all its sequences; past ~8 the step's own compute (attention over
# every sequence's context, the per-sequence GDN state) grows while the weight reads no longer shrink per token, so
# more slots mostly add latency per stream. Larger values stay available through --parallel.
DEFAULT_PARALLEL = 8
STATE_SHARE = 0.25      # the slots' states take at most this share of the memory available at start


@dataclass(frozen=True)
class SlotPlan:
    n: int            # slots
    state_bytes: int  # one slot's state at the full context
    why: str


def state_bytes(hp: Hparams, n_ctx: int) -> int:
    """Bytes of one sequence's state at n_ctx positions (native/state.c's layout, f32)."""
    n_gdn = sum(hp.recurrent)
    n_attn = hp.n_layer - n_gdn
    conv_dim = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner
    kv = 2 * n_ctx * hp.n_head_kv * hp.head_dim
    gdn = (hp.ssm_conv_kernel - 1) * conv_dim + hp.ssm_d_inner * hp.ssm_d_state
    return 4 * (n_attn * kv + n_gdn * gdn)


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def serve_slots(hp: Hparams, n_ctx: int, batched: bool, available: int | None = None) -> SlotPlan:
    """The default number of slots: 1 when the engine decodes one sequence per pass (more slots would share its
    time, not add to it); else DEFAULT_PARALLEL, fewer when their states would take more than STATE_SHARE of the
    available memory (`available`, default mem_available())."""
    one = state_bytes(hp, n_ctx)
    if not batched:
        return SlotPlan(1, one, "this engine decodes one sequence per pass: more slots would not add throughput")
    avail = mem_available() if available is None else available
    if avail is None:
        return SlotPlan(DEFAULT_PARALLEL, one, f"{DEFAULT_PARALLEL} (memory available unknown)")
    fit = int(avail * STATE_SHARE // max(one, 1))
    n = max(1, min(DEFAULT_PARALLEL, fit))
    return SlotPlan(n, one, f"{n}: states of {one / 2**20:.0f} MiB each at a context of {n_ctx}, "
                            f"{avail / 2**30:.1f} GiB available ({STATE_SHARE:.0%} for states)")


def distinct_experts(n_expert: int, k: int, batch: int, shares: np.ndarray | None = None) -> float:
    """Expected distinct experts a layer reads for `batch` tokens of k picks each: sum over experts of
    1 - (1 - k·p_e)^batch, p_e the expert's share of the picks (`shares`, routing counts normalised; None: uniform),
    k·p_e the chance one token picks it (capped at 1), tokens independent. One token reads k; a batch reads each
    expert it uses once, which is the whole gain on a MoE."""
    p = np.full(n_expert, 1.0 / n_expert) if shares is None else np.asarray(shares, dtype=float) / np.sum(shares)
    return float(np.sum(1.0 - (1.0 - np.minimum(k * p, 1.0)) ** batch))


def batched_decode_bytes(hp: Hparams, fp: Footprint, batch: int, context: int, counts: dict | None = None) -> dict:
    """Bytes one CPU decode step of `batch` sequences reads, by part: the weights every token reads (attention, GDN,
    shared experts, LM head) once; the routed experts, each distinct one once (distinct_experts per MoE layer, from
    routing `counts` {layer: [count per expert]} where given); and per sequence its recurrent state (read and written)
    and its KV cache up to `context` positions."""
    dense = fp.parts.get("other", 0) + fp.parts.get("lm_head", 0)
    experts = 0.0
    k = hp.n_expert_used
    if hp.n_expert and k:
        per_expert = fp.parts.get("experts", 0) / (k * hp.n_layer)    # one expert of one layer (every layer is MoE)
        for i in range(hp.n_layer):
            c = counts.get(i) if counts else None
            shares = np.asarray(c, dtype=float) if c is not None and np.sum(c) > 0 else None
            experts += per_expert * distinct_experts(hp.n_expert, k, batch, shares)
    n_gdn = sum(hp.recurrent)
    conv_dim = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner
    state = 2 * 4 * n_gdn * ((hp.ssm_conv_kernel - 1) * conv_dim + hp.ssm_d_inner * hp.ssm_d_state)
    kv = 4 * (hp.n_layer - n_gdn) * 2 * context * hp.n_head_kv * hp.head_dim
    return {"weights": dense, "experts": experts, "states": batch * state, "kv": batch * kv}


def predict_batched_decode(m: Machine, hp: Hparams, fp: Footprint, batches=(1, 2, 4, 8, 16), context: int = 512,
                           counts: dict | None = None, efficiency: float = 0.62) -> dict[int, float]:
    """{B: aggregate decode tok/s of B sequences on the CPU}: B / (batched_decode_bytes / (m's read bandwidth ×
    efficiency)); efficiency: the share of the probe's bandwidth a decode step reaches (planner.CPU_DECODE_EFF).
    Memory-bound: the step's arithmetic grows with B and is not counted (past ~16 it would bind)."""
    bw = m.cpu_read_gbps * 1e9 * efficiency
    return {b: b / (sum(batched_decode_bytes(hp, fp, b, context, counts).values()) / bw) for b in batches}
