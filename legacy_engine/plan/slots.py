"""How many generations the server runs at once (`serve --parallel`'s default): as many as the batched decode
gains from, as long as their states fit in memory.

Each slot holds a state of its own for the whole context: the KV cache of every attention layer (f32, n_ctx rows of
n_head_kv × head_dim keys and values) and the conv and SSM states of every Gated DeltaNet layer (f32)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..format.gguf_model import Hparams

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
