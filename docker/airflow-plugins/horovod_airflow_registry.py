"""The model registry page in the stack's Airflow UI: the image puts our packages on
PYTHONPATH instead of installing the wheel, so its ``airflow.plugins`` entry point is not
there; Airflow's plugins folder loads the same plugin from here."""

from horovod_airflow.operators.registry_plugin import RegistryPlugin

__all__ = ["RegistryPlugin"]
