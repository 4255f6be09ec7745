"""Datamodules (``datamodule``), synthetic dataset writers (``synthetic``), the paper's transforms
(``transforms``), dataset folders and their defaults (``folder``).

Nothing is imported here: the recommender reads ``folder``'s defaults and should not load
Lightning, which ``datamodule`` needs, to do so."""
