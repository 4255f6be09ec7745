"""How each parallelism runs: the Lightning strategies ddlx adds and the parallelizers (a model
and its devices in, a parallel forward installed on it out). Which of them a run uses, with which
knobs, is said by its strategy spec (:mod:`ddlx.strategies`); the LightningModule never knows."""
