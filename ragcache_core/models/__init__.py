"""The models RAGCache runs without a model hub.

- `build_tiny_model` (`tiny`): a random-weight Llama with a BPE tokenizer trained on shipped
  text (or a real family's tokenizer and chat template, `chat_fixtures`), built in seconds; the
  answers are noise, the KV and the timings are real. For tests and benchmarks.
"""

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
    "RECIPE_FILE",
    "ModelRecipe",
    "build_tiny_model",
    "default_model_dir",
    "recipe_for",
]
