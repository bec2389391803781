"""The Horovod training program (runs inside each Horovod rank; never imports Airflow).

Launch: ``horovodrun -np 2 -H localhost:2 python -m horovod_airflow.trainer train --data URI
--output URI``.
See ``python -m horovod_airflow.trainer --help``.
"""
