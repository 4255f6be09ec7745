"""What several strategies run, as parts they compose: a pipeline (:mod:`.pipelines`), the model's
two halves (:mod:`.halves`), replicas averaging their gradients (:mod:`.replicas`). A strategy's
file imports these and :mod:`..spec`, never another strategy's file."""
