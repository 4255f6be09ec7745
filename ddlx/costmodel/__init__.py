"""The cost models: a training step's time and memory as pure functions of a model's profile, a
hardware description and a setup. The strategies are built on them (ddlx.strategies); the
recommender (ddlx.predict) sits above both. Nothing here imports either."""
