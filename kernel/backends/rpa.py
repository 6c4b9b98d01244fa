"""JAX's ragged paged attention (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``):
a serving step over a paged KV cache, mixed prefill and decode, its block sizes tuned per
serving problem (:class:`kernel.serving.ServingProblem`; docs/serving.md).

Tuned: ``num_kv_pages_per_block`` (pages of one sequence's K/V fetched per step, in
``(0, pages_per_seq]``), ``num_queries_per_block`` (a power of two up to the token budget, or
the whole budget) and the scoped VMEM limit. Heads per block are not tuned: upstream's
``get_min_heads_per_blk`` fixes them (:func:`heads_per_block`, its port, for jax-free rules).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kernel.config import IntConfig
from kernel.contract import AttentionFn, ConfigFor, Params, TunableKernel, abstract_arrays
from kernel.rules import Violation, vmem_limit_violations, x64_violations
from kernel.serving import ServingProblem, jax_device_key
from kernel.targets import MiB, TPU_TARGETS, Target

# The one head_dim upstream's kernel compiles: its strided K/V loads need a 128-lane last
# dimension (deviceless v5e, JAX 0.10.2: head_dim 256 fails Mosaic with "The last dim size is not
# 128 in original base memref", 64 an assertion while lowering).
HEAD_DIM = 128
# JAX's block sizes where its table has no entry: (num_kv_pages_per_block,
# num_queries_per_block), (32, 32) on a v4 ("only make sure there's no OOM in vmem").
FALLBACK = (128, 32)
V4_FALLBACK = (32, 32)
# The scoped VMEM limits the search may set beyond the compiler's default (None).
VMEM_LIMITS_MIB = (32, 64)
# The estimate's terms, fitted (a linear program: the least upper bound) to the peak scoped VMEM of
# 35 deviceless v5e compiles of four grid problems (libtpu 0.0.42.1,
# bench/kernels/rpa_vmem_sizes.py; the points are in bench/kernels/data/rpa_vmem/v5e.jsonl): the K/V
# double buffer 1.26x over (its f32 copies for the kv-length mask), the q block's bytes 12x (q and
# the output double buffered, the f32 accumulator, the l and m scratch and the temporaries of a
# query row), and 1.37 f32 logits tiles per K/V head of the block (the logits and their
# exponentials), each rounded up.
KV_BUFFER_FACTOR = 1.3
Q_BLOCK_FACTOR = 12
LOGITS_TILES = 1.4
FIXED_BYTES = MiB // 8
# A trial's batches (batch_compositions): decode at max_model_len / 16 as its short kv_len, and
# prefill chunks over at least this many sequences.
DECODE_SHORT_FRACTION = 16
PREFILL_SEQS = 4


@dataclass(frozen=True)
class RpaConfig(IntConfig):
    """Upstream's tuning arguments; ``vmem_limit_mib`` is its ``vmem_limit_bytes`` in MiB
    (None: the compiler's scoped default)."""

    num_kv_pages_per_block: int = FALLBACK[0]
    num_queries_per_block: int = FALLBACK[1]
    vmem_limit_mib: int | None = None

    def label(self, mode: str = "fwd") -> str:
        limit = "" if self.vmem_limit_mib is None else f" vmem{self.vmem_limit_mib}MiB"
        return f"kv_pages{self.num_kv_pages_per_block} q{self.num_queries_per_block}{limit}"


def _packing(dtype: str) -> int:
    """Elements per 32-bit word (upstream's ``get_dtype_packing``)."""
    return 4 // {"bfloat16": 2, "float32": 4}[dtype]


def _fully_tiled(count: int, packing: int) -> bool:
    """Upstream's ``can_be_xla_fully_tiled``."""
    return count % packing == 0 and (count // packing in (1, 2, 4, 8)
                                     or (count // packing) % 8 == 0)


def heads_per_block(problem: ServingProblem) -> tuple[int, int]:
    """``(q heads, combined K/V heads)`` of one block, as upstream's ``get_min_heads_per_blk``
    picks them (a problem :func:`heads_violations` refuses has none)."""
    combined = 2 * problem.kv_heads
    widest = 8 * _packing(problem.kv_dtype)
    least_combined = widest if combined % widest == 0 else combined
    least_q = least_combined // 2 * problem.group_size
    if _fully_tiled(least_q, _packing(problem.dtype)):
        return least_q, least_combined
    return problem.q_heads, combined


def heads_violations(problem: ServingProblem) -> list[Violation]:
    """``heads_tiling``: K/V heads upstream cannot tile (its "can not be XLA fully tiled")."""
    if _fully_tiled(2 * problem.kv_heads, _packing(problem.kv_dtype)):
        return []
    return [Violation("heads_tiling", f"kv_heads={problem.kv_heads} ({2 * problem.kv_heads} "
                      f"combined K and V heads of {problem.kv_dtype}) cannot be tiled by the "
                      "kernel: it takes 1, 2 or 4 K/V heads, or a multiple of 4 (bfloat16: "
                      "1, 2, 4 or a multiple of 8); pad the K/V heads")]


def vmem_estimate(problem: ServingProblem, config: RpaConfig) -> int:
    """Estimated peak scoped VMEM bytes of the kernel, as the compiler allocates it (the fit
    above): its K/V double buffer ``2 * num_kv_pages_per_block * page_size * combined heads *
    head_dim``, the q block ``num_queries_per_block * q heads * head_dim`` and one f32 logits
    tile ``(num_queries_per_block * group, num_kv_pages_per_block * page_size)`` per K/V head
    of the block, each times its factor. Unpadded: the compiler lays small head counts out
    without padding them to (8, 128) tiles."""
    q_heads, combined = heads_per_block(problem)
    kv_rows = config.num_kv_pages_per_block * problem.page_size
    kv_buffers = 2 * kv_rows * combined * problem.head_dim * problem.kv_itemsize
    q_block = config.num_queries_per_block * q_heads * problem.head_dim * problem.itemsize
    logits = (combined // 2) * config.num_queries_per_block * problem.group_size * kv_rows * 4
    return int(KV_BUFFER_FACTOR * kv_buffers + Q_BLOCK_FACTOR * q_block + LOGITS_TILES * logits
               + FIXED_BYTES)


def _powers_of_two_up_to(most: int) -> list[int]:
    """1, 2, 4, ... up to ``most``, and ``most`` itself."""
    return sorted({1 << exponent for exponent in range(most.bit_length())
                   if 1 << exponent <= most} | {most})


@dataclass(frozen=True)
class RpaKernel(TunableKernel):
    name: ClassVar[str] = "rpa"
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ("JAX's ragged paged attention "
                                  "(jax.experimental.pallas.ops.tpu.ragged_paged_attention): a "
                                  "serving step over a paged KV cache, mixed prefill and decode")
    problem_type: ClassVar[type] = ServingProblem
    targets: ClassVar[tuple[str, ...]] = TPU_TARGETS
    platforms: ClassVar[tuple[str, ...]] = ("tpu",)
    config_type: ClassVar[type[RpaConfig]] = RpaConfig
    landscape_axes: ClassVar[tuple[str, ...]] = ("num_kv_pages_per_block",
                                                 "num_queries_per_block", "vmem_limit_mib")
    profile_names: ClassVar[tuple[str, ...]] = ("ragged_paged_attention_kernel",)
    # JAX's shipped TUNED_BLOCK_SIZES and its simplify_key, read by ``discover``: without them
    # (the service, storage) the default is JAX's fallback.
    shipped: Mapping[str, Mapping[tuple[Any, ...], tuple[int, int]]] = field(
        default_factory=dict, hash=False, compare=False)
    simplify_key: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = field(
        default=None, hash=False, compare=False)

    def discover(self) -> RpaKernel:
        """This backend with JAX's shipped table of block sizes and its key function."""
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

        return dataclasses.replace(self, shipped=tuned_block_sizes.TUNED_BLOCK_SIZES,
                                   simplify_key=tuned_block_sizes.simplify_key)

    def problem_violations(self, problem: ServingProblem) -> list[Violation]:
        head_dim = [] if problem.head_dim == HEAD_DIM else [Violation(
            "head_dim", f"head_dim={problem.head_dim}: the kernel compiles head_dim {HEAD_DIM} "
            "only (its strided K/V loads need 128 lanes); run this model's attention with "
            "kernel.flash_attention over the gathered pages")]
        return head_dim + heads_violations(problem) + x64_violations()

    def space_params(self, problem: ServingProblem) -> Params:
        return {"num_kv_pages_per_block": _powers_of_two_up_to(problem.pages_per_seq),
                "num_queries_per_block": _powers_of_two_up_to(problem.max_num_batched_tokens),
                "vmem_limit_mib": [None, *VMEM_LIMITS_MIB]}

    def violations(self, problem: ServingProblem, config: RpaConfig,
                   target: Target | str = "cpu") -> list[Violation]:
        target = self.target(target)
        out = self.problem_violations(problem)
        pages, queries = config.num_kv_pages_per_block, config.num_queries_per_block
        tokens = problem.max_num_batched_tokens
        if pages > problem.pages_per_seq:
            out.append(Violation("kv_pages_range", f"num_kv_pages_per_block={pages} is over "
                                 f"pages_per_seq={problem.pages_per_seq}; use at most "
                                 f"{problem.pages_per_seq}"))
        if queries > tokens:
            out.append(Violation("queries_max", f"num_queries_per_block={queries} is over "
                                 f"max_num_batched_tokens={tokens}; use at most {tokens}"))
        elif queries & (queries - 1) and queries != tokens:
            out.append(Violation("queries_pow2", f"num_queries_per_block={queries} must be a "
                                 f"power of two or the whole token budget ({tokens})"))
        if out or target.scoped_vmem_bytes is None:
            return out
        limit = config.vmem_limit_mib
        if limit is not None and limit * MiB > target.vmem_capacity_bytes:
            return [Violation("vmem_limit", f"vmem_limit_mib={limit} is over the "
                              f"{target.vmem_capacity_bytes // MiB} MiB of VMEM of "
                              f"{target.name}; use at most that, or none")]
        need = {"rpa": vmem_estimate(problem, config)}
        fits = _fitting_limits(need, target)
        if limit not in fits:
            return vmem_limit_violations(need, _raised(target, limit))
        if limit != fits[0]:
            # A raised limit changes nothing once the blocks fit: on a v5e (2026-12-07) kv_pages16
            # q16 took 1.929 ms at the default and 1.931 at 64 MiB, kv_pages128 q4 2.777 and
            # 2.776 at 32 MiB; so a larger limit than needed is the same kernel, a wasted trial.
            need = "the default" if fits[0] is None else f"{fits[0]} MiB"
            return [Violation("vmem_limit_unneeded", f"vmem_limit_mib={limit} is more than "
                              f"these blocks need ({need} holds them); use vmem_limit_mib="
                              f"{fits[0]}")]
        return []

    def default_config(self, problem: ServingProblem,
                       target: Target | str = "cpu") -> RpaConfig:
        """JAX's own choice (its shipped entry for the problem, else its fallback), clamped as
        JAX clamps it, then halved (``num_kv_pages_per_block`` first; to the power of two below,
        the search's values) until the VMEM estimate admits it: JAX's fallback overflows a
        v5e's scoped VMEM on keys of the serving grid."""
        target = self.target(target)
        config = self.jax_config(problem, target)
        while any(v.rule == "vmem" for v in self.violations(problem, config, target)):
            pages, queries = config.num_kv_pages_per_block, config.num_queries_per_block
            if pages == 1 and queries == 1:
                break  # no block fits: its rule names why
            config = (config.replace(num_kv_pages_per_block=_power_below(pages)) if pages > 1
                      else config.replace(num_queries_per_block=_power_below(queries)))
        return config

    def jax_config(self, problem: ServingProblem, target: Target | str = "cpu") -> RpaConfig:
        """What JAX's ``get_tuned_block_sizes`` picks for ``problem`` on ``target``, legal or
        not (a named baseline): its shipped entry, else its fallback, clamped to the
        problem."""
        target = self.target(target)
        pages, queries = V4_FALLBACK if target.name == "v4" else FALLBACK
        if self.simplify_key is not None and target.name != "v4":
            pages, queries = self._table(target).get(self.simplify_key(jax_key(problem)),
                                                     (pages, queries))
        return _clamped(problem, pages, queries)

    def table_entry(self, problem: ServingProblem,
                    target: Target | str = "cpu") -> RpaConfig | None:
        """The entry JAX's shipped table holds under ``problem``'s raw key (:func:`jax_key`,
        ``pages_per_seq`` last), clamped as JAX clamps: what a serving stack that reads the
        table by hand runs. JAX's own lookup never reaches it at the serving grid's keys: its
        ``simplify_key`` rounds the heads to powers of two and looks up ``page_size *
        pages_per_seq`` last, while the table's last elements read as pages per sequence
        (page 16: 64 to 256; page 256: 1,024 to 4,096). None: no such entry (or a v4, which
        JAX gives no table)."""
        target = self.target(target)
        entry = None if target.name == "v4" else self._table(target).get(jax_key(problem))
        return None if entry is None else _clamped(problem, *entry)

    def _table(self, target: Target) -> Mapping[tuple[Any, ...], tuple[int, int]]:
        return self.shipped.get(jax_device_key(target.device_kind), {})

    def seed_configs(self, problem: ServingProblem,
                     target: Target | str = "cpu") -> list[RpaConfig]:
        """JAX's own choice and its table's entry (:meth:`table_entry`) where the rules admit
        them (both are measured as baselines too)."""
        known = [self.jax_config(problem, target), self.table_entry(problem, target)]
        return [config for config in dict.fromkeys(known)
                if config is not None and not self.violations(problem, config, target)]

    def baselines(self, problem: ServingProblem,
                  target: Target | str = "cpu") -> dict[str, RpaConfig]:
        """JAX's own choice (:meth:`jax_config`: its shipped entry, else its fallback), legal
        or not: issue 73 holds every tuned key to at least its speed. Beside it, where it
        differs, ``jax_entry``: the table's entry for the key as the table is written
        (:meth:`table_entry`), which JAX's lookup misses. Where only its VMEM refuses one,
        also ``jax_vmem`` (``jax_entry_vmem``): its blocks under the smallest raised limit of
        the search that admits them, as a serving stack that passes ``vmem_limit_bytes`` runs
        them (JAX's own call, with none, fails to compile there)."""
        shipped = self.jax_config(problem, target)
        out = {"jax": shipped, **self._vmem_raised("jax_vmem", problem, shipped, target)}
        entry = self.table_entry(problem, target)
        if entry is not None and entry != shipped:
            out |= {"jax_entry": entry,
                    **self._vmem_raised("jax_entry_vmem", problem, entry, target)}
        return out

    def _vmem_raised(self, name: str, problem: ServingProblem, config: RpaConfig,
                     target: Target | str) -> dict[str, RpaConfig]:
        """``{name: config under the smallest raised VMEM limit that admits it}`` where only
        its VMEM refuses ``config``; else nothing."""
        if {v.rule for v in self.violations(problem, config, target)} != {"vmem"}:
            return {}
        fits = _fitting_limits({"rpa": vmem_estimate(problem, config)}, self.target(target))
        return {name: config.replace(vmem_limit_mib=fits[0])} if fits else {}

    def attention(self, problem: ServingProblem, config_for: ConfigFor,
                  sm_scale: float) -> AttentionFn:
        """``(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> out``: upstream's
        kernel with ``config_for("fwd")``, compiled with Mosaic (it runs on a TPU only)."""
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention,
        )

        def attend(*inputs: Any) -> Any:
            config = config_for("fwd")
            limit = config.vmem_limit_mib
            return ragged_paged_attention(
                *inputs, sm_scale=sm_scale, sliding_window=problem.window,
                soft_cap=problem.softcap, num_kv_pages_per_block=config.num_kv_pages_per_block,
                num_queries_per_block=config.num_queries_per_block,
                vmem_limit_bytes=None if limit is None else limit * MiB)

        return attend

    def compositions(self, problem: ServingProblem) -> list[dict[str, Any]]:
        """The batches :meth:`build` runs (:func:`batch_compositions`), as stored."""
        return [composition.to_dict() for composition in batch_compositions(problem)]

    def build(self, problem: ServingProblem, config: RpaConfig, *,
              forward_only: bool = False) -> AttentionFn:
        """The measured step (issue 73 item 2): the kernel with ``config`` over every batch of
        :func:`batch_compositions` in one program, taking :meth:`input_specs`; each output's
        rows past its batch's tokens zeroed. Its time is the whole program's."""
        self.check(problem, config)
        return over_compositions(problem, lambda composition: self.attention(
            problem, lambda mode: config, problem.head_dim ** -0.5))

    def reference(self, problem: ServingProblem) -> AttentionFn:
        """What :meth:`build` computes, in float32 (:func:`paged_reference` per batch)."""
        return over_compositions(problem, lambda composition: paged_reference(
            problem, composition.longest))

    def call_specs(self, problem: ServingProblem, device: Any = None) -> list[Any]:
        """Abstract inputs of one call: ``q``, ``kv_pages`` (one sequence's pages per slot,
        ``max_num_seqs * pages_per_seq`` pages), ``kv_lens``, ``page_indices``, ``cu_q_lens``
        and ``num_seqs``."""
        shapes = [((problem.max_num_batched_tokens, problem.q_heads, problem.head_dim),
                   problem.dtype),
                  ((problem.max_num_seqs * problem.pages_per_seq, problem.page_size,
                    2 * problem.kv_heads, problem.head_dim), problem.kv_dtype),
                  ((problem.max_num_seqs,), "int32"),
                  ((problem.max_num_seqs, problem.pages_per_seq), "int32"),
                  ((problem.max_num_seqs + 1,), "int32"), ((1,), "int32")]
        return abstract_arrays(shapes, device)

    def input_specs(self, problem: ServingProblem, device: Any = None) -> list[Any]:
        """Abstract inputs of :meth:`build`: :meth:`call_specs` with ``kv_lens``,
        ``cu_q_lens`` and ``num_seqs`` stacked per batch composition (``page_indices``, the
        cache's layout, is shared)."""
        count = len(batch_compositions(problem))
        specs = self.call_specs(problem)
        shapes = [(tuple(spec.shape) if index in (0, 1, 3) else (count, *spec.shape),
                   spec.dtype.name) for index, spec in enumerate(specs)]
        return abstract_arrays(shapes, device)

    def example_inputs(self, problem: ServingProblem, seed: int = 0) -> list[Any]:
        """Concrete :meth:`input_specs`, deterministic in ``seed``: standard normal q and
        K/V, each slot's pages shuffled over the cache, and each composition's lengths
        (:func:`composition_metadata`)."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        q_spec, kv_spec = self.call_specs(problem)[:2]
        q_key, kv_key = jax.random.split(jax.random.key(seed))
        pages = np.random.default_rng(seed).permutation(problem.max_num_seqs
                                                        * problem.pages_per_seq)
        metadata = [composition_metadata(problem, c) for c in batch_compositions(problem)]
        kv_lens, cu_q_lens, num_seqs = (jnp.asarray(np.stack(arrays))
                                        for arrays in zip(*metadata, strict=True))
        return [jax.random.normal(q_key, q_spec.shape, q_spec.dtype),
                jax.random.normal(kv_key, kv_spec.shape, kv_spec.dtype), kv_lens,
                jnp.asarray(pages.reshape(problem.max_num_seqs, -1), jnp.int32), cu_q_lens,
                num_seqs]


@dataclass(frozen=True)
class Composition:
    """One batch of a serving step: ``groups`` of ``(sequences, q_len, kv_len)``, their tokens
    one after the other in that order (each sequence's queries the last ``q_len`` of its
    ``kv_len`` tokens)."""

    name: str
    groups: tuple[tuple[int, int, int], ...]

    @property
    def seqs(self) -> int:
        return sum(count for count, _, _ in self.groups)

    @property
    def tokens(self) -> int:
        return sum(count * q_len for count, q_len, _ in self.groups)

    @property
    def longest(self) -> int:
        """The most queries of one sequence."""
        return max(q_len for _, q_len, _ in self.groups)

    def lengths(self) -> list[tuple[int, int]]:
        """``(q_len, kv_len)`` of each sequence, in order."""
        return [(q_len, kv_len) for count, q_len, kv_len in self.groups for _ in range(count)]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "groups": [list(group) for group in self.groups],
                "seqs": self.seqs, "tokens": self.tokens}


def batch_compositions(problem: ServingProblem) -> tuple[Composition, ...]:
    """The batches a trial of ``problem`` runs, a pure function of it: decode only (one token
    per sequence, as many sequences as the budget and ``max_num_seqs`` allow) at a short
    (``max_model_len / 16``) and at the full ``kv_len``; prefill chunks (the budget over at
    least :data:`PREFILL_SEQS` sequences, each chunk ending halfway into its prompt); and a
    mixed batch (decode sequences, half short and half long, as many as leave the prefill
    chunks their sequences, at most half the budget; the rest prefill chunks). Each fills the
    token budget as far as ``max_num_seqs`` and ``max_model_len`` allow."""
    tokens, seqs, longest = (problem.max_num_batched_tokens, problem.max_num_seqs,
                             problem.max_model_len)
    short, decoding = max(1, longest // DECODE_SHORT_FRACTION), min(seqs, tokens)
    mixed_decode = max(0, min(tokens // 2, seqs - -(-tokens // longest)))
    mixed = tuple(group for group in ((mixed_decode - mixed_decode // 2, 1, short),
                                      (mixed_decode // 2, 1, longest)) if group[0])
    return (Composition("decode_short", ((decoding, 1, short),)),
            Composition("decode_long", ((decoding, 1, longest),)),
            Composition("prefill", _chunks(tokens, seqs, PREFILL_SEQS, longest)),
            Composition("mixed", mixed + _chunks(tokens - mixed_decode, seqs - mixed_decode,
                                                 1, longest)))


def _chunks(tokens: int, seqs: int, pieces: int, longest: int) -> tuple[tuple[int, int, int], ...]:
    """Prefill groups: ``tokens`` in ``pieces`` near-equal chunks (more where a chunk would
    pass ``longest``; at most ``seqs``, each of at most ``longest`` tokens), each chunk ending
    halfway into a prompt of ``longest`` tokens (or at its own end, if later)."""
    count = min(seqs, tokens, max(pieces, -(-tokens // longest)))
    size, extra = divmod(min(tokens, count * longest), count)
    return tuple((number, q_len, min(longest, max(q_len, longest // 2)))
                 for number, q_len in ((count - extra, size), (extra, size + 1)) if number)


def composition_metadata(problem: ServingProblem, composition: Composition) -> tuple[Any, ...]:
    """``kv_lens`` ``[max_num_seqs]``, ``cu_q_lens`` ``[max_num_seqs + 1]`` and ``num_seqs``
    ``[1]`` (int32 numpy arrays) of ``composition``; unused slots hold no tokens."""
    import numpy as np

    lengths = composition.lengths()
    kv_lens = np.zeros(problem.max_num_seqs, np.int32)
    kv_lens[:len(lengths)] = [kv_len for _, kv_len in lengths]
    cu_q_lens = np.zeros(problem.max_num_seqs + 1, np.int32)
    cu_q_lens[1:len(lengths) + 1] = np.cumsum([q_len for q_len, _ in lengths])
    cu_q_lens[len(lengths) + 1:] = composition.tokens
    return kv_lens, cu_q_lens, np.asarray([len(lengths)], np.int32)


def batch_inputs(inputs: list[Any], index: int) -> list[Any]:
    """The inputs of one call (:meth:`RpaKernel.call_specs`): batch ``index`` of the measured
    program's (:meth:`RpaKernel.input_specs`)."""
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = inputs
    return [q, kv_pages, kv_lens[index], page_indices, cu_q_lens[index], num_seqs[index]]


def over_compositions(problem: ServingProblem,
                      call_for: Callable[[Composition], AttentionFn]) -> AttentionFn:
    """The program over every batch composition of ``problem``: ``call_for(composition)``
    (one call's function) on each batch of the stacked inputs, a tuple of outputs with the
    rows past each batch's tokens zeroed."""
    import jax.numpy as jnp

    def program(*inputs: Any) -> tuple[Any, ...]:
        outputs = []
        for index, composition in enumerate(batch_compositions(problem)):
            batch = batch_inputs(list(inputs), index)
            out = call_for(composition)(*batch)
            used = batch[4][batch[5][0]]
            rows = jnp.arange(out.shape[0])[:, None, None]
            outputs.append(jnp.where(rows < used, out, jnp.zeros((), out.dtype)))
        return tuple(outputs)

    return program


def paged_reference(problem: ServingProblem, longest: int) -> AttentionFn:
    """One call's attention in float32 at ``highest`` precision, jittable, for batches of at
    most ``longest`` queries a sequence: each sequence's queries against its pages
    (:func:`kernel.reference.blockwise_reference`, bottom-right aligned), one sequence at a
    time; rows past the batch's tokens are zero. Upstream's ``ref_ragged_paged_attention``
    computes the same eagerly (tests/test_rpa.py)."""
    import jax
    import jax.numpy as jnp

    from kernel.reference import blockwise_reference

    window = None if problem.window is None else (problem.window - 1, 0)

    def reference(q: Any, kv_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any,
                  num_seqs: Any) -> Any:
        tokens, heads, dim = q.shape
        padded = jnp.pad(q.astype(jnp.float32), ((0, longest), (0, 0), (0, 0)))
        cache = kv_pages.astype(jnp.float32)

        def sequence(seq: Any, out: Any) -> Any:
            start, q_len = cu_q_lens[seq], cu_q_lens[seq + 1] - cu_q_lens[seq]
            rows = jax.lax.dynamic_slice_in_dim(padded, start, longest).transpose(1, 0, 2)
            pages = cache[page_indices[seq]].reshape(-1, *cache.shape[2:])
            k, v = (pages[:, side::2].transpose(1, 0, 2)[None] for side in (0, 1))
            attended = blockwise_reference(
                rows[None], k, v, causal=True, sm_scale=dim ** -0.5, window=window,
                softcap=problem.softcap, query_offset=kv_lens[seq] - q_len)[0]
            valid = (jnp.arange(longest) < q_len)[:, None, None]
            attended = jnp.where(valid, attended.transpose(1, 0, 2), 0.0)
            return jax.lax.dynamic_update_slice_in_dim(out, attended, start, 0)

        out = jax.lax.fori_loop(0, num_seqs[0], sequence,
                                jnp.zeros((tokens + longest, heads, dim), jnp.float32))
        return out[:tokens]

    return reference


def jax_key(problem: ServingProblem) -> tuple[Any, ...]:
    """JAX's raw key of ``problem`` in its table, before its ``simplify_key``: (q dtype, kv
    dtype, q heads per block, K/V heads per block, head_dim, page_size,
    max_num_batched_tokens, pages_per_seq)."""
    q_heads, combined = heads_per_block(problem)
    return (problem.dtype, problem.kv_dtype, q_heads, combined // 2, problem.head_dim,
            problem.page_size, problem.max_num_batched_tokens, problem.pages_per_seq)


def _clamped(problem: ServingProblem, pages: int, queries: int) -> RpaConfig:
    """JAX's block sizes clamped as its lookup clamps them: to ``pages_per_seq`` and the token
    budget."""
    return RpaConfig(min(pages, problem.pages_per_seq),
                     min(queries, problem.max_num_batched_tokens))


def _power_below(value: int) -> int:
    """The largest power of two below ``value`` (``value`` > 1)."""
    return 1 << ((value - 1).bit_length() - 1)


KERNEL = RpaKernel()


def _fitting_limits(need: dict[str, int], target: Target) -> list[int | None]:
    """The limits of the search (None: the scoped default) under which ``need`` (the VMEM
    estimate of a config's blocks) fits on ``target``, smallest first."""
    return [limit for limit in (None, *VMEM_LIMITS_MIB)
            if not vmem_limit_violations(need, _raised(target, limit))]


def _raised(target: Target, limit_mib: int | None) -> Target:
    """``target`` with its scoped VMEM limit at ``limit_mib`` (None: as it is)."""
    return target if limit_mib is None else dataclasses.replace(
        target, scoped_vmem_bytes=limit_mib * MiB)
