"""The sets and loaders over an image folder (``image_data``) and train.py's Lightning datamodule
of them (``datamodule``), synthetic dataset writers (``synthetic``), the paper's transforms
(``transforms``), dataset folders and their defaults (``folder``).

Nothing is imported here: the recommender reads ``folder``'s defaults and times ``image_data``'s
loaders, and should not load Lightning, which ``datamodule`` needs, to do so."""
