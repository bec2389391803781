"""The model apps shipped with the package (``horovod_airflow.apps``).

An app is what one model brings to the one retraining pipeline
(:class:`horovod_airflow.operators.pipeline.ModelApp`): its registry name, dataset, training
and export programs, the gate's champion scorer and the serving-side check. Apps run on the
Airflow side (the worker and the DAG processor), like ``operators/``: never torch or horovod.
MNIST (:mod:`horovod_airflow.apps.mnist`) is the built-in one; ``examples/waveforms/`` is its
equal, outside the package.
"""
