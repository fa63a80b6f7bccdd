"""The wire schema of the serve routes, pinned: every request model's JSON schema, and what a
bad `sampling` body of `/v1/rag/query` answers (pydantic's error, or `SamplingConfig`'s
`SamplingError` with its field), compared with tests/data/serve_schemas.json.

`SamplingIn` and its nested models are derived from `SamplingConfig` (serve/sampling_in.py),
so a change to a sampling field changes the wire; this test makes that change visible. The
golden file was written from the hand-written models before the derivation (issue 38). After
a deliberate change of the wire, rewrite it with
`RAGCACHE_WRITE_GOLDEN=1 pytest tests/test_serve_schemas.py` and review its diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pydantic
import pytest

from ragcache_core.config import SamplingConfig
from ragcache_core.errors import SamplingError
from ragcache_core.serve import schemas
from ragcache_core.serve.schemas import SamplingIn

GOLDEN = Path(__file__).parent / "data" / "serve_schemas.json"

BAD_SAMPLING: list[Any] = [
    {"max_tokens": "x"},
    {"max_tokens": 0},
    {"max_tokens": 1.5},
    {"temperature": "hot"},
    {"temperature": -1},
    {"temperature": 3},
    {"top_p": 0},
    {"top_k": -2},
    {"min_p": 2},
    {"presence_penalty": 3},
    {"frequency_penalty": -3},
    {"repetition_penalty": 0},
    {"stop": "x"},
    {"stop": [""]},
    {"stop": [1]},
    {"seed": 2**63},
    {"seed": -(2**63) - 1},
    {"ignore_eos": "maybe"},
    {"logit_bias": {"x": 1}},
    {"logit_bias": {"1": "a"}},
    {"logit_bias": {"-1": 1}},
    {"min_tokens": -1},
    {"min_tokens": 100, "max_tokens": 4},
    {"stop_token_ids": [-1]},
    {"stop_token_ids": ["a"]},
    {"bad_words": [""]},
    {"allowed_token_ids": []},
    {"logprobs": -2},
    {"logprob_token_ids": [-1]},
    {"structured_outputs": {"regex": "a", "choice": ["b"]}},
    {"structured_outputs": {}},
    {"structured_outputs": {"json": 3}},
    {"structured_outputs": {"regex": "a", "extra": 1}},
    {"repetition_detection": {"max_pattern_size": 1, "min_pattern_size": 2}},
    {"repetition_detection": {"max_pattern_size": 2, "min_count": 1}},
    {"repetition_detection": {"nope": 1}},
    {"stream_interval": 0},
    {"unknown": 1},
    "not an object",
]


def _models() -> dict[str, type[pydantic.BaseModel]]:
    return {
        name: value
        for name, value in sorted(vars(schemas).items())
        if isinstance(value, type)
        and issubclass(value, pydantic.BaseModel)
        and value is not pydantic.BaseModel
    }


def _answer(body: Any) -> Any:
    """pydantic's errors for `body` as `sampling`, else `SamplingError`'s (message, param)."""
    try:
        parsed = SamplingIn.model_validate(body)
    except pydantic.ValidationError as exc:
        return [[list(e["loc"]), e["type"], e["msg"]] for e in exc.errors()]
    try:
        parsed.over(SamplingConfig())
    except SamplingError as exc:
        return {"message": str(exc), "param": exc.param}
    return "accepted"


def live() -> dict[str, Any]:
    return {
        "schemas": {name: model.model_json_schema() for name, model in _models().items()},
        "sampling_fields": {name: field.default for name, field in SamplingIn.model_fields.items()},
        "bad_sampling": [[body, _answer(body)] for body in BAD_SAMPLING],
    }


def test_the_wire_schema_and_its_errors_are_the_pinned_ones() -> None:
    now = json.loads(json.dumps(live()))
    if os.environ.get("RAGCACHE_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps(now, indent=1) + "\n")
        pytest.skip(f"wrote {GOLDEN}")
    pinned = json.loads(GOLDEN.read_text())
    for name in sorted(set(pinned["schemas"]) | set(now["schemas"])):
        assert now["schemas"].get(name) == pinned["schemas"].get(name), name
    assert now["sampling_fields"] == pinned["sampling_fields"]
    for (body, answer), (_, pinned_answer) in zip(
        now["bad_sampling"], pinned["bad_sampling"], strict=True
    ):
        assert answer == pinned_answer, body
    assert now == pinned


def test_sampling_in_has_every_sampling_config_field() -> None:
    """The derivation, independently: SamplingConfig's fields in order, each optional."""
    names = [f.name for f in dataclasses.fields(SamplingConfig)]
    assert list(SamplingIn.model_fields) == names
    assert all(not f.is_required() for f in SamplingIn.model_fields.values())
    empty = SamplingIn.model_validate({})
    assert empty.over(SamplingConfig(max_tokens=5, seed=3)) == SamplingConfig(max_tokens=5, seed=3)


def test_every_sampling_field_reaches_vllm_under_its_name() -> None:
    """The engine's mapping (engine/sampling.py), derived from the same fields: each field
    set away from its default arrives in vLLM's `SamplingParams` (no engine needed)."""
    from ragcache_core.config import RepetitionDetection, StructuredOutputs
    from ragcache_core.engine.sampling import sampling_params

    config = SamplingConfig(
        max_tokens=9,
        temperature=0.5,
        top_p=0.5,
        stop=("s",),
        seed=4,
        ignore_eos=True,
        top_k=3,
        min_p=0.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias={7: 1.0},
        min_tokens=2,
        stop_token_ids=(5,),
        include_stop_str_in_output=True,
        bad_words=("b",),
        allowed_token_ids=(1, 2),
        logprobs=2,
        logprob_token_ids=(3,),
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        structured_outputs=StructuredOutputs(choice=("x", "y")),
        repetition_detection=RepetitionDetection(4, 2, 3),
        stream_interval=2,
    )
    params = sampling_params(config)
    for f in dataclasses.fields(SamplingConfig):
        value = getattr(config, f.name)
        assert value != f.default, f.name  # the test sets every field
        sent = getattr(params, f.name)
        if isinstance(value, StructuredOutputs | RepetitionDetection):
            for inner in dataclasses.fields(value):
                expected = getattr(value, inner.name)
                expected = list(expected) if isinstance(expected, tuple) else expected
                assert getattr(sent, inner.name) == expected, (f.name, inner.name)
        elif isinstance(value, tuple):
            assert list(sent) == list(value), f.name
        else:
            assert sent == value, f.name
