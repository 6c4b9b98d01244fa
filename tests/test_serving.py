"""The serving problem type (kernel.serving): validation, its key protocol, and the nearest rule
the tables and the resolver take from it."""

from __future__ import annotations

import dataclasses

import pytest

from kernel import Problem, ProblemError
from kernel.serving import ServingProblem

LLAMA_8B = ServingProblem(q_heads=32, kv_heads=8, head_dim=128, page_size=16, pages_per_seq=128,
                          max_num_batched_tokens=512, max_num_seqs=64)


def test_round_trips_through_json_fields():
    gemma = dataclasses.replace(LLAMA_8B, q_heads=16, head_dim=256, window=4096, softcap=50)
    for problem in (LLAMA_8B, gemma):
        assert ServingProblem.from_dict(problem.to_dict()) == problem
        assert hash(ServingProblem.from_dict(problem.to_dict())) == hash(problem)
    assert gemma.softcap == 50.0 and isinstance(gemma.softcap, float)
    assert "window4096" in gemma.label() and "softcap50" in gemma.label()
    assert LLAMA_8B.max_model_len == 2048 and LLAMA_8B.mode == "fwd"


@pytest.mark.parametrize(("changes", "named"), [
    (dict(q_heads=30), "multiple of kv_heads"),
    (dict(page_size=0), "page_size must be between 1"),
    (dict(pages_per_seq=True), "pages_per_seq must be an integer"),
    (dict(dtype="float16"), "dtype must be one of"),
    (dict(kv_dtype="int8"), "kv_dtype must be one of"),
    (dict(window=0), "window must be between 1"),
    (dict(softcap=-1.0), "softcap must be positive"),
    (dict(page_size=1 << 12, pages_per_seq=1 << 12), "max_model_len"),
])
def test_bad_fields_are_named(changes, named):
    with pytest.raises(ProblemError, match=named):
        dataclasses.replace(LLAMA_8B, **changes)


def test_from_dict_names_unknown_and_missing_fields():
    with pytest.raises(ProblemError, match=r"unknown serving problem field\(s\) \['batch'\]"):
        ServingProblem.from_dict({**LLAMA_8B.to_dict(), "batch": 1})
    fields = LLAMA_8B.to_dict()
    del fields["page_size"]
    with pytest.raises(ProblemError, match="missing serving problem field.*page_size"):
        ServingProblem.from_dict(fields)


def test_family_holds_what_a_nearest_entry_must_share():
    same_family = [dataclasses.replace(LLAMA_8B, max_num_batched_tokens=2048),
                   dataclasses.replace(LLAMA_8B, pages_per_seq=512, max_num_seqs=256),
                   dataclasses.replace(LLAMA_8B, softcap=30.0)]
    other_family = [dataclasses.replace(LLAMA_8B, page_size=32),
                    dataclasses.replace(LLAMA_8B, kv_heads=4),
                    dataclasses.replace(LLAMA_8B, window=4096),
                    dataclasses.replace(LLAMA_8B, kv_dtype="float32")]
    assert all(p.family() == LLAMA_8B.family() for p in same_family[:2])
    assert dataclasses.replace(LLAMA_8B, softcap=50.0).family() == same_family[2].family()
    assert all(p.family() != LLAMA_8B.family() for p in other_family + same_family[2:])


def test_distance_counts_octaves_of_tokens_pages_and_sequences():
    doubled = {"max_num_batched_tokens": 1024, "pages_per_seq": 256, "max_num_seqs": 128}
    for name, value in doubled.items():
        other = dataclasses.replace(LLAMA_8B, **{name: value})
        assert LLAMA_8B.distance(other) == pytest.approx(1.0) == other.distance(LLAMA_8B)
    far = dataclasses.replace(LLAMA_8B, **doubled)
    assert LLAMA_8B.distance(far) == pytest.approx(3.0)
    axes_part = LLAMA_8B.axes_distance(far.nearest_axes())
    assert axes_part <= LLAMA_8B.distance(far)  # a lower bound, as the index needs


def test_attention_problem_distance_bound_holds():
    base = Problem(1, 8, 8, 512, 512, 128, causal=True)
    for other in (dataclasses.replace(base, q_len=2048), dataclasses.replace(base, batch=4),
                  dataclasses.replace(base, kv_heads=2, kv_len=4096)):
        assert base.axes_distance(other.nearest_axes()) <= base.distance(other)
        assert base.distance(other) == pytest.approx(other.distance(base))
    assert base.distance(base) == 0
