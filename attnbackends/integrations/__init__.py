"""Adapters for other engines' extension points.

- :mod:`attnbackends.integrations.transformers`: attnbackends as an attention implementation of Hugging Face
  transformers, served by its continuous batching (``model.generate_batch``) over transformers' own paged cache.

Each adapter imports its engine lazily: importing this package needs none of them.
"""

__all__: list[str] = []
