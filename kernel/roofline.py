"""The work of an attention problem and where a measured time stands against a chip's roofline.

Pure Python (core layer: imports only ``problem``), the same for every backend. With
``pairs`` the (query, key) pairs the softmax keeps: ``q_len * kv_len``, or under the causal
mask (top-left aligned, as ``jax.nn.dot_product_attention(is_causal=True)``)
``sum(min(i + 1, kv_len) for i < q_len)``, about half of it. With ``H = q_heads``,
``B = batch``, ``d = head_dim``, ``s`` bytes per element, ``|Q| = B H q_len d`` (also O, dO,
dQ) and ``|K| = B kv_heads kv_len d`` (also V, dK, dV):

FLOPs (two per multiply-add, matrix products only; the softmax's exponentials and the
rescaling are left out, as FlashAttention's papers count):
  ``fwd``: ``4 B H d pairs`` (S = Q Kᵀ and O = P V),
  ``fwd_bwd``: ``14 B H d pairs`` (the forward, then the backward's five products:
  S again, dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q).

HBM bytes (each tensor moved once, the least any kernel can move):
  ``fwd``: ``s (2 |Q| + 2 |K|)`` (read Q, K, V, write O),
  ``fwd_bwd``: ``s (6 |Q| + 6 |K|) + 8 B H q_len``: the forward (read Q, K, V, write O and
  the float32 log-sum-exp), the backward (read Q, K, V, O, dO and the log-sum-exp, write dQ,
  dK, dV).

A kernel taking ``t`` seconds on a chip with peaks ``P`` FLOP/s and ``W`` bytes/s can do no
better than ``max(FLOPs / P, bytes / W)``: the compute roof binds when the first term is the
larger, else the memory roof. Its fraction of the roofline is that bound over ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernel.problem import Problem

LSE_BYTES = 4  # the float32 log-sum-exp per query row the backward pass reads back


def attention_pairs(problem: Problem) -> int:
    """The (query, key) pairs the softmax keeps (all of them, or the causal triangle)."""
    if not problem.causal:
        return problem.q_len * problem.kv_len
    within = min(problem.q_len, problem.kv_len)  # rows i < kv_len keep i + 1 keys
    return within * (within + 1) // 2 + (problem.q_len - within) * problem.kv_len


def attention_flops(problem: Problem) -> int:
    """Matrix-product FLOPs of ``problem`` in its mode (formula in the module docstring)."""
    per_pair = 4 if problem.mode == "fwd" else 14
    return per_pair * problem.batch * problem.q_heads * problem.head_dim * attention_pairs(problem)


def attention_bytes(problem: Problem) -> int:
    """The least HBM traffic of ``problem`` in its mode (formula in the module docstring)."""
    q = problem.batch * problem.q_heads * problem.q_len * problem.head_dim
    k = problem.batch * problem.kv_heads * problem.kv_len * problem.head_dim
    if problem.mode == "fwd":
        return problem.itemsize * (2 * q + 2 * k)
    rows = problem.batch * problem.q_heads * problem.q_len
    return problem.itemsize * (6 * q + 6 * k) + 2 * LSE_BYTES * rows


@dataclass(frozen=True)
class Peaks:
    """A device's peak dense matrix throughput (FLOP/s) and HBM bandwidth (bytes/s), with
    where the figures come from."""

    flops_per_s: float
    bytes_per_s: float
    source: str


@dataclass(frozen=True)
class Roofline:
    """A measured time against a device's roofline: achieved TFLOP/s, and with the device's
    peaks known, the fraction of the binding roof reached and which roof binds (``compute``
    or ``memory``)."""

    tflops: float
    fraction: float | None = None
    bound: str | None = None


def roofline(problem: Problem, time_ms: float, peaks: Peaks | None) -> Roofline:
    """Where ``time_ms`` for ``problem`` stands on a device with ``peaks`` (None: unknown)."""
    seconds = time_ms / 1e3
    tflops = attention_flops(problem) / seconds / 1e12
    if peaks is None:
        return Roofline(tflops)
    compute_s = attention_flops(problem) / peaks.flops_per_s
    memory_s = attention_bytes(problem) / peaks.bytes_per_s
    return Roofline(tflops, max(compute_s, memory_s) / seconds,
                    "compute" if compute_s >= memory_s else "memory")
